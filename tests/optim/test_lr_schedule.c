/*
 * test_lr_schedule.c — the learning-rate schedules at chosen steps, against
 * values worked out by hand from their definitions (include/loom/optim.h):
 * the warmup, the cosine, the linear decay, the constant, and
 * warmup-stable-decay with its decay window, including the edges (a window
 * of every step after warmup is the linear schedule; an empty one never
 * decays before the end).
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

#define NEAR(a, b) assert_true(fabsf((a) - (b)) <= 1e-6f * fmaxf(1.0f, fabsf(b)))

static void test_warmup_and_ends(void **state) {
    (void)state;
    const loom_lr_schedule all[4] = {LOOM_LR_COSINE, LOOM_LR_LINEAR, LOOM_LR_CONSTANT, LOOM_LR_WSD};
    for (int k = 0; k < 4; k++) {
        /* warmup 10 to 2.0: step s gives 2 (s + 1) / 10 */
        NEAR(loom_lr_at(all[k], 0, 10, 100, 2.0f, 0.5f, 0.2f), 0.2f);
        NEAR(loom_lr_at(all[k], 4, 10, 100, 2.0f, 0.5f, 0.2f), 1.0f);
        NEAR(loom_lr_at(all[k], 9, 10, 100, 2.0f, 0.5f, 0.2f), 2.0f);
        /* right after warmup every schedule is at its peak */
        NEAR(loom_lr_at(all[k], 10, 10, 100, 2.0f, 0.5f, 0.2f), 2.0f);
        /* from `total` on: min_lr, or the peak for constant */
        float end = all[k] == LOOM_LR_CONSTANT ? 2.0f : 0.5f;
        NEAR(loom_lr_at(all[k], 100, 10, 100, 2.0f, 0.5f, 0.2f), end);
        NEAR(loom_lr_at(all[k], 250, 10, 100, 2.0f, 0.5f, 0.2f), end);
    }
}

static void test_decays(void **state) {
    (void)state;
    /* warmup 10, total 110: the decay runs over steps 10 .. 110 (100 steps) */
    NEAR(loom_lr_at(LOOM_LR_COSINE, 60, 10, 110, 1.0f, 0.0f, 0.2f), 0.5f);      /* (1 + cos(pi/2)) / 2 */
    NEAR(loom_lr_at(LOOM_LR_COSINE, 35, 10, 110, 1.0f, 0.0f, 0.2f), 0.853553f); /* (1 + cos(pi/4)) / 2 */
    NEAR(loom_lr_at(LOOM_LR_LINEAR, 60, 10, 110, 1.0f, 0.0f, 0.2f), 0.5f);
    NEAR(loom_lr_at(LOOM_LR_LINEAR, 35, 10, 110, 1.0f, 0.0f, 0.2f), 0.75f);
    NEAR(loom_lr_at(LOOM_LR_LINEAR, 35, 10, 110, 1.0f, 0.2f, 0.2f), 0.8f);      /* 1 - 0.25 * 0.8 */
    NEAR(loom_lr_at(LOOM_LR_CONSTANT, 60, 10, 110, 1.0f, 0.0f, 0.2f), 1.0f);
    /* wsd, total 100, 20% decay: stable through step 79, then the 20 steps
     * 80 .. 99 step down to min_lr, reaching it at the last */
    NEAR(loom_lr_at(LOOM_LR_WSD, 50, 10, 100, 1.0f, 0.1f, 0.2), 1.0f);
    NEAR(loom_lr_at(LOOM_LR_WSD, 79, 10, 100, 1.0f, 0.1f, 0.2), 1.0f);
    NEAR(loom_lr_at(LOOM_LR_WSD, 80, 10, 100, 1.0f, 0.1f, 0.2), 0.955f);      /* 1 - 1/20 * 0.9 */
    NEAR(loom_lr_at(LOOM_LR_WSD, 85, 10, 100, 1.0f, 0.1f, 0.2), 0.73f);       /* 1 - 6/20 * 0.9 */
    NEAR(loom_lr_at(LOOM_LR_WSD, 99, 10, 100, 1.0f, 0.1f, 0.2), 0.1f);
    /* a window of 7.5% of 100 steps rounds (half up) to 8: steps 92 .. 99 */
    NEAR(loom_lr_at(LOOM_LR_WSD, 91, 10, 100, 1.0f, 0.0f, 0.075), 1.0f);
    NEAR(loom_lr_at(LOOM_LR_WSD, 96, 10, 100, 1.0f, 0.0f, 0.075), 0.375f);    /* 1 - 5/8 */
    /* 35% of 10 steps is 3.5 (3.4999999999999996 in binary): 4 steps, 6 .. 9 */
    NEAR(loom_lr_at(LOOM_LR_WSD, 5, 0, 10, 1.0f, 0.0f, 0.35), 1.0f);
    NEAR(loom_lr_at(LOOM_LR_WSD, 6, 0, 10, 1.0f, 0.0f, 0.35), 0.75f);
    /* the whole run as the window: it cannot start before warmup ends, and is
     * then the linear schedule one step ahead */
    for (int s = 10; s < 109; s++)
        NEAR(loom_lr_at(LOOM_LR_WSD, s, 10, 110, 1.0f, 0.1f, 1.0),
             loom_lr_at(LOOM_LR_LINEAR, s + 1, 10, 110, 1.0f, 0.1f, 1.0));
    NEAR(loom_lr_at(LOOM_LR_WSD, 109, 10, 110, 1.0f, 0.1f, 1.0), 0.1f);
    /* a window that rounds to no step still has one: the last step is at min */
    NEAR(loom_lr_at(LOOM_LR_WSD, 98, 10, 100, 1.0f, 0.1f, 0.001), 1.0f);
    NEAR(loom_lr_at(LOOM_LR_WSD, 99, 10, 100, 1.0f, 0.1f, 0.001), 0.1f);
    /* the cosine schedule is loom_lr_cosine */
    for (int s = 0; s < 120; s++)
        assert_true(loom_lr_at(LOOM_LR_COSINE, s, 7, 110, 3e-3f, 1e-4f, 0.2f) ==
                    loom_lr_cosine(s, 7, 110, 3e-3f, 1e-4f));
}

static void test_names(void **state) {
    (void)state;
    const char *names[4] = {"cosine", "linear", "constant", "wsd"};
    for (int k = 0; k < 4; k++) {
        loom_lr_schedule s;
        assert_int_equal(loom_lr_schedule_parse(names[k], &s), LOOM_OK);
        assert_string_equal(loom_lr_schedule_name(s), names[k]);
    }
    loom_lr_schedule s;
    assert_int_equal(loom_lr_schedule_parse("step", &s), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "cosine, linear, constant or wsd"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_warmup_and_ends),
        cmocka_unit_test(test_decays),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
