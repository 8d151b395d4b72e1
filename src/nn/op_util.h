/*
 * op_util.h — small helpers shared by the built-in ops: output allocation,
 * shape checks with messages, and handing an fp32 gradient to an input
 * (straight into a parameter's gradient buffer, or as a new tensor).
 */
#ifndef LOOM_OP_UTIL_H
#define LOOM_OP_UTIL_H

#include "loom/ops.h"
#include "kernels/kernels.h"

/* A new activation tensor with t's shape and dtype dt. */
static inline loom_tensor *op_new_like(const loom_tensor *t, loom_dtype dt) {
    return loom_tensor_new(dt, t->ndim, t->shape, LOOM_MEM_ACTIVATIONS);
}
/* A tensor to write the gradient of an input into, with the shape and dtype
 * of the incoming gradient g: g's own storage when g holds the only
 * reference to it (the engine hands each output gradient over with one
 * reference and drops it after backward, so nothing reads it later), else a
 * new tensor. For kernels that read each element, or row, before writing it:
 * one activation-sized buffer fewer at the peak of backward. */
static inline loom_tensor *op_grad_in_place(loom_tensor *g) {
    if (loom_tensor_writable_in_place(g)) return loom_tensor_detach(g);
    return loom_tensor_new(g->dtype, g->ndim, g->shape, LOOM_MEM_ACTIVATIONS);
}
static inline int64_t op_last_dim(const loom_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static inline int64_t op_rows(const loom_tensor *t) {
    int64_t c = op_last_dim(t);
    return c ? loom_tensor_numel(t) / c : 0;
}

/* Whether [start, start + n) lies in [0, all) (all 0: is [0, n)): a
 * loom_window's rows or columns. */
static inline int op_window_fits(int64_t start, int64_t n, int64_t all) {
    if (!all) return start == 0;
    return all > 0 && start >= 0 && n <= all && start <= all - n;
}

loom_status op_check_contiguous(const char *op, const char *what, const loom_tensor *t);
loom_status op_check_same(const char *op, const loom_tensor *a, const loom_tensor *b);
loom_status op_check_dtype(const char *op, const loom_tensor *a, const loom_tensor *b);
/* Give input `in` the fp32 gradient g (numel(in) floats): into the
 * parameter's gradient buffer when `in` is a parameter (counted as one
 * contribution, *gin stays NULL), else as a new tensor of in's dtype. */
loom_status op_grad_from_f32(const loom_tensor *in, const float *g, loom_tensor **gin);
/* Fetch saved slot i or return its error. */
#define OP_SAVED(ctx, i, var) LOOM_TRY(loom_ctx_saved((ctx), (i), &(var)))

#endif
