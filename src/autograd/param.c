/*
 * param.c — parameters: compute copy, fp32 master, gradient (main_grad in
 * fp32 or a gradient in the compute dtype), and the gradient audit.
 * Must never: assign a gradient (only accumulate), or hand out a gradient
 * buffer without counting the contribution.
 */
#include "internal.h"
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>

/* A frozen parameter of compute dtype dt keeps an fp32 master only for
 * fp16, whose range may not hold every weight; bf16 is held as itself. */
static int frozen_keeps_master(loom_dtype dt) { return dt == LOOM_F16; }

/* The parameter without its gradient: name, zero compute copy and, with
 * master, a zero fp32 master (not for f32: the copy is its own). */
static loom_status param_alloc(const char *name, loom_dtype dt, int ndim, const int64_t *shape, int master,
                               loom_param **out) {
    *out = NULL;
    loom_param *p = calloc(1, sizeof *p);
    if (!p) return loom_error(LOOM_ERR_NOMEM, "parameter '%s': out of memory", name);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->tensor = loom_tensor_zeros(dt, ndim, shape, LOOM_MEM_PARAMS);
    if (!p->tensor) {
        free(p);
        return LOOM_ERR_NOMEM;
    }
    p->tensor->param = p;
    p->tp_split_dim = -1;
    if (master && dt != LOOM_F32) {
        p->master = loom_alloc_zeroed((size_t)loom_tensor_numel(p->tensor) * sizeof(float), LOOM_MEM_PARAMS);
        if (!p->master) { loom_param_free(p); return LOOM_ERR_NOMEM; }
    }
    *out = p;
    return LOOM_OK;
}

loom_status loom_param_new(const char *name, loom_dtype dt, int ndim, const int64_t *shape,
                           int master_grad, loom_param **out) {
    loom_param *p;
    LOOM_TRY(param_alloc(name, dt, ndim, shape, 1, &p));
    p->master_grad = master_grad;
    p->grad_dtype = master_grad ? LOOM_F32 : dt;
    p->grad = loom_alloc_zeroed((size_t)loom_param_numel(p) * loom_dtype_size(p->grad_dtype), LOOM_MEM_GRADS);
    if (!p->grad) { loom_param_free(p); return LOOM_ERR_NOMEM; }
    p->trainable = 1;
    *out = p;
    return LOOM_OK;
}

loom_status loom_param_new_frozen(const char *name, loom_dtype dt, int ndim, const int64_t *shape,
                                  loom_param **out) {
    loom_param *p;
    LOOM_TRY(param_alloc(name, dt, ndim, shape, frozen_keeps_master(dt), &p));
    p->grad_dtype = dt;
    *out = p; /* as loom_param_freeze leaves one: trainable 0, grad NULL */
    return LOOM_OK;
}

void loom_param_free(loom_param *p) {
    if (!p) return;
    if (p->tensor) {
        p->tensor->param = NULL;
        loom_tensor_release(p->tensor);
    }
    if (!p->master_borrowed) loom_free(p->master);
    if (!p->grad_borrowed) loom_free(p->grad);
    free(p);
}

int loom_param_has_master(const loom_param *p) {
    return !p->master_sharded && (p->master || p->tensor->dtype == LOOM_F32);
}

int loom_param_compute_only(const loom_param *p) {
    return !p->master_sharded && !p->master && p->tensor->dtype != LOOM_F32;
}

float *loom_param_master(loom_param *p) {
    LOOM_ASSERT(!p->master_sharded); /* ZeRO-1 holds it: attach it first */
    LOOM_ASSERT(loom_param_has_master(p)); /* a frozen bf16 weight has none: loom_param_get_f32 */
    return p->master ? p->master : (float *)loom_tensor_data(p->tensor);
}

void loom_param_get_f32(const loom_param *p, float *dst) {
    LOOM_ASSERT(!p->master_sharded);
    size_t n = (size_t)loom_param_numel(p);
    if (p->master) memcpy(dst, p->master, n * sizeof(float));
    else loom_convert(dst, LOOM_F32, loom_tensor_data(p->tensor), p->tensor->dtype, n);
}

void loom_param_drop_master(loom_param *p) {
    if (!p->master) return;
    if (!p->master_borrowed) loom_free(p->master);
    p->master = NULL;
    p->master_borrowed = 0;
    p->master_sharded = 1;
}

void loom_param_lend_master(loom_param *p, float *buf) {
    if (!p->master_sharded) return;
    p->master = buf;
    p->master_borrowed = 1;
    p->master_sharded = 0;
}

loom_status loom_param_attach_master(loom_param *p, const float *full) {
    if (!p->master_sharded) return LOOM_OK;
    size_t n = (size_t)loom_param_numel(p);
    p->master = loom_alloc(n * sizeof(float), LOOM_MEM_PARAMS);
    if (!p->master) return loom_error(LOOM_ERR_NOMEM, "parameter '%s': out of memory for its master", p->name);
    memcpy(p->master, full, n * sizeof(float));
    p->master_sharded = 0;
    return LOOM_OK;
}

loom_status loom_param_set_grad_buffer(loom_param *p, void *buf) {
    size_t bytes = (size_t)loom_param_numel(p) * loom_dtype_size(p->grad_dtype);
    if (buf && buf == p->grad) return LOOM_OK;
    void *dst = buf ? buf : loom_alloc(bytes, LOOM_MEM_GRADS);
    if (!dst) return loom_error(LOOM_ERR_NOMEM, "parameter '%s': out of memory for its gradient", p->name);
    if (dst != p->grad) memcpy(dst, p->grad, bytes);
    if (!p->grad_borrowed) loom_free(p->grad);
    p->grad = dst;
    p->grad_borrowed = buf != NULL;
    return LOOM_OK;
}

loom_status loom_param_set_f32(loom_param *p, const float *src, int64_t n) {
    if (n != loom_param_numel(p))
        return loom_error(LOOM_ERR_INVALID, "parameter '%s': %lld values given, it has %lld", p->name,
                          (long long)n, (long long)loom_param_numel(p));
    if (loom_param_compute_only(p)) { /* a frozen bf16 weight: its compute copy is all */
        loom_convert(loom_tensor_data(p->tensor), p->tensor->dtype, src, LOOM_F32, (size_t)n);
        return LOOM_OK;
    }
    memcpy(loom_param_master(p), src, (size_t)n * sizeof(float));
    loom_param_sync_from_master(p);
    return LOOM_OK;
}

void loom_param_sync_from_master(loom_param *p) {
    if (p->master)
        loom_convert(loom_tensor_data(p->tensor), p->tensor->dtype, p->master, LOOM_F32,
                     (size_t)loom_param_numel(p));
}

/* ZeRO-1 lends the whole master in the gradient's own memory between
 * steps (loom_dist_optim_unshard_masters): the gradient is zero then, and
 * taking the master back zeroes that memory. */
static int grad_holds_master(const loom_param *p) {
    return p->master_borrowed && (void *)p->master == p->grad;
}

void loom_param_zero_grad(loom_param *p) {
    if (p->grad && !grad_holds_master(p))
        memset(p->grad, 0, (size_t)loom_param_numel(p) * loom_dtype_size(p->grad_dtype));
    p->uses = 0;
    p->contributions = 0;
    p->grad_written = 0;
}

void *loom_param_grad_target(loom_param *p, loom_dtype *dt) {
    LOOM_ASSERT(p->grad != NULL); /* frozen for good (loom_param_freeze), then marked trainable */
    LOOM_ASSERT(!p->master_borrowed); /* a backward between unshard and reshard of ZeRO-1's masters */
    p->contributions++;
    p->grad_written = 1;
    *dt = p->grad_dtype;
    return p->grad;
}

loom_status loom_param_accumulate(loom_param *p, const loom_tensor *g) {
    char a[96], b[96];
    if (!loom_tensor_same_shape(g, p->tensor))
        return loom_error(LOOM_ERR_INVALID, "parameter '%s' of shape %s received a gradient of shape %s",
                          p->name, loom_tensor_describe(p->tensor, a, sizeof a),
                          loom_tensor_describe(g, b, sizeof b));
    loom_tensor *c = loom_tensor_contiguous((loom_tensor *)g, LOOM_MEM_WORKSPACE);
    if (!c) return LOOM_ERR_NOMEM;
    loom_dtype dt;
    void *dst = loom_param_grad_target(p, &dt);
    accumulate(dst, dt, loom_tensor_data(c), c->dtype, 1.0f, (size_t)loom_param_numel(p));
    loom_tensor_release(c);
    return LOOM_OK;
}

void loom_param_read_grad(const loom_param *p, float *dst) {
    if (!p->grad || grad_holds_master(p)) {
        memset(dst, 0, (size_t)loom_param_numel(p) * sizeof(float));
        return;
    }
    loom_convert(dst, LOOM_F32, p->grad, p->grad_dtype, (size_t)loom_param_numel(p));
}

loom_status loom_param_freeze(loom_param *p) {
    if (p->grad_borrowed)
        return loom_error(LOOM_ERR_STATE, "parameter '%s': its gradient lives in a shared buffer (data "
                          "parallelism); freeze it before that buffer is made", p->name);
    p->trainable = 0;
    loom_free(p->grad);
    p->grad = NULL;
    if (!frozen_keeps_master(p->tensor->dtype) && p->master) {
        if (!p->master_borrowed) loom_free(p->master);
        p->master = NULL;
        p->master_borrowed = 0;
    }
    p->uses = p->contributions = p->grad_written = 0;
    return LOOM_OK;
}

loom_status loom_grad_audit(loom_param *const *params, int n, char *report, size_t report_size) {
    char local[4096];
    char *buf = report && report_size ? report : local;
    size_t cap = report && report_size ? report_size : sizeof local, k = 0;
    int bad = 0;
    if (cap) buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        const loom_param *p = params[i];
        if (!p->trainable) continue;
        const char *why = NULL;
        char detail[128];
        if (!p->grad_written) {
            why = detail;
            snprintf(detail, sizeof detail, "gradient never written (%d recorded uses)", p->uses);
        } else if (p->contributions != p->uses) {
            why = detail;
            snprintf(detail, sizeof detail, "%d gradient contributions for %d recorded uses",
                     p->contributions, p->uses);
        }
        if (!why) continue;
        bad++;
        if (k < cap) {
            int w = snprintf(buf + k, cap - k, "%s%s: %s", bad > 1 ? "; " : "", p->name, why);
            if (w > 0) k += (size_t)w;
        }
    }
    if (!bad) return LOOM_OK;
    return loom_error(LOOM_ERR_STATE, "gradient audit failed for %d parameter(s): %s", bad, buf);
}
