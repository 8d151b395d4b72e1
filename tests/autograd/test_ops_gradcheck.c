/*
 * test_ops_gradcheck.c — every built-in op's backward against central
 * finite differences, on the fp32 path.
 *
 * Loss L = sum(op(inputs) * R) with a fixed random R, so dL/dout = R. The
 * numeric derivative (L(x+h) - L(x-h)) / 2h is computed with L summed in
 * fp64 (loom_sum) from fp32 kernels: its error is about eps32 * |L| / h +
 * O(h^2 f'''). With h = 1e-2 and |L| ~ 10 that is ~1e-4 absolute, so we
 * accept |analytic - numeric| <= 2e-3 + 2e-2 * |numeric|; a wrong backward
 * (a missing term, a transposed index) is off by O(1).
 */
#include "testutil.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#include "loom/loom.h"

typedef loom_status (*op_fn)(loom_tensor **in, void *user, loom_tensor **out);

typedef struct gradcheck {
    op_fn op;
    void *user;
    int n_in;
    loom_tensor *in[4];
    loom_tensor *R;      /* same shape as the output, or NULL for scalar outputs */
} gradcheck;

static double eval_loss(gradcheck *g, int record, loom_tensor **loss_out) {
    loom_tensor *out = NULL, *prod = NULL, *loss = NULL;
    if (!record) loom_no_grad_enter();
    loom_rng_default()->offset = 0; /* dropout: the same mask every evaluation */
    assert_int_equal(g->op(g->in, g->user, &out), LOOM_OK);
    if (g->R) {
        assert_int_equal(loom_mul(out, g->R, &prod), LOOM_OK);
        assert_int_equal(loom_sum(prod, &loss), LOOM_OK);
    } else {
        loss = loom_tensor_retain(out);
    }
    double v = loom_tensor_get(loss, 0);
    loom_tensor_release(out);
    loom_tensor_release(prod);
    if (loss_out) *loss_out = loss;
    else loom_tensor_release(loss);
    if (!record) loom_no_grad_exit();
    return v;
}

static void run_gradcheck(gradcheck *g, const char *name) {
    /* Output shape for R: run once. */
    loom_tensor *probe = NULL;
    loom_no_grad_enter();
    loom_rng_default()->offset = 0;
    assert_int_equal(g->op(g->in, g->user, &probe), LOOM_OK);
    loom_no_grad_exit();
    if (loom_tensor_numel(probe) > 1) {
        float *r = malloc((size_t)loom_tensor_numel(probe) * sizeof *r);
        tu_fill_uniform(r, (size_t)loom_tensor_numel(probe), -1.0f, 1.0f, 99);
        g->R = loom_tensor_from_f32(r, LOOM_F32, probe->ndim, probe->shape, LOOM_MEM_ACTIVATIONS);
        free(r);
    }
    loom_tensor_release(probe);
    for (int i = 0; i < g->n_in; i++)
        if (g->in[i]) {
            loom_tensor_release(g->in[i]->grad);
            g->in[i]->grad = NULL;
            assert_int_equal(loom_tensor_set_requires_grad(g->in[i], 1), LOOM_OK);
        }
    loom_tensor *loss = NULL;
    eval_loss(g, 1, &loss);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    loom_tensor_release(loss);
    const float h = 1e-2f;
    for (int i = 0; i < g->n_in; i++) {
        loom_tensor *t = g->in[i];
        if (!t) continue;
        assert_non_null(t->grad);
        float *x = loom_tensor_data(t);
        int64_t n = loom_tensor_numel(t);
        int64_t stride = n > 64 ? n / 47 + 1 : 1; /* a spread of elements */
        for (int64_t k = 0; k < n; k += stride) {
            float keep = x[k];
            x[k] = keep + h;
            double lp = eval_loss(g, 0, NULL);
            x[k] = keep - h;
            double lm = eval_loss(g, 0, NULL);
            x[k] = keep;
            double num = (lp - lm) / (2.0 * h);
            double ana = loom_tensor_get(t->grad, k);
            if (!(fabs(ana - num) <= 2e-3 + 2e-2 * fabs(num))) { /* a NaN on either side fails too */
                fprintf(stderr, "%s: input %d element %lld: analytic %.6g numeric %.6g\n", name, i, (long long)k, ana,
                        num);
                fail();
            }
        }
    }
    for (int i = 0; i < g->n_in; i++) loom_tensor_release(g->in[i]);
    loom_tensor_release(g->R);
}

static loom_tensor *rand_tensor(int ndim, const int64_t *shape, float lo, float hi, uint64_t seed) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    float *v = malloc((size_t)n * sizeof *v);
    tu_fill_uniform(v, (size_t)n, lo, hi, seed);
    loom_tensor *t = loom_tensor_from_f32(v, LOOM_F32, ndim, shape, LOOM_MEM_ACTIVATIONS);
    free(v);
    return t;
}

/* --------------------------------------------------------------- op glue */

static loom_status op_add(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_add(in[0], in[1], out); }
static loom_status op_mul(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_mul(in[0], in[1], out); }
static loom_status op_scale(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_scale(in[0], -1.7f, out); }
static loom_status op_divide(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_divide(in[0], -1.7f, out); }
static loom_status op_silu(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_silu(in[0], out); }
static loom_status op_swiglu(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_swiglu(in[0], in[1], out); }
static loom_status op_geglu(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_geglu(in[0], in[1], out); }
static loom_status op_matmul(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_matmul(in[0], in[1], out); }
static loom_status op_add_bias(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_add_bias(in[0], in[1], out); }
static loom_status op_dora_scale(loom_tensor **in, void *u, loom_tensor **out) {
    (void)u;
    static const float norms[4] = {1.5f, 0.7f, 2.0f, 1.1f};
    int64_t c = 4;
    loom_tensor *n = loom_tensor_from_f32(norms, LOOM_F32, 1, &c, LOOM_MEM_ACTIVATIONS);
    if (!n) return LOOM_ERR_NOMEM;
    loom_status st = loom_dora_scale(in[0], in[1], n, out);
    loom_tensor_release(n);
    return st;
}
static loom_status op_rmsnorm(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_rmsnorm(in[0], in[1], 1e-5f, out); }
static loom_status op_rmsnorm_unit(loom_tensor **in, void *u, loom_tensor **out) {
    (void)u;
    return loom_rmsnorm_ex(in[0], in[1], 1e-5f, 1.0f, out); /* Gemma's 1 + w */
}
static loom_status op_rope(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_rope(in[0], 10000.0f, 3, out); }
static loom_status op_attention(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_attention(in[0], in[1], in[2], out); }
/* u: the loom_attention_opts */
static loom_status op_attention_ex(loom_tensor **in, void *u, loom_tensor **out) {
    return loom_attention_ex(in[0], in[1], in[2], u, out);
}
static loom_status op_softcap(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_softcap(in[0], 1.3f, out); }
static loom_status op_cast_f32(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_cast(in[0], LOOM_F32, out); }
static loom_status op_dropout(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_dropout(in[0], 0.3f, out); }
static loom_status op_fused_linear(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_fused_linear(in[0], in[1], in[2], out); }
static loom_status op_fused_linear_add(loom_tensor **in, void *u, loom_tensor **out) {
    (void)u;
    return loom_fused_linear_add(in[0], in[1], -1.3f, in[2], out);
}
static loom_status op_dropout_window(loom_tensor **in, void *u, loom_tensor **out) {
    (void)u;
    loom_window w = {2, 9, 3, 11}; /* rows 2..6 of 9, columns 3..8 of 11 */
    return loom_dropout_window(in[0], 0.3f, &w, out);
}
static loom_status op_reshape(loom_tensor **in, void *u, loom_tensor **out) {
    (void)u;
    loom_tensor *r = NULL, *s = NULL;
    int64_t shape[2] = {4, 6};
    loom_status st = loom_reshape(in[0], 2, shape, &r);
    if (st == LOOM_OK) st = loom_mul(r, r, &s); /* something non-linear after the view */
    loom_tensor_release(r);
    *out = s;
    return st;
}
static const int32_t emb_tokens[7] = {3, 1, 3, 0, 4, 1, 3};
static loom_status op_embedding(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_embedding(in[0], emb_tokens, 7, out); }
static const int32_t xent_targets[6] = {2, -1, 0, 4, 4, 1};
static loom_status op_xent(loom_tensor **in, void *u, loom_tensor **out) { (void)u; return loom_cross_entropy(in[0], xent_targets, 6, -1, out); }

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

static void test_elementwise(void **state) {
    (void)state;
    gradcheck a = {op_add, NULL, 2, {rand_tensor(2, SHAPE(3, 5), -1, 1, 1), rand_tensor(2, SHAPE(3, 5), -1, 1, 2)}, NULL};
    run_gradcheck(&a, "add");
    gradcheck m = {op_mul, NULL, 2, {rand_tensor(2, SHAPE(3, 5), -1, 1, 3), rand_tensor(2, SHAPE(3, 5), -1, 1, 4)}, NULL};
    run_gradcheck(&m, "mul");
    gradcheck s = {op_scale, NULL, 1, {rand_tensor(1, SHAPE(9), -1, 1, 5)}, NULL};
    run_gradcheck(&s, "scale");
    gradcheck dv = {op_divide, NULL, 1, {rand_tensor(1, SHAPE(9), -1, 1, 31)}, NULL};
    run_gradcheck(&dv, "divide");
    gradcheck si = {op_silu, NULL, 1, {rand_tensor(2, SHAPE(4, 7), -3, 3, 6)}, NULL};
    run_gradcheck(&si, "silu");
    gradcheck sw = {op_swiglu, NULL, 2, {rand_tensor(2, SHAPE(4, 7), -3, 3, 7), rand_tensor(2, SHAPE(4, 7), -2, 2, 8)}, NULL};
    run_gradcheck(&sw, "swiglu");
    gradcheck ge = {op_geglu, NULL, 2, {rand_tensor(2, SHAPE(4, 7), -3, 3, 17), rand_tensor(2, SHAPE(4, 7), -2, 2, 18)}, NULL};
    run_gradcheck(&ge, "geglu");
    gradcheck d = {op_dropout, NULL, 1, {rand_tensor(2, SHAPE(5, 8), -1, 1, 9)}, NULL};
    run_gradcheck(&d, "dropout");
    gradcheck dw = {op_dropout_window, NULL, 1, {rand_tensor(2, SHAPE(5, 6), -1, 1, 10)}, NULL};
    run_gradcheck(&dw, "dropout_window");
    gradcheck r = {op_reshape, NULL, 1, {rand_tensor(3, SHAPE(2, 3, 4), -1, 1, 10)}, NULL};
    run_gradcheck(&r, "reshape");
    gradcheck c = {op_cast_f32, NULL, 1, {rand_tensor(2, SHAPE(3, 4), -1, 1, 30)}, NULL};
    run_gradcheck(&c, "cast (fp32)");
}

/* Casting to a half type rounds (no finite difference sees a derivative
 * through a step function), and its backward passes the gradient straight
 * through: z = cast(cast(x, t), fp32), L = sum(z R) gives z = round_t(x)
 * and dL/dx = round_t(R) (the gradient is held in the half type between
 * the casts), exactly. */
/* A dropout window that does not place x inside the larger tensor, or a
 * larger tensor too large to count, is refused by name. */
static void test_dropout_window_refusals(void **state) {
    (void)state;
    loom_tensor *x = rand_tensor(2, SHAPE(5, 6), -1, 1, 11), *y = NULL;
    static const loom_window bad[] = {
        {1, 0, 0, 0},                   /* a row offset in x's own rows */
        {-1, 9, 0, 0}, {5, 9, 0, 0},    /* before the first row, past the last */
        {0, 4, 0, 0},                   /* fewer rows than x's */
        {0, 0, 1, 6}, {0, 0, 0, -3},    /* past the last column, a negative width */
        {INT64_MAX - 5, INT64_MAX, 0, 0}, /* inside, but the whole cannot be counted */
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        assert_int_equal(loom_dropout_window(x, 0.3f, &bad[k], &y), LOOM_ERR_INVALID);
        assert_null(y);
        assert_non_null(strstr(loom_last_error(), k + 1 < sizeof bad / sizeof bad[0] ? "do not lie in" : "too large"));
    }
    loom_window fits = {4, 9, 2, 8}; /* the last rows, the last columns */
    assert_int_equal(loom_dropout_window(x, 0.3f, &fits, &y), LOOM_OK);
    loom_tensor_release(y);
    assert_int_equal(loom_dropout_window(x, 1.0f, NULL, &y), LOOM_ERR_INVALID);
    loom_tensor_release(x);
    loom_tape_clear();
}

/* Attention's dropout outside [0, 1), a dropout_at the call does not lie
 * in, or a whole batch too large to count is refused by name. */
static void test_attention_dropout_refusals(void **state) {
    (void)state;
    loom_tensor *q = rand_tensor(4, SHAPE(2, 5, 4, 8), -1, 1, 12), *kv = rand_tensor(4, SHAPE(2, 5, 2, 8), -1, 1, 13);
    loom_tensor *y = NULL;
    static const loom_attention_opts bad[] = {
        {.dropout = 1.0f}, {.dropout = -0.1f}, {.dropout = NAN},
        {.dropout = 0.1f, .dropout_at = {1, 0, 0, 0}},  /* a row offset in the call's own rows */
        {.dropout = 0.1f, .dropout_at = {2, 3, 0, 0}},  /* past the last batch row */
        {.dropout = 0.1f, .dropout_at = {0, 0, 1, 4}},  /* past the last head */
        {.dropout = 0.1f, .dropout_at = {0, 2, 0, (int64_t)INT_MAX + 1}}, /* more heads than an int counts */
        {.dropout = 0.1f, .dropout_at = {0, INT_MAX, 0, INT_MAX}},        /* a mask too large to count */
    };
    static const char *const why[] = {"must be in [0, 1)", "must be in [0, 1)", "must be in [0, 1)", "do not lie in",
                                      "do not lie in", "do not lie in", "too large", "too large"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        assert_int_equal(loom_attention_ex(q, kv, kv, &bad[k], &y), LOOM_ERR_INVALID);
        assert_null(y);
        assert_non_null(strstr(loom_last_error(), why[k]));
    }
    loom_attention_opts fits = {.dropout = 0.1f, .dropout_at = {6, 8, 8, 12}}; /* the last rows, the last heads */
    assert_int_equal(loom_attention_ex(q, kv, kv, &fits, &y), LOOM_OK);
    loom_tensor_release(y);
    loom_tensor_release(q);
    loom_tensor_release(kv);
    loom_tape_clear();
}

static void test_cast_half(void **state) {
    (void)state;
    const loom_dtype half[2] = {LOOM_BF16, LOOM_F16};
    for (int k = 0; k < 2; k++) {
        enum { N = 24 };
        float xv[N], rv[N], z[N], dx[N];
        tu_fill_uniform(xv, N, -3.0f, 3.0f, 31);
        tu_fill_uniform(rv, N, -1.0f, 1.0f, 32);
        loom_tensor *x = loom_tensor_from_f32(xv, LOOM_F32, 1, SHAPE(N), LOOM_MEM_ACTIVATIONS);
        loom_tensor *r = loom_tensor_from_f32(rv, LOOM_F32, 1, SHAPE(N), LOOM_MEM_ACTIVATIONS);
        assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
        loom_tensor *y = NULL, *zt = NULL, *p = NULL, *loss = NULL;
        assert_int_equal(loom_cast(x, half[k], &y), LOOM_OK);
        assert_int_equal(y->dtype, half[k]);
        assert_int_equal(loom_cast(y, LOOM_F32, &zt), LOOM_OK);
        assert_int_equal(loom_mul(zt, r, &p), LOOM_OK);
        assert_int_equal(loom_sum(p, &loss), LOOM_OK);
        assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
        loom_tensor_read_f32(zt, z);
        loom_tensor_read_f32(x->grad, dx);
        for (int i = 0; i < N; i++) {
            assert_true(z[i] == loom_round_to(xv[i], half[k]));
            assert_true(dx[i] == loom_round_to(rv[i], half[k]));
        }
        loom_tensor *ts[] = {x, r, y, zt, p, loss};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) loom_tensor_release(ts[i]);
    }
}

static void test_linear_ops(void **state) {
    (void)state;
    gradcheck mm = {op_matmul, NULL, 2, {rand_tensor(3, SHAPE(2, 3, 5), -1, 1, 11), rand_tensor(2, SHAPE(4, 5), -1, 1, 12)}, NULL};
    run_gradcheck(&mm, "matmul");
    gradcheck ab = {op_add_bias, NULL, 2, {rand_tensor(2, SHAPE(3, 4), -1, 1, 13), rand_tensor(1, SHAPE(4), -1, 1, 14)}, NULL};
    run_gradcheck(&ab, "add_bias");
    gradcheck ds = {op_dora_scale, NULL, 2, {rand_tensor(2, SHAPE(3, 4), -1, 1, 15), rand_tensor(1, SHAPE(4), 0.5, 2, 16)}, NULL};
    run_gradcheck(&ds, "dora_scale");
    gradcheck fl = {op_fused_linear, NULL, 3,
                    {rand_tensor(2, SHAPE(6, 5), -1, 1, 15), rand_tensor(2, SHAPE(4, 5), -1, 1, 16),
                     rand_tensor(1, SHAPE(4), -1, 1, 17)}, NULL};
    run_gradcheck(&fl, "fused_linear");
    gradcheck fln = {op_fused_linear, NULL, 3,
                     {rand_tensor(2, SHAPE(6, 5), -1, 1, 18), rand_tensor(2, SHAPE(4, 5), -1, 1, 19), NULL}, NULL};
    run_gradcheck(&fln, "fused_linear (no bias)");
    gradcheck fla = {op_fused_linear_add, NULL, 3,
                     {rand_tensor(3, SHAPE(2, 3, 5), -1, 1, 20), rand_tensor(2, SHAPE(4, 5), -1, 1, 21),
                      rand_tensor(3, SHAPE(2, 3, 4), -1, 1, 22)}, NULL};
    run_gradcheck(&fla, "fused_linear_add");
}

static void test_llama_ops(void **state) {
    (void)state;
    gradcheck rn = {op_rmsnorm, NULL, 2, {rand_tensor(2, SHAPE(5, 8), -2, 2, 20), rand_tensor(1, SHAPE(8), 0.5f, 1.5f, 21)}, NULL};
    run_gradcheck(&rn, "rmsnorm");
    gradcheck ru = {op_rmsnorm_unit, NULL, 2,
                    {rand_tensor(2, SHAPE(5, 8), -2, 2, 26), rand_tensor(1, SHAPE(8), -0.5f, 0.5f, 27)}, NULL};
    run_gradcheck(&ru, "rmsnorm (weights offset from 1)");
    gradcheck rp = {op_rope, NULL, 1, {rand_tensor(4, SHAPE(2, 3, 2, 8), -1, 1, 22)}, NULL};
    run_gradcheck(&rp, "rope");
    /* GQA: 4 query heads over 2 kv heads; LLaMA's, then a scale of its own (Granite's attention_multiplier,
     * not 1/sqrt(8)), Gemma 2's softcap (low enough to bend), Mistral's sliding window (two keys), dropout
     * (Granite 3's attention_dropout, heavier), and dropout as batch rows 1..2 of 3 and heads 4..7 of 12 */
    static const loom_attention_opts opts[6] = {
        {0}, {.scale = 0.6f}, {.scale = 0.9f, .softcap = 1.5f}, {.window = 2}, {.dropout = 0.3f},
        {.dropout = 0.3f, .dropout_at = {1, 3, 4, 12}}};
    static const uint64_t seeds[6] = {23, 28, 31, 35, 37, 41};
    static const char *const names[6] = {"attention (GQA)", "attention (a scale of its own)",
                                         "attention (softcapped scores)", "attention (a sliding window)",
                                         "attention (dropout)", "attention (dropout, part of a batch)"};
    for (int i = 0; i < 6; i++) {
        gradcheck at = {i ? op_attention_ex : op_attention, (void *)&opts[i], 3,
                        {rand_tensor(4, SHAPE(2, 5, 4, 8), -1, 1, seeds[i]),
                         rand_tensor(4, SHAPE(2, 5, 2, 8), -1, 1, seeds[i] + 1),
                         rand_tensor(4, SHAPE(2, 5, 2, 8), -1, 1, seeds[i] + 2)}, NULL};
        run_gradcheck(&at, names[i]);
    }
    gradcheck sc = {op_softcap, NULL, 1, {rand_tensor(2, SHAPE(3, 7), -3, 3, 34)}, NULL};
    run_gradcheck(&sc, "softcap");
    gradcheck em = {op_embedding, NULL, 1, {rand_tensor(2, SHAPE(5, 6), -1, 1, 26)}, NULL};
    run_gradcheck(&em, "embedding");
    gradcheck xe = {op_xent, NULL, 1, {rand_tensor(2, SHAPE(6, 5), -3, 3, 27)}, NULL};
    run_gradcheck(&xe, "cross_entropy");
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_elementwise),
        cmocka_unit_test(test_dropout_window_refusals),
        cmocka_unit_test(test_attention_dropout_refusals),
        cmocka_unit_test(test_cast_half),
        cmocka_unit_test(test_linear_ops),
        cmocka_unit_test(test_llama_ops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
