/*
 * dist_optim.c — AdamW for data-parallel jobs, with optional ZeRO-1.
 * Owns: the flat fp32 view of gradients used for communication, the
 * sharded moments (ZeRO-1), the cross-rank gradient norm and found-inf.
 * Must never: let ranks diverge (every rank applies the same update to the
 * same masters), or count a TP-replicated gradient more than once.
 */
#include "loom/optim.h"
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>

struct loom_dist_optim {
    loom_adamw_config cfg;
    loom_param **params;
    int n;
    loom_dist dist;       /* copy of the layout (borrowed communicators) */
    int distributed, zero;
    size_t *offset;       /* flat offset of each parameter */
    size_t total, padded, shard, own_begin;
    float *flat;          /* (padded) gradients, then masters for the gather */
    float *own_grad;      /* (shard) ZeRO: this rank's reduced gradients */
    loom_adamw *plain;    /* without ZeRO: full moments */
    float *m, *v;         /* ZeRO: (shard) moments */
    int steps;
};

void loom_dist_optim_free(loom_dist_optim *o) {
    if (!o) return;
    loom_adamw_free(o->plain);
    free(o->params);
    free(o->offset);
    loom_free(o->flat);
    loom_free(o->own_grad);
    loom_free(o->m);
    loom_free(o->v);
    free(o);
}

loom_status loom_dist_optim_new(const loom_adamw_config *cfg, loom_param *const *params, int n, const loom_dist *dist,
                                int zero, loom_dist_optim **out) {
    *out = NULL;
    loom_dist_optim *o = calloc(1, sizeof *o);
    if (!o) return loom_error(LOOM_ERR_NOMEM, "optimizer: out of memory");
    o->cfg = *cfg;
    o->n = n;
    if (dist) o->dist = *dist;
    else { o->dist.dp_size = o->dist.tp_size = o->dist.world_size = 1; }
    o->distributed = dist && dist->world_size > 1;
    o->zero = zero && dist && dist->dp_size > 1;
    o->params = malloc((size_t)(n ? n : 1) * sizeof *o->params);
    o->offset = malloc((size_t)(n ? n : 1) * sizeof *o->offset);
    if (!o->params || !o->offset) { loom_dist_optim_free(o); return loom_error(LOOM_ERR_NOMEM, "optimizer: out of memory"); }
    for (int i = 0; i < n; i++) {
        o->params[i] = params[i];
        o->offset[i] = o->total;
        o->total += (size_t)loom_param_numel(params[i]);
    }
    int D = o->dist.dp_size;
    o->padded = (o->total + (size_t)D - 1) / (size_t)D * (size_t)D;
    o->shard = o->padded / (size_t)D;
    o->own_begin = o->zero ? (size_t)o->dist.dp_rank * o->shard : 0;
    loom_status st = LOOM_OK;
    if (o->distributed) {
        o->flat = loom_alloc_zeroed(o->padded * sizeof(float), LOOM_MEM_WORKSPACE);
        if (!o->flat) st = LOOM_ERR_NOMEM;
    }
    if (st == LOOM_OK && o->zero) {
        o->own_grad = loom_alloc_zeroed(o->shard * sizeof(float), LOOM_MEM_OPTIMIZER);
        o->m = loom_alloc_zeroed(o->shard * sizeof(float), LOOM_MEM_OPTIMIZER);
        o->v = loom_alloc_zeroed(o->shard * sizeof(float), LOOM_MEM_OPTIMIZER);
        if (!o->own_grad || !o->m || !o->v) st = LOOM_ERR_NOMEM;
    } else if (st == LOOM_OK) {
        st = loom_adamw_new(cfg, params, n, &o->plain);
    }
    if (st != LOOM_OK) { loom_dist_optim_free(o); return st == LOOM_ERR_NOMEM ? loom_error(st, "optimizer: out of memory") : st; }
    *out = o;
    return LOOM_OK;
}

/* Gradients into / out of the flat fp32 buffer. */
static void grads_to_flat(loom_dist_optim *o) {
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        loom_convert(o->flat + o->offset[i], LOOM_F32, p->grad, p->grad_dtype, (size_t)loom_param_numel(p));
    }
    memset(o->flat + o->total, 0, (o->padded - o->total) * sizeof(float));
}

static void flat_to_grads(loom_dist_optim *o) {
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        loom_convert(p->grad, p->grad_dtype, o->flat + o->offset[i], LOOM_F32, (size_t)loom_param_numel(p));
    }
}

/* Does this rank count parameter i in the global norm? Split parameters
 * on every TP rank; replicated ones on TP rank 0 only. */
static int counts(const loom_dist_optim *o, int i) {
    return o->params[i]->trainable && (o->params[i]->tp_split_dim >= 0 || o->dist.tp_rank == 0);
}

#define BUCKET_FLOATS ((size_t)4 << 20) /* 16 MiB buckets */

loom_status loom_dist_optim_prepare(loom_dist_optim *o, const loom_loss_scaler *scaler, float max_norm,
                                    loom_step_info *info) {
    double ss = 0.0;
    int bad = 0;
    if (!o->distributed) {
        loom_amp_prepare_step(o->params, o->n, scaler, max_norm, info);
        return LOOM_OK;
    }
    grads_to_flat(o);
    if (o->zero) {
        LOOM_TRY(loom_comm_reduce_scatter_f32(o->dist.dp, o->flat, o->own_grad, o->shard));
        size_t b = o->own_begin, e = b + o->shard;
        for (int i = 0; i < o->n; i++) {
            size_t lo = o->offset[i], hi = lo + (size_t)loom_param_numel(o->params[i]);
            if (hi <= b || lo >= e || !counts(o, i)) continue;
            size_t s = lo > b ? lo : b, t = hi < e ? hi : e;
            ss += sumsq(o->own_grad + (s - b), t - s, LOOM_F32);
            bad |= has_nonfinite(o->own_grad + (s - b), t - s, LOOM_F32);
        }
        LOOM_TRY(loom_comm_allreduce_sum_f64(o->dist.world, &ss, 1));
    } else {
        if (o->dist.dp_size > 1)
            for (size_t off = 0; off < o->total; off += BUCKET_FLOATS)
                LOOM_TRY(loom_comm_allreduce_sum_f32(o->dist.dp, o->flat + off,
                                                     o->total - off < BUCKET_FLOATS ? o->total - off : BUCKET_FLOATS));
        flat_to_grads(o);
        for (int i = 0; i < o->n; i++) {
            if (!counts(o, i)) continue;
            size_t k = (size_t)loom_param_numel(o->params[i]);
            ss += sumsq(o->flat + o->offset[i], k, LOOM_F32);
            bad |= has_nonfinite(o->flat + o->offset[i], k, LOOM_F32);
        }
        LOOM_TRY(loom_comm_allreduce_sum_f64(o->dist.tp, &ss, 1));
    }
    LOOM_TRY(loom_comm_allreduce_max_int(o->dist.world, &bad, 1));
    float inv_scale = 1.0f / scaler->scale;
    info->found_inf = bad || !isfinite(ss);
    info->grad_norm = info->found_inf ? NAN : sqrt(ss) * inv_scale;
    info->clip_coef = 1.0f;
    if (!info->found_inf && max_norm > 0.0f && info->grad_norm > max_norm)
        info->clip_coef = (float)(max_norm / (info->grad_norm + 1e-6));
    info->grad_multiplier = inv_scale * info->clip_coef;
    return LOOM_OK;
}

loom_status loom_dist_optim_step(loom_dist_optim *o, float lr, float mult) {
    o->steps++;
    if (!o->zero) {
        loom_adamw_set_steps(o->plain, o->steps - 1);
        return loom_adamw_step(o->plain, lr, mult);
    }
    size_t b = o->own_begin, e = b + o->shard;
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        size_t lo = o->offset[i], hi = lo + (size_t)loom_param_numel(p);
        if (hi <= b || lo >= e || !p->trainable) continue;
        size_t s = lo > b ? lo : b, t = hi < e ? hi : e;
        float wd = p->no_weight_decay ? 0.0f : o->cfg.weight_decay;
        adamw_step(loom_param_master(p) + (s - lo), o->m + (s - b), o->v + (s - b), o->own_grad + (s - b), t - s, lr,
                   o->cfg.beta1, o->cfg.beta2, o->cfg.eps, wd, o->steps, mult);
    }
    /* All-gather the updated masters: each rank contributes its shard. */
    for (int i = 0; i < o->n; i++)
        memcpy(o->flat + o->offset[i], loom_param_master(o->params[i]), (size_t)loom_param_numel(o->params[i]) * sizeof(float));
    LOOM_TRY(loom_comm_allgather_f32(o->dist.dp, o->flat + b, o->flat, o->shard));
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        memcpy(loom_param_master(p), o->flat + o->offset[i], (size_t)loom_param_numel(p) * sizeof(float));
        loom_param_sync_from_master(p);
    }
    return LOOM_OK;
}

int loom_dist_optim_steps(const loom_dist_optim *o) { return o->steps; }

void loom_dist_optim_set_steps(loom_dist_optim *o, int steps) {
    o->steps = steps;
    if (o->plain) loom_adamw_set_steps(o->plain, steps);
}

/* ZeRO: moment array `src` (shard) -> full parameter i via the flat buffer. */
static loom_status gather_moment(loom_dist_optim *o, int i, const float *src, float *out) {
    memcpy(o->flat + o->own_begin, src, o->shard * sizeof(float));
    LOOM_TRY(loom_comm_allgather_f32(o->dist.dp, o->flat + o->own_begin, o->flat, o->shard));
    memcpy(out, o->flat + o->offset[i], (size_t)loom_param_numel(o->params[i]) * sizeof(float));
    return LOOM_OK;
}

loom_status loom_dist_optim_get_moments(loom_dist_optim *o, int i, float *m, float *v) {
    size_t k = (size_t)loom_param_numel(o->params[i]);
    if (!o->zero) {
        memcpy(m, loom_adamw_m(o->plain, i), k * sizeof(float));
        memcpy(v, loom_adamw_v(o->plain, i), k * sizeof(float));
        return LOOM_OK;
    }
    LOOM_TRY(gather_moment(o, i, o->m, m));
    return gather_moment(o, i, o->v, v);
}

void loom_dist_optim_set_moments(loom_dist_optim *o, int i, const float *m, const float *v) {
    size_t k = (size_t)loom_param_numel(o->params[i]);
    if (!o->zero) {
        memcpy(loom_adamw_m(o->plain, i), m, k * sizeof(float));
        memcpy(loom_adamw_v(o->plain, i), v, k * sizeof(float));
        return;
    }
    size_t b = o->own_begin, e = b + o->shard, lo = o->offset[i], hi = lo + k;
    if (hi <= b || lo >= e) return;
    size_t s = lo > b ? lo : b, t = hi < e ? hi : e;
    memcpy(o->m + (s - b), m + (s - lo), (t - s) * sizeof(float));
    memcpy(o->v + (s - b), v + (s - lo), (t - s) * sizeof(float));
}
