/*
 * fused_linear_recompute.c — a user-defined fused linear under every
 * activation-recompute mode, trained in bf16 with fp32 main_grad.
 *
 * The fused linear below is written with loom's public function interface
 * only, the way a user writes a custom op:
 *   forward   y = x W^T (+ b), saving (x, weight, bias) with bias possibly NULL
 *   backward  dx = dy W; main_grad(W) += dy^T x with one GEMM (beta = 1, no
 *             temporary dW); main_grad(b) += sum of dy's rows
 * A 3-layer MLP (32 -> 64 -> 64 -> 16 classes) built from it, each layer a
 * checkpoint region, is trained for a few AdamW steps under each recompute
 * mode (none, reentrant, nonreentrant, selective). The program prints every
 * parameter's main_grad checksum after the first backward and the final
 * loss of each mode, and exits with status 1 if any checksum differs across
 * modes: recompute must not change a single bit of the gradients.
 *
 * Build: it is built with loom (cmake); run ./fused_linear_recompute.
 */
#include "loom/loom.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(expr)                                                                        \
    do {                                                                                   \
        loom_status st_ = (expr);                                                          \
        if (st_ != LOOM_OK) {                                                              \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, loom_last_error()); \
            exit(2);                                                                       \
        }                                                                                  \
    } while (0)

/* ------------------------------------------------- the user's fused linear */

typedef struct linear_args {
    loom_param *w, *b; /* the parameters, to check we get them back; b may be NULL */
} linear_args;

static loom_status linear_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *w = in[1], *b = in[2];
    int N = (int)x->shape[0], K = (int)x->shape[1], M = (int)w->shape[0];
    out[0] = loom_tensor_new_2d(x->dtype, N, M, LOOM_MEM_ACTIVATIONS); /* (N, M) */
    if (!out[0]) return LOOM_ERR_NOMEM;
    LOOM_TRY(loom_gemm(0, 1, N, M, K, 1.0f, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 0.0f,
                       loom_tensor_data(out[0]), M, x->dtype, b ? loom_tensor_data(b) : NULL, x->dtype));
    loom_tensor *save[3] = {x, w, b}; /* b may be NULL: a NULL slot */
    return loom_ctx_save(ctx, save, 3);
}

static loom_status linear_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                   int n_in) {
    (void)n_out; (void)n_in;
    const linear_args *a = loom_ctx_args(ctx);
    loom_tensor *x, *w, *b;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &w));
    LOOM_TRY(loom_ctx_saved(ctx, 2, &b));
    /* The saved weight is the very parameter, in every recompute mode. */
    if (loom_tensor_param(w) != a->w || (a->b ? loom_tensor_param(b) != a->b : b != NULL))
        return loom_error(LOOM_ERR_STATE, "linear: saved weight or bias of '%s' is not the parameter", a->w->name);
    const loom_tensor *dy = gout[0]; /* (N, M) */
    int N = (int)x->shape[0], K = (int)x->shape[1], M = (int)w->shape[0];
    if (loom_ctx_needs_input_grad(ctx, 0)) {
        gin[0] = loom_tensor_new_2d(x->dtype, N, K, LOOM_MEM_ACTIVATIONS); /* dx (N, K) */
        if (!gin[0]) return LOOM_ERR_NOMEM;
        LOOM_TRY(loom_gemm(0, 0, N, K, M, 1.0f, loom_tensor_data(dy), M, loom_tensor_data(w), K, x->dtype, 0.0f,
                           loom_tensor_data(gin[0]), K, x->dtype, NULL, LOOM_F32));
    }
    if (loom_ctx_needs_input_grad(ctx, 1)) {
        loom_dtype dt;
        void *mg = loom_param_grad_target(a->w, &dt); /* fp32 main_grad (M, K) */
        LOOM_TRY(loom_gemm(1, 0, M, K, N, 1.0f, loom_tensor_data(dy), M, loom_tensor_data(x), K, x->dtype, 1.0f, mg,
                           K, dt, NULL, LOOM_F32));
    }
    if (b && loom_ctx_needs_input_grad(ctx, 2)) {
        loom_dtype dt;
        void *bg = loom_param_grad_target(a->b, &dt); /* (M) */
        for (int j = 0; j < M; j++) {
            float s = 0.0f;
            for (int r = 0; r < N; r++) s += loom_tensor_get(dy, (int64_t)r * M + j);
            loom_store(bg, (size_t)j, dt, loom_load(bg, (size_t)j, dt) + s);
        }
    }
    return LOOM_OK;
}

static const loom_function linear_fn = {"user_fused_linear", 3, 1, LOOM_FN_EXPENSIVE, linear_forward,
                                        linear_backward};

/* -------------------------------------------------------------- the model */

enum { N_LAYERS = 3, BATCH = 32, IN = 32, HIDDEN = 64, CLASSES = 16, STEPS = 5 };

typedef struct layer {
    loom_param *w, *b; /* b may be NULL */
    int activation;    /* 1: silu after the linear */
} layer;

typedef struct model {
    layer layers[N_LAYERS];
    loom_param *params[2 * N_LAYERS];
    int n_params;
} model;

/* One layer as a checkpoint region: silu(x W^T + b), or without silu. */
static loom_status layer_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const layer *l = user;
    loom_tensor *lin_in[3] = {in[0], l->w->tensor, l->b ? l->b->tensor : NULL}, *y = NULL;
    linear_args a = {l->w, l->b};
    LOOM_TRY(loom_function_apply(&linear_fn, lin_in, 3, &y, 1, &a, sizeof a));
    if (!l->activation) {
        out[0] = y;
        return LOOM_OK;
    }
    loom_status st = loom_silu(y, &out[0]);
    loom_tensor_release(y);
    return st;
}

static loom_param *add_param(model *m, const char *name, int ndim, int64_t d0, int64_t d1, float scale,
                             uint64_t seed) {
    loom_param *p;
    int64_t shape[2] = {d0, d1};
    CHECK(loom_param_new(name, LOOM_BF16, ndim, shape, 1 /* fp32 main_grad */, &p));
    loom_rng_normal(loom_param_master(p), (size_t)loom_param_numel(p), 0.0f, scale, seed, 0);
    loom_param_sync_from_master(p);
    if (ndim == 1) p->no_weight_decay = 1;
    m->params[m->n_params++] = p;
    return p;
}

static void model_init(model *m) {
    memset(m, 0, sizeof *m);
    const int fan_in[N_LAYERS] = {IN, HIDDEN, HIDDEN}, fan_out[N_LAYERS] = {HIDDEN, HIDDEN, CLASSES};
    const int has_bias[N_LAYERS] = {1, 0, 1}; /* layer 1 saves (x, W, NULL) */
    for (int i = 0; i < N_LAYERS; i++) {
        char name[64];
        layer *l = &m->layers[i];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        l->w = add_param(m, name, 2, fan_out[i], fan_in[i], 1.0f / sqrtf((float)fan_in[i]), 100 + (uint64_t)i);
        if (has_bias[i]) {
            snprintf(name, sizeof name, "layers.%d.bias", i);
            l->b = add_param(m, name, 1, fan_out[i], 0, 0.1f, 200 + (uint64_t)i);
        }
        l->activation = i < N_LAYERS - 1;
    }
}

static void model_free(model *m) {
    for (int i = 0; i < m->n_params; i++) loom_param_free(m->params[i]);
}

/* A fixed data set: inputs x (BATCH, IN) and the class a random linear
 * teacher prefers. */
static void make_data(float *x, int32_t *targets) {
    float teacher[CLASSES * IN];
    loom_rng_normal(x, BATCH * IN, 0.0f, 1.0f, 7, 0);
    loom_rng_normal(teacher, CLASSES * IN, 0.0f, 1.0f, 8, 0);
    for (int r = 0; r < BATCH; r++) {
        int best = 0;
        float best_v = -INFINITY;
        for (int c = 0; c < CLASSES; c++) {
            float v = 0.0f;
            for (int k = 0; k < IN; k++) v += teacher[c * IN + k] * x[r * IN + k];
            if (v > best_v) { best_v = v; best = c; }
        }
        targets[r] = best;
    }
}

/* --------------------------------------------------------------- training */

typedef struct checksum {
    double sum;    /* sum of main_grad's values */
    uint64_t hash; /* FNV-1a of main_grad's bytes */
} checksum;

static uint64_t fnv1a(const void *p, size_t n) {
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ULL;
    return h;
}

typedef struct run {
    checksum sums[2 * N_LAYERS];
    float first_loss, final_loss;
} run;

static float train(loom_recompute_mode mode, model *m, loom_tensor *x, const int32_t *targets, run *r) {
    loom_adamw_config cfg = loom_adamw_defaults();
    loom_adamw *opt;
    CHECK(loom_adamw_new(&cfg, m->params, m->n_params, &opt));
    loom_loss_scaler scaler;
    loom_loss_scaler_init(&scaler, 0); /* bf16: no loss scaling */
    float loss_value = 0.0f;
    for (int step = 0; step < STEPS; step++) {
        for (int i = 0; i < m->n_params; i++) loom_param_zero_grad(m->params[i]);
        loom_tensor *h = loom_tensor_retain(x);
        for (int l = 0; l < N_LAYERS; l++) {
            loom_tensor *next = NULL;
            CHECK(loom_checkpoint(mode, layer_region, &m->layers[l], &h, 1, &next, 1));
            loom_tensor_release(h);
            h = next;
        }
        loom_tensor *loss = NULL;
        CHECK(loom_cross_entropy(h, targets, BATCH, -1, &loss));
        loss_value = loom_tensor_get(loss, 0);
        CHECK(loom_backward(loss, scaler.scale));
        loom_tensor_release(loss);
        loom_tensor_release(h);
        CHECK(loom_grad_audit(m->params, m->n_params, NULL, 0));
        if (step == 0) {
            r->first_loss = loss_value;
            for (int i = 0; i < m->n_params; i++) {
                loom_param *p = m->params[i];
                size_t n = (size_t)loom_param_numel(p);
                const float *g = p->grad; /* fp32 main_grad */
                double s = 0.0;
                for (size_t k = 0; k < n; k++) s += g[k];
                r->sums[i].sum = s;
                r->sums[i].hash = fnv1a(g, n * sizeof(float));
            }
        }
        loom_step_info info;
        loom_amp_prepare_step(m->params, m->n_params, &scaler, 1.0f, &info);
        if (!info.found_inf) CHECK(loom_adamw_step(opt, 1e-2f, info.grad_multiplier));
        loom_loss_scaler_update(&scaler, info.found_inf);
    }
    loom_adamw_free(opt);
    r->final_loss = loss_value;
    return loss_value;
}

int main(void) {
    const loom_recompute_mode modes[4] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                          LOOM_RECOMPUTE_SELECTIVE};
    float xv[BATCH * IN];
    int32_t targets[BATCH];
    make_data(xv, targets);
    loom_tensor *x = loom_tensor_from_f32(xv, LOOM_BF16, 2, (const int64_t[]){BATCH, IN}, LOOM_MEM_ACTIVATIONS);
    if (!x) {
        fprintf(stderr, "%s\n", loom_last_error());
        return 2;
    }
    run runs[4];
    char names[2 * N_LAYERS][160];
    int n_params = 0;
    for (int k = 0; k < 4; k++) {
        model m;
        model_init(&m); /* the same initial weights for every mode */
        n_params = m.n_params;
        for (int i = 0; i < m.n_params; i++) snprintf(names[i], sizeof names[i], "%s", m.params[i]->name);
        train(modes[k], &m, x, targets, &runs[k]);
        model_free(&m);
    }
    loom_tensor_release(x);

    printf("main_grad checksums after the first backward (bf16, master-grad on)\n");
    printf("  %-18s %-13s %-15s %s\n", "parameter", "mode", "sum", "FNV-1a of the bytes");
    int differ = 0;
    for (int i = 0; i < n_params; i++) {
        for (int k = 0; k < 4; k++) {
            int same = runs[k].sums[i].hash == runs[0].sums[i].hash &&
                       memcmp(&runs[k].sums[i].sum, &runs[0].sums[i].sum, sizeof(double)) == 0;
            printf("  %-18s %-13s %+.8e %016llx%s\n", k ? "" : names[i], loom_recompute_mode_name(modes[k]),
                   runs[k].sums[i].sum, (unsigned long long)runs[k].sums[i].hash, same ? "" : "  DIFFERS");
            differ |= !same;
        }
    }
    for (int k = 0; k < 4; k++) {
        printf("%-13s loss: first %.6f  after %d steps %.6f\n", loom_recompute_mode_name(modes[k]),
               (double)runs[k].first_loss, STEPS, (double)runs[k].final_loss);
        if (memcmp(&runs[k].final_loss, &runs[0].final_loss, sizeof(float)) != 0) differ = 1;
    }
    if (differ) {
        printf("FAIL: gradients or losses differ across recompute modes\n");
        return 1;
    }
    printf("OK: identical main_grad in every recompute mode\n");
    return 0;
}
