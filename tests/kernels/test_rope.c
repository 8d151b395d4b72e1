/*
 * test_rope.c — RoPE: fast kernel vs reference, vs the Hugging Face formula
 * in double, backward as the inverse rotation, in place, and backward vs
 * central finite differences; the scaled frequencies (linear, llama3,
 * Phi-3's longrope, YaRN) and a rotary part of each head (Phi-4-mini's).
 */
#include "testutil.h"
#include "kernels/kernels.h"

#include <math.h>

#define FD_STEP 1e-3f

static double unit_roundoff(loom_dtype dt) {
    return dt == LOOM_BF16 ? 0x1p-8 : dt == LOOM_F16 ? 0x1p-11 : 0x1p-24;
}

typedef struct rope_case {
    int B, T, NH, HS, pos0;
    loom_rope_freqs r; /* {.theta = t}: plain RoPE */
} rope_case;

static size_t rope_n(const rope_case *c) { return (size_t)c->B * c->T * c->NH * c->HS; }

static float *rope_input(const rope_case *c, uint64_t seed) {
    float *x = malloc(rope_n(c) * 4);
    tu_fill_uniform(x, rope_n(c), -1.0f, 1.0f, seed);
    return x;
}

/* Same fp32 angles and rotation on both sides: at most one ulp of dt apart. */
static void check_fwd_vs_ref(const rope_case *c, loom_dtype dt) {
    size_t n = rope_n(c);
    float *xf = rope_input(c, 1);
    void *x = tu_from_f32(xf, n, dt), *o1 = malloc(n * 4), *o2 = malloc(n * 4);
    rope_fwd(o1, x, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, dt);
    rope_fwd_ref(o2, x, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, dt);
    float *a = tu_to_f32(o1, n, dt), *b = tu_to_f32(o2, n, dt);
    TU_ASSERT_CLOSE(a, b, n, 1e-6, 2.0 * unit_roundoff(dt) + 1e-6);
    free(xf); free(x); free(o1); free(o2); free(a); free(b);
}

static const rope_case CASES[] = {
    {2, 5, 3, 16, 0, {.theta = 10000.0f}},
    {1, 7, 2, 8, 1000, {.theta = 10000.0f}},
    {2, 3, 4, 64, 17, {.theta = 500000.0f}},
};
#define N_CASES (sizeof CASES / sizeof CASES[0])

static void test_fwd_vs_ref(void **state) {
    (void)state;
    for (size_t i = 0; i < N_CASES; i++) {
        check_fwd_vs_ref(&CASES[i], LOOM_F32);
        check_fwd_vs_ref(&CASES[i], LOOM_BF16);
        check_fwd_vs_ref(&CASES[i], LOOM_F16);
    }
}

/* The Hugging Face formula in double: out = x cos + rotate_half(x) sin with
 * rotate_half([x1, x2]) = [-x2, x1], angle = pos * theta^(-2i/HS). The kernel
 * forms the angle in fp32 (as HF does): a few ulps of the largest angle,
 * ~(pos0 + T) * 2^-24 each, which moves the output by as much (|x| <= 1). */
static void check_formula(const rope_case *c) {
    size_t n = rope_n(c);
    int H2 = c->HS / 2;
    float *x = rope_input(c, 2), *o = malloc(n * 4), *want = malloc(n * 4);
    rope_fwd(o, x, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, LOOM_F32);
    for (size_t r = 0; r < n / c->HS; r++) {
        int t = (int)(r / c->NH % c->T);
        const float *xr = x + r * c->HS;
        for (int i = 0; i < c->HS; i++) {
            double a = (c->pos0 + t) * pow(c->r.theta, -2.0 * (i % H2) / c->HS);
            double rot = i < H2 ? -xr[i + H2] : xr[i - H2];
            want[r * c->HS + i] = (float)(xr[i] * cos(a) + rot * sin(a));
        }
    }
    double atol = 8.0 * (c->pos0 + c->T) * 0x1p-24 + 1e-6;
    TU_ASSERT_CLOSE(o, want, n, atol, 1e-6);
    free(x); free(o); free(want);
}

static void test_fwd_formula(void **state) {
    (void)state;
    for (size_t i = 0; i < N_CASES; i++) check_formula(&CASES[i]);
}

/* bwd is the transpose = inverse rotation: bwd(fwd(x)) = x up to fp32 rounding
 * of the two rotations (a few 2^-24). Both run in place. */
static void test_bwd_inverts_fwd(void **state) {
    (void)state;
    for (size_t k = 0; k < N_CASES; k++) {
        const rope_case *c = &CASES[k];
        size_t n = rope_n(c);
        float *x = rope_input(c, 3), *y = malloc(n * 4);
        memcpy(y, x, n * 4);
        rope_fwd(y, y, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, LOOM_F32);
        assert_true(tu_close_ratio(y, x, n, 1e-3, 0.0, NULL) > 1.0); // it did rotate
        rope_bwd(y, y, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, LOOM_F32);
        TU_ASSERT_CLOSE(y, x, n, 1e-6, 1e-6);
        free(x); free(y);
    }
}

/* In place gives the same bits as out of place, forward and backward (fp32
 * rotates where the rows lie, other dtypes through converted rows). */
static void check_in_place(loom_dtype dt) {
    const rope_case *c = &CASES[0];
    size_t n = rope_n(c), es = loom_dtype_size(dt);
    float *xf = rope_input(c, 4);
    void *x = tu_from_f32(xf, n, dt), *o = malloc(n * es), *d = malloc(n * es);
    rope_fwd(o, x, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, dt);
    rope_bwd(d, x, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, dt);
    void *y = malloc(n * es);
    memcpy(y, x, n * es);
    rope_fwd(y, y, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, dt);
    assert_true(tu_bits_equal(y, o, n * es, "rope_fwd in place"));
    memcpy(y, x, n * es);
    rope_bwd(y, y, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, dt);
    assert_true(tu_bits_equal(y, d, n * es, "rope_bwd in place"));
    free(xf); free(x); free(o); free(d); free(y);
}

static void test_in_place(void **state) {
    (void)state;
    check_in_place(LOOM_F32);
    check_in_place(LOOM_BF16);
}

/* The angle table is shared between calls and grown when a call reaches
 * past it (as generation does, one position at a time): every call still
 * matches the reference, whatever came before it. */
static void test_table_reuse(void **state) {
    (void)state;
    const rope_case seq[] = {
        {1, 5, 2, 16, 0, {.theta = 10000.0f}},  {1, 3, 2, 16, 4, {.theta = 10000.0f}},  {1, 1, 2, 16, 9, {.theta = 10000.0f}},
        {1, 1, 2, 16, 30, {.theta = 10000.0f}}, {1, 4, 2, 16, 2, {.theta = 10000.0f}},  {1, 4, 2, 16, 2, {.theta = 20000.0f}},
        {1, 4, 2, 8, 2, {.theta = 20000.0f}},   {1, 64, 1, 16, 0, {.theta = 10000.0f}},
    };
    for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) check_fwd_vs_ref(&seq[i], LOOM_F32);
}

/* Blocks that alternate between two RoPEs (Gemma 3's local and global
 * ones), decoding one token at a time: each keeps its table, which grows
 * by doubling, so 64 positions x 6 blocks build a handful of tables, not
 * one per switch (a single-table cache built 384 here). */
static void test_tables_of_two_ropes(void **state) {
    (void)state;
    loom_rope_freqs local = {.theta = 10000.0f}, global = {.theta = 1e6f, .type = LOOM_ROPE_LINEAR, .factor = 8.0f};
    float x[2 * 32], o[2 * 32];
    tu_fill_uniform(x, 64, -1.0f, 1.0f, 31);
    unsigned long before = rope_table_builds();
    for (int pos = 0; pos < 64; pos++)
        for (int l = 0; l < 6; l++) rope_fwd(o, x, 1, 1, 2, 32, pos, l % 3 == 2 ? &global : &local, LOOM_F32);
    unsigned long built = rope_table_builds() - before;
    if (built > 16) fail_msg("%lu tables built for two RoPEs over 64 positions", built);
    assert_true(built >= 2);
}

static double loss_f32(const rope_case *c, const float *x, const float *dout) {
    size_t n = rope_n(c);
    float *o = malloc(n * 4);
    rope_fwd(o, x, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, LOOM_F32);
    double L = 0.0;
    for (size_t i = 0; i < n; i++) L += (double)dout[i] * o[i];
    free(o);
    return L;
}

/* rope_bwd of case c against central differences of L = sum(dout *
 * rope(x)), which is linear in x, so the difference has no truncation
 * error; the fp32 rounding of the two outputs x_i touches, ~2 * 2^-24 (times
 * longrope's factor), over 2h = 2e-3, is ~1e-4. */
static void check_bwd_fd(const rope_case *c, uint64_t seed) {
    size_t n = rope_n(c);
    float *x = rope_input(c, seed), *dout = rope_input(c, seed + 1);
    float *dx = malloc(n * 4), *num = malloc(n * 4);
    rope_bwd(dx, dout, c->B, c->T, c->NH, c->HS, c->pos0, &c->r, LOOM_F32);
    for (size_t i = 0; i < n; i++) {
        float x0 = x[i], xp = x0 + FD_STEP, xm = x0 - FD_STEP;
        x[i] = xp;
        double lp = loss_f32(c, x, dout);
        x[i] = xm;
        double lm = loss_f32(c, x, dout);
        x[i] = x0;
        num[i] = (float)((lp - lm) / ((double)xp - (double)xm));
    }
    TU_ASSERT_CLOSE(dx, num, n, 1e-3, 1e-3);
    free(x); free(dout); free(dx); free(num);
}

static void test_bwd_finite_differences(void **state) {
    (void)state;
    rope_case c = {1, 3, 2, 8, 5, {.theta = 10000.0f}};
    check_bwd_fd(&c, 5);
}

/* Scaled frequencies against Hugging Face's rules worked in double: linear
 * divides each; llama3 (Llama 3.1's numbers: theta 5e5, factor 8, low 1,
 * high 4, original 8192, HS 128) keeps the high frequencies, divides the
 * low ones and blends between, and this head size has all three. */
static void test_scaled_frequencies(void **state) {
    (void)state;
    enum { HS = 128, H2 = HS / 2 };
    float got[H2];
    loom_rope_freqs lin = {.theta = 10000.0f, .type = LOOM_ROPE_LINEAR, .factor = 4.0f};
    rope_inv_freq(&lin, HS, got);
    for (int i = 0; i < H2; i++) {
        double want = pow(10000.0, -2.0 * i / HS) / 4.0;
        assert_true(fabs(got[i] - want) <= 1e-6 * want);
    }
    loom_rope_freqs l3 = {.theta = 500000.0f, .type = LOOM_ROPE_LLAMA3, .factor = 8.0f, .low_freq_factor = 1.0f,
                          .high_freq_factor = 4.0f, .original_max_pos = 8192};
    rope_inv_freq(&l3, HS, got);
    int kept = 0, divided = 0, blended = 0;
    for (int i = 0; i < H2; i++) {
        double f = pow(500000.0, -2.0 * i / HS), w = 2.0 * M_PI / f, want;
        if (w < 8192.0 / 4.0) want = f, kept++;
        else if (w > 8192.0 / 1.0) want = f / 8.0, divided++;
        else {
            double sm = (8192.0 / w - 1.0) / (4.0 - 1.0);
            want = (1.0 - sm) * f / 8.0 + sm * f;
            blended++;
        }
        if (!(fabs(got[i] - want) <= 1e-5 * want)) fail_msg("inv_freq[%d] = %g, want %g", i, got[i], want);
    }
    assert_true(kept > 0 && divided > 0 && blended > 0);
    /* the kernel uses them (and its shared table tells the scalings apart) */
    const rope_case seq[] = {{1, 9, 2, HS, 3, {.theta = 500000.0f}}, {1, 9, 2, HS, 3, l3}, {1, 9, 2, HS, 3, lin},
                             {1, 9, 2, HS, 3, {.theta = 10000.0f}}};
    for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) check_fwd_vs_ref(&seq[i], LOOM_F32);
    size_t n = rope_n(&seq[0]);
    float *x = rope_input(&seq[0], 9), *a = malloc(n * 4), *b = malloc(n * 4);
    rope_fwd(a, x, 1, 9, 2, HS, 3, &seq[0].r, LOOM_F32);
    rope_fwd(b, x, 1, 9, 2, HS, 3, &l3, LOOM_F32);
    assert_false(tu_bits_equal(a, b, n * 4, NULL)); /* the low frequencies moved */
    free(x); free(a); free(b);
}

/* The kernel's forward o of x against the rotation in double by the angles
 * pos * freq[i % (HS / 2)] with cosines and sines times amp; the fp32
 * angle's rounding (~pos * 2^-24) dominates the tolerance. */
static void assert_rotation(const rope_case *c, const float *x, const float *o, const double *freq, double amp) {
    size_t n = rope_n(c);
    int H2 = c->HS / 2;
    float *want = malloc(n * 4);
    for (size_t r = 0; r < n / (size_t)c->HS; r++) {
        int t = (int)(r / (size_t)c->NH % (size_t)c->T);
        const float *xr = x + r * (size_t)c->HS;
        for (int i = 0; i < c->HS; i++) {
            double a = (c->pos0 + t) * freq[i % H2], rot = i < H2 ? -xr[i + H2] : xr[i - H2];
            want[r * (size_t)c->HS + i] = (float)(amp * (xr[i] * cos(a) + rot * sin(a)));
        }
    }
    TU_ASSERT_CLOSE(o, want, n, 8.0 * (c->pos0 + c->T) * 0x1p-24 + 1e-6, 1e-6);
    free(want);
}

/* Phi-3's longrope with its short factors: against the formula in double
 * (angle pos / (ext_i theta^(2i/HS)), cosine and sine times the attention
 * factor), against the reference in each dtype, and its backward (the
 * scaled rotation's transpose) against central differences; the shared
 * table tells two sets of factors apart. */
static void test_longrope(void **state) {
    (void)state;
    enum { HS = 16, H2 = HS / 2 };
    rope_case c = {2, 7, 3, HS, 5, {.theta = 10000.0f, .type = LOOM_ROPE_LONGROPE, .attention_factor = 1.19f,
                                     .n_ext = H2}};
    for (int i = 0; i < H2; i++) c.r.ext[i] = 1.0f + 0.37f * (float)i;
    check_fwd_vs_ref(&c, LOOM_F32);
    check_fwd_vs_ref(&c, LOOM_BF16);
    size_t n = rope_n(&c);
    float *x = rope_input(&c, 12), *o = malloc(n * 4);
    double freq[H2];
    for (int i = 0; i < H2; i++) freq[i] = 1.0 / (c.r.ext[i] * pow(c.r.theta, 2.0 * i / HS));
    rope_fwd(o, x, c.B, c.T, c.NH, c.HS, c.pos0, &c.r, LOOM_F32);
    assert_rotation(&c, x, o, freq, 1.19);
    check_bwd_fd(&c, 13);
    rope_case d = c, e = c;
    d.r.ext[3] = 2.5f;            /* one factor else: another table */
    e.r.attention_factor = 1.25f; /* the attention factor else: another too */
    float *o2 = malloc(n * 4), *o3 = malloc(n * 4);
    rope_fwd(o2, x, c.B, c.T, c.NH, c.HS, c.pos0, &d.r, LOOM_F32);
    rope_fwd(o3, x, c.B, c.T, c.NH, c.HS, c.pos0, &e.r, LOOM_F32);
    assert_false(tu_bits_equal(o, o2, n * 4, NULL));
    assert_false(tu_bits_equal(o, o3, n * 4, NULL));
    check_fwd_vs_ref(&d, LOOM_F32);
    check_fwd_vs_ref(&e, LOOM_F32);
    check_fwd_vs_ref(&c, LOOM_F32);
    free(o3);
    free(x); free(o); free(o2);
}

/* A rotary part of each head (Phi-4-mini's partial_rotary_factor: 12 of
 * 16 here): its halves pair with the frequencies theta^(-2i/12), the other
 * 4 elements pass through bit for bit; against the formula in double, the
 * reference in each dtype, in place, and finite differences; with
 * longrope's factors, 6 of them; the table tells it from the whole head's. */
static void test_partial_rotary(void **state) {
    (void)state;
    enum { HS = 16, RD = 12, R2 = RD / 2 };
    rope_case c = {2, 5, 3, HS, 7, {.theta = 10000.0f, .rotary_dim = RD}};
    check_fwd_vs_ref(&c, LOOM_F32);
    check_fwd_vs_ref(&c, LOOM_BF16);
    size_t n = rope_n(&c);
    float *x = rope_input(&c, 41), *o = malloc(n * 4), *want = malloc(n * 4), *whole = malloc(n * 4);
    rope_fwd(o, x, c.B, c.T, c.NH, c.HS, c.pos0, &c.r, LOOM_F32);
    for (size_t r = 0; r < n / HS; r++) {
        int t = (int)(r / c.NH % c.T);
        const float *xr = x + r * HS;
        for (int i = 0; i < HS; i++) {
            if (i >= RD) { want[r * HS + i] = xr[i]; continue; }
            double a = (c.pos0 + t) * pow(10000.0, -2.0 * (i % R2) / RD), rot = i < R2 ? -xr[i + R2] : xr[i - R2];
            want[r * HS + i] = (float)(xr[i] * cos(a) + rot * sin(a));
        }
    }
    TU_ASSERT_CLOSE(o, want, n, 8.0 * (c.pos0 + c.T) * 0x1p-24 + 1e-6, 1e-6);
    for (size_t r = 0; r < n / HS; r++) /* passed through, exactly */
        assert_true(tu_bits_equal(o + r * HS + RD, x + r * HS + RD, (HS - RD) * 4, "pass-through"));
    memcpy(whole, x, n * 4); /* in place */
    rope_fwd(whole, whole, c.B, c.T, c.NH, c.HS, c.pos0, &c.r, LOOM_F32);
    assert_true(tu_bits_equal(whole, o, n * 4, "in place"));
    rope_case full = c;
    full.r.rotary_dim = 0;
    rope_fwd(whole, x, c.B, c.T, c.NH, c.HS, c.pos0, &full.r, LOOM_F32);
    assert_false(tu_bits_equal(whole, o, n * 4, NULL));
    check_bwd_fd(&c, 42);
    rope_case lr = {1, 4, 2, HS, 3, {.theta = 10000.0f, .type = LOOM_ROPE_LONGROPE, .attention_factor = 1.1f,
                                     .n_ext = R2, .rotary_dim = RD}};
    for (int i = 0; i < R2; i++) lr.r.ext[i] = 1.0f + 0.5f * (float)i;
    check_fwd_vs_ref(&lr, LOOM_F32);
    check_bwd_fd(&lr, 43);
    free(x); free(o); free(want); free(whole);
}

/* YaRN's frequency of pair i worked in double from the paper's rules (as
 * Hugging Face's _compute_yarn_parameters states them): the dimensions
 * d(beta) = HS ln(orig / (2 pi beta)) / (2 ln theta) for beta_fast and
 * beta_slow bound a ramp (floored and ceiled with truncate) between the
 * extrapolated frequency (kept) and the interpolated one (divided by
 * factor). */
static double yarn_want(const loom_rope_freqs *r, int HS, int i) {
    double lo = HS * log(r->original_max_pos / (2.0 * M_PI * r->beta_fast)) / (2.0 * log(r->theta));
    double hi = HS * log(r->original_max_pos / (2.0 * M_PI * r->beta_slow)) / (2.0 * log(r->theta));
    if (r->truncate) lo = floor(lo), hi = ceil(hi);
    lo = fmax(lo, 0.0);
    hi = fmin(hi, HS - 1.0);
    double ramp = fmin(fmax((i - lo) / (hi - lo), 0.0), 1.0), f = pow(r->theta, -2.0 * i / HS);
    return f / r->factor * ramp + f * (1.0 - ramp);
}

/* YaRN (Qwen 2.5's numbers: theta 1e6, factor 4 over 32768 positions, HS
 * 128): the frequencies against yarn_want, truncated and not, with pairs
 * kept, divided and blended; the kernel against the formula in double
 * (cosines and sines times the attention factor), the reference in each
 * dtype and finite differences; the shared table tells the betas, the
 * truncation and the attention factor apart. */
static void test_yarn(void **state) {
    (void)state;
    enum { HS = 128, H2 = HS / 2 };
    loom_rope_freqs y = {.theta = 1e6f, .type = LOOM_ROPE_YARN, .factor = 4.0f, .original_max_pos = 32768,
                         .attention_factor = 1.1386294f, .beta_fast = 32.0f, .beta_slow = 1.0f, .truncate = 1};
    float got[H2];
    for (int tr = 1; tr >= 0; tr--) {
        y.truncate = tr;
        rope_inv_freq(&y, HS, got);
        int kept = 0, divided = 0, blended = 0;
        for (int i = 0; i < H2; i++) {
            double want = yarn_want(&y, HS, i), f = pow(1e6, -2.0 * i / HS);
            if (!(fabs(got[i] - want) <= 1e-5 * want)) fail_msg("truncate %d: inv_freq[%d] = %g, want %g", tr, i, got[i], want);
            kept += fabs(want - f) <= 1e-9 * f;
            divided += fabs(want - f / 4.0) <= 1e-9 * f;
        }
        blended = H2 - kept - divided;
        assert_true(kept > 0 && divided > 0 && blended > 0);
    }
    y.truncate = 1;
    rope_case c = {1, 5, 2, HS, 40000, y}; /* positions past the original context */
    check_fwd_vs_ref(&c, LOOM_F32);
    check_fwd_vs_ref(&c, LOOM_BF16);
    size_t n = rope_n(&c);
    float *x = rope_input(&c, 21), *o = malloc(n * 4);
    double freq[H2];
    for (int i = 0; i < H2; i++) freq[i] = yarn_want(&y, HS, i);
    rope_fwd(o, x, c.B, c.T, c.NH, c.HS, c.pos0, &c.r, LOOM_F32);
    assert_rotation(&c, x, o, freq, 1.1386294); /* positions ~4e4, past the original context */
    rope_case small = {1, 3, 2, 16, 5, {.theta = 10000.0f, .type = LOOM_ROPE_YARN, .factor = 8.0f,
                                        .original_max_pos = 64, .attention_factor = 1.2f, .beta_fast = 32.0f,
                                        .beta_slow = 1.0f, .truncate = 1}};
    check_bwd_fd(&small, 22);
    rope_case d = c, e = c, f = c;
    d.r.beta_slow = 2.0f;           /* another range: another table */
    e.r.truncate = 0;               /* not truncated: another too */
    f.r.attention_factor = 1.0f;    /* and another attention factor */
    const rope_case *others[3] = {&d, &e, &f};
    float *o2 = malloc(n * 4);
    for (int k = 0; k < 3; k++) {
        rope_fwd(o2, x, c.B, c.T, c.NH, c.HS, c.pos0, &others[k]->r, LOOM_F32);
        assert_false(tu_bits_equal(o, o2, n * 4, NULL));
        check_fwd_vs_ref(others[k], LOOM_F32);
    }
    free(x); free(o); free(o2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fwd_vs_ref),
        cmocka_unit_test(test_fwd_formula),
        cmocka_unit_test(test_bwd_inverts_fwd),
        cmocka_unit_test(test_in_place),
        cmocka_unit_test(test_table_reuse),
        cmocka_unit_test(test_tables_of_two_ropes),
        cmocka_unit_test(test_bwd_finite_differences),
        cmocka_unit_test(test_scaled_frequencies),
        cmocka_unit_test(test_longrope),
        cmocka_unit_test(test_yarn),
        cmocka_unit_test(test_partial_rotary),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
