/* op_util.c — see op_util.h. */
#include "nn/op_util.h"

loom_status op_check_contiguous(const char *op, const char *what, const loom_tensor *t) {
    if (!t) return loom_error(LOOM_ERR_INVALID, "%s: %s is NULL", op, what);
    if (!loom_tensor_is_contiguous(t))
        return loom_error(LOOM_ERR_INVALID, "%s: %s must be contiguous (call loom_tensor_contiguous)", op, what);
    return LOOM_OK;
}

loom_status op_check_same(const char *op, const loom_tensor *a, const loom_tensor *b) {
    char x[96], y[96];
    if (!a || !b) return loom_error(LOOM_ERR_INVALID, "%s: an input is NULL", op);
    if (!loom_tensor_same_shape(a, b) || a->dtype != b->dtype)
        return loom_error(LOOM_ERR_INVALID, "%s: inputs differ: %s vs %s", op, loom_tensor_describe(a, x, sizeof x),
                          loom_tensor_describe(b, y, sizeof y));
    return LOOM_OK;
}

loom_status op_check_dtype(const char *op, const loom_tensor *a, const loom_tensor *b) {
    if (a->dtype != b->dtype)
        return loom_error(LOOM_ERR_INVALID, "%s: dtypes differ: %s vs %s (cast one first)", op,
                          loom_dtype_name(a->dtype), loom_dtype_name(b->dtype));
    return LOOM_OK;
}

loom_status op_grad_from_f32(const loom_tensor *in, const float *g, loom_tensor **gin) {
    size_t n = (size_t)loom_tensor_numel(in);
    if (in->param) {
        loom_dtype dt;
        void *dst = loom_param_grad_target(in->param, &dt);
        accumulate(dst, dt, g, LOOM_F32, 1.0f, n);
        return LOOM_OK;
    }
    *gin = op_new_like(in, in->dtype);
    if (!*gin) return LOOM_ERR_NOMEM;
    loom_convert(loom_tensor_data(*gin), in->dtype, g, LOOM_F32, n);
    return LOOM_OK;
}
