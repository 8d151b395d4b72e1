/*
 * test_rmsnorm.c — RMSNorm: fast kernel vs reference (f32, bf16, f16), vs a
 * double-precision formula, backward vs central finite differences, and
 * bit-reproducibility of dw across thread counts; each with weights used as
 * they are (offset 0) and as Gemma's offsets from 1.
 */
#include "testutil.h"
#include "kernels/kernels.h"

#include <math.h>

#define EPS 1e-5f
#define FD_STEP 1e-3f

/* Unit roundoff u of a dtype: a store rounds v to v (1 + d), |d| <= u. */
static double unit_roundoff(loom_dtype dt) {
    return dt == LOOM_BF16 ? 0x1p-8 : dt == LOOM_F16 ? 0x1p-11 : 0x1p-24;
}

/* Two fp32 results that agree to ~1e-6 can still round to neighbouring values
 * of dt: one ulp, at most 2u relative. Plus fp32 slack for f32 itself. */
static double rtol_same_inputs(loom_dtype dt) { return 2.0 * unit_roundoff(dt) + 1e-5; }

static void assert_close_dt(const void *a, const void *b, size_t n, loom_dtype dt,
                            double atol, double rtol) {
    float *fa = tu_to_f32(a, n, dt), *fb = tu_to_f32(b, n, dt);
    TU_ASSERT_CLOSE(fa, fb, n, atol, rtol);
    free(fa);
    free(fb);
}

typedef struct case_data {
    int N, C;
    float *x, *w, *dout; // (N, C), (C), (N, C) as f32
    float off;           // the weight offset: w + off scales the rows
} case_data;

/* Weights w + off in [0.5, 1.5]: w itself there for off 0, around 0 for 1. */
static case_data case_make_off(int N, int C, uint64_t seed, float off) {
    case_data c = {N, C, malloc(sizeof(float) * N * C), malloc(sizeof(float) * C),
                   malloc(sizeof(float) * N * C), off};
    tu_fill_uniform(c.x, (size_t)N * C, -2.0f, 2.0f, seed);
    tu_fill_uniform(c.w, C, 0.5f - off, 1.5f - off, seed + 1);
    tu_fill_uniform(c.dout, (size_t)N * C, -1.0f, 1.0f, seed + 2);
    return c;
}

static case_data case_make(int N, int C, uint64_t seed) { return case_make_off(N, C, seed, 0.0f); }

static void case_free(case_data *c) { free(c->x); free(c->w); free(c->dout); }

static void check_fwd_vs_ref(loom_dtype dt, float off) {
    case_data c = case_make_off(7, 67, 11, off);
    size_t n = (size_t)c.N * c.C;
    void *x = tu_from_f32(c.x, n, dt), *w = tu_from_f32(c.w, c.C, dt);
    void *o1 = malloc(n * 4), *o2 = malloc(n * 4);
    float r1[7], r2[7];
    rmsnorm_fwd(o1, r1, x, w, off, c.N, c.C, EPS, dt);
    rmsnorm_fwd_ref(o2, r2, x, w, off, c.N, c.C, EPS, dt);
    assert_close_dt(o1, o2, n, dt, 1e-6, rtol_same_inputs(dt));
    TU_ASSERT_CLOSE(r1, r2, 7, 0.0, 1e-6);
    free(x); free(w); free(o1); free(o2);
    case_free(&c);
}

static void test_fwd_vs_ref(void **state) {
    (void)state;
    for (int off = 0; off < 2; off++) {
        check_fwd_vs_ref(LOOM_F32, (float)off);
        check_fwd_vs_ref(LOOM_BF16, (float)off);
        check_fwd_vs_ref(LOOM_F16, (float)off);
    }
}

/* Independent oracle: the formula in double on the dt-rounded inputs. The
 * kernel's error is fp32 summation (C * 2^-24 relative, < 1e-5 here) plus one
 * rounding to dt (u relative). */
static void check_fwd_formula(loom_dtype dt, float off) {
    case_data c = case_make_off(5, 40, 21, off);
    size_t n = (size_t)c.N * c.C;
    void *x = tu_from_f32(c.x, n, dt), *w = tu_from_f32(c.w, c.C, dt), *o = malloc(n * 4);
    float *want = malloc(n * 4), rstd[5];
    rmsnorm_fwd(o, rstd, x, w, off, c.N, c.C, EPS, dt);
    for (int i = 0; i < c.N; i++) {
        double ss = 0.0;
        for (int j = 0; j < c.C; j++) ss += pow(loom_load(x, (size_t)i * c.C + j, dt), 2);
        double r = 1.0 / sqrt(ss / c.C + EPS);
        assert_true(fabs(rstd[i] - r) <= 1e-5 * r);
        for (int j = 0; j < c.C; j++) {
            double xv = loom_load(x, (size_t)i * c.C + j, dt);
            want[i * c.C + j] = (float)(xv * r * ((double)loom_load(w, j, dt) + off));
        }
    }
    float *got = tu_to_f32(o, n, dt);
    TU_ASSERT_CLOSE(got, want, n, 1e-6, unit_roundoff(dt) + 1e-5);
    free(x); free(w); free(o); free(want); free(got);
    case_free(&c);
}

static void test_fwd_formula(void **state) {
    (void)state;
    for (int off = 0; off < 2; off++) {
        check_fwd_formula(LOOM_F32, (float)off);
        check_fwd_formula(LOOM_BF16, (float)off);
        check_fwd_formula(LOOM_F16, (float)off);
    }
}

static void check_bwd_vs_ref(loom_dtype dt, int N, int C, float off) {
    case_data c = case_make_off(N, C, 31, off);
    size_t n = (size_t)N * C;
    void *x = tu_from_f32(c.x, n, dt), *w = tu_from_f32(c.w, C, dt);
    void *dout = tu_from_f32(c.dout, n, dt), *o = malloc(n * 4);
    void *dx1 = malloc(n * 4), *dx2 = malloc(n * 4);
    float *rstd = malloc(sizeof(float) * N), *dw1 = malloc(4 * C), *dw2 = malloc(4 * C);
    rmsnorm_fwd(o, rstd, x, w, off, N, C, EPS, dt);
    tu_fill_uniform(dw1, C, -1.0f, 1.0f, 5); // dw accumulates onto what is there
    memcpy(dw2, dw1, 4 * C);
    rmsnorm_bwd(dx1, dw1, dout, x, w, off, rstd, N, C, dt);
    rmsnorm_bwd_ref(dx2, dw2, dout, x, w, off, rstd, N, C, dt);
    assert_close_dt(dx1, dx2, n, dt, 1e-6, rtol_same_inputs(dt));
    /* dx may overwrite dout: the same bits in place */
    float *dw3 = calloc(C, 4), *dw4 = calloc(C, 4);
    rmsnorm_bwd(dx2, dw3, dout, x, w, off, rstd, N, C, dt);
    rmsnorm_bwd(dout, dw4, dout, x, w, off, rstd, N, C, dt);
    assert_true(tu_bits_equal(dout, dx2, n * loom_dtype_size(dt), "dx in place"));
    free(dw3); free(dw4);
    // dw: N terms of size <= 2*1*1 summed in another order: N * 2 * 2^-24 abs.
    TU_ASSERT_CLOSE(dw1, dw2, C, 1e-5, 1e-5);
    free(x); free(w); free(dout); free(o); free(dx1); free(dx2);
    free(rstd); free(dw1); free(dw2);
    case_free(&c);
}

static void test_bwd_vs_ref(void **state) {
    (void)state;
    for (int off = 0; off < 2; off++) {
        check_bwd_vs_ref(LOOM_F32, 9, 67, (float)off);
        check_bwd_vs_ref(LOOM_BF16, 9, 67, (float)off);
        check_bwd_vs_ref(LOOM_F16, 9, 67, (float)off);
        check_bwd_vs_ref(LOOM_F32, 200, 33, (float)off); // more rows than dw chunks
    }
}

/* L = sum(dout * rmsnorm(x, w)) in double from the f32 kernel. */
static double loss_f32(const case_data *c) {
    size_t n = (size_t)c->N * c->C;
    float *o = malloc(n * 4);
    rmsnorm_fwd(o, NULL, c->x, c->w, c->off, c->N, c->C, EPS, LOOM_F32);
    double L = 0.0;
    for (size_t i = 0; i < n; i++) L += (double)c->dout[i] * o[i];
    free(o);
    return L;
}

/* Central difference of L w.r.t. p[i], over the step fp32 actually took. */
static double fd_partial(case_data *c, float *p, size_t i) {
    float p0 = p[i], pp = p0 + FD_STEP, pm = p0 - FD_STEP;
    p[i] = pp;
    double lp = loss_f32(c);
    p[i] = pm;
    double lm = loss_f32(c);
    p[i] = p0;
    return (lp - lm) / ((double)pp - (double)pm);
}

/* Tolerance: truncation h^2 |f'''| / 6 ~ 1e-6. Rounding: moving x_ij changes
 * the C outputs of row i, each by independent fp32 noise ~2^-24 |out|, and
 * rstd coherently by a few 2^-24: ~1e-7 .. 1e-6 on L, over 2h = 2e-3 that is
 * ~1e-4 .. 5e-4. Gradients here are O(0.1 .. 1). */
static void check_bwd_finite_differences(float off) {
    case_data c = case_make_off(4, 19, 41, off);
    size_t n = (size_t)c.N * c.C;
    float *o = malloc(n * 4), rstd[4], *dx = malloc(n * 4), *dw = calloc(c.C, 4);
    float *num = malloc(n * 4), *numw = malloc(c.C * 4);
    rmsnorm_fwd(o, rstd, c.x, c.w, off, c.N, c.C, EPS, LOOM_F32);
    rmsnorm_bwd(dx, dw, c.dout, c.x, c.w, off, rstd, c.N, c.C, LOOM_F32);
    for (size_t i = 0; i < n; i++) num[i] = (float)fd_partial(&c, c.x, i);
    for (int j = 0; j < c.C; j++) numw[j] = (float)fd_partial(&c, c.w, j);
    TU_ASSERT_CLOSE(dx, num, n, 1e-3, 5e-3);
    TU_ASSERT_CLOSE(dw, numw, c.C, 1e-3, 5e-3);
    free(o); free(dx); free(dw); free(num); free(numw);
    case_free(&c);
}

static void test_bwd_finite_differences(void **state) {
    (void)state;
    check_bwd_finite_differences(0.0f);
    check_bwd_finite_differences(1.0f);
}

/* dw is reduced over a fixed row partition: same bits for 1 and 2 threads. */
static void test_bwd_thread_count_invariant(void **state) {
    (void)state;
    int N = 150, C = 48;
    case_data c = case_make(N, C, 51);
    size_t n = (size_t)N * C;
    void *x = tu_from_f32(c.x, n, LOOM_BF16), *w = tu_from_f32(c.w, C, LOOM_BF16);
    void *dout = tu_from_f32(c.dout, n, LOOM_BF16), *o = malloc(n * 2);
    void *dx1 = malloc(n * 2), *dx2 = malloc(n * 2);
    float *rstd = malloc(4 * N), *dw1 = calloc(C, 4), *dw2 = calloc(C, 4);
    rmsnorm_fwd(o, rstd, x, w, 0.0f, N, C, EPS, LOOM_BF16);
    loom_set_threads(1);
    rmsnorm_bwd(dx1, dw1, dout, x, w, 0.0f, rstd, N, C, LOOM_BF16);
    loom_set_threads(2);
    rmsnorm_bwd(dx2, dw2, dout, x, w, 0.0f, rstd, N, C, LOOM_BF16);
    loom_set_threads(0);
    assert_true(tu_bits_equal(dx1, dx2, n * 2, "dx"));
    assert_true(tu_bits_equal(dw1, dw2, C * 4, "dw"));
    free(x); free(w); free(dout); free(o); free(dx1); free(dx2);
    free(rstd); free(dw1); free(dw2);
    case_free(&c);
}

/* A row whose mean square overflows fp32 (3e38 squared) gives NaN out,
 * rstd and dx, in every path, where 1 / sqrt(Inf) made a silent 0 (and the
 * AVX2 backward NaN while the portable one gave 0); the other rows are as
 * the reference makes them. */
static void test_overflowing_row(void **state) {
    (void)state;
    enum { N = 2, C = 20 };
    float x[N * C], w[C], dout[N * C], out[N * C], rstd[N], dx[N * C], dw[C] = {0};
    tu_fill_uniform(x, N * C, -1.0f, 1.0f, 41);
    tu_fill_uniform(w, C, 0.5f, 1.5f, 42);
    tu_fill_uniform(dout, N * C, -1.0f, 1.0f, 43);
    for (int j = 0; j < C; j++) x[j] = j % 2 ? 3e38f : -3e38f;
    float ref_out[N * C], ref_rstd[N];
    rmsnorm_fwd_ref(ref_out, ref_rstd, x, w, 0.0f, N, C, EPS, LOOM_F32);
    rmsnorm_fwd(out, rstd, x, w, 0.0f, N, C, EPS, LOOM_F32);
    assert_true(isnan(rstd[0]) && isnan(ref_rstd[0]));
    for (int j = 0; j < C; j++) assert_true(isnan(out[j]) && isnan(ref_out[j]));
    TU_ASSERT_CLOSE(out + C, ref_out + C, C, 1e-6, 1e-6);
    rmsnorm_bwd(dx, dw, dout, x, w, 0.0f, rstd, N, C, LOOM_F32);
    for (int j = 0; j < C; j++) assert_true(isnan(dx[j]));
    for (int j = C; j < N * C; j++) assert_true(isfinite(dx[j]));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fwd_vs_ref),
        cmocka_unit_test(test_fwd_formula),
        cmocka_unit_test(test_bwd_vs_ref),
        cmocka_unit_test(test_bwd_finite_differences),
        cmocka_unit_test(test_bwd_thread_count_invariant),
        cmocka_unit_test(test_overflowing_row),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
