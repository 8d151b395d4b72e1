/*
 * dist_optim.c — AdamW for data-parallel jobs, with optional ZeRO-1.
 * Owns: the flat fp32 gradient buffer (every fp32 main_grad lives in it, so
 * it is communicated in place), its buckets and their all-reduces started
 * during backward, the sharded masters and moments (ZeRO-1), the
 * cross-rank gradient norm and found-inf.
 * Must never: let ranks diverge (every rank applies the same update to the
 * same masters), start collectives in a different order on different
 * ranks, touch a bucket while its collective is in flight, or count a
 * TP-replicated gradient more than once.
 */
#include "loom/optim.h"
#include "kernels/kernels.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>

/* Gradients are communicated in buckets of about this many floats by
 * default, last parameters first (the order backward completes them). */
#define BUCKET_FLOATS ((size_t)1 << 20)

typedef struct bucket {
    int first, last;       /* parameters first..last (ascending) */
    size_t lo, hi;         /* its range of the flat buffer */
    int *counts;           /* ZeRO: floats of [lo, hi) each rank receives */
    loom_comm_request req;
    long contributions;    /* its parameters' contributions when started */
} bucket;

struct loom_dist_optim {
    loom_adamw_config cfg;
    loom_param **params;
    int n;
    loom_dist dist;       /* copy of the layout (borrowed communicators) */
    int distributed, zero;
    size_t *offset;       /* flat offset of each parameter */
    size_t total, padded, shard, own_begin, bucket_floats;
    float *flat;          /* (padded) gradients; after a ZeRO step, scratch for the gather */
    bucket *buckets;      /* nb buckets, bucket 0 holds the last parameters */
    int nb, started;      /* buckets started this step */
    int early;            /* of those, started during the watched backward */
    int watching;         /* the backward hook is installed */
    int *base;            /* contributions of each parameter when watching began */
    float *own_grad;      /* ZeRO: this rank's reduced gradients (flat + own_begin) */
    float *own_master;    /* (shard) ZeRO: fp32 masters of this rank's range */
    loom_adamw *plain;    /* without ZeRO: full moments */
    float *m, *v;         /* ZeRO: (shard) moments */
    int steps;
    int io_first;         /* loom_dist_optim_moments_io: model index of params[0] */
    int *part_counts;     /* ZeRO: (2 dp_size) counts and displacements of gather_moment, made with it */
    int masters_lent;     /* ZeRO: the whole masters live in flat (unshard_masters) */
};

/* Is parameter i's master held (sharded) by the optimizer? ZeRO-1 with a
 * compute dtype other than f32; with f32 the compute copy is the master and
 * every rank needs all of it for forward. */
static int master_sharded(const loom_dist_optim *o, int i) {
    return o->zero && o->params[i]->tensor->dtype != LOOM_F32;
}

/* Does this rank own part of parameter i? [s, t) is that part (flat). */
static int own_part(const loom_dist_optim *o, int i, size_t *s, size_t *t) {
    size_t b = o->own_begin, e = b + o->shard;
    size_t lo = o->offset[i], hi = lo + (size_t)loom_param_numel(o->params[i]);
    if (hi <= b || lo >= e) return 0;
    *s = lo > b ? lo : b;
    *t = hi < e ? hi : e;
    return 1;
}

static int grad_in_flat(const loom_dist_optim *o, int i) {
    return o->flat && (float *)o->params[i]->grad == o->flat + o->offset[i];
}

void loom_dist_optim_free(loom_dist_optim *o) {
    if (!o) return;
    if (o->watching) loom_set_backward_hook(NULL, NULL);
    for (int k = 0; k < o->nb; k++) {
        loom_comm_wait(&o->buckets[k].req);
        free(o->buckets[k].counts);
    }
    free(o->buckets);
    free(o->base);
    free(o->part_counts);
    /* Parameters outlive the optimizer. Masters lent from flat (whole,
     * after loom_dist_optim_unshard_masters) become their own, and flat
     * holds gradients (zero) again; sharded masters stay dropped (giving
     * them back would take a collective). Then the gradients move back into
     * their own memory (a local copy). */
    for (int i = 0; o->masters_lent && i < o->n; i++) {
        loom_param *p = o->params[i];
        if (!p->master_borrowed) continue;
        loom_param_drop_master(p);
        LOOM_ASSERT(loom_param_attach_master(p, o->flat + o->offset[i]) == LOOM_OK);
    }
    if (o->masters_lent) memset(o->flat, 0, o->padded * sizeof(float));
    for (int i = 0; i < o->n; i++)
        if (grad_in_flat(o, i)) LOOM_ASSERT(loom_param_set_grad_buffer(o->params[i], NULL) == LOOM_OK);
    loom_adamw_free(o->plain);
    free(o->params);
    free(o->offset);
    loom_free(o->flat);
    loom_free(o->own_master);
    loom_free(o->m);
    loom_free(o->v);
    free(o);
}

static loom_status make_buckets(loom_dist_optim *o) {
    o->buckets = calloc((size_t)(o->n ? o->n : 1), sizeof *o->buckets);
    if (!o->buckets) return LOOM_ERR_NOMEM;
    int D = o->dist.dp_size;
    for (int i = o->n - 1; i >= 0;) {
        bucket *bk = &o->buckets[o->nb++];
        bk->last = i;
        size_t size = 0;
        while (i >= 0 && (size == 0 || size + (size_t)loom_param_numel(o->params[i]) <= o->bucket_floats))
            size += (size_t)loom_param_numel(o->params[i--]);
        bk->first = i + 1;
        bk->lo = o->offset[bk->first];
        bk->hi = bk->last == o->n - 1 ? o->padded : o->offset[bk->last + 1];
        if (o->zero) {
            bk->counts = calloc((size_t)D, sizeof *bk->counts);
            if (!bk->counts) return LOOM_ERR_NOMEM;
            for (int r = 0; r < D; r++) {
                size_t b = (size_t)r * o->shard, e = b + o->shard;
                size_t s = bk->lo > b ? bk->lo : b, t = bk->hi < e ? bk->hi : e;
                if (t > s && t - s > (size_t)INT_MAX)
                    return loom_error(LOOM_ERR_DIST, "ZeRO: a bucket's shard of %zu floats is more than MPI can "
                                      "count in one call; lower --bucket-size", t - s);
                bk->counts[r] = t > s ? (int)(t - s) : 0;
            }
        }
    }
    return LOOM_OK;
}

loom_status loom_dist_optim_new(const loom_adamw_config *cfg, loom_param *const *params, int n, const loom_dist *dist,
                                int zero, size_t bucket_floats, loom_dist_optim **out) {
    *out = NULL;
    for (int i = 0; i < n; i++)
        if (!params[i]->trainable)
            return loom_error(LOOM_ERR_INVALID, "optimizer: parameter %s is frozen; give the optimizer the "
                              "trainable parameters only", params[i]->name);
    for (int i = 0; i < n; i++)
        if (params[i]->master_sharded)
            return loom_error(LOOM_ERR_STATE, "optimizer: parameter %s has no master weights (an earlier ZeRO "
                              "optimizer holds them sharded); call loom_dist_optim_unshard_masters before freeing "
                              "that optimizer", params[i]->name);
    loom_dist_optim *o = calloc(1, sizeof *o);
    if (!o) return loom_error(LOOM_ERR_NOMEM, "optimizer: out of memory");
    o->cfg = *cfg;
    o->n = n;
    o->bucket_floats = bucket_floats ? bucket_floats : BUCKET_FLOATS;
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
        o->flat = loom_alloc_zeroed(o->padded * sizeof(float), LOOM_MEM_GRADS);
        o->base = calloc((size_t)(n ? n : 1), sizeof *o->base);
        st = o->flat && o->base ? make_buckets(o) : LOOM_ERR_NOMEM;
        /* fp32 gradients move into the flat buffer: communicated in place. */
        for (int i = 0; i < n && st == LOOM_OK; i++)
            if (params[i]->grad_dtype == LOOM_F32) st = loom_param_set_grad_buffer(params[i], o->flat + o->offset[i]);
    }
    if (st == LOOM_OK && o->zero) {
        o->own_grad = o->flat + o->own_begin;
        o->m = loom_alloc_zeroed(o->shard * sizeof(float), LOOM_MEM_OPTIMIZER);
        o->v = loom_alloc_zeroed(o->shard * sizeof(float), LOOM_MEM_OPTIMIZER);
        o->part_counts = calloc(2 * (size_t)D, sizeof *o->part_counts);
        int half = 0; /* fp32 compute copies are their own masters: nothing to shard */
        for (int i = 0; i < n; i++) half |= master_sharded(o, i);
        if (half) o->own_master = loom_alloc_zeroed(o->shard * sizeof(float), LOOM_MEM_PARAMS);
        if (!o->m || !o->v || !o->part_counts || (half && !o->own_master)) st = LOOM_ERR_NOMEM;
        if (st == LOOM_OK) st = loom_dist_optim_reshard_masters(o);
    } else if (st == LOOM_OK) {
        st = loom_adamw_new(cfg, params, n, &o->plain);
    }
    if (st != LOOM_OK) { loom_dist_optim_free(o); return st == LOOM_ERR_NOMEM ? loom_error(st, "optimizer: out of memory") : st; }
    *out = o;
    return LOOM_OK;
}

/* ------------------------------------------------- gradient communication */

/* Parameter i's gradient is complete for this backward: it received a
 * contribution since watching began and now has one per recorded use
 * (every use is counted in the forward, those inside reentrant regions
 * too: autograd_count_uses_begin). */
static int param_done(const loom_dist_optim *o, int i) {
    const loom_param *p = o->params[i];
    return !p->trainable || (p->contributions > o->base[i] && p->contributions == p->uses);
}

static long bucket_contributions(const loom_dist_optim *o, const bucket *bk) {
    long c = 0;
    for (int i = bk->first; i <= bk->last; i++) c += o->params[i]->contributions;
    return c;
}

/* Start bucket k's reduction (the next in order: ranks agree on it). */
static loom_status start_bucket(loom_dist_optim *o, int k) {
    bucket *bk = &o->buckets[k];
    for (int i = bk->first; i <= bk->last; i++) {
        loom_param *p = o->params[i];
        if (!grad_in_flat(o, i))
            loom_convert(o->flat + o->offset[i], LOOM_F32, p->grad, p->grad_dtype, (size_t)loom_param_numel(p));
    }
    if (bk->hi == o->padded) memset(o->flat + o->total, 0, (o->padded - o->total) * sizeof(float)); /* the padding */
    bk->contributions = bucket_contributions(o, bk);
    loom_status st = LOOM_OK;
    if (o->zero) /* in place: this rank's part lands at lo (moved home afterwards) */
        st = loom_comm_ireduce_scatter_f32(o->dist.dp, o->flat + bk->lo, o->flat + bk->lo, bk->counts, &bk->req);
    else if (o->dist.dp_size > 1)
        st = loom_comm_iallreduce_sum_f32(o->dist.dp, o->flat + bk->lo, bk->hi - bk->lo, &bk->req);
    if (st == LOOM_OK) o->started = k + 1; /* a bucket that failed to start never counts as reduced */
    return st;
}

/* After each node of the watched backward: start every bucket whose
 * gradients are complete, in order, and let the ones in flight progress. */
static loom_status on_backward_node(void *user) {
    loom_dist_optim *o = user;
    while (o->started < o->nb) {
        const bucket *bk = &o->buckets[o->started];
        int ready = 1;
        for (int i = bk->first; i <= bk->last && ready; i++) ready = param_done(o, i);
        if (!ready) break;
        LOOM_TRY(start_bucket(o, o->started));
        o->early++;
    }
    for (int k = 0; k < o->started; k++) {
        int done;
        LOOM_TRY(loom_comm_test(&o->buckets[k].req, &done));
    }
    return LOOM_OK;
}

void loom_dist_optim_watch_backward(loom_dist_optim *o) {
    /* Lent masters live where buckets would be reduced: no bucket starts
     * (prepare refuses the step, naming why). */
    if (!o->distributed || o->dist.dp_size < 2 || o->masters_lent) return;
    /* A failed step may have left reductions in flight: finish them before
     * their requests are reused (ranks stay in step). */
    for (int k = 0; k < o->nb; k++) (void)loom_comm_wait(&o->buckets[k].req);
    for (int i = 0; i < o->n; i++) o->base[i] = o->params[i]->contributions;
    o->started = o->early = 0;
    o->watching = 1;
    loom_set_backward_hook(on_backward_node, o);
}

/* Start what backward did not and wait for everything. *late becomes 1 +
 * the first bucket a gradient reached after its reduction had started (0:
 * none); the caller reports it after combining it over all ranks, so that
 * every rank stops together. */
static loom_status finish_buckets(loom_dist_optim *o, int *late) {
    if (o->watching) loom_set_backward_hook(NULL, NULL);
    int watched = o->watching;
    o->watching = 0;
    if (!watched) o->started = o->early = 0;
    loom_status st = LOOM_OK;
    while (st == LOOM_OK && o->started < o->nb) st = start_bucket(o, o->started);
    for (int k = 0; k < o->nb; k++) {
        loom_status w = loom_comm_wait(&o->buckets[k].req);
        if (st == LOOM_OK) st = w;
    }
    o->started = 0;
    LOOM_TRY(st);
    for (int k = 0; k < o->nb; k++) {
        const bucket *bk = &o->buckets[k];
        if (o->zero && bk->counts[o->dist.dp_rank] > 0) {
            size_t s = bk->lo > o->own_begin ? bk->lo : o->own_begin;
            memmove(o->flat + s, o->flat + bk->lo, (size_t)bk->counts[o->dist.dp_rank] * sizeof(float));
        }
        if (!*late && bucket_contributions(o, bk) != bk->contributions) *late = k + 1;
    }
    return LOOM_OK;
}

/* Does this rank count parameter i in the global norm? Split parameters
 * on every TP rank; replicated ones on TP rank 0 only. */
static int counts(const loom_dist_optim *o, int i) {
    return o->params[i]->trainable && (o->params[i]->tp_split_dim >= 0 || o->dist.tp_rank == 0);
}

loom_status loom_dist_optim_prepare(loom_dist_optim *o, const loom_loss_scaler *scaler, float max_norm,
                                    loom_step_info *info) {
    double ss = 0.0;
    int bad = 0;
    if (o->masters_lent)
        return loom_error(LOOM_ERR_STATE, "optimizer: the whole masters live in the gradient buffer "
                          "(loom_dist_optim_unshard_masters); call loom_dist_optim_reshard_masters before the next "
                          "step's backward");
    if (!o->distributed) {
        loom_amp_prepare_step(o->params, o->n, scaler, max_norm, info);
        return LOOM_OK;
    }
    int late = 0;
    LOOM_TRY(finish_buckets(o, &late));
    /* A gradient kept in half precision (master-grad off) is read by the
     * optimizer as the fp32 sum rounded to that precision: so plain data
     * parallelism rounds the sum back into p->grad, and ZeRO-1 rounds its
     * shard of the sum alike, and both take the norm and the found-inf check
     * from the rounded values. ZeRO-1 then updates exactly as plain DP. */
    if (o->zero) {
        for (int i = 0; i < o->n; i++) {
            size_t s, t;
            if (!own_part(o, i, &s, &t)) continue;
            float *g = o->own_grad + (s - o->own_begin);
            loom_dtype gd = o->params[i]->grad_dtype;
            if (gd != LOOM_F32) {
                #pragma omp parallel for schedule(static) if (t - s > 65536)
                for (size_t k = 0; k < t - s; k++) g[k] = loom_round_to(g[k], gd);
            }
            if (!counts(o, i)) continue;
            ss += sumsq(g, t - s, LOOM_F32);
            bad |= has_nonfinite(g, t - s, LOOM_F32);
        }
        LOOM_TRY(loom_comm_allreduce_sum_f64(o->dist.world, &ss, 1));
    } else {
        for (int i = 0; i < o->n; i++) {
            loom_param *p = o->params[i];
            size_t k = (size_t)loom_param_numel(p);
            /* The optimizer reads p->grad, so that is what is checked: an
             * fp16 gradient can overflow when the fp32 sum is rounded back
             * although every rank's part and the sum are finite. */
            if (!grad_in_flat(o, i)) {
                loom_convert(p->grad, p->grad_dtype, o->flat + o->offset[i], LOOM_F32, k);
                loom_convert(o->flat + o->offset[i], LOOM_F32, p->grad, p->grad_dtype, k); /* the rounded sum */
            }
            if (p->trainable) bad |= has_nonfinite(p->grad, k, p->grad_dtype);
            if (counts(o, i)) ss += sumsq(o->flat + o->offset[i], k, LOOM_F32);
        }
        LOOM_TRY(loom_comm_allreduce_sum_f64(o->dist.tp, &ss, 1));
    }
    int flags[2] = {bad, late};
    LOOM_TRY(loom_comm_allreduce_max_int(o->dist.world, flags, 2));
    bad = flags[0];
    if (flags[1]) {
        const bucket *bk = &o->buckets[flags[1] - 1];
        return loom_error(LOOM_ERR_STATE, "a gradient of parameters %s..%s arrived after their all-reduce had "
                          "started%s (a parameter used again after its uses seemed complete); turn the overlap "
                          "off (--overlap off)", o->params[bk->first]->name, o->params[bk->last]->name,
                          late ? "" : " on another rank");
    }
    loom_amp_step_info(ss, bad, scaler, max_norm, info);
    return LOOM_OK;
}

/* --------------------------------------------------------------- update */

/* This rank's range of the fp32 masters into flat[own range]. */
static void own_masters_to_flat(loom_dist_optim *o) {
    for (int i = 0; i < o->n; i++) {
        size_t s, t;
        if (!own_part(o, i, &s, &t)) continue;
        const float *src = master_sharded(o, i) ? o->own_master + (s - o->own_begin)
                                                : loom_param_master(o->params[i]) + (s - o->offset[i]);
        memcpy(o->flat + s, src, (t - s) * sizeof(float));
    }
}

loom_status loom_dist_optim_step(loom_dist_optim *o, float lr, float mult) {
    o->steps++;
    if (!o->zero) {
        loom_adamw_set_steps(o->plain, o->steps - 1);
        return loom_adamw_step(o->plain, lr, mult);
    }
    size_t b = o->own_begin;
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        size_t s, t;
        if (!p->trainable || !own_part(o, i, &s, &t)) continue;
        float *master = master_sharded(o, i) ? o->own_master + (s - b) : loom_param_master(p) + (s - o->offset[i]);
        float wd = p->no_weight_decay ? 0.0f : o->cfg.weight_decay;
        adamw_step(master, o->m + (s - b), o->v + (s - b), o->own_grad + (s - b), t - s, lr, o->cfg.beta1,
                   o->cfg.beta2, o->cfg.eps, wd, o->steps, mult);
    }
    /* All-gather the updated masters through the gradient buffer (the
     * gradients are spent), refresh every compute copy, zero the buffer. */
    own_masters_to_flat(o);
    LOOM_TRY(loom_comm_allgather_f32(o->dist.dp, o->flat + b, o->flat, o->shard));
    for (int i = 0; i < o->n; i++) {
        loom_param *p = o->params[i];
        loom_convert(loom_tensor_data(p->tensor), p->tensor->dtype, o->flat + o->offset[i], LOOM_F32,
                     (size_t)loom_param_numel(p));
    }
    memset(o->flat, 0, o->padded * sizeof(float));
    return LOOM_OK;
}

int loom_dist_optim_steps(const loom_dist_optim *o) { return o->steps; }

int loom_dist_optim_buckets(const loom_dist_optim *o, int *early) {
    *early = o->early;
    return o->distributed ? o->nb : 0;
}

void loom_dist_optim_set_steps(loom_dist_optim *o, int steps) {
    o->steps = steps;
    if (o->plain) loom_adamw_set_steps(o->plain, steps);
}

/* ---------------------------------------------------- masters and moments */

/* The whole masters are gathered into the flat gradient buffer (which
 * holds no gradients between steps) and lent to the parameters from there:
 * no memory beyond what the optimizer holds already. */
loom_status loom_dist_optim_unshard_masters(loom_dist_optim *o) {
    if (!o->own_master) return LOOM_OK;
    int any = 0;
    for (int i = 0; i < o->n; i++) any |= o->params[i]->master_sharded;
    if (!any) return LOOM_OK;
    own_masters_to_flat(o);
    LOOM_TRY(loom_comm_allgather_f32(o->dist.dp, o->flat + o->own_begin, o->flat, o->shard));
    for (int i = 0; i < o->n; i++) loom_param_lend_master(o->params[i], o->flat + o->offset[i]);
    o->masters_lent = 1;
    return LOOM_OK;
}

loom_status loom_dist_optim_reshard_masters(loom_dist_optim *o) {
    if (!o->own_master) return LOOM_OK;
    for (int i = 0; i < o->n; i++) {
        size_t s, t;
        if (!master_sharded(o, i) || o->params[i]->master_sharded) continue;
        if (own_part(o, i, &s, &t))
            memcpy(o->own_master + (s - o->own_begin), loom_param_master(o->params[i]) + (s - o->offset[i]),
                   (t - s) * sizeof(float));
        loom_param_drop_master(o->params[i]);
    }
    if (o->masters_lent) memset(o->flat, 0, o->padded * sizeof(float)); /* gradients again */
    o->masters_lent = 0;
    return LOOM_OK;
}

/* -------------------------------------------- moments, for checkpoints */

static float *moment_base(loom_dist_optim *o, int kind) { return kind ? o->v : o->m; }

static float *io_view(void *user, int i, int kind) {
    loom_dist_optim *o = user;
    i -= o->io_first;
    if (o->zero) return NULL; /* sharded: only a gather makes it whole */
    return kind ? loom_adamw_v(o->plain, i) : loom_adamw_m(o->plain, i);
}

/* ZeRO: gather parameter j's moment from the ranks that own its parts
 * (contiguous, in rank order) to DP rank 0. */
static loom_status gather_moment(loom_dist_optim *o, int j, int kind, float *out) {
    int D = o->dist.dp_size, *counts = o->part_counts, *displs = counts + D; /* made beforehand: no failure */
    size_t lo = o->offset[j], hi = lo + (size_t)loom_param_numel(o->params[j]);
    if (hi - lo > (size_t)INT_MAX) /* the same on every rank */
        return loom_error(LOOM_ERR_DIST, "ZeRO: %s has %zu elements, more than MPI can count in one call",
                          o->params[j]->name, hi - lo);
    for (int r = 0; r < D; r++) { /* counts and offsets within the parameter: they fit in an int */
        size_t b = (size_t)r * o->shard, e = b + o->shard;
        size_t s = lo > b ? lo : b, t = hi < e ? hi : e;
        counts[r] = t > s ? (int)(t - s) : 0;
        displs[r] = t > s ? (int)(s - lo) : 0;
    }
    size_t s, t;
    const float *mine = own_part(o, j, &s, &t) ? moment_base(o, kind) + (s - o->own_begin) : moment_base(o, kind);
    return loom_comm_gatherv_f32(o->dist.dp, mine, out, counts, displs, 0);
}

static loom_status io_get(void *user, int i, int kind, float *out) {
    loom_dist_optim *o = user;
    int j = i - o->io_first;
    if (o->zero) return gather_moment(o, j, kind, out);
    if (out) memcpy(out, io_view(user, i, kind), (size_t)loom_param_numel(o->params[j]) * sizeof(float));
    return LOOM_OK;
}

static void io_set(void *user, int i, int kind, const float *in) {
    loom_dist_optim *o = user;
    int j = i - o->io_first;
    size_t s, t;
    if (!o->zero)
        memcpy(io_view(user, i, kind), in, (size_t)loom_param_numel(o->params[j]) * sizeof(float));
    else if (own_part(o, j, &s, &t))
        memcpy(moment_base(o, kind) + (s - o->own_begin), in + (s - o->offset[j]), (t - s) * sizeof(float));
}

loom_moments_io loom_dist_optim_moments_io(loom_dist_optim *o, int first) {
    o->io_first = first;
    return (loom_moments_io){io_view, io_get, io_set, o};
}

loom_status loom_dist_optim_serve_moments(loom_dist_optim *o) {
    for (int j = 0; o->zero && j < o->n; j++)
        for (int kind = 0; kind < 2; kind++) LOOM_TRY(gather_moment(o, j, kind, NULL));
    return LOOM_OK;
}
