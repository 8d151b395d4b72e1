/*
 * test_dist_optim.c — the data-parallel optimizer's found-inf rule. Run
 * alone it checks one process; tests/scripts/test_mpi.sh also runs it under
 * `mpirun -np 2`, where the gradients of the two ranks are summed.
 *
 * Each rank's fp16 gradient is 40000 (finite). Summed over 2 ranks that is
 * 80000: finite in the fp32 reduction buffer, +Inf once rounded back to
 * fp16 for the optimizer. The step must be reported (found_inf) and
 * skipped, never applied: an applied step would make the masters NaN. ZeRO-1
 * rounds its shard of the sum to fp16 too (it updates exactly as plain data
 * parallelism does), so it skips the same step.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

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
    int summed_overflows = dist.dp_size >= 2 && gdt == LOOM_F16;
    assert_int_equal(info.found_inf, summed_overflows);
    if (!info.found_inf) {
        assert_int_equal(loom_dist_optim_step(o, 1e-3f, info.grad_multiplier), LOOM_OK);
        assert_int_equal(loom_dist_optim_unshard_masters(o), LOOM_OK);
        const float *m = loom_param_master(p);
        for (int i = 0; i < N; i++) assert_true(isfinite(m[i]) && m[i] != w[i]);
    }
    /* The moments: borrowed without ZeRO (the very values get_moments
     * copies, moved by a step taken; a write through them is what the
     * optimizer holds), none to borrow with it. */
    float gm[N], gv[N], *mv[1] = {NULL}, *vv[1] = {NULL}, *gmp[1] = {gm}, *gvp[1] = {gv};
    assert_int_equal(loom_dist_optim_get_moments(o, gmp, gvp), LOOM_OK);
    int viewed = loom_dist_optim_moments_view(o, mv, vv);
    assert_int_equal(viewed, !(zero && dist.dp_size > 1));
    if (viewed) {
        assert_memory_equal(mv[0], gm, sizeof gm);
        assert_memory_equal(vv[0], gv, sizeof gv);
        assert_true((gm[0] != 0.0f) == !info.found_inf);
        mv[0][0] = 12345.0f;
        assert_int_equal(loom_dist_optim_get_moments(o, gmp, gvp), LOOM_OK);
        assert_true(gm[0] == 12345.0f);
    } else {
        assert_null(mv[0]);
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

/* A gradient that reaches a parameter after its bucket's reduction started
 * during the watched backward — here on rank 0 only — fails prepare on
 * every rank (not on rank 0 alone, leaving the others in a collective). */
static void test_late_gradient_stops_every_rank(void **state) {
    (void)state;
    if (dist.dp_size < 2) skip(); /* nothing is watched without data parallelism */
    int64_t shape[2] = {4, 4};
    loom_param *p = NULL;
    assert_int_equal(loom_param_new("w", LOOM_F32, 2, shape, 1, &p), LOOM_OK);
    float w[16];
    for (int i = 0; i < 16; i++) w[i] = 0.1f * (float)(i % 5);
    assert_int_equal(loom_param_set_f32(p, w, 16), LOOM_OK);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, &p, 1, &dist, 0, 0, &o), LOOM_OK);
    loom_param_zero_grad(p);
    loom_tensor *x = loom_tensor_from_f32(w, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS), *y = NULL, *l = NULL;
    assert_int_equal(loom_fused_linear(x, p->tensor, NULL, &y), LOOM_OK);
    assert_int_equal(loom_sum(y, &l), LOOM_OK);
    loom_dist_optim_watch_backward(o);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK); /* the bucket starts when w's gradient is complete */
    if (dist.dp_rank == 0) assert_int_equal(loom_param_accumulate(p, x), LOOM_OK); /* then one more arrives */
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    loom_step_info info;
    assert_int_equal(loom_dist_optim_prepare(o, &sc, 0.0f, &info), LOOM_ERR_STATE);
    assert_non_null(strstr(loom_last_error(), dist.dp_rank == 0 ? "had started (" : "on another rank"));
    loom_tensor_release(l);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_dist_optim_free(o);
    loom_param_free(p);
}

/* A parameter used inside a reentrant region and again after it: the use
 * after the region is backpropagated first, and the region's replay adds
 * the other. Its uses must be known before the backward, or its bucket
 * starts at the first contribution and the replay's is late. With the
 * overlap on, every mode prepares, and to the same gradient. */
static loom_param *shared_w;

static loom_status shared_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)user; (void)n_in; (void)n_out;
    loom_tensor *h = NULL;
    loom_status st = loom_fused_linear(in[0], shared_w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &out[0]);
    loom_tensor_release(h);
    return st;
}

static void run_shared(loom_recompute_mode mode, float *grad) {
    int64_t shape[2] = {4, 4};
    assert_int_equal(loom_param_new("w", LOOM_F32, 2, shape, 1, &shared_w), LOOM_OK);
    float w[16];
    for (int i = 0; i < 16; i++) w[i] = 0.1f * (float)(i % 5) - 0.2f;
    assert_int_equal(loom_param_set_f32(shared_w, w, 16), LOOM_OK);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, &shared_w, 1, &dist, 0, 0, &o), LOOM_OK);
    loom_param_zero_grad(shared_w);
    for (int i = 0; i < 16; i++) w[i] = 0.05f * (float)(i + dist.dp_rank);
    loom_tensor *x = loom_tensor_from_f32(w, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS), *y = NULL, *z = NULL,
                *l = NULL;
    assert_int_equal(loom_checkpoint(mode, shared_region, NULL, &x, 1, &y, 1), LOOM_OK);
    assert_int_equal(loom_fused_linear(y, shared_w->tensor, NULL, &z), LOOM_OK); /* and after the region */
    assert_int_equal(loom_sum(z, &l), LOOM_OK);
    loom_dist_optim_watch_backward(o);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    loom_step_info info;
    loom_status st = loom_dist_optim_prepare(o, &sc, 0.0f, &info);
    if (st != LOOM_OK) fprintf(stderr, "%s: %s\n", loom_recompute_mode_name(mode), loom_last_error());
    assert_int_equal(st, LOOM_OK);
    memcpy(grad, shared_w->grad, 16 * sizeof(float));
    loom_tensor_release(l);
    loom_tensor_release(z);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_dist_optim_free(o);
    loom_param_free(shared_w);
}

static void test_parameter_inside_reentrant_and_after(void **state) {
    (void)state;
    float ref[16], got[16];
    run_shared(LOOM_RECOMPUTE_NONE, ref);
    const loom_recompute_mode modes[] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                         LOOM_RECOMPUTE_SELECTIVE};
    for (int k = 0; k < 3; k++) {
        run_shared(modes[k], got);
        assert_memory_equal(got, ref, sizeof ref);
    }
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
        cmocka_unit_test(test_late_gradient_stops_every_rank),
        cmocka_unit_test(test_parameter_inside_reentrant_and_after),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    loom_dist_layout_free(&dist);
    loom_dist_finalize();
    return rc;
}
