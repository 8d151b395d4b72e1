/*
 * test_crossentropy.c — fused softmax cross-entropy: fast kernel vs
 * reference, vs the formula in double, ignore_index rows, dlogits aliasing
 * logits, large logits, and the gradient vs central finite differences.
 */
#include "testutil.h"
#include "kernels/kernels.h"

#include <math.h>

#define IGNORE (-100)
#define GRAD_SCALE 0.37f
#define FD_STEP 1e-3f

static double unit_roundoff(loom_dtype dt) {
    return dt == LOOM_BF16 ? 0x1p-8 : dt == LOOM_F16 ? 0x1p-11 : 0x1p-24;
}

/* Logits (N, V) as dt, uniform in [center - spread, center + spread]; rows 2
 * and 5 (when present) are ignored, the others have targets spread over V. */
typedef struct ce_data {
    int N, V;
    loom_dtype dt;
    void *logits;
    int32_t *targets;
} ce_data;

static ce_data ce_make(int N, int V, float center, float spread, loom_dtype dt, uint64_t seed) {
    ce_data d = {N, V, dt, NULL, malloc(sizeof(int32_t) * N)};
    float *f = malloc(sizeof(float) * N * V);
    tu_fill_uniform(f, (size_t)N * V, center - spread, center + spread, seed);
    d.logits = tu_from_f32(f, (size_t)N * V, dt);
    for (int i = 0; i < N; i++) d.targets[i] = (i == 2 || i == 5) ? IGNORE : (i * 37 + 3) % V;
    free(f);
    return d;
}

static void ce_free(ce_data *d) { free(d->logits); free(d->targets); }

static size_t ce_bytes(const ce_data *d) { return (size_t)d->N * d->V * loom_dtype_size(d->dt); }

/* The formula in double on the stored logits: loss (N), dlogits (N, V). */
static void ce_double(double *loss, double *grad, const ce_data *d, double scale) {
    for (int i = 0; i < d->N; i++) {
        size_t off = (size_t)i * d->V;
        int t = d->targets[i];
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < d->V; j++) m = fmax(m, loom_load(d->logits, off + j, d->dt));
        for (int j = 0; j < d->V; j++) sum += exp(loom_load(d->logits, off + j, d->dt) - m);
        loss[i] = t == IGNORE ? 0.0 : log(sum) - (loom_load(d->logits, off + t, d->dt) - m);
        for (int j = 0; j < d->V; j++) {
            double p = exp(loom_load(d->logits, off + j, d->dt) - m) / sum;
            grad[off + j] = t == IGNORE ? 0.0 : (p - (j == t)) * scale;
        }
    }
}

/* Same fp32 math on both sides, row by row: losses within fp32 noise,
 * dlogits at most one ulp of dt apart (2u relative). */
static void check_vs_ref(loom_dtype dt) {
    ce_data d = ce_make(9, 301, 0.0f, 4.0f, dt, 1);
    float l1[9], l2[9];
    void *g1 = malloc(ce_bytes(&d)), *g2 = malloc(ce_bytes(&d));
    crossentropy_fwd_bwd(l1, g1, d.logits, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, dt);
    crossentropy_fwd_bwd_ref(l2, g2, d.logits, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, dt);
    TU_ASSERT_CLOSE(l1, l2, 9, 1e-6, 1e-6);
    float *a = tu_to_f32(g1, (size_t)d.N * d.V, dt), *b = tu_to_f32(g2, (size_t)d.N * d.V, dt);
    TU_ASSERT_CLOSE(a, b, (size_t)d.N * d.V, 1e-9, 2.0 * unit_roundoff(dt) + 1e-6);
    free(g1); free(g2); free(a); free(b);
    ce_free(&d);
}

static void test_vs_ref(void **state) {
    (void)state;
    check_vs_ref(LOOM_F32);
    check_vs_ref(LOOM_BF16);
    check_vs_ref(LOOM_F16);
}

/* Kernel vs the double formula. The loss: fp32 sum of V exponentials, whose
 * independent roundings give ~sqrt(V) * 2^-24 ~ 1e-6 relative on the sum, so
 * absolute on its log, and x_t - m (exact) plus a rounding of the loss.
 * dlogits: a few 2^-24 relative plus one rounding to dt (u); atol for entries
 * near 0 (f16 subnormals). */
static void check_formula(ce_data *d, int alias) {
    size_t n = (size_t)d->N * d->V;
    double *wl = malloc(sizeof(double) * d->N), *wg = malloc(sizeof(double) * n);
    float *loss = malloc(sizeof(float) * d->N), *wlf = malloc(sizeof(float) * d->N);
    float *wgf = malloc(sizeof(float) * n);
    ce_double(wl, wg, d, GRAD_SCALE);
    void *grad = alias ? d->logits : malloc(ce_bytes(d));
    crossentropy_fwd_bwd(loss, grad, d->logits, d->targets, d->N, d->V, IGNORE, GRAD_SCALE, d->dt);
    for (int i = 0; i < d->N; i++) wlf[i] = (float)wl[i];
    for (size_t i = 0; i < n; i++) wgf[i] = (float)wg[i];
    TU_ASSERT_CLOSE(loss, wlf, d->N, 5e-6, 1e-6);
    float *g = tu_to_f32(grad, n, d->dt);
    TU_ASSERT_CLOSE(g, wgf, n, 1e-7, unit_roundoff(d->dt) + 1e-5);
    for (int i = 0; i < d->N; i++) { // ignored rows: exactly 0 loss, 0 gradient
        if (d->targets[i] != IGNORE) continue;
        assert_true(loss[i] == 0.0f);
        for (int j = 0; j < d->V; j++) assert_true(g[(size_t)i * d->V + j] == 0.0f);
    }
    if (!alias) free(grad);
    free(wl); free(wg); free(loss); free(wlf); free(wgf); free(g);
}

static void test_vs_formula(void **state) {
    (void)state;
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int i = 0; i < 3; i++) {
        ce_data d = ce_make(8, 301, 0.0f, 4.0f, dts[i], 2);
        check_formula(&d, 0);
        ce_free(&d);
    }
}

typedef void (*ce_fn)(float *, void *, const void *, const int32_t *, int, int, int, float,
                      loom_dtype);

/* dlogits may be logits: a row is read in full before it is written. Aliased
 * and separate outputs give the same bits, for the kernel and the reference. */
static void check_alias(ce_fn fn, loom_dtype dt) {
    ce_data d = ce_make(8, 129, 0.0f, 4.0f, dt, 3);
    float l1[8], l2[8];
    void *g = malloc(ce_bytes(&d));
    fn(l1, g, d.logits, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, dt);
    fn(l2, d.logits, d.logits, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, dt);
    assert_true(tu_bits_equal(l1, l2, sizeof l1, "losses"));
    assert_true(tu_bits_equal(g, d.logits, ce_bytes(&d), "dlogits in place"));
    free(g);
    ce_free(&d);
}

static void test_alias(void **state) {
    (void)state;
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int k = 0; k < 3; k++) {
        check_alias(crossentropy_fwd_bwd, dts[k]);
        check_alias(crossentropy_fwd_bwd_ref, dts[k]);
        ce_data d = ce_make(8, 129, 0.0f, 4.0f, dts[k], 3);
        check_formula(&d, 1);
        ce_free(&d);
    }
}

/* Ignored rows are never read: NaN logits there change nothing. dlogits may
 * also be NULL (loss only). */
static void test_ignore_index(void **state) {
    (void)state;
    ce_data d = ce_make(6, 50, 0.0f, 4.0f, LOOM_F32, 4);
    float *x = d.logits, l1[6], l2[6], *g = malloc(ce_bytes(&d));
    for (int j = 0; j < d.V; j++) x[2 * d.V + j] = x[5 * d.V + j] = NAN;
    crossentropy_fwd_bwd(l1, g, x, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, LOOM_F32);
    crossentropy_fwd_bwd(l2, NULL, x, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, LOOM_F32);
    assert_true(tu_bits_equal(l1, l2, sizeof l1, "losses without dlogits"));
    for (int i = 0; i < d.N; i++) {
        assert_true(isfinite(l1[i]) && (l1[i] == 0.0f) == (d.targets[i] == IGNORE));
        for (int j = 0; j < d.V; j++)
            assert_true(d.targets[i] == IGNORE ? g[i * d.V + j] == 0.0f : isfinite(g[i * d.V + j]));
    }
    free(g);
    ce_free(&d);
}

/* exp of these logits overflows every dtype; subtracting the max keeps all
 * finite and exact. f32 around 1e4, bf16 around 1e3 (spacing 8), f16 around
 * 6e4 (spacing 32, near its max 65504). */
static void test_large_logits(void **state) {
    (void)state;
    ce_data d = ce_make(8, 301, 1e4f, 5.0f, LOOM_F32, 5);
    check_formula(&d, 0);
    ce_free(&d);
    d = ce_make(8, 301, 1e3f, 40.0f, LOOM_BF16, 6);
    check_formula(&d, 0);
    ce_free(&d);
    d = ce_make(8, 301, 6e4f, 200.0f, LOOM_F16, 7);
    check_formula(&d, 0);
    ce_free(&d);
}

static double loss_f32(const ce_data *d) {
    float *loss = malloc(sizeof(float) * d->N);
    crossentropy_fwd_bwd(loss, NULL, d->logits, d->targets, d->N, d->V, IGNORE, 1.0f, LOOM_F32);
    double L = 0.0;
    for (int i = 0; i < d->N; i++) L += loss[i];
    free(loss);
    return L;
}

/* dlogits / grad_scale = d(sum of losses) / dlogits. Truncation h^2 |L'''| / 6
 * < 1e-6; the loss of the perturbed row carries fp32 noise of a few 2^-24,
 * over 2h = 2e-3 that is ~1e-4. Gradients are O(1 / V) = O(0.1). */
static void test_finite_differences(void **state) {
    (void)state;
    ce_data d = ce_make(6, 7, 0.0f, 2.0f, LOOM_F32, 8);
    size_t n = (size_t)d.N * d.V;
    float *x = d.logits, *g = malloc(n * 4), *num = malloc(n * 4), loss[6];
    crossentropy_fwd_bwd(loss, g, x, d.targets, d.N, d.V, IGNORE, GRAD_SCALE, LOOM_F32);
    for (size_t i = 0; i < n; i++) {
        g[i] /= GRAD_SCALE;
        float p0 = x[i], pp = p0 + FD_STEP, pm = p0 - FD_STEP;
        x[i] = pp;
        double lp = loss_f32(&d);
        x[i] = pm;
        double lm = loss_f32(&d);
        x[i] = p0;
        num[i] = (float)((lp - lm) / ((double)pp - (double)pm));
    }
    TU_ASSERT_CLOSE(g, num, n, 1e-3, 5e-3);
    free(g); free(num);
    ce_free(&d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vs_ref),
        cmocka_unit_test(test_vs_formula),
        cmocka_unit_test(test_alias),
        cmocka_unit_test(test_ignore_index),
        cmocka_unit_test(test_large_logits),
        cmocka_unit_test(test_finite_differences),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
