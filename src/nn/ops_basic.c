/*
 * ops_basic.c — element-wise ops, cast, reshape, sum, dropout, matmul and
 * bias add as loom_functions. Forward and backward side by side.
 */
#include "nn/op_util.h"
#include "kernels/gemm_internal.h"

#include <math.h>
#include <stdlib.h>

static loom_status apply1(const loom_function *fn, loom_tensor *a, loom_tensor *b, const void *args,
                          size_t args_size, loom_tensor **out) {
    loom_tensor *in[2] = {a, b};
    *out = NULL;
    return loom_function_apply(fn, in, b ? 2 : 1, out, 1, args, args_size);
}

/* ------------------------------------------------------------------- add */

static loom_status add_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    out[0] = op_new_like(in[0], in[0]->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    add_fwd(loom_tensor_data(out[0]), loom_tensor_data(in[0]), loom_tensor_data(in[1]),
            (size_t)loom_tensor_numel(in[0]), in[0]->dtype);
    return LOOM_OK;
}

static loom_status add_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    for (int i = 0; i < 2; i++)
        if (loom_ctx_needs_input_grad(ctx, i)) gin[i] = loom_tensor_retain(gout[0]);
    return LOOM_OK;
}

static const loom_function add_function = {"add", 2, 1, 0, add_forward, add_backward};

loom_status loom_add(loom_tensor *a, loom_tensor *b, loom_tensor **out) {
    LOOM_TRY(op_check_same("add", a, b));
    LOOM_TRY(op_check_contiguous("add", "a", a));
    LOOM_TRY(op_check_contiguous("add", "b", b));
    return apply1(&add_function, a, b, NULL, 0, out);
}

/* ------------------------------------------------------------------- mul */

static loom_status mul_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    out[0] = op_new_like(in[0], in[0]->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    mul_fwd(loom_tensor_data(out[0]), loom_tensor_data(in[0]), loom_tensor_data(in[1]),
            (size_t)loom_tensor_numel(in[0]), in[0]->dtype);
    return loom_ctx_save(ctx, in, 2);
}

static loom_status mul_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *a, *b;
    OP_SAVED(ctx, 0, a);
    OP_SAVED(ctx, 1, b);
    size_t n = (size_t)loom_tensor_numel(a);
    loom_tensor *other[2] = {b, a};
    for (int i = 0; i < 2; i++) {
        if (!loom_ctx_needs_input_grad(ctx, i)) continue;
        gin[i] = op_new_like(a, a->dtype);
        if (!gin[i]) return LOOM_ERR_NOMEM;
        mul_fwd(loom_tensor_data(gin[i]), loom_tensor_data(gout[0]), loom_tensor_data(other[i]), n, a->dtype);
    }
    return LOOM_OK;
}

static const loom_function mul_function = {"mul", 2, 1, 0, mul_forward, mul_backward};

loom_status loom_mul(loom_tensor *a, loom_tensor *b, loom_tensor **out) {
    LOOM_TRY(op_check_same("mul", a, b));
    LOOM_TRY(op_check_contiguous("mul", "a", a));
    LOOM_TRY(op_check_contiguous("mul", "b", b));
    return apply1(&mul_function, a, b, NULL, 0, out);
}

/* ----------------------------------------------------------------- scale */

/* a times s, or divided by it (divide): the backward does the same to the
 * gradient. */
typedef struct scale_args {
    float s;
    int divide;
} scale_args;

/* out = x * s or x / s, as a says. */
static loom_status scaled(const loom_fn_ctx *ctx, loom_tensor *x, loom_tensor **out) {
    const scale_args *a = loom_ctx_args(ctx);
    *out = op_new_like(x, x->dtype);
    if (!*out) return LOOM_ERR_NOMEM;
    (a->divide ? divide_fwd : scale_fwd)(loom_tensor_data(*out), loom_tensor_data(x), a->s,
                                         (size_t)loom_tensor_numel(x), x->dtype);
    return LOOM_OK;
}

static loom_status scale_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    return scaled(ctx, in[0], &out[0]);
}

static loom_status scale_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    return scaled(ctx, gout[0], &gin[0]);
}

static const loom_function scale_function = {"scale", 1, 1, 0, scale_forward, scale_backward};

static loom_status scale_op(loom_tensor *a, float s, int divide, loom_tensor **out) {
    LOOM_TRY(op_check_contiguous("scale", "a", a));
    scale_args args;
    memset(&args, 0, sizeof args); /* no stray padding: the arguments are copied as bytes */
    args.s = s;
    args.divide = divide;
    return apply1(&scale_function, a, NULL, &args, sizeof args, out);
}

loom_status loom_scale(loom_tensor *a, float s, loom_tensor **out) { return scale_op(a, s, 0, out); }

loom_status loom_divide(loom_tensor *a, float d, loom_tensor **out) { return scale_op(a, d, 1, out); }

/* --------------------------------------------------------------- softcap */

static loom_status softcap_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const float *cap = loom_ctx_args(ctx);
    out[0] = op_new_like(in[0], in[0]->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    softcap_fwd(loom_tensor_data(out[0]), loom_tensor_data(in[0]), *cap, (size_t)loom_tensor_numel(in[0]),
                in[0]->dtype);
    return loom_ctx_save(ctx, out, 1); /* the derivative from the output, as tanh's */
}

static loom_status softcap_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                    int n_in) {
    (void)n_out; (void)n_in;
    const float *cap = loom_ctx_args(ctx);
    loom_tensor *y;
    OP_SAVED(ctx, 0, y);
    gin[0] = op_grad_in_place(gout[0]); /* softcap_bwd reads dy[i] before writing dx[i] */
    if (!gin[0]) return LOOM_ERR_NOMEM;
    softcap_bwd(loom_tensor_data(gin[0]), loom_tensor_data(gout[0]), loom_tensor_data(y), *cap,
                (size_t)loom_tensor_numel(y), y->dtype);
    return LOOM_OK;
}

static const loom_function softcap_function = {"softcap", 1, 1, 0, softcap_forward, softcap_backward};

loom_status loom_softcap(loom_tensor *x, float cap, loom_tensor **out) {
    *out = NULL;
    LOOM_TRY(op_check_contiguous("softcap", "x", x));
    if (!(cap > 0.0f) || !isfinite(cap))
        return loom_error(LOOM_ERR_INVALID, "softcap: the cap %g must be a finite number > 0", (double)cap);
    return apply1(&softcap_function, x, NULL, &cap, sizeof cap, out);
}

/* ------------------------------------------------------------ silu/swiglu */

static loom_status silu_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    out[0] = op_new_like(in[0], in[0]->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    silu_fwd(loom_tensor_data(out[0]), loom_tensor_data(in[0]), (size_t)loom_tensor_numel(in[0]), in[0]->dtype);
    return loom_ctx_save(ctx, in, 1);
}

static loom_status silu_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x;
    OP_SAVED(ctx, 0, x);
    gin[0] = op_new_like(x, x->dtype);
    if (!gin[0]) return LOOM_ERR_NOMEM;
    silu_bwd(loom_tensor_data(gin[0]), loom_tensor_data(gout[0]), loom_tensor_data(x), (size_t)loom_tensor_numel(x),
             x->dtype);
    return LOOM_OK;
}

static const loom_function silu_function = {"silu", 1, 1, 0, silu_forward, silu_backward};

loom_status loom_silu(loom_tensor *x, loom_tensor **out) {
    LOOM_TRY(op_check_contiguous("silu", "x", x));
    return apply1(&silu_function, x, NULL, NULL, 0, out);
}

/* The gated activations: SwiGLU (silu(gate) * up) and GeGLU (the tanh
 * GELU of gate times up), one pair of functions; the kernels differ. */
typedef void (*glu_fwd_fn)(void *, const void *, const void *, size_t, loom_dtype);
typedef void (*glu_bwd_fn)(void *, void *, const void *, const void *, const void *, size_t, loom_dtype);

/* The arguments: 1 for GeGLU. */
static int is_geglu(const loom_fn_ctx *ctx) { return *(const int *)loom_ctx_args(ctx); }

static loom_status glu_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    glu_fwd_fn fwd = is_geglu(ctx) ? geglu_fwd : swiglu_fwd;
    out[0] = op_new_like(in[0], in[0]->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    fwd(loom_tensor_data(out[0]), loom_tensor_data(in[0]), loom_tensor_data(in[1]), (size_t)loom_tensor_numel(in[0]),
        in[0]->dtype);
    return loom_ctx_save(ctx, in, 2);
}

static loom_status glu_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    glu_bwd_fn bwd = is_geglu(ctx) ? geglu_bwd : swiglu_bwd;
    loom_tensor *gate, *up;
    OP_SAVED(ctx, 0, gate);
    OP_SAVED(ctx, 1, up);
    gin[0] = op_grad_in_place(gout[0]); /* the kernels read dout[i] before writing dgate[i] */
    gin[1] = op_new_like(up, up->dtype);
    if (!gin[0] || !gin[1]) return LOOM_ERR_NOMEM;
    bwd(loom_tensor_data(gin[0]), loom_tensor_data(gin[1]), loom_tensor_data(gout[0]), loom_tensor_data(gate),
        loom_tensor_data(up), (size_t)loom_tensor_numel(gate), gate->dtype);
    return LOOM_OK;
}

static const loom_function swiglu_function = {"swiglu", 2, 1, 0, glu_forward, glu_backward};
static const loom_function geglu_function = {"geglu", 2, 1, 0, glu_forward, glu_backward};

static loom_status glu(const loom_function *fn, loom_tensor *gate, loom_tensor *up, loom_tensor **out) {
    LOOM_TRY(op_check_same(fn->name, gate, up));
    LOOM_TRY(op_check_contiguous(fn->name, "gate", gate));
    LOOM_TRY(op_check_contiguous(fn->name, "up", up));
    int geglu = fn == &geglu_function;
    return apply1(fn, gate, up, &geglu, sizeof geglu, out);
}

loom_status loom_swiglu(loom_tensor *gate, loom_tensor *up, loom_tensor **out) {
    return glu(&swiglu_function, gate, up, out);
}

loom_status loom_geglu(loom_tensor *gate, loom_tensor *up, loom_tensor **out) {
    return glu(&geglu_function, gate, up, out);
}

/* --------------------------------------------------------------- dropout */

typedef struct dropout_state {
    uint64_t seed, offset;
} dropout_state;

/* A dropout over x as a window of a larger tensor (loom_window; zeros:
 * the whole). */
typedef struct dropout_args {
    float p;
    loom_window w;
} dropout_args;

/* x as a matrix, and the larger tensor's row count and width. */
static void dropout_shape(const loom_tensor *x, const dropout_args *a, size_t *rows, size_t *cols, size_t *all_rows,
                          size_t *width) {
    *cols = x->ndim ? (size_t)x->shape[x->ndim - 1] : 1;
    *rows = *cols ? (size_t)loom_tensor_numel(x) / *cols : 0;
    *all_rows = a->w.rows ? (size_t)a->w.rows : *rows;
    *width = a->w.cols ? (size_t)a->w.cols : *cols;
}

static loom_status dropout_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const dropout_args *a = loom_ctx_args(ctx);
    size_t rows, cols, all_rows, width;
    dropout_shape(in[0], a, &rows, &cols, &all_rows, &width);
    loom_rng *rng = loom_rng_default();
    dropout_state *s = loom_ctx_state(ctx, sizeof *s);
    s->seed = rng->seed;
    s->offset = loom_rng_reserve(rng, dropout_blocks(all_rows * width)); /* the whole tensor's draws */
    out[0] = op_new_like(in[0], in[0]->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    dropout_window(loom_tensor_data(out[0]), loom_tensor_data(in[0]), rows, cols, (size_t)a->w.row0,
                   (size_t)a->w.col0, width, a->p, s->seed, s->offset, in[0]->dtype);
    return LOOM_OK;
}

static loom_status dropout_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    const dropout_args *a = loom_ctx_args(ctx);
    const dropout_state *s = loom_ctx_state(ctx, sizeof *s);
    size_t rows, cols, all_rows, width;
    dropout_shape(gout[0], a, &rows, &cols, &all_rows, &width);
    gin[0] = op_new_like(gout[0], gout[0]->dtype);
    if (!gin[0]) return LOOM_ERR_NOMEM;
    dropout_window(loom_tensor_data(gin[0]), loom_tensor_data(gout[0]), rows, cols, (size_t)a->w.row0,
                   (size_t)a->w.col0, width, a->p, s->seed, s->offset, gout[0]->dtype);
    return LOOM_OK;
}

static const loom_function dropout_function = {"dropout", 1, 1, 0, dropout_forward, dropout_backward};

loom_status loom_dropout(loom_tensor *x, float p, loom_tensor **out) {
    return loom_dropout_window(x, p, NULL, out);
}

loom_status loom_dropout_window(loom_tensor *x, float p, const loom_window *w, loom_tensor **out) {
    LOOM_TRY(op_check_contiguous("dropout", "x", x));
    if (!(p >= 0.0f && p < 1.0f))
        return loom_error(LOOM_ERR_INVALID, "dropout: probability %g must be in [0, 1)", (double)p);
    dropout_args a = {p, {0, 0, 0, 0}};
    if (w) a.w = *w;
    int64_t cols = x->ndim ? x->shape[x->ndim - 1] : 1, rows = cols ? loom_tensor_numel(x) / cols : 0;
    if (!op_window_fits(a.w.row0, rows, a.w.rows) || !op_window_fits(a.w.col0, cols, a.w.cols))
        return loom_error(LOOM_ERR_INVALID,
                          "dropout: %lld rows from row %lld and %lld columns from column %lld do not lie in a "
                          "%lld x %lld tensor (0: x's own)",
                          (long long)rows, (long long)a.w.row0, (long long)cols, (long long)a.w.col0,
                          (long long)a.w.rows, (long long)a.w.cols);
    int64_t all_rows = a.w.rows ? a.w.rows : rows, width = a.w.cols ? a.w.cols : cols;
    if (width && all_rows > INT64_MAX / width)
        return loom_error(LOOM_ERR_INVALID, "dropout: a %lld x %lld tensor is too large", (long long)all_rows,
                          (long long)width);
    return apply1(&dropout_function, x, NULL, &a, sizeof a, out);
}

/* ------------------------------------------------------------------ cast */

static loom_status cast_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const loom_dtype *dt = loom_ctx_args(ctx);
    out[0] = loom_tensor_to(in[0], *dt, LOOM_MEM_ACTIVATIONS);
    return out[0] ? LOOM_OK : LOOM_ERR_NOMEM;
}

static loom_status cast_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in; (void)ctx;
    /* The gradient goes back in the input's dtype: the engine checks shapes,
     * and the consumer (a producer node's accumulator or a parameter)
     * converts on accumulation. */
    gin[0] = loom_tensor_retain(gout[0]);
    return LOOM_OK;
}

static const loom_function cast_function = {"cast", 1, 1, 0, cast_forward, cast_backward};

loom_status loom_cast(loom_tensor *x, loom_dtype dt, loom_tensor **out) {
    *out = NULL;
    if (!x) return loom_error(LOOM_ERR_INVALID, "cast: x is NULL");
    if (!loom_dtype_valid(dt))
        return loom_error(LOOM_ERR_INVALID, "cast: unknown dtype %d (fp32, bf16 or fp16)", (int)dt);
    return apply1(&cast_function, x, NULL, &dt, sizeof dt, out);
}

/* --------------------------------------------------------------- reshape */

typedef struct reshape_args {
    int ndim;
    int64_t shape[LOOM_MAX_DIMS];
} reshape_args;

static loom_status reshape_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const reshape_args *a = loom_ctx_args(ctx);
    out[0] = loom_tensor_view(in[0], a->ndim, a->shape);
    return out[0] ? LOOM_OK : LOOM_ERR_INVALID;
}

static loom_status reshape_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)ctx; (void)n_out; (void)n_in;
    /* The engine records the input's shape; view the gradient back to it. */
    const reshape_args *a = loom_ctx_args(ctx);
    const reshape_args *orig = a + 1;
    loom_tensor *g = loom_tensor_contiguous(gout[0], LOOM_MEM_ACTIVATIONS);
    if (!g) return LOOM_ERR_NOMEM;
    gin[0] = loom_tensor_view(g, orig->ndim, orig->shape);
    loom_tensor_release(g);
    return gin[0] ? LOOM_OK : LOOM_ERR_INVALID;
}

static const loom_function reshape_function = {"reshape", 1, 1, 0, reshape_forward, reshape_backward};

loom_status loom_reshape(loom_tensor *x, int ndim, const int64_t *shape, loom_tensor **out) {
    LOOM_TRY(op_check_contiguous("reshape", "x", x));
    if (ndim < 1 || ndim > LOOM_MAX_DIMS)
        return loom_error(LOOM_ERR_INVALID, "reshape: %d dimensions requested, 1..%d supported", ndim, LOOM_MAX_DIMS);
    reshape_args a[2];
    memset(a, 0, sizeof a);
    a[0].ndim = ndim;
    memcpy(a[0].shape, shape, (size_t)ndim * sizeof *shape);
    a[1].ndim = x->ndim;
    memcpy(a[1].shape, x->shape, sizeof a[1].shape);
    return apply1(&reshape_function, x, NULL, a, sizeof a, out);
}

/* ------------------------------------------------------------------- sum */

static loom_status sum_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    int64_t one = 1;
    out[0] = loom_tensor_new(LOOM_F32, 1, &one, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    double s = 0.0;
    size_t n = (size_t)loom_tensor_numel(in[0]);
    const void *x = loom_tensor_data(in[0]);
    for (size_t i = 0; i < n; i++) s += loom_load(x, i, in[0]->dtype);
    ((float *)loom_tensor_data(out[0]))[0] = (float)s;
    return LOOM_OK;
}

static loom_status sum_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    const int64_t *shape_args = loom_ctx_args(ctx);
    int ndim = (int)shape_args[0];
    loom_dtype dt = (loom_dtype)shape_args[1];
    gin[0] = loom_tensor_new(dt, ndim, shape_args + 2, LOOM_MEM_ACTIVATIONS);
    if (!gin[0]) return LOOM_ERR_NOMEM;
    float g = loom_tensor_get(gout[0], 0);
    size_t n = (size_t)loom_tensor_numel(gin[0]);
    for (size_t i = 0; i < n; i++) loom_store(loom_tensor_data(gin[0]), i, dt, g);
    return LOOM_OK;
}

static const loom_function sum_function = {"sum", 1, 1, 0, sum_forward, sum_backward};

loom_status loom_sum(loom_tensor *x, loom_tensor **out) {
    LOOM_TRY(op_check_contiguous("sum", "x", x));
    int64_t a[2 + LOOM_MAX_DIMS] = {x->ndim, x->dtype};
    memcpy(a + 2, x->shape, sizeof x->shape);
    return apply1(&sum_function, x, NULL, a, sizeof a, out);
}

/* ------------------------------------------------------------------ gemm */

loom_status loom_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const void *A, int lda,
                      const void *B, int ldb, loom_dtype ab_dt, float beta, void *C, int ldc, loom_dtype c_dt,
                      const void *bias, loom_dtype bias_dt) {
    if (M < 0 || N < 0 || K < 0) return loom_error(LOOM_ERR_INVALID, "gemm: negative size %dx%dx%d", M, N, K);
    if (c_dt != LOOM_F32 && c_dt != ab_dt)
        return loom_error(LOOM_ERR_INVALID, "gemm: output dtype %s must be fp32 or the input dtype %s",
                          loom_dtype_name(c_dt), loom_dtype_name(ab_dt));
    return gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_dt, beta, C, ldc, c_dt, bias, bias_dt);
}

void loom_gemm_get_stats(loom_gemm_stats *out) {
    gemm_counters c;
    gemm_get_counters(&c);
    *out = (loom_gemm_stats){c.onednn_calls, c.onednn_created, c.fallback_calls, c.widened_calls, c.padded_calls};
}

/* ---------------------------------------------------------------- matmul */

static loom_status matmul_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *w = in[1];
    int K = (int)op_last_dim(x), N = (int)op_rows(x), M = (int)w->shape[0];
    int64_t shape[LOOM_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = M;
    out[0] = loom_tensor_new(x->dtype, x->ndim, shape, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    LOOM_TRY(gemm(0, 1, N, M, K, 1.0f, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 0.0f,
                  loom_tensor_data(out[0]), M, x->dtype, NULL, LOOM_F32));
    return loom_ctx_save(ctx, in, 2);
}

static loom_status matmul_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x, *w;
    OP_SAVED(ctx, 0, x);
    OP_SAVED(ctx, 1, w);
    int K = (int)op_last_dim(x), N = (int)op_rows(x), M = (int)w->shape[0];
    const void *dy = loom_tensor_data(gout[0]); /* (N, M) */
    if (loom_ctx_needs_input_grad(ctx, 0)) {
        gin[0] = op_new_like(x, x->dtype);
        if (!gin[0]) return LOOM_ERR_NOMEM;
        LOOM_TRY(gemm(0, 0, N, K, M, 1.0f, dy, M, loom_tensor_data(w), K, x->dtype, 0.0f, loom_tensor_data(gin[0]), K,
                      x->dtype, NULL, LOOM_F32));
    }
    if (loom_ctx_needs_input_grad(ctx, 1)) {
        gin[1] = op_new_like(w, LOOM_F32); /* dW (M, K) in fp32, accumulated by the engine */
        if (!gin[1]) return LOOM_ERR_NOMEM;
        LOOM_TRY(gemm(1, 0, M, K, N, 1.0f, dy, M, loom_tensor_data(x), K, x->dtype, 0.0f, loom_tensor_data(gin[1]), K,
                      LOOM_F32, NULL, LOOM_F32));
    }
    return LOOM_OK;
}

static const loom_function matmul_function = {"matmul", 2, 1, LOOM_FN_EXPENSIVE, matmul_forward, matmul_backward};

loom_status loom_matmul(loom_tensor *x, loom_tensor *w, loom_tensor **out) {
    char a[96], b[96];
    LOOM_TRY(op_check_contiguous("matmul", "x", x));
    LOOM_TRY(op_check_contiguous("matmul", "w", w));
    LOOM_TRY(op_check_dtype("matmul", x, w));
    if (w->ndim != 2 || x->ndim < 1 || op_last_dim(x) != w->shape[1])
        return loom_error(LOOM_ERR_INVALID, "matmul: x %s and w %s do not fit (need x (..., K), w (M, K))",
                          loom_tensor_describe(x, a, sizeof a), loom_tensor_describe(w, b, sizeof b));
    return apply1(&matmul_function, x, w, NULL, 0, out);
}

/* ------------------------------------------------------------- dora_scale */

/* s = m / n in fp32, C of them (a workspace buffer). */
static float *dora_factors(const loom_tensor *m, const loom_tensor *n) {
    int64_t C = m->shape[0];
    float *s = loom_alloc((size_t)C * sizeof *s + 1, LOOM_MEM_WORKSPACE);
    if (!s) return NULL;
    const float *nv = loom_tensor_data(n);
    for (int64_t c = 0; c < C; c++) s[c] = loom_load(loom_tensor_data(m), (size_t)c, m->dtype) / nv[c];
    return s;
}

static loom_status dora_scale_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                      int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *m = in[1], *n = in[2];
    float *s = dora_factors(m, n);
    out[0] = op_new_like(x, x->dtype);
    if (!s || !out[0]) { loom_free(s); return LOOM_ERR_NOMEM; }
    colscale(loom_tensor_data(out[0]), loom_tensor_data(x), s, (size_t)op_rows(x), (size_t)op_last_dim(x), x->dtype);
    loom_free(s);
    loom_tensor *save[3] = {x, m, n};
    return loom_ctx_save(ctx, save, 3);
}

static loom_status dora_scale_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                       int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x, *m, *n, *g = gout[0];
    OP_SAVED(ctx, 0, x);
    OP_SAVED(ctx, 1, m);
    OP_SAVED(ctx, 2, n);
    size_t rows = (size_t)op_rows(x), cols = (size_t)op_last_dim(x);
    int need_x = loom_ctx_needs_input_grad(ctx, 0), need_m = loom_ctx_needs_input_grad(ctx, 1);
    float *dm = loom_alloc(cols * sizeof *dm + 1, LOOM_MEM_WORKSPACE), *s = dora_factors(m, n);
    /* x's gradient in g's own storage when it may: each element is read before it is written */
    if (need_x) gin[0] = op_grad_in_place(g);
    loom_status st = dm && s && (!need_x || gin[0]) ? LOOM_OK : LOOM_ERR_NOMEM;
    if (st == LOOM_OK && need_x) /* one pass: m's sums and x's gradient */
        coldot_colscale(dm, loom_tensor_data(gin[0]), loom_tensor_data(x), loom_tensor_data(g), s, rows, cols,
                        g->dtype);
    else if (st == LOOM_OK && need_m)
        coldot(dm, loom_tensor_data(x), loom_tensor_data(g), rows, cols, x->dtype);
    if (st == LOOM_OK && need_m) {
        const float *nv = loom_tensor_data(n);
        for (size_t c = 0; c < cols; c++) dm[c] /= nv[c];
        st = op_grad_from_f32(m, dm, &gin[1]);
    }
    loom_free(dm);
    loom_free(s);
    return st;
}

static const loom_function dora_scale_function = {"dora_scale", 3, 1, 0, dora_scale_forward, dora_scale_backward};

loom_status loom_dora_scale(loom_tensor *x, loom_tensor *m, loom_tensor *n, loom_tensor **out) {
    char d1[96], d2[96];
    *out = NULL;
    LOOM_TRY(op_check_contiguous("dora_scale", "x", x));
    LOOM_TRY(op_check_contiguous("dora_scale", "m", m));
    LOOM_TRY(op_check_contiguous("dora_scale", "n", n));
    if (m->dtype != LOOM_F32) LOOM_TRY(op_check_dtype("dora_scale", x, m));
    if (m->ndim != 1 || m->shape[0] != op_last_dim(x) || n->ndim != 1 || n->shape[0] != m->shape[0] ||
        n->dtype != LOOM_F32)
        return loom_error(LOOM_ERR_INVALID, "dora_scale: magnitudes %s and fp32 norms must match the last dimension "
                          "of x %s", loom_tensor_describe(m, d1, sizeof d1), loom_tensor_describe(x, d2, sizeof d2));
    if (loom_tensor_requires_grad(n))
        return loom_error(LOOM_ERR_INVALID, "dora_scale: the norms are a constant (DoRA detaches them): pass a "
                          "tensor without a gradient");
    loom_tensor *in[3] = {x, m, n};
    return loom_function_apply(&dora_scale_function, in, 3, out, 1, NULL, 0);
}

/* -------------------------------------------------------------- add_bias */

static loom_status add_bias_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *b = in[1];
    int64_t C = op_last_dim(x), N = op_rows(x);
    out[0] = op_new_like(x, x->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    rowadd(loom_tensor_data(out[0]), loom_tensor_data(x), loom_tensor_data(b), (size_t)N, (size_t)C, x->dtype);
    return LOOM_OK;
}

static loom_status add_bias_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *g = gout[0];
    int64_t C = op_last_dim(g), N = op_rows(g);
    if (loom_ctx_needs_input_grad(ctx, 0)) gin[0] = loom_tensor_retain(g);
    if (loom_ctx_needs_input_grad(ctx, 1)) {
        int64_t shape = C;
        gin[1] = loom_tensor_zeros(LOOM_F32, 1, &shape, LOOM_MEM_ACTIVATIONS);
        if (!gin[1]) return LOOM_ERR_NOMEM;
        colsum(loom_tensor_data(gin[1]), loom_tensor_data(g), (size_t)N, (size_t)C, g->dtype);
    }
    return LOOM_OK;
}

static const loom_function add_bias_function = {"add_bias", 2, 1, 0, add_bias_forward, add_bias_backward};

loom_status loom_add_bias(loom_tensor *x, loom_tensor *b, loom_tensor **out) {
    char d1[96], d2[96];
    LOOM_TRY(op_check_contiguous("add_bias", "x", x));
    LOOM_TRY(op_check_contiguous("add_bias", "b", b));
    LOOM_TRY(op_check_dtype("add_bias", x, b));
    if (b->ndim != 1 || b->shape[0] != op_last_dim(x))
        return loom_error(LOOM_ERR_INVALID, "add_bias: bias %s does not match the last dimension of x %s",
                          loom_tensor_describe(b, d1, sizeof d1), loom_tensor_describe(x, d2, sizeof d2));
    return apply1(&add_bias_function, x, b, NULL, 0, out);
}
