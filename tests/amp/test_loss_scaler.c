/*
 * test_loss_scaler.c — fp16 dynamic loss scaling, found-inf, the global
 * gradient norm and clipping, as a trainer uses them:
 *
 *     loom_amp_prepare_step(params, n, &scaler, max_norm, &info);
 *     if (!info.found_inf) loom_adamw_step(opt, lr, info.grad_multiplier);
 *     loom_loss_scaler_update(&scaler, info.found_inf);
 *
 * Scaler: initial 2^16; an overflow (Inf or NaN in any trainable gradient)
 * skips the step and halves the scale; growth_interval good steps in a row
 * double it; an overflow restarts the count; disabled (bf16, fp32) it stays 1.
 * Norm: the global L2 norm of the unscaled gradients, against a direct fp64
 * sum; clipping coefficient and the optimizer's multiplier (1/scale x clip).
 */
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "loom/loom.h"

/* ---------------------------------------------------------------- helpers */

static loom_param *make_param(const char *name, loom_dtype dt, int master_grad, int64_t n, uint64_t seed) {
    loom_param *p;
    int64_t shape[1] = {n};
    assert_int_equal(loom_param_new(name, dt, 1, shape, master_grad, &p), LOOM_OK);
    float *v = malloc((size_t)n * sizeof *v);
    tu_fill_uniform(v, (size_t)n, -1.0f, 1.0f, seed);
    assert_int_equal(loom_param_set_f32(p, v, n), LOOM_OK);
    free(v);
    return p;
}

/* Overwrite p's gradient with g (converted to the gradient dtype). */
static void set_grad(loom_param *p, const float *g) {
    loom_param_zero_grad(p);
    loom_dtype dt;
    void *dst = loom_param_grad_target(p, &dt);
    for (int64_t i = 0; i < loom_param_numel(p); i++) loom_store(dst, (size_t)i, dt, g[i]);
}

/* Gradients uniform in [-a, a) (scaled by the loss scale, as backward leaves them). */
static void set_random_grads(loom_param **ps, int n, float a, uint64_t seed) {
    for (int i = 0; i < n; i++) {
        int64_t k = loom_param_numel(ps[i]);
        float *g = malloc((size_t)k * sizeof *g);
        tu_fill_uniform(g, (size_t)k, -a, a, seed + (uint64_t)i);
        set_grad(ps[i], g);
        free(g);
    }
}

/* Put v into element i of p's gradient. */
static void poke_grad(loom_param *p, int64_t i, float v) {
    loom_store(p->grad, (size_t)i, p->grad_dtype, v);
}

/* The trainer's step; returns 1 when the optimizer ran. */
static int train_step(loom_param **ps, int n, loom_adamw *opt, loom_loss_scaler *s, float max_norm,
                      loom_step_info *info) {
    loom_amp_prepare_step(ps, n, s, max_norm, info);
    if (!info->found_inf) assert_int_equal(loom_adamw_step(opt, 1e-2f, info->grad_multiplier), LOOM_OK);
    loom_loss_scaler_update(s, info->found_inf);
    return !info->found_inf;
}

/* Copies of the fp32 masters and compute copies. */
typedef struct snapshot {
    int n;
    void *master[8], *compute[8];
    size_t master_bytes[8], compute_bytes[8];
} snapshot;

static void take_snapshot(snapshot *s, loom_param **ps, int n) {
    s->n = n;
    for (int i = 0; i < n; i++) {
        s->master_bytes[i] = (size_t)loom_param_numel(ps[i]) * sizeof(float);
        s->compute_bytes[i] = loom_tensor_nbytes(ps[i]->tensor);
        s->master[i] = malloc(s->master_bytes[i]);
        s->compute[i] = malloc(s->compute_bytes[i]);
        memcpy(s->master[i], loom_param_master(ps[i]), s->master_bytes[i]);
        memcpy(s->compute[i], loom_tensor_data(ps[i]->tensor), s->compute_bytes[i]);
    }
}

static int snapshot_matches(const snapshot *s, loom_param **ps) {
    for (int i = 0; i < s->n; i++) {
        if (memcmp(s->master[i], loom_param_master(ps[i]), s->master_bytes[i]) != 0) return 0;
        if (memcmp(s->compute[i], loom_tensor_data(ps[i]->tensor), s->compute_bytes[i]) != 0) return 0;
    }
    return 1;
}

static void free_snapshot(snapshot *s) {
    for (int i = 0; i < s->n; i++) {
        free(s->master[i]);
        free(s->compute[i]);
    }
}

/* ------------------------------------------------------------------ tests */

static void test_initial_state(void **state) {
    (void)state;
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    assert_true(s.enabled);
    assert_true(s.scale == 65536.0f);
    assert_true(s.growth_factor == 2.0f);
    assert_true(s.backoff_factor == 0.5f);
    assert_int_equal(s.growth_interval, 2000);
    assert_int_equal(s.good_steps, 0);
    assert_int_equal(s.skipped_steps, 0);
    loom_loss_scaler_init(&s, 0);
    assert_false(s.enabled);
    assert_true(s.scale == 1.0f);
}

/* Inf, then NaN, injected in one parameter's gradient: each skips the step
 * (parameters bit for bit unchanged) and halves the scale. */
static void test_overflow_skips_step_and_backs_off(void **state) {
    (void)state;
    loom_param *ps[3] = {
        make_param("a", LOOM_F16, 1, 33, 1),
        make_param("b", LOOM_F16, 1, 64, 2),
        make_param("c", LOOM_F16, 0, 17, 3), /* master-grad off: an fp16 gradient */
    };
    assert_int_equal(ps[2]->grad_dtype, LOOM_F16);
    loom_adamw_config cfg = loom_adamw_defaults();
    loom_adamw *opt;
    assert_int_equal(loom_adamw_new(&cfg, ps, 3, &opt), LOOM_OK);
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    loom_step_info info;
    const float bad[4] = {INFINITY, -INFINITY, NAN, -NAN};
    for (int k = 0; k < 4; k++) {
        set_random_grads(ps, 3, 100.0f, 10);
        loom_param *victim = ps[k % 3];
        poke_grad(victim, loom_param_numel(victim) / 2, bad[k]);
        snapshot before;
        take_snapshot(&before, ps, 3);
        float scale_before = s.scale;
        assert_false(train_step(ps, 3, opt, &s, 1.0f, &info));
        assert_true(info.found_inf);
        assert_true(isnan(info.grad_norm));
        assert_true(snapshot_matches(&before, ps)); /* the step was skipped */
        assert_true(s.scale == scale_before * 0.5f);
        assert_int_equal(s.skipped_steps, k + 1);
        assert_int_equal(s.good_steps, 0);
        free_snapshot(&before);
    }
    assert_true(s.scale == 4096.0f); /* 2^16 / 2^4 */
    assert_int_equal(loom_adamw_steps(opt), 0);

    /* A finite step runs the optimizer and counts a good step. */
    set_random_grads(ps, 3, 100.0f, 20);
    snapshot before;
    take_snapshot(&before, ps, 3);
    assert_true(train_step(ps, 3, opt, &s, 0.0f, &info));
    assert_false(info.found_inf);
    assert_false(snapshot_matches(&before, ps));
    assert_int_equal(loom_adamw_steps(opt), 1);
    assert_int_equal(s.good_steps, 1);
    assert_true(s.scale == 4096.0f);
    free_snapshot(&before);

    /* A frozen parameter's gradient does not count. */
    set_random_grads(ps, 3, 1.0f, 30);
    poke_grad(ps[1], 0, INFINITY);
    ps[1]->trainable = 0;
    loom_amp_prepare_step(ps, 3, &s, 0.0f, &info);
    assert_false(info.found_inf);
    ps[1]->trainable = 1;
    loom_amp_prepare_step(ps, 3, &s, 0.0f, &info);
    assert_true(info.found_inf);

    loom_adamw_free(opt);
    for (int i = 0; i < 3; i++) loom_param_free(ps[i]);
}

/* A real fp16 overflow: loss = sum(x W^T) seeded with the initial scale
 * 2^16 sends dy = 65536 into fp16, which rounds to Inf (the largest half is
 * 65504); the step is skipped, the scale halves, and at 2^15 the same step
 * goes through. */
static void test_fp16_backward_overflow(void **state) {
    (void)state;
    int64_t wshape[2] = {4, 8};
    loom_param *w;
    assert_int_equal(loom_param_new("w", LOOM_F16, 2, wshape, 1, &w), LOOM_OK);
    float wv[32], xv[6 * 8];
    tu_fill_uniform(wv, 32, -0.1f, 0.1f, 40);
    tu_fill_uniform(xv, 48, -1.0f, 1.0f, 41);
    assert_int_equal(loom_param_set_f32(w, wv, 32), LOOM_OK);
    loom_tensor *x = loom_tensor_from_f32(xv, LOOM_F16, 2, (const int64_t[]){6, 8}, LOOM_MEM_ACTIVATIONS);
    loom_adamw_config cfg = loom_adamw_defaults();
    loom_adamw *opt;
    assert_int_equal(loom_adamw_new(&cfg, &w, 1, &opt), LOOM_OK);
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    loom_step_info info;
    int ran[2];
    for (int step = 0; step < 2; step++) {
        loom_param_zero_grad(w);
        loom_tensor *y = NULL, *loss = NULL;
        assert_int_equal(loom_fused_linear(x, w->tensor, NULL, &y), LOOM_OK);
        assert_int_equal(loom_sum(y, &loss), LOOM_OK);
        assert_int_equal(loom_backward(loss, s.scale), LOOM_OK);
        ran[step] = train_step(&w, 1, opt, &s, 0.0f, &info);
        loom_tensor_release(y);
        loom_tensor_release(loss);
    }
    assert_false(ran[0]);
    assert_true(ran[1]);
    assert_true(s.scale == 32768.0f);
    assert_int_equal(s.skipped_steps, 1);
    assert_int_equal(s.good_steps, 1);
    /* At scale 2^15 the unscaled gradient is exact: dW = column sums of x. */
    float g[32];
    loom_param_read_grad(w, g);
    for (int j = 0; j < 8; j++) {
        double col = 0;
        for (int r = 0; r < 6; r++) col += loom_round_to(xv[r * 8 + j], LOOM_F16);
        for (int i = 0; i < 4; i++) assert_float_equal(g[i * 8 + j] / 32768.0f, col, 1e-5);
    }
    loom_tensor_release(x);
    loom_adamw_free(opt);
    loom_param_free(w);
}

static void test_growth(void **state) {
    (void)state;
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    s.growth_interval = 3;
    loom_loss_scaler_update(&s, 0);
    loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 65536.0f);
    assert_int_equal(s.good_steps, 2);
    loom_loss_scaler_update(&s, 0); /* the third good step doubles */
    assert_true(s.scale == 131072.0f);
    assert_int_equal(s.good_steps, 0);

    /* An overflow restarts the count: two good, overflow, two good: no growth. */
    loom_loss_scaler_update(&s, 0);
    loom_loss_scaler_update(&s, 0);
    loom_loss_scaler_update(&s, 1);
    assert_true(s.scale == 65536.0f);
    assert_int_equal(s.good_steps, 0);
    loom_loss_scaler_update(&s, 0);
    loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 65536.0f);
    loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 131072.0f);
    assert_int_equal(s.skipped_steps, 1);

    /* The default interval: 2000 good steps. */
    loom_loss_scaler_init(&s, 1);
    for (int i = 0; i < 1999; i++) {
        loom_loss_scaler_update(&s, 0);
        assert_true(s.scale == 65536.0f);
    }
    loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 131072.0f);
    assert_int_equal(s.good_steps, 0);
    /* 1999 good, one overflow, 1999 good: still no growth. */
    for (int i = 0; i < 1999; i++) loom_loss_scaler_update(&s, 0);
    loom_loss_scaler_update(&s, 1);
    for (int i = 0; i < 1999; i++) loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 65536.0f);
    loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 131072.0f);

    /* Growth never reaches Inf. */
    s.scale = ldexpf(1.0f, 127);
    s.growth_interval = 1;
    loom_loss_scaler_update(&s, 0);
    assert_true(isfinite(s.scale));
    assert_true(s.scale == ldexpf(1.0f, 127));
}

/* bf16 and fp32 train with the scaler disabled: the scale stays 1 through
 * overflows and good steps, and the multiplier is the clipping alone. */
static void test_disabled_scaler(void **state) {
    (void)state;
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 0);
    s.growth_interval = 3;
    for (int i = 0; i < 10; i++) loom_loss_scaler_update(&s, 0);
    assert_true(s.scale == 1.0f);
    loom_loss_scaler_update(&s, 1);
    assert_true(s.scale == 1.0f);
    assert_int_equal(s.skipped_steps, 1); /* a skipped step is still counted */

    const loom_dtype dts[2] = {LOOM_BF16, LOOM_F32};
    for (int d = 0; d < 2; d++) {
        loom_param *p = make_param("p", dts[d], 1, 40, 50);
        set_random_grads(&p, 1, 2.0f, 51);
        loom_step_info info;
        loom_amp_prepare_step(&p, 1, &s, 0.0f, &info);
        assert_false(info.found_inf);
        assert_true(info.clip_coef == 1.0f);
        assert_true(info.grad_multiplier == 1.0f);
        poke_grad(p, 3, NAN);
        loom_amp_prepare_step(&p, 1, &s, 0.0f, &info);
        assert_true(info.found_inf);
        loom_param_free(p);
    }
}

/* The global norm against a direct fp64 sum over parameters of mixed
 * gradient dtypes; clipping; the optimizer's multiplier. */
static void test_grad_norm_and_clipping(void **state) {
    (void)state;
    loom_param *ps[4] = {
        make_param("f32", LOOM_F32, 1, 100, 60),
        make_param("bf16_main_grad", LOOM_BF16, 1, 70, 61),
        make_param("bf16_grad", LOOM_BF16, 0, 50, 62),
        make_param("frozen", LOOM_F32, 1, 30, 63),
    };
    const float scale = 1024.0f;
    set_random_grads(ps, 4, 3.0f * scale, 64);
    ps[3]->trainable = 0;
    double ss = 0.0;
    for (int i = 0; i < 3; i++) { /* the frozen parameter does not count */
        int64_t n = loom_param_numel(ps[i]);
        for (int64_t k = 0; k < n; k++) {
            double v = loom_load(ps[i]->grad, (size_t)k, ps[i]->grad_dtype);
            ss += v * v;
        }
    }
    double norm = sqrt(ss) / scale;
    int found = -1;
    double got_ss = loom_grad_sumsq(ps, 4, &found);
    assert_int_equal(found, 0);
    assert_true(fabs(got_ss - ss) <= 1e-12 * ss);

    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    s.scale = scale;
    loom_step_info info;

    /* No clipping (max_norm <= 0): the multiplier is exactly 1/scale. */
    loom_amp_prepare_step(ps, 4, &s, 0.0f, &info);
    assert_false(info.found_inf);
    assert_true(fabs(info.grad_norm - norm) <= 1e-12 * norm);
    assert_true(info.clip_coef == 1.0f);
    assert_true(info.grad_multiplier == 1.0f / scale);

    /* max_norm above the norm: no clipping either. */
    loom_amp_prepare_step(ps, 4, &s, (float)(2.0 * norm), &info);
    assert_true(info.clip_coef == 1.0f);
    assert_true(info.grad_multiplier == 1.0f / scale);

    /* max_norm below the norm: clip to it. */
    const float max_norm = (float)(norm / 4.0);
    loom_amp_prepare_step(ps, 4, &s, max_norm, &info);
    assert_true(info.clip_coef == (float)(max_norm / (info.grad_norm + 1e-6)));
    assert_true(info.clip_coef < 0.26f && info.clip_coef > 0.24f);
    assert_true(info.grad_multiplier == (1.0f / scale) * info.clip_coef);
    /* The gradients the optimizer sees have norm max_norm. */
    double clipped = 0.0;
    for (int i = 0; i < 3; i++)
        for (int64_t k = 0; k < loom_param_numel(ps[i]); k++) {
            double v = loom_load(ps[i]->grad, (size_t)k, ps[i]->grad_dtype) * (double)info.grad_multiplier;
            clipped += v * v;
        }
    assert_true(fabs(sqrt(clipped) - max_norm) <= 1e-6 * max_norm);
    for (int i = 0; i < 4; i++) loom_param_free(ps[i]);
}

/* Unscaling fused into the optimizer equals unscaling first: AdamW on
 * gradients g * 2^k with multiplier 2^-k gives the same masters, bit for
 * bit, as AdamW on g with multiplier 1. */
static void test_multiplier_unscales(void **state) {
    (void)state;
    const float scale = 8192.0f;
    loom_param *a = make_param("a", LOOM_F16, 1, 48, 70), *b = make_param("b", LOOM_F16, 1, 48, 70);
    float g[48], gs[48];
    tu_fill_uniform(g, 48, -0.5f, 0.5f, 71);
    for (int i = 0; i < 48; i++) gs[i] = g[i] * scale;
    loom_adamw_config cfg = loom_adamw_defaults();
    loom_adamw *oa, *ob;
    assert_int_equal(loom_adamw_new(&cfg, &a, 1, &oa), LOOM_OK);
    assert_int_equal(loom_adamw_new(&cfg, &b, 1, &ob), LOOM_OK);
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    s.scale = scale;
    for (int step = 0; step < 3; step++) {
        loom_step_info info;
        set_grad(a, gs);
        set_grad(b, g);
        assert_true(train_step(&a, 1, oa, &s, 0.0f, &info));
        assert_true(info.grad_multiplier == 1.0f / scale);
        assert_int_equal(loom_adamw_step(ob, 1e-2f, 1.0f), LOOM_OK);
        assert_memory_equal(loom_param_master(a), loom_param_master(b), 48 * sizeof(float));
        assert_memory_equal(loom_tensor_data(a->tensor), loom_tensor_data(b->tensor), 48 * 2);
    }
    loom_adamw_free(oa);
    loom_adamw_free(ob);
    loom_param_free(a);
    loom_param_free(b);
}

/* A scale whose inverse overflows (0, or a denormal from a damaged
 * checkpoint) with finite gradients: found_inf, so no step multiplies
 * them by Inf (it used to pass as a good step and write NaN into every
 * master); with a normal scale the same gradients make a good step. */
static void test_scale_with_infinite_inverse(void **state) {
    (void)state;
    loom_param *a = make_param("a", LOOM_F16, 1, 48, 72);
    float g[48];
    tu_fill_uniform(g, 48, -0.5f, 0.5f, 73);
    loom_loss_scaler s;
    loom_loss_scaler_init(&s, 1);
    const float scales[] = {0.0f, 1e-45f, 2.0f};
    for (int k = 0; k < 3; k++) {
        s.scale = scales[k];
        set_grad(a, g);
        loom_step_info info;
        loom_amp_prepare_step(&a, 1, &s, 1.0f, &info);
        assert_int_equal(info.found_inf, k < 2);
        assert_int_equal(isnan(info.grad_norm), k < 2);
        loom_amp_step_info(1.0, 0, &s, 0.0f, &info); /* the pieces summed over ranks */
        assert_int_equal(info.found_inf, k < 2);
    }
    loom_param_free(a);
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_initial_state),
        cmocka_unit_test(test_overflow_skips_step_and_backs_off),
        cmocka_unit_test(test_fp16_backward_overflow),
        cmocka_unit_test(test_growth),
        cmocka_unit_test(test_disabled_scaler),
        cmocka_unit_test(test_grad_norm_and_clipping),
        cmocka_unit_test(test_multiplier_unscales),
        cmocka_unit_test(test_scale_with_infinite_inverse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
