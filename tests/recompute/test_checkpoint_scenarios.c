/*
 * test_checkpoint_scenarios.c — the scenarios PyTorch's and Paddle's own
 * checkpoint tests cover, rebuilt in C on small fp32 tensors.
 *
 * Each scenario runs once with LOOM_RECOMPUTE_NONE (the reference) and once
 * under each of REENTRANT, NONREENTRANT and SELECTIVE; the gradients of
 * every parameter and every leaf must be bit-identical (memcmp on the fp32
 * buffers): the same kernels run on the same values in the same order, only
 * where the saved activations come from differs.
 *
 * Scenarios: forward once / replay once per backward; dropout with RNG
 * replay; NULL and non-tensor inputs and outputs; partial gradients; a
 * region whose outputs need no gradient; a second backward through a freed
 * graph; nested regions in every combination of modes; a parameter passed
 * as a region input; a parameter used inside and outside a region; several
 * outputs with inputs that need no gradient; the determinism check.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "loom/loom.h"

#define ROWS 6 /* N */
#define DIM 8  /* C */

static const loom_recompute_mode recompute_modes[3] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                                       LOOM_RECOMPUTE_SELECTIVE};

/* ---------------------------------------------------------------- helpers */

static loom_tensor *make_leaf(int64_t rows, int64_t cols, uint64_t seed, int requires_grad) {
    size_t n = (size_t)(rows * cols);
    float *v = malloc(n * sizeof *v);
    tu_fill_uniform(v, n, -1.0f, 1.0f, seed);
    loom_tensor *t = loom_tensor_from_f32(v, LOOM_F32, 2, (const int64_t[]){rows, cols}, LOOM_MEM_ACTIVATIONS);
    free(v);
    assert_non_null(t);
    if (requires_grad) assert_int_equal(loom_tensor_set_requires_grad(t, 1), LOOM_OK);
    return t;
}

static loom_param *make_param(const char *name, int64_t d0, int64_t d1, uint64_t seed) {
    loom_param *p;
    int64_t shape[2] = {d0, d1};
    assert_int_equal(loom_param_new(name, LOOM_F32, 2, shape, 1, &p), LOOM_OK);
    size_t n = (size_t)(d0 * d1);
    float *v = malloc(n * sizeof *v);
    tu_fill_uniform(v, n, -0.4f, 0.4f, seed);
    assert_int_equal(loom_param_set_f32(p, v, (int64_t)n), LOOM_OK);
    free(v);
    return p;
}

/* sum(y * R) with a fixed random R that needs no gradient: dL/dy = R. */
static loom_tensor *weighted_sum(loom_tensor *y, uint64_t seed) {
    loom_tensor *r = make_leaf(y->shape[0], y->shape[1], seed, 0), *prod = NULL, *loss = NULL;
    assert_int_equal(loom_mul(y, r, &prod), LOOM_OK);
    assert_int_equal(loom_sum(prod, &loss), LOOM_OK);
    loom_tensor_release(prod);
    loom_tensor_release(r);
    return loss;
}

/* a + b for two 1-element losses, consuming both references. */
static loom_tensor *add_losses(loom_tensor *a, loom_tensor *b) {
    loom_tensor *s = NULL;
    assert_int_equal(loom_add(a, b, &s), LOOM_OK);
    loom_tensor_release(a);
    loom_tensor_release(b);
    return s;
}

static void backward_ok(loom_tensor *loss) {
    loom_status st = loom_backward(loss, 1.0f);
    if (st != LOOM_OK) fprintf(stderr, "backward: %s\n", loom_last_error());
    assert_int_equal(st, LOOM_OK);
    assert_int_equal(loom_tape_size(), 0);
}

/* Copies of gradients (fp32), compared bit for bit. */
#define MAX_GRADS 16
typedef struct grad_set {
    int n;
    char name[MAX_GRADS][160];
    size_t numel[MAX_GRADS]; /* 0: no gradient */
    float *data[MAX_GRADS];
} grad_set;

static void gs_param(grad_set *g, const loom_param *p) {
    assert_true(g->n < MAX_GRADS);
    int i = g->n++;
    snprintf(g->name[i], sizeof g->name[i], "%s", p->name);
    g->numel[i] = (size_t)loom_param_numel(p);
    g->data[i] = malloc(g->numel[i] * sizeof(float));
    loom_param_read_grad(p, g->data[i]);
}

static void gs_leaf(grad_set *g, const char *name, const loom_tensor *t) {
    assert_true(g->n < MAX_GRADS);
    int i = g->n++;
    snprintf(g->name[i], sizeof g->name[i], "%s", name);
    g->numel[i] = t->grad ? (size_t)loom_tensor_numel(t->grad) : 0;
    g->data[i] = t->grad ? malloc(g->numel[i] * sizeof(float)) : NULL;
    if (t->grad) loom_tensor_read_f32(t->grad, g->data[i]);
}

static void gs_free(grad_set *g) {
    for (int i = 0; i < g->n; i++) free(g->data[i]);
    memset(g, 0, sizeof *g);
}

/* Sanity: the reference gradients are not all zero (the test compares
 * something). */
static void gs_expect_nonzero(const grad_set *g) {
    for (int i = 0; i < g->n; i++) {
        double s = 0;
        for (size_t k = 0; k < g->numel[i]; k++) s += fabs(g->data[i][k]);
        if (!(s > 0)) {
            fprintf(stderr, "reference gradient %s is zero\n", g->name[i]);
            fail();
        }
    }
}

static int gs_equal(const grad_set *ref, const grad_set *got, const char *what) {
    if (ref->n != got->n) {
        if (what) fprintf(stderr, "%s: %d gradients vs %d\n", what, got->n, ref->n);
        return 0;
    }
    for (int i = 0; i < ref->n; i++) {
        if (ref->numel[i] != got->numel[i]) {
            if (what) fprintf(stderr, "%s: %s has %zu elements, reference %zu\n", what, ref->name[i], got->numel[i],
                              ref->numel[i]);
            return 0;
        }
        if (ref->numel[i] && memcmp(ref->data[i], got->data[i], ref->numel[i] * sizeof(float)) != 0) {
            if (what) {
                size_t k = 0;
                while (memcmp(&ref->data[i][k], &got->data[i][k], sizeof(float)) == 0) k++;
                fprintf(stderr, "%s: %s differs first at [%zu]: %.9g vs reference %.9g\n", what, ref->name[i], k,
                        (double)got->data[i][k], (double)ref->data[i][k]);
            }
            return 0;
        }
    }
    return 1;
}

static void gs_expect_equal(const grad_set *ref, const grad_set *got, const char *what) {
    if (!gs_equal(ref, got, what)) fail();
}

static void mem_check_clean(size_t act_before) {
    loom_mem_stats ms;
    loom_mem_get_stats(&ms);
    if (ms.current[LOOM_MEM_ACTIVATIONS] != act_before) {
        fprintf(stderr, "activation bytes leaked: %zu now, %zu before\n", ms.current[LOOM_MEM_ACTIVATIONS],
                act_before);
        fail();
    }
}

static size_t act_bytes(void) {
    loom_mem_stats ms;
    loom_mem_get_stats(&ms);
    return ms.current[LOOM_MEM_ACTIVATIONS];
}

/* run in every recompute mode gives the gradients of the run without
 * recompute, bit for bit (and nonzero ones). */
static void expect_every_mode_matches(void (*run)(loom_recompute_mode, grad_set *)) {
    grad_set ref = {0};
    run(LOOM_RECOMPUTE_NONE, &ref);
    gs_expect_nonzero(&ref);
    for (int k = 0; k < 3; k++) {
        grad_set got = {0};
        run(recompute_modes[k], &got);
        gs_expect_equal(&ref, &got, loom_recompute_mode_name(recompute_modes[k]));
        gs_free(&got);
    }
    gs_free(&ref);
}

/* -------------------------------------- 1. forward once, replay once */

typedef struct counting_block {
    loom_param *w;
    int calls;
    long sleep_us;          /* each call waits this long first (replay timing) */
    long backward_sleep_us; /* the output passes an identity whose backward waits this long */
} counting_block;

static void sleep_us(long us) {
    struct timespec t = {us / 1000000L, us % 1000000L * 1000L};
    while (nanosleep(&t, &t) != 0) continue; /* resumes after a signal */
}

/* y = x; its backward waits *args microseconds, then passes the gradient on. */
static loom_status slow_identity_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                         int n_out) {
    (void)ctx; (void)n_in; (void)n_out;
    out[0] = loom_tensor_to(in[0], in[0]->dtype, LOOM_MEM_ACTIVATIONS);
    return out[0] ? LOOM_OK : LOOM_ERR_NOMEM;
}
static loom_status slow_identity_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                          int n_in) {
    (void)n_out; (void)n_in;
    sleep_us(*(const long *)loom_ctx_args(ctx));
    gin[0] = loom_tensor_to(gout[0], gout[0]->dtype, LOOM_MEM_ACTIVATIONS);
    return gin[0] ? LOOM_OK : LOOM_ERR_NOMEM;
}
static const loom_function slow_identity = {"slow_identity", 1, 1, 0, slow_identity_forward, slow_identity_backward};

/* y = silu(x W^T)^2: a GEMM (kept by the selective policy), then element-wise
 * ops whose saved inputs are recomputed. */
static loom_status counting_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    counting_block *b = user;
    b->calls++;
    if (b->sleep_us > 0) sleep_us(b->sleep_us);
    loom_tensor *h = NULL, *a = NULL, *y = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &a);
    if (st == LOOM_OK) st = loom_mul(a, a, b->backward_sleep_us > 0 ? &y : &out[0]);
    if (st == LOOM_OK && y)
        st = loom_function_apply(&slow_identity, &y, 1, out, 1, &b->backward_sleep_us, sizeof b->backward_sleep_us);
    loom_tensor_release(h);
    loom_tensor_release(a);
    loom_tensor_release(y);
    return st;
}

static void run_counting(loom_recompute_mode mode, grad_set *gs) {
    const int n_blocks = 3, steps = 2;
    counting_block blocks[3];
    loom_param *w[3];
    for (int i = 0; i < n_blocks; i++) {
        char name[32];
        snprintf(name, sizeof name, "w%d", i);
        w[i] = make_param(name, DIM, DIM, 10 + (uint64_t)i);
        blocks[i] = (counting_block){w[i], 0, 0, 0};
    }
    loom_tensor *x = make_leaf(ROWS, DIM, 1, 1);
    int per_backward = mode == LOOM_RECOMPUTE_NONE ? 0 : 1;
    for (int step = 0; step < steps; step++) {
        loom_recompute_reset_stats();
        loom_tensor *h = loom_tensor_retain(x);
        for (int i = 0; i < n_blocks; i++) {
            loom_tensor *next = NULL;
            assert_int_equal(loom_checkpoint(mode, counting_region, &blocks[i], &h, 1, &next, 1), LOOM_OK);
            loom_tensor_release(h);
            h = next;
        }
        loom_recompute_stats rs;
        loom_recompute_get_stats(&rs);
        /* The forward ran each region exactly once and replayed nothing. */
        for (int i = 0; i < n_blocks; i++) assert_int_equal(blocks[i].calls, step * (1 + per_backward) + 1);
        assert_int_equal(rs.replays, 0);
        assert_int_equal(rs.regions, per_backward * n_blocks);
        if (mode == LOOM_RECOMPUTE_NONREENTRANT || mode == LOOM_RECOMPUTE_SELECTIVE) assert_true(rs.placeholders > 0);
        if (mode == LOOM_RECOMPUTE_SELECTIVE) assert_int_equal(rs.kept_outputs, n_blocks); /* one GEMM each */
        else assert_int_equal(rs.kept_outputs, 0);
        loom_tensor *loss = weighted_sum(h, 50);
        loom_tensor_release(h);
        backward_ok(loss);
        loom_tensor_release(loss);
        /* The backward replayed each region exactly once. */
        loom_recompute_get_stats(&rs);
        for (int i = 0; i < n_blocks; i++) assert_int_equal(blocks[i].calls, (step + 1) * (1 + per_backward));
        assert_int_equal(rs.replays, per_backward * n_blocks);
    }
    for (int i = 0; i < n_blocks; i++) gs_param(gs, w[i]);
    gs_leaf(gs, "x", x);
    assert_int_equal(loom_grad_audit(w, n_blocks, NULL, 0), LOOM_OK);
    loom_tensor_release(x);
    for (int i = 0; i < n_blocks; i++) loom_param_free(w[i]);
}

static void test_forward_once_replay_once(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    expect_every_mode_matches(run_counting);
    mem_check_clean(act0);
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* stats.replay_seconds is the replays' forwards and nothing else: none in
 * the forward (whose regions wait as long as their replays), at least each
 * replay's wait in the backward, none of the ops' backward waits (a
 * reentrant region's nested backward included), and none at all without
 * recompute. */
static void test_replay_time_is_measured(void **state) {
    (void)state;
    enum { BLOCKS = 2 };
    const long wait_us = 3000, backward_wait_us = 20000;
    const loom_recompute_mode modes[4] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT,
                                          LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    for (int k = 0; k < 4; k++) {
        loom_param *w[BLOCKS];
        counting_block blocks[BLOCKS];
        for (int i = 0; i < BLOCKS; i++) {
            w[i] = make_param("w", DIM, DIM, 30 + (uint64_t)i);
            blocks[i] = (counting_block){w[i], 0, wait_us, backward_wait_us};
        }
        loom_tensor *x = make_leaf(ROWS, DIM, 3, 1), *h = loom_tensor_retain(x);
        loom_recompute_reset_stats();
        for (int i = 0; i < BLOCKS; i++) {
            loom_tensor *next = NULL;
            assert_int_equal(loom_checkpoint(modes[k], counting_region, &blocks[i], &h, 1, &next, 1), LOOM_OK);
            loom_tensor_release(h);
            h = next;
        }
        loom_recompute_stats rs;
        loom_recompute_get_stats(&rs);
        assert_true(rs.replay_seconds == 0.0);
        loom_tensor *loss = weighted_sum(h, 5);
        double t0 = seconds_now();
        backward_ok(loss);
        double backward_s = seconds_now() - t0;
        loom_recompute_get_stats(&rs);
        if (modes[k] == LOOM_RECOMPUTE_NONE) {
            assert_int_equal(rs.replays, 0);
            assert_true(rs.replay_seconds == 0.0);
        } else {
            assert_int_equal(rs.replays, BLOCKS);
            assert_true(rs.replay_seconds >= BLOCKS * wait_us * 1e-6);
            assert_true(rs.replay_seconds <= backward_s - BLOCKS * backward_wait_us * 1e-6);
        }
        loom_tensor_release(loss);
        loom_tensor_release(h);
        loom_tensor_release(x);
        for (int i = 0; i < BLOCKS; i++) loom_param_free(w[i]);
    }
}

/* A region that saves nothing but its inputs has nothing to recompute: the
 * backward does not replay it. */
static loom_status adding_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    ((counting_block *)user)->calls++;
    return loom_add(in[0], in[0], &out[0]);
}

static void test_nothing_to_recompute(void **state) {
    (void)state;
    for (int k = 1; k < 3; k++) { /* the non-reentrant modes */
        counting_block b = {NULL, 0, 0, 0};
        loom_tensor *x = make_leaf(ROWS, DIM, 2, 1), *y = NULL;
        loom_recompute_reset_stats();
        assert_int_equal(loom_checkpoint(recompute_modes[k], adding_region, &b, &x, 1, &y, 1), LOOM_OK);
        loom_tensor *loss = weighted_sum(y, 3);
        backward_ok(loss);
        loom_recompute_stats rs;
        loom_recompute_get_stats(&rs);
        assert_int_equal(rs.replays, 0);
        assert_int_equal(b.calls, 1);
        loom_tensor_release(loss);
        loom_tensor_release(y);
        loom_tensor_release(x);
    }
}

/* ---------------------------------------------------------- 2. dropout */

typedef struct dropout_block {
    loom_param *w;
    float p;
    int chained; /* two_dropouts_region: the second dropout reads the first's output */
} dropout_block;

/* d = dropout(x W^T); y = d * d (the mul saves d, which a replay must
 * recompute with the same mask). */
static loom_status dropout_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    dropout_block *b = user;
    loom_tensor *h = NULL, *d = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_dropout(h, b->p, &d);
    if (st == LOOM_OK) st = loom_mul(d, d, &out[0]);
    loom_tensor_release(h);
    loom_tensor_release(d);
    return st;
}

/* Two dropout regions with a dropout between them, from a fresh RNG. */
static void run_dropout(loom_recompute_mode mode, uint64_t seed, grad_set *gs, uint64_t *rng_after) {
    loom_param *w1 = make_param("w1", DIM, DIM, 20), *w2 = make_param("w2", DIM, DIM, 21);
    dropout_block b1 = {w1, 0.3f, 0}, b2 = {w2, 0.5f, 0};
    loom_tensor *x = make_leaf(ROWS, DIM, 3, 1), *y1 = NULL, *y1d = NULL, *y2 = NULL;
    loom_rng_init(loom_rng_default(), seed);
    assert_int_equal(loom_checkpoint(mode, dropout_region, &b1, &x, 1, &y1, 1), LOOM_OK);
    assert_int_equal(loom_dropout(y1, 0.2f, &y1d), LOOM_OK);
    assert_int_equal(loom_checkpoint(mode, dropout_region, &b2, &y1d, 1, &y2, 1), LOOM_OK);
    uint64_t after_forward = loom_rng_default()->offset;
    loom_tensor *loss = weighted_sum(y2, 51);
    backward_ok(loss);
    /* A replay restores the RNG it found: backward consumes no numbers. */
    assert_true(loom_rng_default()->offset == after_forward);
    *rng_after = after_forward;
    gs_param(gs, w1);
    gs_param(gs, w2);
    gs_leaf(gs, "x", x);
    loom_tensor_release(loss);
    loom_tensor_release(y1);
    loom_tensor_release(y1d);
    loom_tensor_release(y2);
    loom_tensor_release(x);
    loom_param_free(w1);
    loom_param_free(w2);
}

/* Collect w's and x's gradients into gs, then free the run's tensors. */
static void collect_and_free(grad_set *gs, loom_param *w, loom_tensor *x, loom_tensor *y, loom_tensor *loss) {
    gs_param(gs, w);
    gs_leaf(gs, "x", x);
    loom_tensor_release(loss);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_param_free(w);
}

/* h = x W^T, a = dropout(h), d = dropout(chained ? a : h), y = d * d.
 * Unchained, a is a dead op that draws random numbers: never read, but a
 * replay that skipped it would start the second dropout at another RNG
 * offset, so its mask (and the gradients) would change. The replay's
 * dead-op rule keeps ops that draw numbers. */
static loom_status two_dropouts_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    dropout_block *b = user;
    loom_tensor *h = NULL, *a = NULL, *d = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_dropout(h, 0.3f, &a); /* dead unless chained */
    if (st == LOOM_OK) st = loom_dropout(b->chained ? a : h, b->p, &d);
    if (st == LOOM_OK) st = loom_mul(d, d, &out[0]);
    loom_tensor_release(h);
    loom_tensor_release(a);
    loom_tensor_release(d);
    return st;
}

static void run_dead_dropout(loom_recompute_mode mode, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 22);
    dropout_block b = {w, 0.5f, 0};
    loom_tensor *x = make_leaf(ROWS, DIM, 4, 1), *y = NULL;
    loom_rng_init(loom_rng_default(), 77);
    assert_int_equal(loom_checkpoint_flags(mode, LOOM_REGION_OPS_ONLY, two_dropouts_region, &b, &x, 1, &y, 1),
                     LOOM_OK);
    loom_tensor *loss = weighted_sum(y, 52);
    backward_ok(loss);
    collect_and_free(gs, w, x, y, loss);
}

static void test_dead_op_drawing_random_numbers(void **state) {
    (void)state;
    grad_set ref = {0}, got = {0};
    run_dead_dropout(LOOM_RECOMPUTE_NONE, &ref);
    gs_expect_nonzero(&ref);
    loom_recompute_reset_stats();
    run_dead_dropout(LOOM_RECOMPUTE_NONREENTRANT, &got);
    gs_expect_equal(&ref, &got, "dead dropout, nonreentrant");
    loom_recompute_stats rs;
    loom_recompute_get_stats(&rs);
    assert_int_equal(rs.replays, 1);
    assert_true(rs.skipped_ops >= 1); /* the mul is skipped (its saves are its inputs); the dropouts run */
    gs_free(&got);
    gs_free(&ref);
}

/* A kept op that draws random numbers, then one the replay recomputes: the
 * replay does not run the kept op, yet the next dropout must draw where it
 * drew in the forward, or its mask (and the gradients) change silently.
 * The policy keeps the first dropout it is asked about: in the chained
 * two_dropouts_region, a (kept), then d = dropout(a) (recomputed). */
static int keep_first_dropout(void *user, const loom_function *fn) {
    int *seen = user;
    return !strcmp(fn->name, "dropout") && (*seen)++ == 0;
}

static void run_kept_dropout(int with_policy, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 23);
    dropout_block b = {w, 0.5f, 1};
    int seen = 0;
    loom_recompute_policy policy = {keep_first_dropout, &seen};
    loom_tensor *x = make_leaf(ROWS, DIM, 5, 1), *y = NULL;
    loom_rng_init(loom_rng_default(), 78);
    if (with_policy)
        assert_int_equal(loom_checkpoint_policy(&policy, two_dropouts_region, &b, &x, 1, &y, 1), LOOM_OK);
    else
        assert_int_equal(loom_checkpoint(LOOM_RECOMPUTE_NONE, two_dropouts_region, &b, &x, 1, &y, 1), LOOM_OK);
    uint64_t after_forward = loom_rng_default()->offset;
    loom_tensor *loss = weighted_sum(y, 53);
    backward_ok(loss);
    assert_true(loom_rng_default()->offset == after_forward);
    assert_int_equal(seen, with_policy ? 2 : 0); /* asked about both dropouts */
    collect_and_free(gs, w, x, y, loss);
}

static void test_kept_op_drawing_random_numbers(void **state) {
    (void)state;
    grad_set ref = {0}, got = {0};
    run_kept_dropout(0, &ref);
    gs_expect_nonzero(&ref);
    run_kept_dropout(1, &got);
    gs_expect_equal(&ref, &got, "kept dropout, then a recomputed one");
    gs_free(&got);
    gs_free(&ref);
}

/* ------------------------------ 2b. what keeps the dead-op rule honest */

/* Dead-op skipping is for regions whose caller vouches that intermediates
 * flow only through ops (LOOM_REGION_OPS_ONLY); within those, a view of an
 * op's output is that output, an op under explicit no-grad turns skipping
 * off, and a nested reentrant region always runs. Each scenario would give
 * NaN gradients (skipped outputs are NaN-filled) if its rule were missing. */
typedef struct skip_block {
    loom_param *w1, *w2;
    int kind; /* SKIP_* */
} skip_block;

enum { SKIP_PLAIN, SKIP_VIEW, SKIP_NO_GRAD, SKIP_NESTED };

/* y = silu(h W2^T), the inner region of SKIP_NESTED. */
static loom_status skip_inner(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    skip_block *b = user;
    loom_tensor *t = NULL;
    loom_status st = loom_fused_linear(in[0], b->w2->tensor, NULL, &t);
    if (st == LOOM_OK) st = loom_silu(t, &out[0]);
    loom_tensor_release(t);
    return st;
}

/* h = x W1^T, then per kind:
 *   PLAIN:   y = (h * h) + h              the mul and the add are dead
 *   VIEW:    y = v * (x W2^T), v a raw view of h (a constant to autograd):
 *            the mul is dead, and it reads h only through v
 *   NO_GRAD: m = h * h under no-grad; y = m * (x W2^T)
 *   NESTED:  y = reentrant(silu(h W2^T)) + h   the region is read only by a dead add */
static loom_status skip_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    skip_block *b = user;
    loom_tensor *h = NULL, *a = NULL, *z = NULL;
    loom_status st = loom_fused_linear(in[0], b->w1->tensor, NULL, &h);
    if (st != LOOM_OK) return st;
    switch (b->kind) {
    case SKIP_PLAIN:
        st = loom_mul(h, h, &a);
        if (st == LOOM_OK) st = loom_add(a, h, &out[0]);
        break;
    case SKIP_VIEW:
        a = loom_tensor_view(h, 2, h->shape); /* a raw view: a constant to autograd */
        st = a ? loom_fused_linear(in[0], b->w2->tensor, NULL, &z) : LOOM_ERR_NOMEM;
        if (st == LOOM_OK) st = loom_mul(a, z, &out[0]);
        break;
    case SKIP_NO_GRAD:
        loom_no_grad_enter();
        st = loom_mul(h, h, &a);
        loom_no_grad_exit();
        if (st == LOOM_OK) st = loom_fused_linear(in[0], b->w2->tensor, NULL, &z);
        if (st == LOOM_OK) st = loom_mul(a, z, &out[0]);
        break;
    default:
        st = loom_checkpoint(LOOM_RECOMPUTE_REENTRANT, skip_inner, b, &h, 1, &a, 1);
        if (st == LOOM_OK) st = loom_add(a, h, &out[0]);
    }
    loom_tensor_release(h);
    loom_tensor_release(a);
    loom_tensor_release(z);
    return st;
}

static void run_skip(int kind, loom_recompute_mode mode, unsigned flags, grad_set *gs, long *skipped) {
    loom_param *w1 = make_param("w1", DIM, DIM, 80), *w2 = make_param("w2", DIM, DIM, 81);
    skip_block b = {w1, w2, kind};
    loom_tensor *x = make_leaf(ROWS, DIM, 12, 1), *y = NULL;
    loom_recompute_reset_stats();
    assert_int_equal(loom_checkpoint_flags(mode, flags, skip_region, &b, &x, 1, &y, 1), LOOM_OK);
    loom_tensor *loss = weighted_sum(y, 57);
    backward_ok(loss);
    loom_recompute_stats rs;
    loom_recompute_get_stats(&rs);
    *skipped = rs.skipped_ops;
    /* Through a raw view or a no-grad op, h carries no gradient to w1. */
    if (kind == SKIP_PLAIN || kind == SKIP_NESTED) gs_param(gs, w1);
    if (kind != SKIP_PLAIN) gs_param(gs, w2);
    gs_leaf(gs, "x", x);
    loom_tensor_release(loss);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_param_free(w1);
    loom_param_free(w2);
}

static void test_dead_op_rule_guards(void **state) {
    (void)state;
    /* kind, ops replay skips with LOOM_REGION_OPS_ONLY */
    static const struct { int kind; long skipped; const char *what; } cases[] = {
        {SKIP_PLAIN, 2, "plain: the mul and the add"},
        {SKIP_VIEW, 1, "the mul is skipped, but a view of h keeps h's producer"},
        {SKIP_NO_GRAD, 0, "a no-grad op turns skipping off"},
        {SKIP_NESTED, 1, "the nested reentrant region runs; the add is skipped"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        grad_set ref = {0}, got = {0}, plain = {0};
        long skipped = -1;
        run_skip(cases[c].kind, LOOM_RECOMPUTE_NONE, 0, &ref, &skipped);
        gs_expect_nonzero(&ref);
        run_skip(cases[c].kind, LOOM_RECOMPUTE_NONREENTRANT, LOOM_REGION_OPS_ONLY, &got, &skipped);
        gs_expect_equal(&ref, &got, cases[c].what);
        if (skipped != cases[c].skipped) {
            fprintf(stderr, "%s: %ld ops skipped, expected %ld\n", cases[c].what, skipped, cases[c].skipped);
            fail();
        }
        /* Without the flag the replay runs every op. */
        run_skip(cases[c].kind, LOOM_RECOMPUTE_NONREENTRANT, 0, &plain, &skipped);
        gs_expect_equal(&ref, &plain, cases[c].what);
        assert_int_equal(skipped, 0);
        gs_free(&ref);
        gs_free(&got);
        gs_free(&plain);
    }
    loom_tensor *x = make_leaf(ROWS, DIM, 12, 1), *y = NULL;
    skip_block b = {NULL, NULL, SKIP_PLAIN};
    assert_int_equal(loom_checkpoint_flags(LOOM_RECOMPUTE_NONREENTRANT, 1u << 7, skip_region, &b, &x, 1, &y, 1),
                     LOOM_ERR_INVALID);
    assert_null(y);
    loom_tensor_release(x);
}

static void test_dropout_rng_replay(void **state) {
    (void)state;
    grad_set ref = {0}, other = {0};
    uint64_t off_ref, off;
    run_dropout(LOOM_RECOMPUTE_NONE, 1234, &ref, &off_ref);
    gs_expect_nonzero(&ref);
    for (int k = 0; k < 3; k++) {
        grad_set got = {0};
        run_dropout(recompute_modes[k], 1234, &got, &off);
        gs_expect_equal(&ref, &got, loom_recompute_mode_name(recompute_modes[k]));
        assert_true(off == off_ref);
        gs_free(&got);
    }
    /* Sanity: the masks matter, so another seed gives other gradients. */
    run_dropout(LOOM_RECOMPUTE_NONE, 999, &other, &off);
    assert_false(gs_equal(&ref, &other, NULL));
    gs_free(&other);
    run_dropout(LOOM_RECOMPUTE_NONREENTRANT, 999, &other, &off);
    assert_false(gs_equal(&ref, &other, NULL));
    gs_free(&other);
    gs_free(&ref);
}

/* ---------------------------------------- 3. NULL and non-tensor arguments */

typedef struct scaled_block {
    loom_param *w;
    float factor;       /* a non-tensor argument */
    int saw_null_input; /* every call found inputs[1] == NULL */
    int calls;
} scaled_block;

/* inputs {x, NULL}, outputs {silu(factor * x W^T), NULL}. */
static loom_status scaled_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    scaled_block *b = user;
    b->calls++;
    b->saw_null_input &= n_in == 2 && in[1] == NULL && n_out == 2;
    loom_tensor *h = NULL, *s = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_scale(h, b->factor, &s);
    if (st == LOOM_OK) st = loom_silu(s, &out[0]);
    out[1] = NULL; /* an output that does not exist */
    loom_tensor_release(h);
    loom_tensor_release(s);
    return st;
}

static void run_scaled(loom_recompute_mode mode, float factor, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 30);
    scaled_block b = {w, factor, 1, 0};
    loom_tensor *x = make_leaf(ROWS, DIM, 4, 1);
    loom_tensor *in[2] = {x, NULL}, *out[2] = {NULL, NULL};
    loom_status st = loom_checkpoint(mode, scaled_region, &b, in, 2, out, 2);
    if (st != LOOM_OK) fprintf(stderr, "%s: %s\n", loom_recompute_mode_name(mode), loom_last_error());
    assert_int_equal(st, LOOM_OK);
    assert_non_null(out[0]);
    assert_null(out[1]);
    loom_tensor *loss = weighted_sum(out[0], 52);
    backward_ok(loss);
    assert_true(b.saw_null_input);
    assert_int_equal(b.calls, mode == LOOM_RECOMPUTE_NONE ? 1 : 2);
    gs_param(gs, w);
    gs_leaf(gs, "x", x);
    assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);
    loom_tensor_release(loss);
    loom_tensor_release(out[0]);
    loom_tensor_release(x);
    loom_param_free(w);
}

static void test_null_and_non_tensor_arguments(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    grad_set ref = {0}, other = {0};
    run_scaled(LOOM_RECOMPUTE_NONE, 0.75f, &ref);
    gs_expect_nonzero(&ref);
    for (int k = 0; k < 3; k++) {
        grad_set got = {0};
        run_scaled(recompute_modes[k], 0.75f, &got);
        gs_expect_equal(&ref, &got, loom_recompute_mode_name(recompute_modes[k]));
        gs_free(&got);
    }
    /* The float argument is really used. */
    run_scaled(LOOM_RECOMPUTE_NONREENTRANT, 1.5f, &other);
    assert_false(gs_equal(&ref, &other, NULL));
    gs_free(&other);
    gs_free(&ref);
    mem_check_clean(act0);
}

/* ----------------------------------------------- 4. partial gradients */

typedef struct two_out_block {
    loom_param *w;
} two_out_block;

/* outputs {silu(x W^T), x * x} */
static loom_status two_out_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    two_out_block *b = user;
    loom_tensor *h = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &out[0]);
    if (st == LOOM_OK) st = loom_mul(in[0], in[0], &out[1]);
    loom_tensor_release(h);
    return st;
}

/* The loss uses output `used` only. */
static void run_partial(loom_recompute_mode mode, int used, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 40);
    two_out_block b = {w};
    loom_tensor *x = make_leaf(ROWS, DIM, 5, 1), *out[2] = {NULL, NULL};
    assert_int_equal(loom_checkpoint(mode, two_out_region, &b, &x, 1, out, 2), LOOM_OK);
    loom_tensor *loss = weighted_sum(out[used], 53);
    backward_ok(loss);
    gs_param(gs, w);
    gs_leaf(gs, "x", x);
    if (used == 0) assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);
    loom_tensor_release(loss);
    loom_tensor_release(out[0]);
    loom_tensor_release(out[1]);
    loom_tensor_release(x);
    loom_param_free(w);
}

static void test_partial_gradients(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    for (int used = 0; used < 2; used++) {
        grad_set ref = {0};
        run_partial(LOOM_RECOMPUTE_NONE, used, &ref);
        for (int k = 0; k < 3; k++) {
            grad_set got = {0};
            char what[64];
            snprintf(what, sizeof what, "%s, loss on output %d", loom_recompute_mode_name(recompute_modes[k]), used);
            run_partial(recompute_modes[k], used, &got);
            gs_expect_equal(&ref, &got, what);
            gs_free(&got);
        }
        gs_free(&ref);
    }
    mem_check_clean(act0);
}

/* ------------------------------------ 5. outputs that need no gradient */

typedef struct const_block {
    loom_tensor *c; /* needs no gradient */
} const_block;

/* Ignores its input: the output depends on a constant only. */
static loom_status const_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)in; (void)n_in; (void)n_out;
    const_block *b = user;
    return loom_mul(b->c, b->c, &out[0]);
}

static void test_outputs_need_no_gradient(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    const loom_recompute_mode all[4] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                        LOOM_RECOMPUTE_SELECTIVE};
    for (int k = 0; k < 4; k++) {
        const_block b = {make_leaf(ROWS, DIM, 6, 0)};
        loom_tensor *x = make_leaf(ROWS, DIM, 7, 1), *y = NULL, *loss = NULL;
        assert_int_equal(loom_checkpoint(all[k], const_region, &b, &x, 1, &y, 1), LOOM_OK);
        assert_int_equal(loom_sum(y, &loss), LOOM_OK);
        loom_status st = loom_backward(loss, 1.0f);
        if (all[k] == LOOM_RECOMPUTE_REENTRANT) {
            /* The reentrant region records itself (its inputs need a
             * gradient) and finds out in its replay that it adds none. */
            assert_int_equal(st, LOOM_OK);
        } else {
            assert_int_equal(st, LOOM_ERR_STATE);
            /* Nothing inside was recorded: the loss needs no gradient. */
            assert_non_null(strstr(loom_last_error(), "none of the tensors requires a gradient"));
        }
        assert_int_equal(loom_tape_size(), 0);
        assert_null(x->grad);
        loom_tensor_release(loss);
        loom_tensor_release(y);
        loom_tensor_release(x);
        loom_tensor_release(b.c);
    }
    mem_check_clean(act0);
}

/* -------------------------------------- 6. backward through a freed graph */

static void test_second_backward_is_an_error(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    const loom_recompute_mode all[4] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                        LOOM_RECOMPUTE_SELECTIVE};
    grad_set ref = {0};
    for (int k = 0; k < 4; k++) {
        loom_param *w = make_param("w", DIM, DIM, 60);
        counting_block b = {w, 0, 0, 0};
        loom_tensor *x = make_leaf(ROWS, DIM, 8, 1), *y = NULL;
        assert_int_equal(loom_checkpoint(all[k], counting_region, &b, &x, 1, &y, 1), LOOM_OK);
        loom_tensor *la = weighted_sum(y, 54), *lb = weighted_sum(y, 55);
        backward_ok(la);
        grad_set got = {0};
        gs_param(&got, w);
        gs_leaf(&got, "x", x);
        if (k == 0) ref = got;
        else {
            gs_expect_equal(&ref, &got, loom_recompute_mode_name(all[k]));
            gs_free(&got);
        }
        /* The first backward freed the whole graph, lb's part included. */
        assert_int_equal(loom_backward(la, 1.0f), LOOM_ERR_STATE);
        assert_non_null(strstr(loom_last_error(), "already freed"));
        assert_int_equal(loom_backward(lb, 1.0f), LOOM_ERR_STATE);
        assert_non_null(strstr(loom_last_error(), "already freed"));
        loom_tensor *g = make_leaf(ROWS, DIM, 9, 0);
        assert_int_equal(loom_backward_multi(&y, &g, 1), LOOM_ERR_STATE);
        assert_non_null(strstr(loom_last_error(), "already freed"));
        /* No second replay happened and the gradients are unchanged. */
        assert_int_equal(b.calls, all[k] == LOOM_RECOMPUTE_NONE ? 1 : 2);
        grad_set again = {0};
        gs_param(&again, w);
        gs_leaf(&again, "x", x);
        gs_expect_equal(&ref, &again, "after the failed second backward");
        gs_free(&again);
        loom_tensor_release(g);
        loom_tensor_release(la);
        loom_tensor_release(lb);
        loom_tensor_release(y);
        loom_tensor_release(x);
        loom_param_free(w);
    }
    gs_free(&ref);
    mem_check_clean(act0);
}

/* ---------------------------------------------------- 7. nested regions */

typedef struct inner_block {
    loom_param *w;
} inner_block;

typedef struct outer_block {
    loom_param *w;
    loom_recompute_mode inner_mode;
    inner_block inner;
} outer_block;

/* y = dropout(silu(x W^T)) * (x W^T) */
static loom_status inner_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    inner_block *b = user;
    loom_tensor *h = NULL, *s = NULL, *d = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &s);
    if (st == LOOM_OK) st = loom_dropout(s, 0.25f, &d);
    if (st == LOOM_OK) st = loom_mul(d, h, &out[0]);
    loom_tensor_release(h);
    loom_tensor_release(s);
    loom_tensor_release(d);
    return st;
}

/* a = silu(x W^T); y = inner(a) * a */
static loom_status outer_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    outer_block *b = user;
    loom_tensor *h = NULL, *a = NULL, *g = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &a);
    if (st == LOOM_OK) st = loom_checkpoint(b->inner_mode, inner_region, &b->inner, &a, 1, &g, 1);
    if (st == LOOM_OK) st = loom_mul(g, a, &out[0]);
    loom_tensor_release(h);
    loom_tensor_release(a);
    loom_tensor_release(g);
    return st;
}

static void run_nested(loom_recompute_mode outer, loom_recompute_mode inner, grad_set *gs) {
    loom_param *w1 = make_param("w_outer", DIM, DIM, 70), *w2 = make_param("w_inner", DIM, DIM, 71);
    outer_block b = {w1, inner, {w2}};
    loom_tensor *x = make_leaf(ROWS, DIM, 10, 1), *y = NULL;
    loom_rng_init(loom_rng_default(), 77);
    assert_int_equal(loom_checkpoint(outer, outer_region, &b, &x, 1, &y, 1), LOOM_OK);
    loom_tensor *loss = weighted_sum(y, 56);
    backward_ok(loss);
    gs_param(gs, w1);
    gs_param(gs, w2);
    gs_leaf(gs, "x", x);
    loom_param *ps[2] = {w1, w2};
    assert_int_equal(loom_grad_audit(ps, 2, NULL, 0), LOOM_OK);
    loom_tensor_release(loss);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_param_free(w1);
    loom_param_free(w2);
}

static void test_nested_regions(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    grad_set ref = {0};
    run_nested(LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_NONE, &ref);
    gs_expect_nonzero(&ref);
    /* Every (outer, inner) pair of the four modes; NONE/NONE is the reference. */
    for (int o = 0; o < 4; o++) {
        for (int i = 0; i < 4; i++) {
            if (!o && !i) continue;
            grad_set got = {0};
            char what[96];
            snprintf(what, sizeof what, "outer %s, inner %s", loom_recompute_mode_name((loom_recompute_mode)o),
                     loom_recompute_mode_name((loom_recompute_mode)i));
            run_nested((loom_recompute_mode)o, (loom_recompute_mode)i, &got);
            gs_expect_equal(&ref, &got, what);
            gs_free(&got);
        }
    }
    gs_free(&ref);
    mem_check_clean(act0);
}

/* -------------------------------------- 8. a parameter as a region input */

typedef struct param_input_block {
    loom_param *expect;
    int identity_ok; /* every call got the parameter's own tensor */
    int calls;
} param_input_block;

/* inputs {x, W}: y = silu(x W^T) * x */
static loom_status param_input_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    param_input_block *b = user;
    b->calls++;
    b->identity_ok &= in[1] == b->expect->tensor && loom_tensor_param(in[1]) == b->expect;
    loom_tensor *h = NULL, *s = NULL;
    loom_status st = loom_fused_linear(in[0], in[1], NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &s);
    if (st == LOOM_OK) st = loom_mul(s, in[0], &out[0]);
    loom_tensor_release(h);
    loom_tensor_release(s);
    return st;
}

static void run_param_input(loom_recompute_mode mode, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 80);
    param_input_block b = {w, 1, 0};
    loom_tensor *x = make_leaf(ROWS, DIM, 11, 1), *y = NULL;
    loom_tensor *in[2] = {x, w->tensor};
    assert_int_equal(loom_checkpoint(mode, param_input_region, &b, in, 2, &y, 1), LOOM_OK);
    loom_tensor *loss = weighted_sum(y, 57);
    backward_ok(loss);
    assert_true(b.identity_ok);
    assert_int_equal(b.calls, mode == LOOM_RECOMPUTE_NONE ? 1 : 2);
    /* The gradient reached the real parameter, exactly once. */
    assert_int_equal(w->uses, 1);
    assert_int_equal(w->contributions, 1);
    assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);
    collect_and_free(gs, w, x, y, loss);
}

static void test_parameter_as_region_input(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    expect_every_mode_matches(run_param_input);
    mem_check_clean(act0);
}

/* ------------------------- 9. a parameter used inside and outside a region */

static void run_shared_param(loom_recompute_mode mode, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 90);
    counting_block b = {w, 0, 0, 0};
    loom_tensor *x = make_leaf(ROWS, DIM, 12, 1), *y = NULL, *z = NULL;
    assert_int_equal(loom_checkpoint(mode, counting_region, &b, &x, 1, &y, 1), LOOM_OK);
    assert_int_equal(loom_fused_linear(y, w->tensor, NULL, &z), LOOM_OK); /* outside the region */
    /* Both uses are known before the backward begins, in every mode: the
     * overlapped data-parallel all-reduce starts w's bucket when its
     * contributions reach its uses, and the use after the region is
     * backpropagated first. */
    assert_int_equal(w->uses, 2);
    loom_tensor *loss = weighted_sum(z, 58);
    backward_ok(loss);
    assert_int_equal(w->uses, 2);
    assert_int_equal(w->contributions, 2);
    assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);
    gs_param(gs, w);
    gs_leaf(gs, "x", x);
    loom_tensor_release(loss);
    loom_tensor_release(y);
    loom_tensor_release(z);
    loom_tensor_release(x);
    loom_param_free(w);
}

static void test_parameter_inside_and_outside(void **state) {
    (void)state;
    expect_every_mode_matches(run_shared_param);
}

/* --------- 11. an activation used inside and outside a region; frozen */

typedef struct two_use_block {
    loom_tensor *a, *b; /* need no gradient */
} two_use_block;

/* in * a + in * b: the input has two uses inside. */
static loom_status two_use_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    two_use_block *u = user;
    loom_tensor *p = NULL, *q = NULL;
    loom_status st = loom_mul(in[0], u->a, &p);
    if (st == LOOM_OK) st = loom_mul(in[0], u->b, &q);
    if (st == LOOM_OK) st = loom_add(p, q, &out[0]);
    loom_tensor_release(p);
    loom_tensor_release(q);
    return st;
}

#define WIDE 512 /* rows: enough sums for a different order to round differently */

/* The region's input is a leaf x itself (through_node 0) or an op's output
 * h = x * c (1), and is used again after the region. Without recomputation
 * its gradient is the use after the region, then each use inside added in
 * turn; every mode must add in that order. */
static void run_used_outside(loom_recompute_mode mode, int through_node, grad_set *gs) {
    loom_tensor *x = make_leaf(WIDE, DIM, 21, 1), *c = make_leaf(WIDE, DIM, 22, 0);
    two_use_block u = {make_leaf(WIDE, DIM, 23, 0), make_leaf(WIDE, DIM, 24, 0)};
    loom_tensor *h = NULL, *y = NULL, *z = NULL;
    if (through_node) assert_int_equal(loom_mul(x, c, &h), LOOM_OK);
    else h = loom_tensor_retain(x);
    assert_int_equal(loom_checkpoint(mode, two_use_region, &u, &h, 1, &y, 1), LOOM_OK);
    assert_int_equal(loom_mul(h, c, &z), LOOM_OK);
    loom_tensor *loss = add_losses(weighted_sum(y, 25), weighted_sum(z, 26));
    backward_ok(loss);
    gs_leaf(gs, "x", x);
    loom_tensor *all[] = {x, c, u.a, u.b, h, y, z, loss};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) loom_tensor_release(all[i]);
}

static void test_input_used_inside_and_outside(void **state) {
    (void)state;
    for (int through_node = 0; through_node < 2; through_node++) {
        grad_set ref = {0};
        run_used_outside(LOOM_RECOMPUTE_NONE, through_node, &ref);
        gs_expect_nonzero(&ref);
        for (int k = 0; k < 3; k++) {
            grad_set got = {0};
            char what[64];
            snprintf(what, sizeof what, "%s, input %s", loom_recompute_mode_name(recompute_modes[k]),
                     through_node ? "an op's output" : "a leaf");
            run_used_outside(recompute_modes[k], through_node, &got);
            gs_expect_equal(&ref, &got, what);
            gs_free(&got);
        }
        gs_free(&ref);
    }
}

typedef struct frozen_block {
    loom_param *w;
} frozen_block;

static loom_status frozen_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    frozen_block *b = user;
    return loom_fused_linear(in[0], b->w->tensor, NULL, &out[0]);
}

/* A block of frozen weights on an input that needs no gradient (the lower
 * layers when fine-tuning the upper ones), beside a trainable path: every
 * mode completes, the trainable leaf gets its gradient, the frozen weight
 * none. */
static void run_frozen(loom_recompute_mode mode, grad_set *gs) {
    frozen_block b = {make_param("w", DIM, DIM, 31)};
    b.w->trainable = 0;
    loom_tensor *x = make_leaf(ROWS, DIM, 32, 0), *v = make_leaf(ROWS, DIM, 33, 1), *y = NULL, *vv = NULL;
    assert_int_equal(loom_checkpoint(mode, frozen_region, &b, &x, 1, &y, 1), LOOM_OK);
    assert_int_equal(loom_mul(v, v, &vv), LOOM_OK);
    loom_tensor *loss = add_losses(weighted_sum(y, 34), weighted_sum(vv, 35));
    backward_ok(loss);
    gs_leaf(gs, "v", v);
    assert_null(x->grad);
    assert_int_equal(b.w->grad_written, 0);
    loom_tensor *all[] = {x, v, y, vv, loss};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) loom_tensor_release(all[i]);
    loom_param_free(b.w);
}

static void test_frozen_block(void **state) {
    (void)state;
    expect_every_mode_matches(run_frozen);
}

/* ------------- 12. a branch the loss does not use is not kept by the replay */

/* u = silu(x), w = silu(u), out0 = silu(w); with a branch also
 * v = silu(x), out1 = silu(v). After the replay (at out0's backward) the
 * placeholder of u is still waiting, so the region lives on. */
static loom_status branch_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)user; (void)n_in;
    loom_tensor *u = NULL, *w = NULL, *v = NULL;
    loom_status st = loom_silu(in[0], &u);
    if (st == LOOM_OK) st = loom_silu(u, &w);
    if (st == LOOM_OK) st = loom_silu(w, &out[0]);
    if (st == LOOM_OK && n_out > 1) st = loom_silu(in[0], &v);
    if (st == LOOM_OK && n_out > 1) st = loom_silu(v, &out[1]);
    loom_tensor_release(u);
    loom_tensor_release(w);
    loom_tensor_release(v);
    return st;
}

#define HOOK_MAX 16
typedef struct act_trace {
    size_t bytes[HOOK_MAX];
    int n;
} act_trace;

static loom_status trace_hook(void *user) {
    act_trace *t = user;
    if (t->n < HOOK_MAX) t->bytes[t->n++] = act_bytes();
    return LOOM_OK;
}

/* Activation bytes after each node's backward, the loss on out0 only. */
static act_trace run_branch(loom_recompute_mode mode, int with_branch) {
    loom_tensor *x = make_leaf(WIDE, DIM, 41, 1), *out[2] = {NULL, NULL};
    assert_int_equal(loom_checkpoint(mode, branch_region, NULL, &x, 1, out, with_branch ? 2 : 1), LOOM_OK);
    loom_tensor_release(out[1]); /* the branch's output: nobody needs it */
    loom_tensor *loss = weighted_sum(out[0], 42);
    act_trace t = {{0}, 0};
    loom_set_backward_hook(trace_hook, &t);
    backward_ok(loss);
    loom_set_backward_hook(NULL, NULL);
    loom_tensor_release(loss);
    loom_tensor_release(out[0]);
    loom_tensor_release(x);
    return t;
}

/* The branch's node gets no gradient and goes (with its placeholder) before
 * the replay; the replay must not keep its saved tensor until the region
 * ends: after every node, the activations equal the run without the branch. */
static void test_unused_branch_not_kept(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    for (int k = 1; k < 3; k++) {
        act_trace plain = run_branch(recompute_modes[k], 0), branch = run_branch(recompute_modes[k], 1);
        assert_int_equal(plain.n, branch.n);
        for (int i = 0; i < plain.n; i++)
            if (plain.bytes[i] != branch.bytes[i])
                fail_msg("%s: after node %d, %zu activation bytes with the unused branch, %zu without",
                         loom_recompute_mode_name(recompute_modes[k]), i, branch.bytes[i], plain.bytes[i]);
    }
    mem_check_clean(act0);
}

/* ------------------- 10. several outputs, inputs that need no gradient */

typedef struct multi_block {
    loom_param *w;
} multi_block;

/* inputs {x, c (no gradient)}; outputs {silu(x W^T), x * c, silu(x W^T) + c} */
static loom_status multi_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    multi_block *b = user;
    loom_tensor *h = NULL;
    loom_status st = loom_fused_linear(in[0], b->w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &out[0]);
    if (st == LOOM_OK) st = loom_mul(in[0], in[1], &out[1]);
    if (st == LOOM_OK) st = loom_add(out[0], in[1], &out[2]);
    loom_tensor_release(h);
    return st;
}

static void run_multi(loom_recompute_mode mode, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 100);
    multi_block b = {w};
    loom_tensor *x = make_leaf(ROWS, DIM, 13, 1), *c = make_leaf(ROWS, DIM, 14, 0);
    loom_tensor *in[2] = {x, c}, *out[3] = {NULL, NULL, NULL};
    assert_int_equal(loom_checkpoint(mode, multi_region, &b, in, 2, out, 3), LOOM_OK);
    for (int i = 0; i < 3; i++) assert_true(loom_tensor_requires_grad(out[i]));
    loom_tensor *loss = add_losses(add_losses(weighted_sum(out[0], 59), weighted_sum(out[1], 60)),
                                   weighted_sum(out[2], 61));
    backward_ok(loss);
    assert_null(c->grad);
    assert_int_equal(loom_grad_audit(&w, 1, NULL, 0), LOOM_OK);
    gs_param(gs, w);
    gs_leaf(gs, "x", x);
    loom_tensor_release(loss);
    for (int i = 0; i < 3; i++) loom_tensor_release(out[i]);
    loom_tensor_release(x);
    loom_tensor_release(c);
    loom_param_free(w);
}

static void test_several_outputs_and_constant_inputs(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    expect_every_mode_matches(run_multi);
    mem_check_clean(act0);
}

/* ---------------------------------------------- 11. determinism check */

enum { FLAKY_SKIP_OP, FLAKY_OTHER_SHAPE, FLAKY_FEWER_OPS, FLAKY_N };

typedef struct flaky_block {
    int variant;
    int calls;
} flaky_block;

/* The first call runs y = silu(silu(x))^2; the second (the replay) does
 * something else: skips an op, sees x with another shape, or stops early. */
static loom_status flaky_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    flaky_block *b = user;
    int replay = ++b->calls > 1;
    loom_tensor *x = loom_tensor_retain(in[0]), *a = NULL, *s = NULL;
    if (replay && b->variant == FLAKY_OTHER_SHAPE) {
        loom_tensor_release(x);
        x = loom_tensor_view(in[0], 2, (const int64_t[]){in[0]->shape[1], in[0]->shape[0]});
    }
    loom_status st = loom_silu(x, &a);
    if (st == LOOM_OK) {
        if (replay && b->variant == FLAKY_SKIP_OP) s = loom_tensor_retain(a);
        else st = loom_silu(a, &s);
    }
    if (st == LOOM_OK) {
        if (replay && b->variant == FLAKY_FEWER_OPS) out[0] = loom_tensor_retain(s);
        else st = loom_mul(s, s, &out[0]);
    }
    loom_tensor_release(x);
    loom_tensor_release(a);
    loom_tensor_release(s);
    return st;
}

static void test_determinism_check(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    const loom_recompute_mode modes[2] = {LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    /* What each variant's message says was different. */
    const char *detail[FLAKY_N] = {
        "op 1 of the replay is mul, the forward ran silu",
        "saved tensor 0 is (8, 6) fp32 in the replay but was (6, 8) fp32 in the forward",
        "the replay ran 2 ops, the forward 3",
    };
    for (int k = 0; k < 2; k++) {
        for (int v = 0; v < FLAKY_N; v++) {
            flaky_block b = {v, 0};
            loom_tensor *x = make_leaf(ROWS, DIM, 15, 1), *y = NULL;
            assert_int_equal(loom_checkpoint(modes[k], flaky_region, &b, &x, 1, &y, 1), LOOM_OK);
            loom_tensor *loss = weighted_sum(y, 62);
            loom_status st = loom_backward(loss, 1.0f);
            if (st != LOOM_ERR_STATE || !strstr(loom_last_error(), "determinism check") ||
                !strstr(loom_last_error(), detail[v])) {
                fprintf(stderr, "%s, variant %d: status %d, message: %s\n", loom_recompute_mode_name(modes[k]), v,
                        (int)st, loom_last_error());
                fail();
            }
            assert_int_equal(b.calls, 2);
            assert_int_equal(loom_tape_size(), 0);
            loom_tensor_release(loss);
            loom_tensor_release(y);
            loom_tensor_release(x);
        }
    }
    /* The same region that behaves the same on replay passes. */
    flaky_block steady = {FLAKY_N, 0};
    loom_tensor *x = make_leaf(ROWS, DIM, 15, 1), *y = NULL;
    assert_int_equal(loom_checkpoint(LOOM_RECOMPUTE_NONREENTRANT, flaky_region, &steady, &x, 1, &y, 1), LOOM_OK);
    loom_tensor *loss = weighted_sum(y, 62);
    backward_ok(loss);
    loom_tensor_release(loss);
    loom_tensor_release(y);
    loom_tensor_release(x);
    mem_check_clean(act0);
}

/* ------------- 16. a tensor passed twice, or handed back by the region */

/* The region gets or returns the same tensor in two places, as a region
 * written for no recomputation may: without recomputation it is one tensor
 * and its gradient one sum, and every mode must sum the same terms in the
 * same order (reentrant used to give each slot its own leaf and gradient,
 * changing the order of the sums in the last bits). */
enum { ALIAS_INPUT_TWICE, ALIAS_INPUT_RETURNED, ALIAS_OUTPUT_TWICE };

typedef struct alias_block {
    int kind;
    loom_param *w1, *w2;
} alias_block;

static loom_status alias_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const alias_block *b = user;
    loom_tensor *a = NULL, *c = NULL;
    loom_status st = loom_matmul(in[0], b->w1->tensor, &a);
    if (st == LOOM_OK) st = loom_matmul(b->kind == ALIAS_INPUT_TWICE ? in[1] : in[0], b->w2->tensor, &c);
    if (st == LOOM_OK) st = loom_add(a, c, &out[0]);
    if (st == LOOM_OK && b->kind != ALIAS_INPUT_TWICE)
        out[1] = loom_tensor_retain(b->kind == ALIAS_INPUT_RETURNED ? in[0] : out[0]);
    loom_tensor_release(a);
    loom_tensor_release(c);
    return st;
}

static void run_alias(int kind, loom_recompute_mode mode, grad_set *gs) {
    loom_param *w0 = make_param("w0", DIM, DIM, 90), *w1 = make_param("w1", DIM, DIM, 91),
               *w2 = make_param("w2", DIM, DIM, 92);
    alias_block b = {kind, w1, w2};
    loom_tensor *x = make_leaf(ROWS, DIM, 16, 1), *h = NULL, *u = NULL, *out[2] = {NULL, NULL};
    assert_int_equal(loom_matmul(x, w0->tensor, &h), LOOM_OK);
    loom_tensor *in[2] = {h, h};
    int n_out = kind == ALIAS_INPUT_TWICE ? 1 : 2;
    assert_int_equal(loom_checkpoint(mode, alias_region, &b, in, kind == ALIAS_INPUT_TWICE ? 2 : 1, out, n_out),
                     LOOM_OK);
    if (kind == ALIAS_INPUT_RETURNED) assert_ptr_equal(out[1], h);      /* as without recomputation */
    if (kind == ALIAS_OUTPUT_TWICE) assert_ptr_equal(out[1], out[0]);
    assert_int_equal(loom_scale(h, 0.7f, &u), LOOM_OK); /* h used after the region too */
    loom_tensor *loss = add_losses(weighted_sum(out[0], 63), weighted_sum(u, 64));
    if (n_out == 2) loss = add_losses(loss, weighted_sum(out[1], 65));
    backward_ok(loss);
    gs_param(gs, w0);
    gs_param(gs, w1);
    gs_param(gs, w2);
    gs_leaf(gs, "x", x);
    loom_tensor_release(loss);
    for (int i = 0; i < n_out; i++) loom_tensor_release(out[i]);
    loom_tensor_release(u);
    loom_tensor_release(h);
    loom_tensor_release(x);
    loom_param_free(w0);
    loom_param_free(w1);
    loom_param_free(w2);
}

static void run_input_twice(loom_recompute_mode m, grad_set *gs) { run_alias(ALIAS_INPUT_TWICE, m, gs); }
static void run_input_returned(loom_recompute_mode m, grad_set *gs) { run_alias(ALIAS_INPUT_RETURNED, m, gs); }
static void run_output_twice(loom_recompute_mode m, grad_set *gs) { run_alias(ALIAS_OUTPUT_TWICE, m, gs); }

static void test_aliased_inputs_and_outputs(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    expect_every_mode_matches(run_input_twice);
    expect_every_mode_matches(run_input_returned);
    expect_every_mode_matches(run_output_twice);
    mem_check_clean(act0);
}

/* ---------------------------- 17. reentrant regions nested very deep */

/* A region that runs a reentrant region inside itself, `depth` levels:
 * each level replays onto its own tape in backward. Past the engine's
 * tapes the backward fails with an error naming the limit (it used to
 * abort the process); at a depth that fits, the gradients are those of the
 * run without recomputation. */
typedef struct deep_block {
    loom_param *w;
    int depth;
    loom_recompute_mode mode;
} deep_block;

static loom_status deep_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    deep_block *b = user;
    loom_tensor *h = NULL;
    loom_status st = loom_matmul(in[0], b->w->tensor, &h);
    if (st != LOOM_OK || b->depth == 0) {
        if (st == LOOM_OK) st = loom_silu(h, &out[0]);
        loom_tensor_release(h);
        return st;
    }
    st = loom_checkpoint(b->mode, deep_region, b + 1, &h, 1, out, 1); /* b + 1: one level down */
    loom_tensor_release(h);
    return st;
}

static loom_status run_deep(loom_recompute_mode mode, int depth, grad_set *gs) {
    loom_param *w = make_param("w", DIM, DIM, 95);
    deep_block b[64]; /* a replay calls the region again: its user data lives until backward */
    assert_true(depth < 64);
    for (int i = 0; i <= depth; i++) b[i] = (deep_block){w, depth - i, mode};
    loom_tensor *x = make_leaf(ROWS, DIM, 17, 1), *y = NULL;
    assert_int_equal(loom_checkpoint(mode, deep_region, b, &x, 1, &y, 1), LOOM_OK);
    loom_tensor *loss = weighted_sum(y, 66);
    loom_status st = loom_backward(loss, 1.0f);
    assert_int_equal(loom_tape_size(), 0);
    collect_and_free(gs, w, x, y, loss);
    return st;
}

static void test_deep_nesting(void **state) {
    (void)state;
    size_t act0 = act_bytes();
    grad_set ref = {0}, got = {0};
    assert_int_equal(run_deep(LOOM_RECOMPUTE_NONE, 12, &ref), LOOM_OK);
    assert_int_equal(run_deep(LOOM_RECOMPUTE_REENTRANT, 12, &got), LOOM_OK);
    gs_expect_equal(&ref, &got, "reentrant, 13 levels");
    gs_free(&got);
    loom_status st = run_deep(LOOM_RECOMPUTE_REENTRANT, 40, &got);
    if (st != LOOM_ERR_UNSUPPORTED) fprintf(stderr, "41 levels: %d %s\n", (int)st, loom_last_error());
    assert_int_equal(st, LOOM_ERR_UNSUPPORTED);
    assert_non_null(strstr(loom_last_error(), "nest more than"));
    gs_free(&got);
    gs_free(&ref);
    mem_check_clean(act0);
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_once_replay_once),
        cmocka_unit_test(test_replay_time_is_measured),
        cmocka_unit_test(test_nothing_to_recompute),
        cmocka_unit_test(test_dropout_rng_replay),
        cmocka_unit_test(test_dead_op_drawing_random_numbers),
        cmocka_unit_test(test_kept_op_drawing_random_numbers),
        cmocka_unit_test(test_dead_op_rule_guards),
        cmocka_unit_test(test_null_and_non_tensor_arguments),
        cmocka_unit_test(test_partial_gradients),
        cmocka_unit_test(test_outputs_need_no_gradient),
        cmocka_unit_test(test_second_backward_is_an_error),
        cmocka_unit_test(test_nested_regions),
        cmocka_unit_test(test_parameter_as_region_input),
        cmocka_unit_test(test_parameter_inside_and_outside),
        cmocka_unit_test(test_several_outputs_and_constant_inputs),
        cmocka_unit_test(test_input_used_inside_and_outside),
        cmocka_unit_test(test_frozen_block),
        cmocka_unit_test(test_unused_branch_not_kept),
        cmocka_unit_test(test_determinism_check),
        cmocka_unit_test(test_aliased_inputs_and_outputs),
        cmocka_unit_test(test_deep_nesting),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
