/*
 * test_status.c — loom_error / loom_last_error / LOOM_TRY / status names.
 */
#include "testutil.h"

#include <omp.h>
#include <string.h>

static void test_error_sets_message(void **state) {
    (void)state;
    loom_clear_error();
    assert_string_equal(loom_last_error(), "");
    loom_status st = loom_error(LOOM_ERR_INVALID, "bad shape %d x %d (%s)", 3, 4, "rows");
    assert_int_equal(st, LOOM_ERR_INVALID);
    assert_string_equal(loom_last_error(), "bad shape 3 x 4 (rows)");
    /* The next failure replaces the message. */
    assert_int_equal(loom_error(LOOM_ERR_IO, "cannot open '%s'", "x.bin"), LOOM_ERR_IO);
    assert_string_equal(loom_last_error(), "cannot open 'x.bin'");
    loom_clear_error();
    assert_string_equal(loom_last_error(), "");
}

static void test_error_returns_every_status(void **state) {
    (void)state;
    for (int s = LOOM_OK; s <= LOOM_ERR_DIST; s++) {
        assert_int_equal(loom_error((loom_status)s, "status %d", s), s);
        char want[32];
        snprintf(want, sizeof want, "status %d", s);
        assert_string_equal(loom_last_error(), want);
    }
}

/* A message longer than the buffer is truncated, never overflowed. */
static void test_error_long_message(void **state) {
    (void)state;
    char big[40000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    assert_int_equal(loom_error(LOOM_ERR_FORMAT, "%s", big), LOOM_ERR_FORMAT);
    size_t len = strlen(loom_last_error());
    assert_true(len > 100 && len < sizeof big - 1);
    for (size_t i = 0; i < len; i++) assert_true(loom_last_error()[i] == 'a');
}

/* Adding context to the current message: the argument is the message
 * buffer itself. */
static void test_error_wraps_previous_message(void **state) {
    (void)state;
    loom_error(LOOM_ERR_IO, "cannot read 'weights.bin'");
    assert_int_equal(loom_error(LOOM_ERR_IO, "loading checkpoint: %s", loom_last_error()),
                     LOOM_ERR_IO);
    assert_string_equal(loom_last_error(), "loading checkpoint: cannot read 'weights.bin'");
    loom_error(LOOM_ERR_FORMAT, "%s (and more)", loom_last_error());
    assert_string_equal(loom_last_error(),
                        "loading checkpoint: cannot read 'weights.bin' (and more)");
}

/* The message is per thread. */
static void test_error_thread_local(void **state) {
    (void)state;
    loom_error(LOOM_ERR_STATE, "main thread");
    int other_ok = 1;
    #pragma omp parallel num_threads(2)
    {
        if (omp_get_thread_num() == 1) {
            if (strcmp(loom_last_error(), "") != 0) other_ok = 0;
            loom_error(LOOM_ERR_DIST, "worker thread");
            if (strcmp(loom_last_error(), "worker thread") != 0) other_ok = 0;
        }
    }
    assert_true(other_ok);
    assert_string_equal(loom_last_error(), "main thread");
}

static loom_status fails_with(loom_status st, int *reached) {
    if (st != LOOM_OK) return loom_error(st, "inner failure %d", (int)st);
    *reached += 1;
    return LOOM_OK;
}

static loom_status outer(loom_status inner_st, int *reached, int *after) {
    LOOM_TRY(fails_with(inner_st, reached));
    *after += 1;
    LOOM_TRY(fails_with(LOOM_OK, reached));
    return LOOM_OK;
}

static void test_try_propagates(void **state) {
    (void)state;
    int reached = 0, after = 0;
    assert_int_equal(outer(LOOM_OK, &reached, &after), LOOM_OK);
    assert_int_equal(reached, 2);
    assert_int_equal(after, 1);
    for (int s = LOOM_ERR_INVALID; s <= LOOM_ERR_DIST; s++) {
        reached = after = 0;
        assert_int_equal(outer((loom_status)s, &reached, &after), s);
        assert_int_equal(reached, 0);
        assert_int_equal(after, 0); /* returned before the next statement */
        char want[32];
        snprintf(want, sizeof want, "inner failure %d", s);
        assert_string_equal(loom_last_error(), want);
    }
}

/* LOOM_TRY evaluates its argument exactly once and works as an if body. */
static int n_calls;
static loom_status counted(loom_status st) { n_calls++; return st; }
static loom_status try_once(loom_status st) {
    if (1) LOOM_TRY(counted(st));
    else return LOOM_ERR_STATE;
    return LOOM_OK;
}

static void test_try_evaluates_once(void **state) {
    (void)state;
    n_calls = 0;
    assert_int_equal(try_once(LOOM_ERR_NUMERIC), LOOM_ERR_NUMERIC);
    assert_int_equal(n_calls, 1);
    n_calls = 0;
    assert_int_equal(try_once(LOOM_OK), LOOM_OK);
    assert_int_equal(n_calls, 1);
}

static void test_status_names(void **state) {
    (void)state;
    static const struct { loom_status st; const char *name; } names[] = {
        {LOOM_OK, "ok"},
        {LOOM_ERR_INVALID, "invalid argument"},
        {LOOM_ERR_NOMEM, "out of memory"},
        {LOOM_ERR_IO, "I/O error"},
        {LOOM_ERR_FORMAT, "bad file format"},
        {LOOM_ERR_STATE, "invalid state"},
        {LOOM_ERR_NUMERIC, "non-finite value"},
        {LOOM_ERR_UNSUPPORTED, "unsupported"},
        {LOOM_ERR_DIST, "distributed error"},
    };
    assert_int_equal(sizeof names / sizeof names[0], LOOM_ERR_DIST + 1);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        assert_string_equal(loom_status_name(names[i].st), names[i].name);
        /* Names are distinct. */
        for (size_t j = 0; j < i; j++)
            assert_string_not_equal(loom_status_name(names[i].st), loom_status_name(names[j].st));
    }
    assert_string_equal(loom_status_name((loom_status)(LOOM_ERR_DIST + 1)), "unknown status");
    assert_string_equal(loom_status_name((loom_status)-1), "unknown status");
    assert_string_equal(loom_status_name((loom_status)1000), "unknown status");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_sets_message),
        cmocka_unit_test(test_error_returns_every_status),
        cmocka_unit_test(test_error_long_message),
        cmocka_unit_test(test_error_wraps_previous_message),
        cmocka_unit_test(test_error_thread_local),
        cmocka_unit_test(test_try_propagates),
        cmocka_unit_test(test_try_evaluates_once),
        cmocka_unit_test(test_status_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
