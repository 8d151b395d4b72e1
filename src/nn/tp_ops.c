/*
 * tp_ops.c — Megatron's two tensor-parallel communication ops as
 * loom_functions, and gathering/scattering split parameters.
 *
 *   copy_to_tp     ("f"): identity in forward, all-reduce of the gradient in
 *                  backward; placed before a column-parallel linear.
 *   reduce_from_tp ("g"): all-reduce in forward, identity in backward;
 *                  placed after a row-parallel linear.
 *
 * Reductions run in fp32 whatever the activation dtype. Every rank of the
 * group runs the same ops in the same order (recompute replays included),
 * so the collectives always match.
 */
#include "nn/op_util.h"
#include "nn/tp.h"

#include <stdlib.h>

/* In-place fp32 all-reduce of a tensor of any dtype. */
static loom_status allreduce_tensor(loom_comm *comm, loom_tensor *t) {
    size_t n = (size_t)loom_tensor_numel(t);
    if (t->dtype == LOOM_F32) return loom_comm_allreduce_sum_f32(comm, loom_tensor_data(t), n);
    float *tmp = loom_alloc(n * sizeof(float), LOOM_MEM_WORKSPACE);
    if (!tmp) return loom_error(LOOM_ERR_NOMEM, "tensor parallel: out of memory");
    loom_convert(tmp, LOOM_F32, loom_tensor_data(t), t->dtype, n);
    loom_status st = loom_comm_allreduce_sum_f32(comm, tmp, n);
    if (st == LOOM_OK) loom_convert(loom_tensor_data(t), t->dtype, tmp, LOOM_F32, n);
    loom_free(tmp);
    return st;
}

static loom_status copy_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    out[0] = loom_tensor_detach(in[0]); /* a view: no copy */
    return out[0] ? LOOM_OK : LOOM_ERR_NOMEM;
}

static loom_status copy_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_comm *const *comm = loom_ctx_args(ctx);
    gin[0] = loom_tensor_to(gout[0], gout[0]->dtype, LOOM_MEM_ACTIVATIONS);
    if (!gin[0]) return LOOM_ERR_NOMEM;
    return allreduce_tensor(*comm, gin[0]);
}

static loom_status reduce_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    loom_comm *const *comm = loom_ctx_args(ctx);
    out[0] = loom_tensor_to(in[0], in[0]->dtype, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    return allreduce_tensor(*comm, out[0]);
}

static loom_status reduce_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)ctx; (void)n_out; (void)n_in;
    gin[0] = loom_tensor_retain(gout[0]);
    return LOOM_OK;
}

static const loom_function copy_to_tp_function = {"copy_to_tp", 1, 1, 0, copy_forward, copy_backward};
static const loom_function reduce_from_tp_function = {"reduce_from_tp", 1, 1, 0, reduce_forward, reduce_backward};

loom_status tp_copy(loom_comm *comm, loom_tensor *x, loom_tensor **out) {
    if (!comm || loom_comm_size(comm) == 1) { *out = loom_tensor_retain(x); return LOOM_OK; }
    return loom_function_apply(&copy_to_tp_function, &x, 1, out, 1, &comm, sizeof comm);
}

loom_status tp_reduce(loom_comm *comm, loom_tensor *x, loom_tensor **out) {
    if (!comm || loom_comm_size(comm) == 1) { *out = loom_tensor_retain(x); return LOOM_OK; }
    return loom_function_apply(&reduce_from_tp_function, &x, 1, out, 1, &comm, sizeof comm);
}

/* ------------------------------------------------- split parameters */

void tp_full_shape(const loom_param *p, int tp_size, int64_t shape[2]) {
    shape[0] = p->tensor->shape[0];
    shape[1] = p->tensor->ndim > 1 ? p->tensor->shape[1] : 1;
    if (p->tp_split_dim >= 0) shape[p->tp_split_dim] *= tp_size;
}

/* full (R, Cc) row-major; rank r's shard is rows [r R/T, (r+1) R/T) for
 * split dim 0, columns [r Cc/T, ...) for split dim 1. */
void tp_take_shard(const loom_param *p, int tp_rank, int tp_size, const float *full, float *shard) {
    int64_t fs[2];
    tp_full_shape(p, tp_size, fs);
    if (p->tp_split_dim < 0) {
        memcpy(shard, full, (size_t)(fs[0] * fs[1]) * sizeof(float));
    } else if (p->tp_split_dim == 0) {
        int64_t rows = fs[0] / tp_size;
        memcpy(shard, full + tp_rank * rows * fs[1], (size_t)(rows * fs[1]) * sizeof(float));
    } else {
        int64_t cols = fs[1] / tp_size;
        for (int64_t r = 0; r < fs[0]; r++)
            memcpy(shard + r * cols, full + r * fs[1] + tp_rank * cols, (size_t)cols * sizeof(float));
    }
}

loom_status tp_gather(loom_comm *comm, const loom_param *p, const float *shard, float *full) {
    int T = comm ? loom_comm_size(comm) : 1;
    size_t n = (size_t)loom_param_numel(p);
    if (T == 1 || p->tp_split_dim < 0) {
        memcpy(full, shard, n * sizeof(float));
        return LOOM_OK;
    }
    if (p->tp_split_dim == 0) return loom_comm_allgather_f32(comm, shard, full, n);
    return loom_comm_allgather_cols_f32(comm, shard, full, (size_t)p->tensor->shape[0], (size_t)p->tensor->shape[1]);
}
