/*
 * test_function.c — the function interface as a user sees it: a custom
 * linear that saves (x, weight, NULL), the identity of saved parameters,
 * gradient accumulation, no-grad, misuse errors, allocator accounting.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

/* (1, 2, 3) as a 1-D fp32 tensor, a leaf that needs a gradient or not. */
static const float leaf_values[3] = {1, 2, 3};

static loom_tensor *leaf3(int requires_grad) {
    loom_tensor *t = loom_tensor_from_f32(leaf_values, LOOM_F32, 1, (const int64_t[]){3}, LOOM_MEM_ACTIVATIONS);
    assert_non_null(t);
    if (requires_grad) assert_int_equal(loom_tensor_set_requires_grad(t, 1), LOOM_OK);
    return t;
}

/* ------------------------------------------------ a user-written linear */

static int saw_param_identity;   /* backward found the very same parameter */
static loom_param *expected_param;

static loom_status user_linear_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *w = in[1], *b = in[2];
    int K = (int)x->shape[1], N = (int)x->shape[0], M = (int)w->shape[0];
    out[0] = loom_tensor_new_2d(x->dtype, N, M, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    LOOM_TRY(loom_gemm(0, 1, N, M, K, 1.0f, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 0.0f,
                       loom_tensor_data(out[0]), M, x->dtype, b ? loom_tensor_data(b) : NULL, x->dtype));
    loom_tensor *save[3] = {x, w, b}; /* b is NULL here */
    return loom_ctx_save(ctx, save, 3);
}

static loom_status user_linear_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x, *w, *b;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &w));
    LOOM_TRY(loom_ctx_saved(ctx, 2, &b));
    saw_param_identity = (b == NULL) && loom_tensor_param(w) == expected_param && w == expected_param->tensor;
    int K = (int)x->shape[1], N = (int)x->shape[0], M = (int)w->shape[0];
    if (loom_ctx_needs_input_grad(ctx, 0)) {
        gin[0] = loom_tensor_new_2d(x->dtype, N, K, LOOM_MEM_ACTIVATIONS);
        LOOM_TRY(loom_gemm(0, 0, N, K, M, 1.0f, loom_tensor_data(gout[0]), M, loom_tensor_data(w), K, x->dtype, 0.0f,
                           loom_tensor_data(gin[0]), K, x->dtype, NULL, LOOM_F32));
    }
    loom_dtype dt;
    void *mg = loom_param_grad_target(loom_tensor_param(w), &dt);
    return loom_gemm(1, 0, M, K, N, 1.0f, loom_tensor_data(gout[0]), M, loom_tensor_data(x), K, x->dtype, 1.0f, mg, K,
                     dt, NULL, LOOM_F32);
}

static const loom_function user_linear = {"user_linear", 3, 1, 0, user_linear_forward, user_linear_backward};

static loom_param *make_param(const char *name, int64_t d0, int64_t d1, uint64_t seed) {
    loom_param *p;
    int64_t shape[2] = {d0, d1};
    assert_int_equal(loom_param_new(name, LOOM_F32, 2, shape, 1, &p), LOOM_OK);
    float *v = malloc((size_t)(d0 * d1) * sizeof *v);
    tu_fill_uniform(v, (size_t)(d0 * d1), -0.5f, 0.5f, seed);
    assert_int_equal(loom_param_set_f32(p, v, d0 * d1), LOOM_OK);
    free(v);
    return p;
}

/* loss = sum(tanh-free nonlinearity(linear(x)) * R) built from ops */
static void custom_vs_builtin(int use_custom, loom_param *w, loom_tensor *x, float *dx_out) {
    loom_tensor *y = NULL, *sq = NULL, *loss = NULL;
    loom_tensor_release(x->grad);
    x->grad = NULL;
    if (use_custom) {
        loom_tensor *in[3] = {x, w->tensor, NULL};
        assert_int_equal(loom_function_apply(&user_linear, in, 3, &y, 1, NULL, 0), LOOM_OK);
    } else {
        assert_int_equal(loom_matmul(x, w->tensor, &y), LOOM_OK);
    }
    assert_int_equal(loom_mul(y, y, &sq), LOOM_OK);
    assert_int_equal(loom_sum(sq, &loss), LOOM_OK);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    loom_tensor_read_f32(x->grad, dx_out);
    loom_tensor_release(y);
    loom_tensor_release(sq);
    loom_tensor_release(loss);
}

static void test_custom_linear_matches_builtin(void **state) {
    (void)state;
    loom_param *w = make_param("w", 6, 5, 1);
    float xv[4 * 5];
    tu_fill_uniform(xv, 20, -1, 1, 2);
    loom_tensor *x = loom_tensor_from_f32(xv, LOOM_F32, 2, (const int64_t[]){4, 5}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    float dx_builtin[20], dx_custom[20], dw_builtin[30], dw_custom[30];
    loom_param_zero_grad(w);
    custom_vs_builtin(0, w, x, dx_builtin);
    loom_param_read_grad(w, dw_builtin);
    loom_param_zero_grad(w);
    expected_param = w;
    saw_param_identity = 0;
    custom_vs_builtin(1, w, x, dx_custom);
    loom_param_read_grad(w, dw_custom);
    assert_true(saw_param_identity);
    TU_ASSERT_CLOSE(dx_custom, dx_builtin, 20, 1e-6, 1e-5);
    TU_ASSERT_CLOSE(dw_custom, dw_builtin, 30, 1e-6, 1e-5);
    /* Not zero: the gradient really reached main_grad. */
    double s = 0;
    for (int i = 0; i < 30; i++) s += fabs(dw_custom[i]);
    assert_true(s > 1e-3);
    assert_int_equal(w->uses, 1);
    assert_int_equal(w->contributions, 1);
    assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);
    loom_tensor_release(x);
    loom_param_free(w);
}

/* A function saving (NULL, weight, x, NULL): y = x + w. */
static int mix_checked;
static loom_status mix_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    LOOM_TRY(loom_add(in[0], in[1], &out[0])); /* inside forward: not recorded */
    loom_tensor *save[4] = {NULL, in[1], in[0], NULL};
    return loom_ctx_save(ctx, save, 4);
}
static loom_status mix_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *s[4];
    for (int i = 0; i < 4; i++) LOOM_TRY(loom_ctx_saved(ctx, i, &s[i]));
    mix_checked = s[0] == NULL && s[3] == NULL && s[1] == expected_param->tensor &&
                  loom_tensor_param(s[1]) == expected_param && s[2] && !s[2]->param;
    loom_tensor *none;
    assert_int_equal(loom_ctx_saved(ctx, 4, &none), LOOM_ERR_INVALID); /* out of range: an error */
    gin[0] = loom_tensor_retain(gout[0]);
    gin[1] = loom_tensor_retain(gout[0]);
    return LOOM_OK;
}
static const loom_function mix_fn = {"mix", 2, 1, 0, mix_forward, mix_backward};

static void test_saved_slots_any_mix(void **state) {
    (void)state;
    loom_param *w = make_param("w", 2, 2, 3);
    float v[4] = {1, 2, 3, 4};
    loom_tensor *a = loom_tensor_from_f32(v, LOOM_F32, 2, (const int64_t[]){2, 2}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(a, 1), LOOM_OK);
    expected_param = w;
    mix_checked = 0;
    loom_param_zero_grad(w);
    loom_tensor *in[2] = {a, w->tensor}, *y = NULL, *l = NULL;
    assert_int_equal(loom_function_apply(&mix_fn, in, 2, &y, 1, NULL, 0), LOOM_OK);
    assert_int_equal(loom_sum(y, &l), LOOM_OK);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
    assert_true(mix_checked);
    float g[4];
    loom_param_read_grad(w, g);
    for (int i = 0; i < 4; i++) assert_float_equal(g[i], 1.0f, 0);
    assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);

    /* The audit flags a parameter whose gradient was never written. */
    loom_param_zero_grad(w);
    w->uses = 1;
    char report[256];
    assert_int_equal(loom_grad_audit(&w, 1, report, sizeof report), LOOM_ERR_STATE);
    assert_non_null(strstr(report, "w: gradient never written"));
    assert_non_null(strstr(loom_last_error(), "w"));
    loom_tensor_release(y);
    loom_tensor_release(l);
    loom_tensor_release(a);
    loom_param_free(w);
}

static void test_accumulation_and_reuse(void **state) {
    (void)state;
    /* y = x * x + x: dy/dx = 2x + 1, x used three times */
    float v[5] = {-2, -0.5f, 0, 1, 3};
    loom_tensor *x = loom_tensor_from_f32(v, LOOM_F32, 1, (const int64_t[]){5}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    loom_tensor *sq, *y, *loss;
    assert_int_equal(loom_mul(x, x, &sq), LOOM_OK);
    assert_int_equal(loom_add(sq, x, &y), LOOM_OK);
    assert_int_equal(loom_sum(y, &loss), LOOM_OK);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    for (int i = 0; i < 5; i++) assert_float_equal(loom_tensor_get(x->grad, i), 2 * v[i] + 1, 1e-6);
    /* The tape was consumed; a second backward is an error, not a crash. */
    assert_int_equal(loom_tape_size(), 0);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_ERR_STATE);
    assert_non_null(strstr(loom_last_error(), "already freed"));
    loom_tensor_release(sq);
    loom_tensor_release(y);
    loom_tensor_release(loss);

    /* A parameter used twice in one step and across two steps accumulates. */
    loom_param *w = make_param("w", 1, 5, 4);
    loom_param_zero_grad(w);
    loom_tensor *wv = loom_tensor_view(w->tensor, 1, (const int64_t[]){5});
    (void)wv;
    for (int step = 0; step < 2; step++) {
        loom_tensor *p1, *l1;
        assert_int_equal(loom_mul(w->tensor, w->tensor, &p1), LOOM_OK); /* two uses */
        assert_int_equal(loom_sum(p1, &l1), LOOM_OK);
        assert_int_equal(loom_backward(l1, 1.0f), LOOM_OK);
        loom_tensor_release(p1);
        loom_tensor_release(l1);
    }
    float g[5], wvals[5];
    loom_param_read_grad(w, g);
    memcpy(wvals, loom_param_master(w), sizeof wvals);
    for (int i = 0; i < 5; i++) assert_float_equal(g[i], 2 * (2 * wvals[i]), 1e-6); /* two steps of 2w */
    assert_int_equal(w->uses, 4);
    assert_int_equal(w->contributions, 4);
    loom_tensor_release(wv);
    loom_tensor_release(x);
    loom_param_free(w);
}

/* A backward that sums its input's gradient in place: y_k = x w_k^T for
 * three weights, each dX GEMM taking the gradient x has so far
 * (loom_ctx_take_grad_sum) with beta = 1. The first finds none, the other
 * two find it; asking for another dtype finds nothing and leaves it. */
static int sums_taken, wrong_dtype_given;

static loom_status sum_linear_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                       int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x, *w;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &w));
    int K = (int)x->shape[1], N = (int)x->shape[0], M = (int)w->shape[0];
    wrong_dtype_given += loom_ctx_take_grad_sum(ctx, 0, LOOM_BF16) != NULL;
    float beta = 1.0f;
    if ((gin[0] = loom_ctx_take_grad_sum(ctx, 0, x->dtype)) != NULL) {
        sums_taken++;
    } else {
        beta = 0.0f;
        gin[0] = loom_tensor_new_2d(x->dtype, N, K, LOOM_MEM_ACTIVATIONS);
    }
    return loom_gemm(0, 0, N, K, M, 1.0f, loom_tensor_data(gout[0]), M, loom_tensor_data(w), K, x->dtype, beta,
                     loom_tensor_data(gin[0]), K, x->dtype, NULL, LOOM_F32);
}

static const loom_function sum_linear = {"sum_linear", 3, 1, 0, user_linear_forward, sum_linear_backward};

static void three_linears(const loom_function *fn, loom_param *const *w, loom_tensor *x, float *dx) {
    loom_tensor_release(x->grad);
    x->grad = NULL;
    loom_tensor *total = NULL;
    for (int k = 0; k < 3; k++) {
        loom_tensor *in[3] = {x, w[k]->tensor, NULL}, *y = NULL, *s = NULL, *t = NULL;
        assert_int_equal(loom_function_apply(fn, in, 3, &y, 1, NULL, 0), LOOM_OK);
        assert_int_equal(loom_mul(y, y, &s), LOOM_OK);
        assert_int_equal(loom_sum(s, &t), LOOM_OK);
        if (total) {
            loom_tensor *u = NULL;
            assert_int_equal(loom_add(total, t, &u), LOOM_OK);
            loom_tensor_release(total);
            loom_tensor_release(t);
            total = u;
        } else {
            total = t;
        }
        loom_tensor_release(y);
        loom_tensor_release(s);
    }
    assert_int_equal(loom_backward(total, 1.0f), LOOM_OK);
    loom_tensor_read_f32(x->grad, dx);
    loom_tensor_release(total);
}

static void test_backward_sums_into_input_grad(void **state) {
    (void)state;
    enum { N = 6, K = 5, M = 4 };
    loom_param *w[3] = {make_param("w0", M, K, 21), make_param("w1", M, K, 22), make_param("w2", M, K, 23)};
    float xv[N * K], want[N * K], got[N * K];
    tu_fill_uniform(xv, N * K, -1.0f, 1.0f, 24);
    loom_tensor *x = loom_tensor_from_f32(xv, LOOM_F32, 2, (const int64_t[]){N, K}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    expected_param = w[0]; /* user_linear_backward checks identity against it; only w[0] passes */
    three_linears(&user_linear, w, x, want);
    sums_taken = wrong_dtype_given = 0;
    three_linears(&sum_linear, w, x, got);
    assert_int_equal(sums_taken, 2);
    assert_int_equal(wrong_dtype_given, 0);
    TU_ASSERT_CLOSE(got, want, N * K, 1e-5, 1e-5);
    /* Outside a backward there is nothing to take. */
    assert_null(loom_ctx_take_grad_sum(NULL, 0, LOOM_F32));
    loom_tensor_release(x);
    for (int k = 0; k < 3; k++) loom_param_free(w[k]);
}

/* A backward (or a tape clear) called from inside a node's backward on the
 * tape being walked: refused (or a no-op), never a second walk of the same
 * nodes or nodes freed under the walk; the outer backward completes. */
static int nested_mode; /* 0: backward on a saved input, 1: loom_tape_clear */
static loom_status nested_status;

static loom_status nested_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    out[0] = loom_tensor_to(in[0], LOOM_F32, LOOM_MEM_ACTIVATIONS);
    return out[0] ? loom_ctx_save(ctx, in, 1) : LOOM_ERR_NOMEM;
}

static loom_status nested_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                   int n_in) {
    (void)n_out; (void)n_in;
    loom_tensor *x;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    if (nested_mode == 0) {
        loom_tensor *g = loom_tensor_zeros(LOOM_F32, x->ndim, x->shape, LOOM_MEM_ACTIVATIONS);
        nested_status = loom_backward_multi(&x, &g, 1);
        loom_tensor_release(g);
    } else {
        loom_tape_clear();
    }
    gin[0] = loom_tensor_retain(gout[0]);
    return LOOM_OK;
}

static const loom_function nested_fn = {"nested", 1, 1, 0, nested_forward, nested_backward};

static void test_backward_inside_backward(void **state) {
    (void)state;
    for (nested_mode = 0; nested_mode < 2; nested_mode++) {
        loom_tensor *x = leaf3(1), *y = NULL, *z = NULL, *l = NULL;
        assert_int_equal(loom_scale(x, 2.0f, &y), LOOM_OK); /* x -> y has a node the nested call could walk */
        assert_int_equal(loom_function_apply(&nested_fn, &y, 1, &z, 1, NULL, 0), LOOM_OK);
        assert_int_equal(loom_sum(z, &l), LOOM_OK);
        nested_status = LOOM_OK;
        assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
        if (nested_mode == 0) {
            assert_int_equal(nested_status, LOOM_ERR_STATE);
            assert_non_null(strstr(loom_last_error(), "loom_tape_push"));
        }
        for (int i = 0; i < 3; i++) assert_float_equal(loom_tensor_get(x->grad, i), 2.0f, 0.0f);
        assert_int_equal(loom_tape_size(), 0);
        loom_tensor_release(l);
        loom_tensor_release(z);
        loom_tensor_release(y);
        loom_tensor_release(x);
    }
}

static void test_no_grad_and_misuse(void **state) {
    (void)state;
    loom_param *w = make_param("w", 3, 4, 5);
    float v[8];
    tu_fill_uniform(v, 8, -1, 1, 6);
    loom_tensor *x = loom_tensor_from_f32(v, LOOM_F32, 2, (const int64_t[]){2, 4}, LOOM_MEM_ACTIVATIONS);
    loom_tensor *y = NULL;
    loom_no_grad_enter();
    assert_int_equal(loom_fused_linear(x, w->tensor, NULL, &y), LOOM_OK);
    loom_no_grad_exit();
    assert_int_equal(loom_tape_size(), 0);
    assert_false(loom_tensor_requires_grad(y));
    assert_int_equal(w->uses, 0);
    loom_tensor_release(y);

    /* Wrong number of inputs: a clear error. */
    loom_tensor *in[2] = {x, w->tensor};
    assert_int_equal(loom_function_apply(&user_linear, in, 2, &y, 1, NULL, 0), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "user_linear"));
    /* Wrong shapes: a clear error naming both. */
    loom_tensor *wt = loom_tensor_zeros(LOOM_F32, 2, (const int64_t[]){4, 3}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_fused_linear(x, wt, NULL, &y), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "(2, 4)"));
    assert_non_null(strstr(loom_last_error(), "(4, 3)"));
    loom_tensor_release(wt);
    /* No input features (K = 0): refused, not a division by zero. */
    loom_tensor *x0 = loom_tensor_zeros(LOOM_F32, 2, (const int64_t[]){2, 0}, LOOM_MEM_ACTIVATIONS);
    loom_tensor *w0 = loom_tensor_zeros(LOOM_F32, 2, (const int64_t[]){3, 0}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_fused_linear(x0, w0, NULL, &y), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "K > 0"));
    loom_tensor_release(x0);
    loom_tensor_release(w0);
    /* Negative counts and NULL arrays: refused before the forward runs. */
    loom_function variadic = user_linear;
    variadic.n_inputs = variadic.n_outputs = -1;
    assert_int_equal(loom_function_apply(&variadic, in, -1, &y, 1, NULL, 0), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "negative"));
    assert_int_equal(loom_function_apply(&variadic, in, 2, &y, -1, NULL, 0), LOOM_ERR_INVALID);
    assert_int_equal(loom_function_apply(&variadic, NULL, 2, &y, 1, NULL, 0), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "NULL array"));
    /* A cast of nothing, or to a dtype that does not exist. */
    assert_int_equal(loom_cast(NULL, LOOM_BF16, &y), LOOM_ERR_INVALID);
    assert_null(y);
    assert_int_equal(loom_cast(x, (loom_dtype)9, &y), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "dtype 9"));
    assert_null(loom_tensor_new((loom_dtype)9, 1, (const int64_t[]){2}, LOOM_MEM_ACTIVATIONS));
    /* Backward on something that needs no gradient. */
    loom_tensor *s = NULL;
    assert_int_equal(loom_sum(x, &s), LOOM_OK);
    assert_int_equal(loom_backward(s, 1.0f), LOOM_ERR_STATE);
    loom_tensor_release(s);
    loom_tensor_release(x);
    loom_param_free(w);
}

/* A function whose backward returns a gradient of the wrong shape. */
static loom_status bad_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    out[0] = loom_tensor_to(in[0], in[0]->dtype, LOOM_MEM_ACTIVATIONS);
    return LOOM_OK;
}
static loom_status bad_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)ctx; (void)gout; (void)n_out; (void)n_in;
    gin[0] = loom_tensor_zeros(LOOM_F32, 1, (const int64_t[]){7}, LOOM_MEM_ACTIVATIONS);
    return LOOM_OK;
}
static const loom_function bad_fn = {"bad_grad", 1, 1, 0, bad_forward, bad_backward};

static void test_bad_gradient_shape(void **state) {
    (void)state;
    loom_tensor *x = leaf3(1);
    loom_tensor *y = NULL, *l = NULL;
    assert_int_equal(loom_function_apply(&bad_fn, &x, 1, &y, 1, NULL, 0), LOOM_OK);
    assert_int_equal(loom_sum(y, &l), LOOM_OK);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_ERR_STATE);
    assert_non_null(strstr(loom_last_error(), "bad_grad"));
    loom_tensor_release(y);
    loom_tensor_release(l);
    loom_tensor_release(x);
}

/* Forwards that hand back a tensor they did not create: an input (here one
 * that needs no gradient), or one new tensor as both outputs. */
static loom_status passthrough_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                       int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    out[0] = loom_tensor_retain(in[0]);
    return LOOM_OK;
}

static loom_status passthrough_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                        int n_in) {
    (void)ctx; (void)n_out; (void)n_in;
    gin[1] = loom_tensor_retain(gout[0]); /* d out / d in[1] = 1 (same shape) */
    return LOOM_OK;
}

static loom_status twice_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    out[0] = loom_tensor_to(in[0], in[0]->dtype, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    out[1] = loom_tensor_retain(out[0]);
    return LOOM_OK;
}

static loom_status twice_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                  int n_in) {
    (void)ctx; (void)n_out; (void)n_in;
    return loom_add(gout[0], gout[1], &gin[0]);
}

static void test_forward_returns_existing_tensor(void **state) {
    (void)state;
    static const loom_function passthrough = {"passthrough", 2, 1, 0, passthrough_forward, passthrough_backward};
    static const loom_function twice = {"twice", 1, 2, 0, twice_forward, twice_backward};
    const float *v = leaf_values;
    loom_tensor *c = leaf3(0), *x = leaf3(1); /* c: a constant */
    loom_tensor *in[2] = {c, x}, *y = NULL, *l = NULL;
    assert_int_equal(loom_function_apply(&passthrough, in, 2, &y, 1, NULL, 0), LOOM_OK);
    assert_ptr_not_equal(y, c);   /* a view, recorded; the constant stays a constant */
    assert_null(c->node);
    assert_false(loom_tensor_requires_grad(c));
    assert_true(loom_tensor_requires_grad(y));
    assert_int_equal(loom_sum(y, &l), LOOM_OK);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
    for (int i = 0; i < 3; i++) assert_float_equal(loom_tensor_get(x->grad, i), 1.0f, 0.0f);
    loom_tensor_release(y);
    loom_tensor_release(l);

    /* One tensor as both outputs: two outputs, each with its gradient. */
    loom_tensor *o[2] = {NULL, NULL}, *l0 = NULL, *l1 = NULL, *t = NULL, *ls = NULL;
    assert_int_equal(loom_function_apply(&twice, &x, 1, o, 2, NULL, 0), LOOM_OK);
    assert_ptr_not_equal(o[0], o[1]);
    assert_int_equal(loom_mul(o[1], o[1], &t), LOOM_OK);   /* loss = sum(o0) + sum(o1^2) */
    assert_int_equal(loom_sum(o[0], &l0), LOOM_OK);
    assert_int_equal(loom_sum(t, &l1), LOOM_OK);
    assert_int_equal(loom_add(l0, l1, &ls), LOOM_OK);
    loom_tensor_release(x->grad);
    x->grad = NULL;
    assert_int_equal(loom_backward(ls, 1.0f), LOOM_OK);
    for (int i = 0; i < 3; i++) assert_float_equal(loom_tensor_get(x->grad, i), 1.0f + 2.0f * v[i], 1e-6);
    loom_tensor *all[] = {o[0], o[1], l0, l1, t, ls, c, x};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) loom_tensor_release(all[i]);
}

/* A backward refused for its arguments runs nothing and frees nothing: the
 * same graph can then be backpropagated with the right arguments. */
static void test_refused_backward_keeps_graph(void **state) {
    (void)state;
    const float *v = leaf_values;
    loom_tensor *x = leaf3(1);
    loom_tensor *y = NULL, *l = NULL;
    assert_int_equal(loom_mul(x, x, &y), LOOM_OK);
    assert_int_equal(loom_sum(y, &l), LOOM_OK);
    loom_tensor *wrong = loom_tensor_new(LOOM_F32, 1, (const int64_t[]){2}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_backward_multi(&y, &wrong, 1), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "does not match"));
    assert_int_equal(loom_backward(y, 1.0f), LOOM_ERR_INVALID); /* not a scalar */
    assert_null(x->grad);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
    for (int i = 0; i < 3; i++) assert_float_equal(loom_tensor_get(x->grad, i), 2 * v[i], 1e-6);
    loom_tensor_release(wrong);
    loom_tensor_release(y);
    loom_tensor_release(l);
    loom_tensor_release(x);
}

static void test_memory_returns_to_zero(void **state) {
    (void)state;
    loom_param *w = make_param("w", 16, 8, 7);
    loom_mem_stats before, after;
    loom_mem_get_stats(&before);
    for (int step = 0; step < 2; step++) {
        float v[32 * 8];
        tu_fill_uniform(v, 32 * 8, -1, 1, 8);
        loom_tensor *x = loom_tensor_from_f32(v, LOOM_F32, 2, (const int64_t[]){32, 8}, LOOM_MEM_ACTIVATIONS);
        loom_tensor *y, *h, *l;
        assert_int_equal(loom_fused_linear(x, w->tensor, NULL, &y), LOOM_OK);
        assert_int_equal(loom_silu(y, &h), LOOM_OK);
        assert_int_equal(loom_sum(h, &l), LOOM_OK);
        assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
        loom_tensor_release(x);
        loom_tensor_release(y);
        loom_tensor_release(h);
        loom_tensor_release(l);
    }
    loom_mem_get_stats(&after);
    assert_int_equal(after.current[LOOM_MEM_ACTIVATIONS], before.current[LOOM_MEM_ACTIVATIONS]);
    assert_int_equal(after.current[LOOM_MEM_WORKSPACE], before.current[LOOM_MEM_WORKSPACE]);
    assert_true(after.peak[LOOM_MEM_ACTIVATIONS] > before.current[LOOM_MEM_ACTIVATIONS]);
    loom_param_free(w);
}

/* The backward hook: called after every node; a parameter's gradient is
 * complete once its contributions equal its uses. In y = (x W1^T) W2^T the
 * second weight completes first; each is complete exactly when the node
 * that uses it has run. */
typedef struct hook_log {
    loom_param *w1, *w2;
    int calls, w1_done_at, w2_done_at;
} hook_log;

static loom_status record_completion(void *user) {
    hook_log *h = user;
    h->calls++;
    if (!h->w1_done_at && h->w1->uses > 0 && h->w1->contributions == h->w1->uses) h->w1_done_at = h->calls;
    if (!h->w2_done_at && h->w2->uses > 0 && h->w2->contributions == h->w2->uses) h->w2_done_at = h->calls;
    return LOOM_OK;
}

static loom_status failing_hook(void *user) {
    (void)user;
    return loom_error(LOOM_ERR_DIST, "the hook failed");
}

static void test_backward_hook(void **state) {
    (void)state;
    loom_param *w1 = make_param("w1", 6, 4, 11), *w2 = make_param("w2", 3, 6, 12);
    loom_tensor *x = loom_tensor_new_2d(LOOM_F32, 5, 4, LOOM_MEM_ACTIVATIONS);
    tu_fill_uniform(loom_tensor_data(x), 20, -1.0f, 1.0f, 13);
    for (int pass = 0; pass < 2; pass++) {
        loom_tensor *h = NULL, *y = NULL, *loss = NULL;
        assert_int_equal(loom_matmul(x, w1->tensor, &h), LOOM_OK);
        assert_int_equal(loom_matmul(h, w2->tensor, &y), LOOM_OK);
        assert_int_equal(loom_sum(y, &loss), LOOM_OK);
        hook_log log = {w1, w2, 0, 0, 0};
        loom_set_backward_hook(pass == 0 ? record_completion : failing_hook, &log);
        loom_status st = loom_backward(loss, 1.0f);
        loom_set_backward_hook(NULL, NULL);
        if (pass == 0) {
            assert_int_equal(st, LOOM_OK);
            assert_int_equal(log.calls, 3); /* sum, second matmul, first matmul */
            assert_int_equal(log.w2_done_at, 2);
            assert_int_equal(log.w1_done_at, 3);
        } else {
            assert_int_equal(st, LOOM_ERR_DIST); /* the hook's error stops backward */
        }
        loom_tensor_release(h);
        loom_tensor_release(y);
        loom_tensor_release(loss);
        loom_param_zero_grad(w1);
        loom_param_zero_grad(w2);
    }
    loom_tensor_release(x);
    loom_param_free(w1);
    loom_param_free(w2);
}

/* A gradient moved into a borrowed buffer keeps its values and keeps
 * accumulating there; moved back, the parameter owns it again. A dropped
 * master (ZeRO-1) comes back from the values given. */
static void test_grad_buffer_and_master(void **state) {
    (void)state;
    int64_t shape[2] = {4, 8};
    loom_param *p;
    assert_int_equal(loom_param_new("w", LOOM_BF16, 2, shape, 1, &p), LOOM_OK);
    float v[32], g[32], back[32];
    tu_fill_uniform(v, 32, -1.0f, 1.0f, 21);
    assert_int_equal(loom_param_set_f32(p, v, 32), LOOM_OK);
    loom_tensor *ones = loom_tensor_zeros(LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS);
    for (int i = 0; i < 32; i++) ((float *)loom_tensor_data(ones))[i] = 1.0f;
    assert_int_equal(loom_param_accumulate(p, ones), LOOM_OK);
    float buf[40] = {0};
    assert_int_equal(loom_param_set_grad_buffer(p, buf + 4), LOOM_OK);
    assert_true(p->grad == buf + 4 && p->grad_borrowed);
    assert_int_equal(loom_param_accumulate(p, ones), LOOM_OK);
    for (int i = 0; i < 32; i++) assert_true(buf[4 + i] == 2.0f);
    assert_true(buf[0] == 0.0f && buf[36] == 0.0f);
    assert_int_equal(loom_param_set_grad_buffer(p, NULL), LOOM_OK);
    assert_false(p->grad_borrowed);
    assert_true(p->grad != buf + 4);
    loom_param_read_grad(p, g);
    for (int i = 0; i < 32; i++) assert_true(g[i] == 2.0f);

    loom_param_drop_master(p);
    assert_true(p->master == NULL && p->master_sharded);
    /* An optimizer over a parameter whose master is held elsewhere would
     * update zeros: it is refused. */
    loom_dist_optim *opt = NULL;
    loom_adamw_config ac = loom_adamw_defaults();
    assert_int_equal(loom_dist_optim_new(&ac, &p, 1, NULL, 0, 0, &opt), LOOM_ERR_STATE);
    assert_null(opt);
    assert_non_null(strstr(loom_last_error(), "unshard"));
    assert_int_equal(loom_param_attach_master(p, v), LOOM_OK);
    assert_false(p->master_sharded);
    memcpy(back, loom_param_master(p), sizeof back);
    assert_memory_equal(back, v, sizeof back);
    assert_int_equal(loom_dist_optim_new(&ac, &p, 1, NULL, 0, 0, &opt), LOOM_OK);
    loom_dist_optim_free(opt);
    loom_tensor_release(ones);
    loom_param_free(p);
}

/* ----------------------------- gradients that share memory, or are views */

static float silu_grad(float x) {
    float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}

/* a = silu(x), c = silu(x), d = 3c, r = reshape(c); loss = sum(a + r) + sum(d).
 * add hands one gradient tensor to both a's and r's slots, reshape passes a
 * view of it on to c; accumulating d's gradient into c must not write into
 * a's. dL/dx = silu'(x) (1 + 1 + 3). */
static void test_shared_gradient_memory(void **state) {
    (void)state;
    float v[24];
    tu_fill_uniform(v, 24, -2.0f, 2.0f, 41);
    int64_t shape[2] = {4, 6};
    loom_tensor *x = loom_tensor_from_f32(v, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    loom_tensor *a, *c, *d, *r, *y, *sy, *sd, *loss;
    assert_int_equal(loom_silu(x, &a), LOOM_OK);
    assert_int_equal(loom_silu(x, &c), LOOM_OK);
    assert_int_equal(loom_scale(c, 3.0f, &d), LOOM_OK);
    assert_int_equal(loom_reshape(c, 2, shape, &r), LOOM_OK);
    assert_int_equal(loom_add(a, r, &y), LOOM_OK);
    assert_int_equal(loom_sum(y, &sy), LOOM_OK);
    assert_int_equal(loom_sum(d, &sd), LOOM_OK);
    assert_int_equal(loom_add(sy, sd, &loss), LOOM_OK);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    float g[24];
    loom_tensor_read_f32(x->grad, g);
    for (int i = 0; i < 24; i++) {
        float want = 5.0f * silu_grad(v[i]);
        if (!(fabsf(g[i] - want) <= 1e-5f * (1.0f + fabsf(want)))) { /* NaN fails */
            fprintf(stderr, "dx[%d] = %g, want %g\n", i, g[i], want);
            fail();
        }
    }
    loom_tensor *all[] = {x, a, c, d, r, y, sy, sd, loss};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) loom_tensor_release(all[i]);
}

/* A custom transpose whose backward returns a strided view of its incoming
 * gradient: the ops upstream read gradients as dense arrays, so the engine
 * must hand them a contiguous one. */
static loom_status tr_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    loom_tensor *t = loom_tensor_transpose(in[0], 0, 1);
    out[0] = t ? loom_tensor_contiguous(t, LOOM_MEM_ACTIVATIONS) : NULL;
    loom_tensor_release(t);
    return out[0] ? LOOM_OK : LOOM_ERR_NOMEM;
}

static loom_status tr_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)ctx; (void)n_out; (void)n_in;
    gin[0] = loom_tensor_transpose(gout[0], 0, 1); /* a view, not contiguous */
    return gin[0] ? LOOM_OK : LOOM_ERR_NOMEM;
}

static const loom_function view_transpose = {"view_transpose", 1, 1, 0, tr_forward, tr_backward};

static void test_strided_gradient_from_custom_op(void **state) {
    (void)state;
    float v[15], w[15];
    tu_fill_uniform(v, 15, -2.0f, 2.0f, 42);
    tu_fill_uniform(w, 15, -1.0f, 1.0f, 43);
    loom_tensor *x = loom_tensor_from_f32(v, LOOM_F32, 2, (const int64_t[]){3, 5}, LOOM_MEM_ACTIVATIONS);
    loom_tensor *R = loom_tensor_from_f32(w, LOOM_F32, 2, (const int64_t[]){5, 3}, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    loom_tensor *a, *t, *p, *loss;
    assert_int_equal(loom_silu(x, &a), LOOM_OK);
    assert_int_equal(loom_function_apply(&view_transpose, &a, 1, &t, 1, NULL, 0), LOOM_OK);
    assert_int_equal(loom_mul(t, R, &p), LOOM_OK);
    assert_int_equal(loom_sum(p, &loss), LOOM_OK);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    float g[15];
    loom_tensor_read_f32(x->grad, g);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 5; j++) {
            float want = silu_grad(v[i * 5 + j]) * w[j * 3 + i]; /* dL/da = R^T */
            if (!(fabsf(g[i * 5 + j] - want) <= 1e-5f * (1.0f + fabsf(want)))) { /* NaN fails */
                fprintf(stderr, "dx[%d][%d] = %g, want %g\n", i, j, g[i * 5 + j], want);
                fail();
            }
        }
    loom_tensor *all[] = {x, R, a, t, p, loss};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) loom_tensor_release(all[i]);
}

/* The fused linear with its weight and bias as parameters: dW and db go
 * straight into the fp32 main_grads (the bias's branch was exercised only
 * by checks that compare recompute modes with each other). Against sums in
 * double of the dt-rounded inputs: dW = R^T x, db = column sums of R, and
 * dx = R W, for fp32 and for bf16 compute with master-grad. */
static void test_fused_linear_parameter_grads(void **state) {
    (void)state;
    enum { N = 6, K = 5, M = 4 };
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int d = 0; d < 2; d++) {
        loom_dtype dt = dts[d];
        float xv[N * K], wv[M * K], bv[M], rv[N * M];
        tu_fill_uniform(xv, N * K, -1.0f, 1.0f, 51);
        tu_fill_uniform(wv, M * K, -1.0f, 1.0f, 52);
        tu_fill_uniform(bv, M, -1.0f, 1.0f, 53);
        tu_fill_uniform(rv, N * M, -1.0f, 1.0f, 54);
        for (int i = 0; i < N * K; i++) xv[i] = loom_round_to(xv[i], dt);
        for (int i = 0; i < M * K; i++) wv[i] = loom_round_to(wv[i], dt);
        for (int i = 0; i < N * M; i++) rv[i] = loom_round_to(rv[i], dt);
        loom_param *w, *b;
        assert_int_equal(loom_param_new("w", dt, 2, (const int64_t[]){M, K}, 1, &w), LOOM_OK);
        assert_int_equal(loom_param_new("b", dt, 1, (const int64_t[]){M}, 1, &b), LOOM_OK);
        assert_int_equal(loom_param_set_f32(w, wv, M * K), LOOM_OK);
        assert_int_equal(loom_param_set_f32(b, bv, M), LOOM_OK);
        loom_tensor *x = loom_tensor_from_f32(xv, dt, 2, (const int64_t[]){N, K}, LOOM_MEM_ACTIVATIONS);
        loom_tensor *r = loom_tensor_from_f32(rv, dt, 2, (const int64_t[]){N, M}, LOOM_MEM_ACTIVATIONS);
        assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
        loom_tensor *y = NULL, *p = NULL, *loss = NULL;
        assert_int_equal(loom_fused_linear(x, w->tensor, b->tensor, &y), LOOM_OK);
        assert_int_equal(loom_mul(y, r, &p), LOOM_OK);
        assert_int_equal(loom_sum(p, &loss), LOOM_OK);
        assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
        float gw[M * K], gb[M], gx[N * K], want_w[M * K], want_b[M], want_x[N * K];
        loom_param_read_grad(w, gw);
        loom_param_read_grad(b, gb);
        loom_tensor_read_f32(x->grad, gx);
        for (int m = 0; m < M; m++) {
            double sb = 0.0;
            for (int n = 0; n < N; n++) sb += rv[n * M + m];
            want_b[m] = (float)sb;
            for (int k = 0; k < K; k++) {
                double sw = 0.0;
                for (int n = 0; n < N; n++) sw += (double)rv[n * M + m] * xv[n * K + k];
                want_w[m * K + k] = (float)sw;
            }
        }
        for (int n = 0; n < N; n++)
            for (int k = 0; k < K; k++) {
                double sx = 0.0;
                for (int m = 0; m < M; m++) sx += (double)rv[n * M + m] * wv[m * K + k];
                want_x[n * K + k] = (float)sx;
            }
        /* main_grads sum exact inputs in fp32; dx is stored in dt */
        TU_ASSERT_CLOSE(gw, want_w, M * K, 1e-5, 1e-5);
        TU_ASSERT_CLOSE(gb, want_b, M, 1e-5, 1e-5);
        TU_ASSERT_CLOSE(gx, want_x, N * K, dt == LOOM_F32 ? 1e-5 : 1e-2, dt == LOOM_F32 ? 1e-5 : 1e-2);
        assert_int_equal(w->contributions, 1);
        assert_int_equal(b->contributions, 1);
        loom_tensor *ts[] = {x, r, y, p, loss};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) loom_tensor_release(ts[i]);
        loom_param_free(w);
        loom_param_free(b);
    }
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_custom_linear_matches_builtin),
        cmocka_unit_test(test_saved_slots_any_mix),
        cmocka_unit_test(test_accumulation_and_reuse),
        cmocka_unit_test(test_backward_sums_into_input_grad),
        cmocka_unit_test(test_no_grad_and_misuse),
        cmocka_unit_test(test_backward_inside_backward),
        cmocka_unit_test(test_bad_gradient_shape),
        cmocka_unit_test(test_refused_backward_keeps_graph),
        cmocka_unit_test(test_forward_returns_existing_tensor),
        cmocka_unit_test(test_memory_returns_to_zero),
        cmocka_unit_test(test_backward_hook),
        cmocka_unit_test(test_grad_buffer_and_master),
        cmocka_unit_test(test_shared_gradient_memory),
        cmocka_unit_test(test_strided_gradient_from_custom_op),
        cmocka_unit_test(test_fused_linear_parameter_grads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
