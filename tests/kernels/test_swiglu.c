/*
 * test_swiglu.c — SiLU, SwiGLU and GeGLU (tanh GELU): forward and backward
 * vs the formulas in double (f32, bf16, f16; GELU in PyTorch's tanh form,
 * not the kernel's sigmoid form), backward vs central finite differences,
 * extreme inputs, in place, and the AVX-512F path against the AVX2 one bit
 * for bit.
 */
#include "testutil.h"
#include "kernels/kernels.h"

#include <math.h>

#define N_ELEMS 1000
#define FD_STEP 1e-3f

static double unit_roundoff(loom_dtype dt) {
    return dt == LOOM_BF16 ? 0x1p-8 : dt == LOOM_F16 ? 0x1p-11 : 0x1p-24;
}

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
static double silu_d(double x) { return x * sigmoid_d(x); }
static double silu_grad_d(double x) {
    double s = sigmoid_d(x);
    return s * (1.0 + x * (1.0 - s));
}

/* PyTorch's gelu(approximate="tanh"): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). */
static double gelu_d(double x) { return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
static double gelu_grad_d(double x) {
    double t = tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * x * x);
}

/* The kernel's fp32 expf and division cost a few 2^-24 relative (1e-6 allows
 * 16), then one rounding to dt (u). atol covers the cancellation in
 * 1 + x (1 - s) near silu' = 0 (a few 2^-24 absolute with |dout| <= 1) and
 * f16 subnormal results (spacing 6e-8). */
static void assert_close_formula_atol(const void *got, const double *want, size_t n, loom_dtype dt, double atol) {
    float *g = tu_to_f32(got, n, dt), *w = malloc(n * 4);
    for (size_t i = 0; i < n; i++) w[i] = (float)want[i];
    TU_ASSERT_CLOSE(g, w, n, atol, unit_roundoff(dt) + 1e-6);
    free(g);
    free(w);
}

static void assert_close_formula(const void *got, const double *want, size_t n, loom_dtype dt) {
    assert_close_formula_atol(got, want, n, dt, 5e-7);
}

/* Inputs a, b, dout (N_ELEMS) in dt; fa, fb, fd are their values as float. */
typedef struct ew_data {
    loom_dtype dt;
    void *a, *b, *dout;
    float *fa, *fb, *fd;
} ew_data;

static ew_data ew_make(loom_dtype dt) {
    ew_data d = {.dt = dt, .fa = malloc(N_ELEMS * 4), .fb = malloc(N_ELEMS * 4),
                 .fd = malloc(N_ELEMS * 4)};
    tu_fill_uniform(d.fa, N_ELEMS, -8.0f, 8.0f, 1);
    tu_fill_uniform(d.fb, N_ELEMS, -2.0f, 2.0f, 2);
    tu_fill_uniform(d.fd, N_ELEMS, -1.0f, 1.0f, 3);
    d.a = tu_from_f32(d.fa, N_ELEMS, dt);
    d.b = tu_from_f32(d.fb, N_ELEMS, dt);
    d.dout = tu_from_f32(d.fd, N_ELEMS, dt);
    for (int i = 0; i < N_ELEMS; i++) { // the values the kernel sees
        d.fa[i] = loom_load(d.a, i, dt);
        d.fb[i] = loom_load(d.b, i, dt);
        d.fd[i] = loom_load(d.dout, i, dt);
    }
    return d;
}

static void ew_free(ew_data *d) {
    free(d->a); free(d->b); free(d->dout); free(d->fa); free(d->fb); free(d->fd);
}

static void check_silu(loom_dtype dt) {
    ew_data d = ew_make(dt);
    void *out = malloc(N_ELEMS * 4), *dx = malloc(N_ELEMS * 4);
    double want[N_ELEMS], wgrad[N_ELEMS];
    silu_fwd(out, d.a, N_ELEMS, dt);
    silu_bwd(dx, d.dout, d.a, N_ELEMS, dt);
    for (int i = 0; i < N_ELEMS; i++) {
        want[i] = silu_d(d.fa[i]);
        wgrad[i] = d.fd[i] * silu_grad_d(d.fa[i]);
    }
    assert_close_formula(out, want, N_ELEMS, dt);
    assert_close_formula(dx, wgrad, N_ELEMS, dt);
    free(out); free(dx);
    ew_free(&d);
}

/* geglu: the tanh GELU's gate (geglu_*), else SiLU's (swiglu_*). */
static void check_glu(loom_dtype dt, int geglu) {
    ew_data d = ew_make(dt);
    void *out = malloc(N_ELEMS * 4), *dg = malloc(N_ELEMS * 4), *du = malloc(N_ELEMS * 4);
    double want[N_ELEMS], wg[N_ELEMS], wu[N_ELEMS];
    (geglu ? geglu_fwd : swiglu_fwd)(out, d.a, d.b, N_ELEMS, dt);
    (geglu ? geglu_bwd : swiglu_bwd)(dg, du, d.dout, d.a, d.b, N_ELEMS, dt);
    for (int i = 0; i < N_ELEMS; i++) {
        double act = geglu ? gelu_d(d.fa[i]) : silu_d(d.fa[i]);
        want[i] = act * d.fb[i];
        wg[i] = d.fd[i] * d.fb[i] * (geglu ? gelu_grad_d(d.fa[i]) : silu_grad_d(d.fa[i]));
        wu[i] = d.fd[i] * act;
    }
    assert_close_formula(out, want, N_ELEMS, dt);
    /* GeGLU's 1 + x (1 - s) z' multiplies the rounding of s near 1 (2^-25
     * absolute, where 1 - s has no bits left) by |x z'| <= 123 for |x| <= 8,
     * and |dout * up| <= 2: 7.4e-6 absolute; SiLU's z' = 1 keeps it in 5e-7. */
    assert_close_formula_atol(dg, wg, N_ELEMS, dt, geglu ? 8e-6 : 5e-7);
    assert_close_formula(du, wu, N_ELEMS, dt);
    free(out); free(dg); free(du);
    ew_free(&d);
}

static void test_vs_formula(void **state) {
    (void)state;
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int i = 0; i < 3; i++) {
        check_silu(dts[i]);
        check_glu(dts[i], 0);
        check_glu(dts[i], 1);
    }
}

/* out_i depends on input i only, so shifting every element by +-h at once
 * gives each element's central difference of L = sum(dout * f(x)).
 * Truncation h^2 |f'''| / 6 < 1e-6; rounding 2 * 2^-24 * |out| <= 8 over
 * 2h = 2e-3 is < 1e-3 at worst. p points into one input of d. */
enum { FD_SILU, FD_SWIGLU, FD_GEGLU };

static void fd_elementwise(float *num, float *p, const ew_data *d, int fn) {
    float *xp = malloc(N_ELEMS * 4), *xm = malloc(N_ELEMS * 4), *saved = malloc(N_ELEMS * 4);
    float *op = malloc(N_ELEMS * 4), *om = malloc(N_ELEMS * 4);
    memcpy(saved, p, N_ELEMS * 4);
    for (int i = 0; i < N_ELEMS; i++) { xp[i] = saved[i] + FD_STEP; xm[i] = saved[i] - FD_STEP; }
    for (int s = 0; s < 2; s++) {
        memcpy(p, s ? xm : xp, N_ELEMS * 4);
        if (fn == FD_SWIGLU) swiglu_fwd(s ? om : op, d->fa, d->fb, N_ELEMS, LOOM_F32);
        else if (fn == FD_GEGLU) geglu_fwd(s ? om : op, d->fa, d->fb, N_ELEMS, LOOM_F32);
        else silu_fwd(s ? om : op, d->fa, N_ELEMS, LOOM_F32);
    }
    memcpy(p, saved, N_ELEMS * 4);
    for (int i = 0; i < N_ELEMS; i++)
        num[i] = (float)((double)d->fd[i] * ((double)op[i] - om[i]) / ((double)xp[i] - xm[i]));
    free(xp); free(xm); free(saved); free(op); free(om);
}

static void test_bwd_finite_differences(void **state) {
    (void)state;
    ew_data d = ew_make(LOOM_F32);
    float *num = malloc(N_ELEMS * 4), *dx = malloc(N_ELEMS * 4), *du = malloc(N_ELEMS * 4);
    silu_bwd(dx, d.fd, d.fa, N_ELEMS, LOOM_F32);
    fd_elementwise(num, d.fa, &d, FD_SILU);
    TU_ASSERT_CLOSE(dx, num, N_ELEMS, 1e-3, 1e-3);
    for (int fn = FD_SWIGLU; fn <= FD_GEGLU; fn++) {
        (fn == FD_GEGLU ? geglu_bwd : swiglu_bwd)(dx, du, d.fd, d.fa, d.fb, N_ELEMS, LOOM_F32);
        fd_elementwise(num, d.fa, &d, fn);
        TU_ASSERT_CLOSE(dx, num, N_ELEMS, 1e-3, 1e-3);
        fd_elementwise(num, d.fb, &d, fn);
        TU_ASSERT_CLOSE(du, num, N_ELEMS, 1e-3, 1e-3);
    }
    free(num); free(dx); free(du);
    ew_free(&d);
}

/* Saturated sigmoid: exp overflows to inf for x << 0; results stay finite
 * and take their limits (silu -> 0 or x, silu' -> 0 or 1). */
static void test_extreme_inputs(void **state) {
    (void)state;
    float x[4] = {-1e4f, -100.0f, 100.0f, 1e4f}, one[4] = {1, 1, 1, 1};
    float out[4], dx[4], dg[4], du[4];
    silu_fwd(out, x, 4, LOOM_F32);
    silu_bwd(dx, one, x, 4, LOOM_F32);
    swiglu_bwd(dg, du, one, x, one, 4, LOOM_F32);
    for (int i = 0; i < 4; i++) {
        assert_true(isfinite(out[i]) && isfinite(dx[i]) && isfinite(dg[i]) && isfinite(du[i]));
        assert_true(fabsf(out[i] - (x[i] > 0 ? x[i] : 0.0f)) <= 1e-6f * fabsf(x[i]) + 1e-30f);
        assert_true(fabsf(dx[i] - (x[i] > 0 ? 1.0f : 0.0f)) < 1e-6f);
        assert_true(dg[i] == dx[i] && du[i] == out[i]);
    }
    /* The tanh GELU saturates as SiLU does, far enough that x (1 - s) z'
     * overflows (x = -2e13, -1e18; 16 and 8 lanes, then the tail), and a
     * NaN stays NaN. */
    float gx[25], g1[25], gout[25], gdg[25], gdu[25];
    for (int i = 0; i < 25; i++) {
        gx[i] = i % 6 == 4 ? -2e13f : i % 6 == 5 ? -1e18f : x[i % 6 % 4];
        g1[i] = 1.0f;
    }
    gx[24] = NAN;
    geglu_fwd(gout, gx, g1, 25, LOOM_F32);
    geglu_bwd(gdg, gdu, g1, gx, g1, 25, LOOM_F32);
    for (int i = 0; i < 24; i++) {
        assert_true(isfinite(gout[i]) && isfinite(gdg[i]) && isfinite(gdu[i]));
        assert_true(fabsf(gout[i] - (gx[i] > 0 ? gx[i] : 0.0f)) <= 1e-6f * fabsf(gx[i]) + 1e-30f);
        assert_true(fabsf(gdg[i] - (gx[i] > 0 ? 1.0f : 0.0f)) < 1e-6f && gdu[i] == gout[i]);
    }
    assert_true(isnan(gout[24]) && isnan(gdg[24]));
}

/* Outputs may alias inputs: in place gives the same bits. */
static void test_in_place(void **state) {
    (void)state;
    ew_data d = ew_make(LOOM_BF16);
    void *out = malloc(N_ELEMS * 2), *dg = malloc(N_ELEMS * 2), *du = malloc(N_ELEMS * 2);
    void *du2 = malloc(N_ELEMS * 2);
    swiglu_fwd(out, d.a, d.b, N_ELEMS, LOOM_BF16);
    swiglu_bwd(dg, du, d.dout, d.a, d.b, N_ELEMS, LOOM_BF16);
    swiglu_bwd(d.dout, du2, d.dout, d.a, d.b, N_ELEMS, LOOM_BF16); /* dgate over dout */
    assert_true(tu_bits_equal(d.dout, dg, N_ELEMS * 2, "dgate over dout"));
    assert_true(tu_bits_equal(du2, du, N_ELEMS * 2, "dup with dgate over dout"));
    ew_free(&d);
    d = ew_make(LOOM_BF16);
    swiglu_bwd(d.a, d.b, d.dout, d.a, d.b, N_ELEMS, LOOM_BF16); /* over gate and up */
    assert_true(tu_bits_equal(d.a, dg, N_ELEMS * 2, "dgate in place"));
    assert_true(tu_bits_equal(d.b, du, N_ELEMS * 2, "dup in place"));
    free(out); free(dg); free(du); free(du2);
    ew_free(&d);
    d = ew_make(LOOM_BF16); /* GeGLU over its gate, as generate runs it */
    void *ge = malloc(N_ELEMS * 2), *gdg = malloc(N_ELEMS * 2), *gdu = malloc(N_ELEMS * 2);
    geglu_fwd(ge, d.a, d.b, N_ELEMS, LOOM_BF16);
    geglu_bwd(gdg, gdu, d.dout, d.a, d.b, N_ELEMS, LOOM_BF16);
    geglu_bwd(d.dout, d.b, d.dout, d.a, d.b, N_ELEMS, LOOM_BF16); /* dgate over dout, dup over up */
    assert_true(tu_bits_equal(d.dout, gdg, N_ELEMS * 2, "geglu dgate over dout"));
    assert_true(tu_bits_equal(d.b, gdu, N_ELEMS * 2, "geglu dup over up"));
    ew_free(&d);
    d = ew_make(LOOM_BF16);
    geglu_fwd(d.a, d.a, d.b, N_ELEMS, LOOM_BF16);
    assert_true(tu_bits_equal(d.a, ge, N_ELEMS * 2, "geglu over gate"));
    free(ge); free(gdg); free(gdu);
    ew_free(&d);
}

/* The 16-lane and 8-lane loops do the same operations per element: every
 * output has the same bits on both levels (and on a length off both
 * vector widths). */
static void test_levels_agree(void **state) {
    (void)state;
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    if (strncmp(was, "avx512", 6) != 0) skip(); /* one level only, or capped by the group */
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    const size_t ns[] = {N_ELEMS, N_ELEMS - 11}; /* 16-lane vectors then 8, then 8 and 5 left */
    for (int t = 0; t < 6; t++) {
        size_t n = ns[t % 2];
        ew_data d = ew_make(dts[t / 2]);
        void *o[2][8];
        for (int lv = 0; lv < 2; lv++) {
            assert_int_equal(loom_set_simd_level(lv ? "avx2" : was), LOOM_OK);
            for (int k = 0; k < 8; k++) o[lv][k] = malloc(N_ELEMS * 4);
            silu_fwd(o[lv][0], d.a, n, d.dt);
            silu_bwd(o[lv][1], d.dout, d.a, n, d.dt);
            swiglu_fwd(o[lv][2], d.a, d.b, n, d.dt);
            swiglu_bwd(o[lv][3], o[lv][4], d.dout, d.a, d.b, n, d.dt);
            geglu_fwd(o[lv][5], d.a, d.b, n, d.dt);
            geglu_bwd(o[lv][6], o[lv][7], d.dout, d.a, d.b, n, d.dt);
        }
        assert_int_equal(loom_set_simd_level(was), LOOM_OK);
        for (int k = 0; k < 8; k++) {
            assert_true(tu_bits_equal(o[0][k], o[1][k], n * loom_dtype_size(d.dt), "avx512f vs avx2"));
            free(o[0][k]);
            free(o[1][k]);
        }
        ew_free(&d);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vs_formula),
        cmocka_unit_test(test_bwd_finite_differences),
        cmocka_unit_test(test_extreme_inputs),
        cmocka_unit_test(test_in_place),
        cmocka_unit_test(test_levels_agree),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
