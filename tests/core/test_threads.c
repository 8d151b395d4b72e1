/*
 * test_threads.c — loom_set_threads / loom_get_threads and the default
 * (OMP_NUM_THREADS when it is a positive number, else the number of cores).
 */
#include "testutil.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

static char saved_env[64];
static int had_env;

static int setup(void **state) {
    (void)state;
    const char *e = getenv("OMP_NUM_THREADS");
    had_env = e != NULL;
    if (e) snprintf(saved_env, sizeof saved_env, "%s", e);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    if (had_env) setenv("OMP_NUM_THREADS", saved_env, 1);
    else unsetenv("OMP_NUM_THREADS");
    loom_set_threads(0);
    return 0;
}

/* The default as documented, computed here from the environment. */
static int expected_default(void) {
    const char *e = getenv("OMP_NUM_THREADS");
    int n = e && atoi(e) > 0 ? atoi(e) : omp_get_num_procs();
    return n < LOOM_MAX_THREADS ? n : LOOM_MAX_THREADS;
}

static int threads_in_region(void) {
    int n = 0;
    #pragma omp parallel
    {
        #pragma omp single
        n = omp_get_num_threads();
    }
    return n;
}

static void test_set_one(void **state) {
    (void)state;
    loom_set_threads(1);
    assert_int_equal(loom_get_threads(), 1);
    assert_int_equal(threads_in_region(), 1);
}

static void test_set_several(void **state) {
    (void)state;
    for (int n = 1; n <= 4; n++) {
        loom_set_threads(n);
        assert_int_equal(loom_get_threads(), n);
        assert_int_equal(threads_in_region(), n);
    }
}

static void test_zero_restores_default(void **state) {
    (void)state;
    loom_set_threads(1);
    loom_set_threads(0);
    assert_int_equal(loom_get_threads(), expected_default());
    loom_set_threads(3);
    loom_set_threads(-7); /* any n <= 0 */
    assert_int_equal(loom_get_threads(), expected_default());
}

/* The default follows OMP_NUM_THREADS, and ignores values that are not a
 * positive number. */
static void test_default_from_env(void **state) {
    (void)state;
    setenv("OMP_NUM_THREADS", "3", 1);
    loom_set_threads(1);
    loom_set_threads(0);
    assert_int_equal(loom_get_threads(), 3);
    assert_int_equal(threads_in_region(), 3);

    const char *bad[] = {"0", "-2", "abc", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("OMP_NUM_THREADS", bad[i], 1);
        loom_set_threads(1);
        loom_set_threads(0);
        assert_int_equal(loom_get_threads(), omp_get_num_procs());
    }
    unsetenv("OMP_NUM_THREADS");
    loom_set_threads(1);
    loom_set_threads(0);
    assert_int_equal(loom_get_threads(), omp_get_num_procs());
}

/* More threads than LOOM_MAX_THREADS, asked for or from the environment,
 * are clamped: the OpenMP runtime crashes building a team of 99999. */
static void test_too_many_clamped(void **state) {
    (void)state;
    loom_set_threads(99999);
    assert_int_equal(loom_get_threads(), LOOM_MAX_THREADS);
    loom_set_threads(LOOM_MAX_THREADS);
    assert_int_equal(loom_get_threads(), LOOM_MAX_THREADS);
    setenv("OMP_NUM_THREADS", "99999", 1);
    loom_set_threads(1);
    loom_set_threads(0);
    assert_int_equal(loom_get_threads(), LOOM_MAX_THREADS);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_set_one, setup, teardown),
        cmocka_unit_test_setup_teardown(test_set_several, setup, teardown),
        cmocka_unit_test_setup_teardown(test_zero_restores_default, setup, teardown),
        cmocka_unit_test_setup_teardown(test_default_from_env, setup, teardown),
        cmocka_unit_test_setup_teardown(test_too_many_clamped, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
