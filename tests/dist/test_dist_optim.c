/*
 * test_dist_optim.c — the data-parallel optimizer's found-inf rule. Run
 * alone it checks one process; tests/scripts/test_mpi.sh also runs it under
 * `mpirun -np 2`, where the gradients of the two ranks are summed.
 *
 * Each rank's fp16 gradient is 40000 (finite). Summed over 2 ranks that is
 * 80000: finite in the fp32 reduction buffer, +Inf once rounded back to
 * fp16 for the optimizer. The step must be reported (found_inf) and
 * skipped, never applied: an applied step would make the masters NaN. With
 * ZeRO-1 the optimizer updates from the fp32 sum, which is fine.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>

#include "loom/loom.h"

#define N 64

static loom_dist dist;

static void run_case(int zero) {
    int64_t shape[1] = {N};
    loom_param *p = NULL;
    assert_int_equal(loom_param_new("w", LOOM_F16, 1, shape, 0, &p), LOOM_OK); /* master-grad off: fp16 grad */
    float w[N];
    for (int i = 0; i < N; i++) w[i] = 0.01f * (float)i;
    assert_int_equal(loom_param_set_f32(p, w, N), LOOM_OK);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, &p, 1, &dist, zero, 0, &o), LOOM_OK);
    loom_dtype gdt;
    void *g = loom_param_grad_target(p, &gdt);
    float local[N];
    for (int i = 0; i < N; i++) local[i] = 40000.0f;
    loom_convert(g, gdt, local, LOOM_F32, N);
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 1);
    sc.scale = 1.0f;
    loom_step_info info;
    assert_int_equal(loom_dist_optim_prepare(o, &sc, 0.0f, &info), LOOM_OK);
    int summed_overflows = dist.dp_size >= 2 && !zero && gdt == LOOM_F16;
    assert_int_equal(info.found_inf, summed_overflows);
    if (!info.found_inf) {
        assert_int_equal(loom_dist_optim_step(o, 1e-3f, info.grad_multiplier), LOOM_OK);
        assert_int_equal(loom_dist_optim_unshard_masters(o), LOOM_OK);
        const float *m = loom_param_master(p);
        for (int i = 0; i < N; i++) assert_true(isfinite(m[i]) && m[i] != w[i]);
    }
    loom_dist_optim_free(o);
    loom_param_free(p);
}

static void test_fp16_gradient_sum_overflow(void **state) {
    (void)state;
    run_case(0);
}

static void test_fp16_gradient_sum_zero(void **state) {
    (void)state;
    run_case(1);
}

int main(int argc, char **argv) {
    loom_comm *world = NULL;
    if (loom_dist_init(&argc, &argv, &world) != LOOM_OK || loom_dist_layout(world, 1, &dist) != LOOM_OK) {
        fprintf(stderr, "test_dist_optim: %s\n", loom_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp16_gradient_sum_overflow),
        cmocka_unit_test(test_fp16_gradient_sum_zero),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    loom_dist_layout_free(&dist);
    loom_dist_finalize();
    return rc;
}
