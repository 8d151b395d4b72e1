/*
 * fused_linear.c — the fused linear layer, written only with loom's public
 * function interface, exactly as a user would write a custom op.
 *
 *   forward:  y = x · W^T (+ b)            one GEMM with the bias fused
 *   backward: dx = dy · W                  one GEMM
 *             main_grad(W) += dy^T · x     one GEMM, beta = 1, fp32 accumulate,
 *                                          no temporary dW
 *             grad(b) += sum_rows(dy)      fp32 reduction
 *
 * loom_fused_linear_add, y = base + scale x · W^T, is the same GEMM with
 * beta = 1 into a copy of base (LoRA's up-projection added to the base
 * linear's output; any residual): no scaled temporary, no add pass.
 *
 * It saves (x, W, b) with b possibly NULL. In backward the saved W is the
 * parameter itself (loom_tensor_param(W) != NULL) in every recompute mode,
 * which is how dW reaches main_grad.
 */
#include "loom/loom.h"

#include <math.h>
#include <stdlib.h>

static int64_t last_dim(const loom_tensor *t) { return t->shape[t->ndim - 1]; }
static int64_t rows(const loom_tensor *t) { return loom_tensor_numel(t) / last_dim(t); }

static loom_status fused_linear_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                        int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *w = in[1], *b = in[2];
    int K = (int)last_dim(x), N = (int)rows(x), M = (int)w->shape[0];
    int64_t shape[LOOM_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = M;
    out[0] = loom_tensor_new(x->dtype, x->ndim, shape, LOOM_MEM_ACTIVATIONS); /* (..., M) */
    if (!out[0]) return LOOM_ERR_NOMEM;
    LOOM_TRY(loom_gemm(0, 1, N, M, K, 1.0f, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 0.0f,
                       loom_tensor_data(out[0]), M, x->dtype, b ? loom_tensor_data(b) : NULL, x->dtype));
    return loom_ctx_save(ctx, in, 3); /* (x, W, b), b may be NULL */
}

/* grad(b) += sum over rows of dy, reduced in fp32 first. */
static loom_status bias_grad(loom_tensor *b, const loom_tensor *dy, loom_tensor **gin) {
    int M = (int)last_dim(dy), N = (int)rows(dy);
    float *db = calloc((size_t)M, sizeof *db); /* (M) */
    if (!db) return loom_error(LOOM_ERR_NOMEM, "fused_linear: out of memory");
    const void *g = loom_tensor_data(dy);
    for (int r = 0; r < N; r++)
        for (int j = 0; j < M; j++) db[j] += loom_load(g, (size_t)r * (size_t)M + (size_t)j, dy->dtype);
    loom_param *p = loom_tensor_param(b);
    if (p) {
        loom_dtype dt;
        void *dst = loom_param_grad_target(p, &dt);
        for (int j = 0; j < M; j++) loom_store(dst, (size_t)j, dt, loom_load(dst, (size_t)j, dt) + db[j]);
    } else {
        *gin = loom_tensor_from_f32(db, b->dtype, 1, b->shape, LOOM_MEM_ACTIVATIONS);
    }
    free(db);
    return (p || *gin) ? LOOM_OK : LOOM_ERR_NOMEM;
}

/* dx = scale dy · W (joining x's gradient from its other uses), and
 * scale dy^T · x into W's gradient: the backward of y = scale x · W^T. */
static loom_status linear_backward(loom_fn_ctx *ctx, const loom_tensor *dy, loom_tensor *x, loom_tensor *w,
                                   float scale, loom_tensor **gin) {
    int K = (int)last_dim(x), N = (int)rows(x), M = (int)w->shape[0];
    if (loom_ctx_needs_input_grad(ctx, 0)) {
        /* dX joins the gradient x has from its other uses in the GEMM (q,
         * k and v share their input; so do gate and up): beta = 1, no
         * separate sum pass. */
        float beta = 1.0f;
        if (!(gin[0] = loom_ctx_take_grad_sum(ctx, 0, x->dtype))) {
            beta = 0.0f;
            gin[0] = loom_tensor_new(x->dtype, x->ndim, x->shape, LOOM_MEM_ACTIVATIONS);
            if (!gin[0]) return LOOM_ERR_NOMEM;
        }
        LOOM_TRY(loom_gemm(0, 0, N, K, M, scale, loom_tensor_data(dy), M, loom_tensor_data(w), K, x->dtype, beta,
                           loom_tensor_data(gin[0]), K, x->dtype, NULL, LOOM_F32));
    }
    if (loom_ctx_needs_input_grad(ctx, 1)) {
        loom_param *p = loom_tensor_param(w);
        if (p) {
            /* dW accumulates straight into the parameter's gradient (fp32
             * main_grad when master-grad is on): beta = 1, no temporary. */
            loom_dtype dt;
            void *dst = loom_param_grad_target(p, &dt);
            LOOM_TRY(loom_gemm(1, 0, M, K, N, scale, loom_tensor_data(dy), M, loom_tensor_data(x), K, x->dtype, 1.0f,
                               dst, K, dt, NULL, LOOM_F32));
        } else {
            gin[1] = loom_tensor_new(LOOM_F32, 2, w->shape, LOOM_MEM_ACTIVATIONS);
            if (!gin[1]) return LOOM_ERR_NOMEM;
            LOOM_TRY(loom_gemm(1, 0, M, K, N, scale, loom_tensor_data(dy), M, loom_tensor_data(x), K, x->dtype, 0.0f,
                               loom_tensor_data(gin[1]), K, LOOM_F32, NULL, LOOM_F32));
        }
    }
    return LOOM_OK;
}

static loom_status fused_linear_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                         int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x, *w, *b;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &w));
    LOOM_TRY(loom_ctx_saved(ctx, 2, &b));
    LOOM_TRY(linear_backward(ctx, gout[0], x, w, 1.0f, gin));
    if (b && loom_ctx_needs_input_grad(ctx, 2)) LOOM_TRY(bias_grad(b, gout[0], &gin[2]));
    return LOOM_OK;
}

static const loom_function fused_linear_function = {
    "fused_linear", 3, 1, LOOM_FN_EXPENSIVE, fused_linear_forward, fused_linear_backward,
};

const loom_function *loom_fused_linear_function(void) { return &fused_linear_function; }

/* ------------------------------------------------- y = base + scale x W^T */

static loom_status fused_linear_add_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                            int n_out) {
    (void)n_in; (void)n_out;
    const float *scale = loom_ctx_args(ctx);
    loom_tensor *x = in[0], *w = in[1], *base = in[2];
    int K = (int)last_dim(x), N = (int)rows(x), M = (int)w->shape[0];
    out[0] = loom_tensor_new(base->dtype, base->ndim, base->shape, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    memcpy(loom_tensor_data(out[0]), loom_tensor_data(base),
           (size_t)loom_tensor_numel(base) * loom_dtype_size(base->dtype));
    LOOM_TRY(loom_gemm(0, 1, N, M, K, *scale, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 1.0f,
                       loom_tensor_data(out[0]), M, x->dtype, NULL, x->dtype));
    return loom_ctx_save(ctx, in, 2); /* (x, W); base is not needed */
}

static loom_status fused_linear_add_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                             int n_in) {
    (void)n_out; (void)n_in;
    const float *scale = loom_ctx_args(ctx);
    loom_tensor *x, *w;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &w));
    if (loom_ctx_needs_input_grad(ctx, 2)) gin[2] = loom_tensor_retain(gout[0]); /* d base = dy */
    return linear_backward(ctx, gout[0], x, w, *scale, gin);
}

static const loom_function fused_linear_add_function = {
    "fused_linear_add", 3, 1, LOOM_FN_EXPENSIVE, fused_linear_add_forward, fused_linear_add_backward,
};

loom_status loom_fused_linear(loom_tensor *x, loom_tensor *w, loom_tensor *b, loom_tensor **out) {
    char d1[96], d2[96];
    *out = NULL;
    if (!x || !w) return loom_error(LOOM_ERR_INVALID, "fused_linear: x and w are required");
    if (!loom_tensor_is_contiguous(x) || !loom_tensor_is_contiguous(w) || (b && !loom_tensor_is_contiguous(b)))
        return loom_error(LOOM_ERR_INVALID, "fused_linear: x, w and b must be contiguous");
    if (w->ndim != 2 || x->ndim < 1 || last_dim(x) != w->shape[1] || last_dim(x) == 0 || x->dtype != w->dtype ||
        (b && (b->ndim != 1 || b->shape[0] != w->shape[0] || b->dtype != w->dtype)))
        return loom_error(LOOM_ERR_INVALID, "fused_linear: x %s does not fit w %s (need x (..., K), w (M, K), "
                          "b (M), K > 0, one dtype)", loom_tensor_describe(x, d1, sizeof d1),
                          loom_tensor_describe(w, d2, sizeof d2));
    loom_tensor *in[3] = {x, w, b};
    return loom_function_apply(&fused_linear_function, in, 3, out, 1, NULL, 0);
}

loom_status loom_fused_linear_add(loom_tensor *x, loom_tensor *w, float scale, loom_tensor *base, loom_tensor **out) {
    char d1[96], d2[96], d3[96];
    *out = NULL;
    if (!x || !w || !base) return loom_error(LOOM_ERR_INVALID, "fused_linear_add: x, w and base are required");
    if (!loom_tensor_is_contiguous(x) || !loom_tensor_is_contiguous(w) || !loom_tensor_is_contiguous(base))
        return loom_error(LOOM_ERR_INVALID, "fused_linear_add: x, w and base must be contiguous");
    int fits = w->ndim == 2 && x->ndim >= 1 && last_dim(x) == w->shape[1] && last_dim(x) > 0 &&
               x->dtype == w->dtype && base->dtype == x->dtype && base->ndim == x->ndim && isfinite(scale);
    for (int d = 0; fits && d < x->ndim; d++) fits = base->shape[d] == (d == x->ndim - 1 ? w->shape[0] : x->shape[d]);
    if (!fits)
        return loom_error(LOOM_ERR_INVALID, "fused_linear_add: x %s, w %s and base %s do not fit (need x (..., K), "
                          "w (M, K), base (..., M), one dtype, a finite scale)", loom_tensor_describe(x, d1, sizeof d1),
                          loom_tensor_describe(w, d2, sizeof d2), loom_tensor_describe(base, d3, sizeof d3));
    loom_tensor *in[3] = {x, w, base};
    return loom_function_apply(&fused_linear_add_function, in, 3, out, 1, &scale, sizeof scale);
}
