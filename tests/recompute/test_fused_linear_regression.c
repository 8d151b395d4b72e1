/*
 * test_fused_linear_regression.c — the regression loom exists to prevent.
 *
 * A fused linear that saves (x, weight, bias) for backward and accumulates
 * dW straight into the weight's fp32 main_grad, inside recomputed blocks of
 * a small bf16 model with master-grad on. In the framework this mirrors,
 * non-reentrant recompute handed backward a fresh tensor instead of the
 * parameter (so main_grad was lost) and rejected bias = None; reentrant
 * recompute happened to work. Here, in every mode:
 *  - the saved weight is the very parameter (loom_tensor_param(w) == p, the
 *    same loom_tensor), and a NULL bias comes back NULL;
 *  - every parameter's main_grad equals the no-recompute run bit for bit;
 *  - the gradient audit passes.
 * Each block uses two fused linears: the library's loom_fused_linear and a
 * copy written here with the public API only, as a user would.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

#define LAYERS 4
#define ROWS 8  /* N = B * T */
#define DIM 16  /* C */

/* ------------------------------------------------ a user-written fused linear */

typedef struct user_linear_args {
    loom_param *w; /* the parameters backward must find again */
    loom_param *b; /* NULL: no bias */
} user_linear_args;

/* Counts over one run: backward calls, and how many of them found the saved
 * weight (and bias) to be the very parameter. */
static int identity_checks, identity_ok;

static loom_status user_linear_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                       int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *w = in[1], *b = in[2];
    int N = (int)x->shape[0], K = (int)x->shape[1], M = (int)w->shape[0];
    out[0] = loom_tensor_new_2d(x->dtype, N, M, LOOM_MEM_ACTIVATIONS); /* (N, M) */
    if (!out[0]) return LOOM_ERR_NOMEM;
    LOOM_TRY(loom_gemm(0, 1, N, M, K, 1.0f, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 0.0f,
                       loom_tensor_data(out[0]), M, x->dtype, b ? loom_tensor_data(b) : NULL, x->dtype));
    loom_tensor *save[3] = {x, w, b}; /* b may be NULL */
    return loom_ctx_save(ctx, save, 3);
}

static loom_status user_linear_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                        int n_in) {
    (void)n_out; (void)n_in;
    const user_linear_args *a = loom_ctx_args(ctx);
    loom_tensor *x, *w, *b;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &w));
    LOOM_TRY(loom_ctx_saved(ctx, 2, &b));
    identity_checks++;
    int same = loom_tensor_param(w) == a->w && w == a->w->tensor &&
               (a->b ? (loom_tensor_param(b) == a->b && b == a->b->tensor) : b == NULL);
    if (!same)
        return loom_error(LOOM_ERR_STATE, "user_fused_linear: the saved weight%s is not the parameter '%s'",
                          a->b ? " or bias" : "", a->w->name);
    identity_ok++;
    loom_param *pw = loom_tensor_param(w);
    const loom_tensor *dy = gout[0]; /* (N, M) */
    int N = (int)x->shape[0], K = (int)x->shape[1], M = (int)w->shape[0];
    if (loom_ctx_needs_input_grad(ctx, 0)) {
        gin[0] = loom_tensor_new_2d(x->dtype, N, K, LOOM_MEM_ACTIVATIONS); /* dx (N, K) */
        if (!gin[0]) return LOOM_ERR_NOMEM;
        LOOM_TRY(loom_gemm(0, 0, N, K, M, 1.0f, loom_tensor_data(dy), M, loom_tensor_data(w), K, x->dtype, 0.0f,
                           loom_tensor_data(gin[0]), K, x->dtype, NULL, LOOM_F32));
    }
    if (loom_ctx_needs_input_grad(ctx, 1)) {
        /* main_grad(W) += dy^T x: one GEMM, beta = 1, no temporary dW. */
        loom_dtype dt;
        void *mg = loom_param_grad_target(pw, &dt);
        LOOM_TRY(loom_gemm(1, 0, M, K, N, 1.0f, loom_tensor_data(dy), M, loom_tensor_data(x), K, x->dtype, 1.0f, mg,
                           K, dt, NULL, LOOM_F32));
    }
    if (b && loom_ctx_needs_input_grad(ctx, 2)) {
        /* main_grad(b) += sum over rows of dy, reduced in fp32 first. */
        float *db = calloc((size_t)M, sizeof *db); /* (M) */
        if (!db) return LOOM_ERR_NOMEM;
        for (int r = 0; r < N; r++)
            for (int j = 0; j < M; j++) db[j] += loom_tensor_get(dy, (int64_t)r * M + j);
        loom_dtype dt;
        void *bg = loom_param_grad_target(loom_tensor_param(b), &dt);
        for (int j = 0; j < M; j++) loom_store(bg, (size_t)j, dt, loom_load(bg, (size_t)j, dt) + db[j]);
        free(db);
    }
    return LOOM_OK;
}

/* Not flagged LOOM_FN_EXPENSIVE: the selective policy recomputes it (and
 * keeps loom_fused_linear), so every mode replays a call that saves W. */
static const loom_function user_linear = {"user_fused_linear", 3, 1, 0, user_linear_forward, user_linear_backward};

static loom_status user_fused_linear(loom_tensor *x, loom_param *w, loom_param *b, loom_tensor **out) {
    loom_tensor *in[3] = {x, w->tensor, b ? b->tensor : NULL};
    user_linear_args a = {w, b};
    return loom_function_apply(&user_linear, in, 3, out, 1, &a, sizeof a);
}

/* ------------------------------------------------------------- the model */

typedef struct block {
    loom_param *w1, *b1, *w2, *b2; /* b1, b2 may be NULL */
} block;

typedef struct model {
    block blocks[LAYERS];
    loom_param *params[4 * LAYERS];
    int n_params;
} model;

/* out = x + fused_linear(silu(user_fused_linear(x, W1, b1)), W2, b2) */
static loom_status block_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const block *b = user;
    loom_tensor *h = NULL, *a = NULL, *o = NULL;
    loom_status st = user_fused_linear(in[0], b->w1, b->b1, &h);
    if (st == LOOM_OK) st = loom_silu(h, &a);
    if (st == LOOM_OK) st = loom_fused_linear(a, b->w2->tensor, b->b2 ? b->b2->tensor : NULL, &o);
    if (st == LOOM_OK) st = loom_add(in[0], o, &out[0]);
    loom_tensor_release(h);
    loom_tensor_release(a);
    loom_tensor_release(o);
    return st;
}

static loom_param *new_param(model *m, const char *name, int ndim, int64_t d0, int64_t d1, uint64_t seed) {
    loom_param *p;
    int64_t shape[2] = {d0, d1};
    assert_int_equal(loom_param_new(name, LOOM_BF16, ndim, shape, 1, &p), LOOM_OK);
    assert_int_equal(p->grad_dtype, LOOM_F32); /* master-grad: fp32 main_grad */
    size_t n = (size_t)loom_param_numel(p);
    float *v = malloc(n * sizeof *v);
    tu_fill_uniform(v, n, -0.3f, 0.3f, seed);
    assert_int_equal(loom_param_set_f32(p, v, (int64_t)n), LOOM_OK);
    free(v);
    m->params[m->n_params++] = p;
    return p;
}

/* bias: 0 none, 1 on every linear, 2 on the linears of odd layers */
static void model_init(model *m, int bias) {
    memset(m, 0, sizeof *m);
    for (int l = 0; l < LAYERS; l++) {
        char name[64];
        block *b = &m->blocks[l];
        int has_bias = bias == 1 || (bias == 2 && (l & 1));
        snprintf(name, sizeof name, "layers.%d.w1", l);
        b->w1 = new_param(m, name, 2, DIM, DIM, 100 + 4 * (uint64_t)l);
        snprintf(name, sizeof name, "layers.%d.w2", l);
        b->w2 = new_param(m, name, 2, DIM, DIM, 101 + 4 * (uint64_t)l);
        if (has_bias) {
            snprintf(name, sizeof name, "layers.%d.b1", l);
            b->b1 = new_param(m, name, 1, DIM, 0, 102 + 4 * (uint64_t)l);
            snprintf(name, sizeof name, "layers.%d.b2", l);
            b->b2 = new_param(m, name, 1, DIM, 0, 103 + 4 * (uint64_t)l);
        }
    }
}

static void model_free(model *m) {
    for (int i = 0; i < m->n_params; i++) loom_param_free(m->params[i]);
}

typedef struct run_result {
    int n;
    char names[4 * LAYERS][160];
    float *main_grad[4 * LAYERS]; /* copies */
    size_t numel[4 * LAYERS];
    uint16_t *dx;                 /* bf16 gradient of the input (ROWS * DIM) */
    float loss;
} run_result;

static void run_model(loom_recompute_mode mode, int bias, run_result *r) {
    model m;
    model_init(&m, bias);
    float xv[ROWS * DIM], rv[ROWS * DIM];
    tu_fill_uniform(xv, ROWS * DIM, -1.0f, 1.0f, 7);
    tu_fill_uniform(rv, ROWS * DIM, -1.0f, 1.0f, 8);
    const int64_t shape[2] = {ROWS, DIM};
    loom_tensor *x = loom_tensor_from_f32(xv, LOOM_BF16, 2, shape, LOOM_MEM_ACTIVATIONS);
    loom_tensor *R = loom_tensor_from_f32(rv, LOOM_BF16, 2, shape, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    identity_checks = identity_ok = 0;
    loom_recompute_reset_stats();

    loom_tensor *h = loom_tensor_retain(x);
    for (int l = 0; l < LAYERS; l++) {
        loom_tensor *next = NULL;
        loom_status st = loom_checkpoint(mode, block_region, &m.blocks[l], &h, 1, &next, 1);
        if (st != LOOM_OK) fprintf(stderr, "%s forward: %s\n", loom_recompute_mode_name(mode), loom_last_error());
        assert_int_equal(st, LOOM_OK);
        loom_tensor_release(h);
        h = next;
    }
    loom_tensor *prod = NULL, *loss = NULL;
    assert_int_equal(loom_mul(h, R, &prod), LOOM_OK);
    assert_int_equal(loom_sum(prod, &loss), LOOM_OK);
    r->loss = loom_tensor_get(loss, 0);
    loom_status st = loom_backward(loss, 1.0f);
    if (st != LOOM_OK) fprintf(stderr, "%s backward: %s\n", loom_recompute_mode_name(mode), loom_last_error());
    assert_int_equal(st, LOOM_OK);
    assert_int_equal(loom_tape_size(), 0);
    loom_recompute_stats rs;
    loom_recompute_get_stats(&rs);
    assert_int_equal(rs.replays, mode == LOOM_RECOMPUTE_NONE ? 0 : LAYERS);
    /* Only activations become placeholders, never W or b: per block, silu's
     * input h and the input of loom_fused_linear (under the selective policy
     * the GEMM is kept, and its saved input is refilled from the replay's).
     * The user linear's x is the region's input, stored. */
    int per_block = mode == LOOM_RECOMPUTE_NONREENTRANT || mode == LOOM_RECOMPUTE_SELECTIVE ? 2 : 0;
    assert_int_equal(rs.placeholders, per_block * LAYERS);

    /* The user linear ran its backward once per layer and found the very
     * parameters each time. */
    assert_int_equal(identity_checks, LAYERS);
    assert_int_equal(identity_ok, LAYERS);
    char report[1024];
    st = loom_grad_audit(m.params, m.n_params, report, sizeof report);
    if (st != LOOM_OK) fprintf(stderr, "%s: %s\n", loom_recompute_mode_name(mode), report);
    assert_int_equal(st, LOOM_OK);

    r->n = m.n_params;
    for (int i = 0; i < m.n_params; i++) {
        loom_param *p = m.params[i];
        snprintf(r->names[i], sizeof r->names[i], "%s", p->name);
        r->numel[i] = (size_t)loom_param_numel(p);
        r->main_grad[i] = malloc(r->numel[i] * sizeof(float));
        memcpy(r->main_grad[i], p->grad, r->numel[i] * sizeof(float));
    }
    assert_non_null(x->grad);
    assert_int_equal(x->grad->dtype, LOOM_BF16);
    r->dx = malloc(ROWS * DIM * sizeof *r->dx);
    memcpy(r->dx, loom_tensor_data(x->grad), ROWS * DIM * sizeof *r->dx);

    loom_tensor_release(prod);
    loom_tensor_release(loss);
    loom_tensor_release(h);
    loom_tensor_release(R);
    loom_tensor_release(x);
    model_free(&m);
}

static void free_result(run_result *r) {
    for (int i = 0; i < r->n; i++) free(r->main_grad[i]);
    free(r->dx);
}

static void expect_same(const run_result *ref, const run_result *got, const char *what) {
    assert_int_equal(ref->n, got->n);
    if (memcmp(&ref->loss, &got->loss, sizeof ref->loss) != 0) {
        fprintf(stderr, "%s: loss %.9g vs %.9g\n", what, (double)got->loss, (double)ref->loss);
        fail();
    }
    for (int i = 0; i < ref->n; i++) {
        if (memcmp(ref->main_grad[i], got->main_grad[i], ref->numel[i] * sizeof(float)) != 0) {
            fprintf(stderr, "%s: main_grad of %s differs from the run without recompute\n", what, ref->names[i]);
            fail();
        }
    }
    if (memcmp(ref->dx, got->dx, ROWS * DIM * sizeof *ref->dx) != 0) {
        fprintf(stderr, "%s: the input gradient differs\n", what);
        fail();
    }
}

static void check_all_modes(int bias) {
    const loom_recompute_mode modes[3] = {LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_REENTRANT,
                                          LOOM_RECOMPUTE_SELECTIVE};
    run_result ref = {0};
    run_model(LOOM_RECOMPUTE_NONE, bias, &ref);
    /* The weights' main_grads are really written (not all zero). */
    for (int i = 0; i < ref.n; i++) {
        double s = 0;
        for (size_t k = 0; k < ref.numel[i]; k++) s += fabs(ref.main_grad[i][k]);
        assert_true(s > 0);
    }
    for (int k = 0; k < 3; k++) {
        run_result got = {0};
        char what[96];
        snprintf(what, sizeof what, "%s, bias mode %d", loom_recompute_mode_name(modes[k]), bias);
        run_model(modes[k], bias, &got);
        expect_same(&ref, &got, what);
        free_result(&got);
    }
    free_result(&ref);
}

/* Weights without bias: each linear saves (x, W, NULL). */
static void test_no_bias(void **state) {
    (void)state;
    check_all_modes(0);
}

/* Every linear with a bias parameter. */
static void test_with_bias(void **state) {
    (void)state;
    check_all_modes(1);
}

/* Some layers with bias, some without. */
static void test_mixed_bias(void **state) {
    (void)state;
    check_all_modes(2);
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_bias),
        cmocka_unit_test(test_with_bias),
        cmocka_unit_test(test_mixed_bias),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
