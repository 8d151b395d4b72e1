/*
 * adamw.c — AdamW on fp32 masters. Owns the moments (LOOM_MEM_OPTIMIZER).
 * Must never: update a frozen parameter, or leave the compute copy stale
 * after a step.
 */
#include "loom/optim.h"
#include "kernels/kernels.h"

#include <math.h>
#include <string.h>
#include <stdlib.h>

struct loom_adamw {
    loom_adamw_config cfg;
    loom_param **params;
    float **m, **v;
    int n;
    int steps;
};

loom_adamw_config loom_adamw_defaults(void) {
    loom_adamw_config c = {0.9f, 0.95f, 1e-8f, 0.1f};
    return c;
}

loom_status loom_adamw_new(const loom_adamw_config *cfg, loom_param *const *params, int n, loom_adamw **out) {
    *out = NULL;
    loom_adamw *o = calloc(1, sizeof *o);
    if (!o) return loom_error(LOOM_ERR_NOMEM, "adamw: out of memory");
    o->cfg = *cfg;
    o->n = n;
    o->params = calloc((size_t)(n ? n : 1), sizeof *o->params);
    o->m = calloc((size_t)(n ? n : 1), sizeof *o->m);
    o->v = calloc((size_t)(n ? n : 1), sizeof *o->v);
    if (!o->params || !o->m || !o->v) { loom_adamw_free(o); return loom_error(LOOM_ERR_NOMEM, "adamw: out of memory"); }
    for (int i = 0; i < n; i++) {
        o->params[i] = params[i];
        if (!params[i]->trainable) continue; /* frozen: no moments (NULL) */
        size_t bytes = (size_t)loom_param_numel(params[i]) * sizeof(float);
        o->m[i] = loom_alloc_zeroed(bytes, LOOM_MEM_OPTIMIZER);
        o->v[i] = loom_alloc_zeroed(bytes, LOOM_MEM_OPTIMIZER);
        if (!o->m[i] || !o->v[i]) { loom_adamw_free(o); return LOOM_ERR_NOMEM; }
    }
    *out = o;
    return LOOM_OK;
}

void loom_adamw_free(loom_adamw *o) {
    if (!o) return;
    for (int i = 0; i < o->n; i++) {
        if (o->m) loom_free(o->m[i]);
        if (o->v) loom_free(o->v[i]);
    }
    free(o->params);
    free(o->m);
    free(o->v);
    free(o);
}

loom_status loom_adamw_step(loom_adamw *o, float lr, float grad_multiplier) {
    /* Gradients kept in the compute dtype (master-grad off) are widened
     * into one scratch, taken before any parameter moves: out of memory
     * leaves the step not taken at all, never half of it. */
    size_t widest = 0;
    for (int i = 0; i < o->n; i++) {
        const loom_param *p = o->params[i];
        size_t n = (size_t)loom_param_numel(p);
        if (p->trainable && p->grad_dtype != LOOM_F32 && n > widest) widest = n;
    }
    for (int i = 0; i < o->n; i++)
        if (o->params[i]->trainable && (!o->m[i] || !o->params[i]->grad))
            return loom_error(LOOM_ERR_STATE, "adamw: parameter %s was frozen and is marked trainable now; "
                              "freezing is one-way (the step was not taken)", o->params[i]->name);
    float *tmp = widest ? loom_alloc(widest * sizeof(float), LOOM_MEM_WORKSPACE) : NULL;
    if (widest && !tmp) return loom_error(LOOM_ERR_NOMEM, "adamw: out of memory (the step was not taken)");
    o->steps++;
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        if (!p->trainable) continue;
        size_t n = (size_t)loom_param_numel(p);
        const float *g = p->grad;
        if (p->grad_dtype != LOOM_F32) {
            loom_convert(tmp, LOOM_F32, p->grad, p->grad_dtype, n);
            g = tmp;
        }
        float wd = p->no_weight_decay ? 0.0f : o->cfg.weight_decay;
        adamw_step(loom_param_master(p), o->m[i], o->v[i], g, n, lr, o->cfg.beta1, o->cfg.beta2, o->cfg.eps, wd,
                   o->steps, grad_multiplier);
        loom_param_sync_from_master(p);
    }
    loom_free(tmp);
    return LOOM_OK;
}

int loom_adamw_steps(const loom_adamw *o) { return o->steps; }
float *loom_adamw_m(loom_adamw *o, int i) { return o->m[i]; }
float *loom_adamw_v(loom_adamw *o, int i) { return o->v[i]; }
void loom_adamw_set_steps(loom_adamw *o, int steps) { o->steps = steps; }

float loom_lr_cosine(int step, int warmup, int total, float max_lr, float min_lr) {
    if (warmup > 0 && step < warmup) return max_lr * (float)(step + 1) / (float)warmup;
    if (step >= total) return min_lr;
    double progress = (double)(step - warmup) / (double)(total - warmup > 0 ? total - warmup : 1);
    double c = 0.5 * (1.0 + cos(M_PI * progress));
    return min_lr + (float)c * (max_lr - min_lr);
}

static const char *const schedule_names[] = {"cosine", "linear", "constant", "wsd"};

loom_status loom_lr_schedule_parse(const char *name, loom_lr_schedule *out) {
    for (int i = 0; i < 4; i++)
        if (name && strcmp(name, schedule_names[i]) == 0) {
            *out = (loom_lr_schedule)i;
            return LOOM_OK;
        }
    return loom_error(LOOM_ERR_INVALID, "unknown learning-rate schedule '%s' (cosine, linear, constant or wsd)",
                      name ? name : "");
}

const char *loom_lr_schedule_name(loom_lr_schedule s) {
    return (unsigned)s < 4 ? schedule_names[s] : "?";
}

float loom_lr_at(loom_lr_schedule s, int step, int warmup, int total, float max_lr, float min_lr, double decay_frac) {
    if (s == LOOM_LR_COSINE) return loom_lr_cosine(step, warmup, total, max_lr, min_lr);
    if (warmup > 0 && step < warmup) return max_lr * (float)(step + 1) / (float)warmup;
    if (s == LOOM_LR_CONSTANT) return max_lr;
    if (step >= total) return min_lr;
    int start = warmup, lead = 0;
    if (s == LOOM_LR_WSD) {
        /* Round half up, with room for a decimal fraction's binary error
         * (0.35 * 10 is 3.4999999999999996). */
        int decay = (int)floor(decay_frac * total + 0.5 + 1e-9);
        decay = decay < 1 ? 1 : decay;
        start = total - decay > warmup ? total - decay : warmup;
        if (step < start) return max_lr;
        lead = 1; /* the window's last step is at min_lr */
    }
    double progress = (double)(step - start + lead) / (double)(total - start > 0 ? total - start : 1);
    return max_lr + (float)progress * (min_lr - max_lr);
}
