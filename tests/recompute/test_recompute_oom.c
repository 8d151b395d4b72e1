/*
 * test_recompute_oom.c — running out of memory anywhere in a step with
 * recompute regions is an error, never an abort, a leak or a broken engine.
 *
 * The test binary is linked with -Wl,--wrap for malloc, calloc, realloc and
 * aligned_alloc (tests/CMakeLists.txt), so every allocation loom makes
 * passes through here and the n-th one can be made to fail. For nested
 * regions in every pairing of modes (a reentrant region's replay runs the
 * inner region's recording during backward), and for each phase of a step
 * (forward, backward), a clean run counts the allocations; then, in a child
 * process per n, the n-th one fails. The step must return an error (or
 * LOOM_OK where loom has a way around, such as running a skipped op after
 * all), leave no activation bytes once its tensors are released and the
 * tape cleared, and the next step must give the clean run's gradients bit
 * for bit. A child killed by a signal (loom_panic's abort) fails the test.
 */
#include "testutil.h"

#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "loom/loom.h"

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);

static long fail_at = -1; /* the allocation (counted from 0) that fails; -1: none */
static long n_allocs;     /* allocations since counting started */
static int counting;

static int fails_now(void) { return counting && n_allocs++ == fail_at; }
void *__wrap_malloc(size_t n) { return fails_now() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t size) { return fails_now() ? NULL : __real_calloc(n, size); }
void *__wrap_realloc(void *p, size_t n) { return fails_now() ? NULL : __real_realloc(p, n); }
void *__wrap_aligned_alloc(size_t align, size_t n) { return fails_now() ? NULL : __real_aligned_alloc(align, n); }

#define ROWS 6
#define DIM 8

static loom_param *w[3];
static loom_recompute_mode inner_mode;

/* inner: silu(in W2^T) * in */
static loom_status inner(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)user; (void)n_in; (void)n_out;
    loom_tensor *a = NULL, *b = NULL;
    loom_status st = loom_fused_linear(in[0], w[2]->tensor, NULL, &a);
    if (st == LOOM_OK) st = loom_silu(a, &b);
    if (st == LOOM_OK) st = loom_mul(b, in[0], &out[0]);
    loom_tensor_release(a);
    loom_tensor_release(b);
    return st;
}

/* outer: dropout(inner(silu(in W1^T))), the inner region in inner_mode */
static loom_status outer(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)user; (void)n_in; (void)n_out;
    loom_tensor *a = NULL, *b = NULL, *c = NULL;
    loom_status st = loom_fused_linear(in[0], w[1]->tensor, NULL, &a);
    if (st == LOOM_OK) st = loom_silu(a, &b);
    if (st == LOOM_OK) st = loom_checkpoint(inner_mode, inner, NULL, &b, 1, &c, 1);
    if (st == LOOM_OK) st = loom_dropout(c, 0.2f, &out[0]);
    loom_tensor_release(a);
    loom_tensor_release(b);
    loom_tensor_release(c);
    return st;
}

enum { PHASE_FORWARD, PHASE_BACKWARD };

/* One step: loss = sum(outer(x W0^T) * R); allocation fail_at of `phase`
 * fails. The gradient of w0 goes to g0 when the step succeeds. */
static loom_status step(loom_recompute_mode mode, int phase, float *g0) {
    for (int i = 0; i < 3; i++) loom_param_zero_grad(w[i]);
    loom_rng_init(loom_rng_default(), 4242);
    float xv[ROWS * DIM], rv[ROWS * DIM];
    tu_fill_uniform(xv, ROWS * DIM, -1.0f, 1.0f, 11);
    tu_fill_uniform(rv, ROWS * DIM, -1.0f, 1.0f, 12);
    const int64_t shape[2] = {ROWS, DIM};
    loom_tensor *x = loom_tensor_from_f32(xv, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS);
    loom_tensor *r = loom_tensor_from_f32(rv, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS);
    assert_non_null(x);
    assert_non_null(r);
    assert_int_equal(loom_tensor_set_requires_grad(x, 1), LOOM_OK);
    loom_tensor *h = NULL, *y = NULL, *p = NULL, *loss = NULL;
    n_allocs = 0;
    counting = phase == PHASE_FORWARD;
    loom_status st = loom_matmul(x, w[0]->tensor, &h);
    if (st == LOOM_OK) st = loom_checkpoint(mode, outer, NULL, &h, 1, &y, 1);
    if (st == LOOM_OK) st = loom_mul(y, r, &p);
    if (st == LOOM_OK) st = loom_sum(p, &loss);
    counting = phase == PHASE_BACKWARD;
    if (st == LOOM_OK) st = loom_backward(loss, 1.0f);
    counting = 0;
    if (st == LOOM_OK && g0) loom_param_read_grad(w[0], g0);
    loom_tensor_release(loss);
    loom_tensor_release(p);
    loom_tensor_release(y);
    loom_tensor_release(h);
    loom_tensor_release(r);
    loom_tensor_release(x);
    return st;
}

static size_t activation_bytes(void) {
    loom_mem_stats ms;
    loom_mem_get_stats(&ms);
    return ms.current[LOOM_MEM_ACTIVATIONS];
}

/* In a child: the step with allocation n failing, then the checks. Exit
 * 0: all good; 1: activation bytes left; 2: the next step failed; 3: the
 * next step's gradient differs; 4: a failed backward left its tape. */
static int child(loom_recompute_mode mode, int phase, long n, const float *ref) {
    fail_at = n;
    loom_status st = step(mode, phase, NULL);
    fail_at = -1;
    if (st != LOOM_OK && phase == PHASE_BACKWARD && loom_tape_size() != 0) return 4;
    if (st != LOOM_OK) loom_tape_clear(); /* a failed forward leaves its recorded ops to the caller */
    if (activation_bytes() != 0) return 1;
    float g[DIM * DIM];
    if (step(mode, phase, g) != LOOM_OK) return 2;
    return memcmp(g, ref, sizeof g) ? 3 : 0;
}

static void check_every_allocation(loom_recompute_mode mode, loom_recompute_mode in_mode, int phase) {
    inner_mode = in_mode;
    float ref[DIM * DIM];
    fail_at = -1;
    assert_int_equal(step(mode, phase, ref), LOOM_OK);
    long total = n_allocs;
    assert_true(total > 0);
    for (long n = 0; n < total; n++) {
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) _exit(child(mode, phase, n, ref));
        int ws = 0;
        assert_int_equal(waitpid(pid, &ws, 0), pid);
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
            static const char *why[] = {"", "activation bytes left", "the next step failed",
                                        "the next step's gradient differs", "a failed backward left its tape"};
            fprintf(stderr, "outer %s, inner %s, %s: allocation %ld of %ld failing: %s\n",
                    loom_recompute_mode_name(mode), loom_recompute_mode_name(in_mode),
                    phase == PHASE_FORWARD ? "forward" : "backward", n, total,
                    WIFSIGNALED(ws) ? "killed by a signal (abort?)"
                    : WEXITSTATUS(ws) < 5 ? why[WEXITSTATUS(ws)] : "?");
            fail();
        }
    }
}

static const loom_recompute_mode pairs[][2] = {
    {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_NONE},
    {LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_NONE},
    {LOOM_RECOMPUTE_SELECTIVE, LOOM_RECOMPUTE_NONE},
    {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONE},
    {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT},
    {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_SELECTIVE},
    {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_REENTRANT},
    {LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_REENTRANT},
};

static void test_forward(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        check_every_allocation(pairs[i][0], pairs[i][1], PHASE_FORWARD);
}

static void test_backward(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        check_every_allocation(pairs[i][0], pairs[i][1], PHASE_BACKWARD);
}

/* AdamW with gradients in bf16 (master-grad off) widens them into a
 * scratch: when that allocation fails the step is not taken at all (it
 * used to move the parameters before the failing one and count the step). */
static void test_adamw_all_or_nothing(void **state) {
    (void)state;
    loom_param *p[2]; /* the second the larger: the scratch is sized for it */
    float v[DIM * (DIM + 8)];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(loom_param_new(i ? "b" : "a", LOOM_BF16, 2, (const int64_t[]){DIM, DIM + 8 * i}, 0, &p[i]),
                         LOOM_OK);
        tu_fill_uniform(v, (size_t)loom_param_numel(p[i]), -0.5f, 0.5f, 30 + (uint64_t)i);
        assert_int_equal(loom_param_set_f32(p[i], v, loom_param_numel(p[i])), LOOM_OK);
    }
    assert_int_equal(p[0]->grad_dtype, LOOM_BF16);
    loom_adamw_config cfg = loom_adamw_defaults();
    loom_adamw *opt;
    assert_int_equal(loom_adamw_new(&cfg, p, 2, &opt), LOOM_OK);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        for (int i = 0; i < 2; i++) {
            tu_fill_uniform(v, (size_t)loom_param_numel(p[i]), -1.0f, 1.0f, 40 + (uint64_t)i);
            loom_convert(p[i]->grad, LOOM_BF16, v, LOOM_F32, (size_t)loom_param_numel(p[i]));
        }
        float before[2][DIM * (DIM + 8)];
        for (int i = 0; i < 2; i++)
            memcpy(before[i], loom_param_master(p[i]), (size_t)loom_param_numel(p[i]) * sizeof(float));
        loom_mem_trim(); /* the scratch must come from the system, not loom's cache */
        n_allocs = 0;
        fail_at = 0;
        counting = 1;
        loom_status st = loom_adamw_step(opt, 1e-2f, 1.0f);
        counting = 0;
        fail_at = -1;
        int moved = 0;
        for (int i = 0; i < 2; i++)
            moved |= memcmp(before[i], loom_param_master(p[i]), (size_t)loom_param_numel(p[i]) * sizeof(float)) != 0;
        if (st != LOOM_ERR_NOMEM || moved || loom_adamw_steps(opt) != 0) _exit(1);
        if (loom_adamw_step(opt, 1e-2f, 1.0f) != LOOM_OK || loom_adamw_steps(opt) != 1) _exit(2);
        _exit(0);
    }
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
        fprintf(stderr, "adamw: %s\n", !WIFEXITED(ws) ? "killed by a signal"
                                       : WEXITSTATUS(ws) == 1 ? "a failed step moved parameters or counted"
                                                              : "the next step failed");
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    loom_adamw_free(opt);
    for (int i = 0; i < 2; i++) loom_param_free(p[i]);
}

int main(void) {
    loom_set_threads(1);
    for (int i = 0; i < 3; i++) {
        char name[8];
        snprintf(name, sizeof name, "w%d", i);
        assert_int_equal(loom_param_new(name, LOOM_F32, 2, (const int64_t[]){DIM, DIM}, 1, &w[i]), LOOM_OK);
        float v[DIM * DIM];
        tu_fill_uniform(v, DIM * DIM, -0.5f, 0.5f, 20 + (uint64_t)i);
        assert_int_equal(loom_param_set_f32(w[i], v, DIM * DIM), LOOM_OK);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward),
        cmocka_unit_test(test_backward),
        cmocka_unit_test(test_adamw_all_or_nothing),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < 3; i++) loom_param_free(w[i]);
    return rc;
}
