/*
 * test_elementwise.c — add/mul/scale/divide/accumulate, sumsq/has_nonfinite,
 * dropout and AdamW against plain loops.
 *
 * add/mul/scale/divide do one fp32 operation and one rounding, so a plain loop
 * doing the same must match bit for bit. accumulate may fuse its multiply-
 * add, so it gets one ulp of the destination dtype. Dropout's mask is
 * recomputed here from the Philox definition in kernels.h.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

static const loom_dtype dtypes[] = { LOOM_F32, LOOM_BF16, LOOM_F16 };
static const size_t sizes[] = { 1, 5, 29, 100003 }; /* 29: 16 + 8 + 5 lanes; the last runs in parallel */

static void *random_dt(size_t n, loom_dtype dt, float lo, float hi, uint64_t seed) {
    float *f = malloc(n * sizeof(float) + 1);
    tu_fill_uniform(f, n, lo, hi, seed);
    void *p = tu_from_f32(f, n, dt);
    free(f);
    return p;
}

/* ------------------------------------------------------------ binary ops */

enum { OP_ADD, OP_MUL, OP_SCALE, OP_DIVIDE };

static float op_ref(int op, float x, float y, float s) {
    return op == OP_ADD ? x + y : op == OP_MUL ? x * y : op == OP_SCALE ? x * s : x / s;
}

static void run_op(int op, void *out, const void *a, const void *b, float s, size_t n,
                   loom_dtype dt) {
    if (op == OP_ADD) add_fwd(out, a, b, n, dt);
    else if (op == OP_MUL) mul_fwd(out, a, b, n, dt);
    else if (op == OP_SCALE) scale_fwd(out, a, s, n, dt);
    else divide_fwd(out, a, s, n, dt); /* by -1.37: not a multiply by its reciprocal */
}

static void check_op(int op, size_t n, loom_dtype dt, int in_place) {
    size_t es = loom_dtype_size(dt);
    void *a = random_dt(n, dt, -3, 3, 1 + n), *b = random_dt(n, dt, -3, 3, 2 + n);
    void *want = malloc(n * es + 1), *out = in_place ? a : malloc(n * es + 1);
    const float s = -1.37f;
    for (size_t i = 0; i < n; i++)
        loom_store(want, i, dt, op_ref(op, loom_load(a, i, dt), loom_load(b, i, dt), s));
    run_op(op, out, a, b, s, n, dt);
    assert_true(tu_bits_equal(out, want, n * es, loom_dtype_name(dt)));
    if (!in_place) free(out);
    free(a); free(b); free(want);
}

static void test_binary_ops(void **state) {
    (void)state;
    for (int op = OP_ADD; op <= OP_DIVIDE; op++)
        for (int d = 0; d < 3; d++)
            for (int s = 0; s < 3; s++) {
                check_op(op, sizes[s], dtypes[d], 0);
                check_op(op, sizes[s], dtypes[d], 1);
            }
}

/* Gemma 2's softcap: cap tanh(x / cap) against the formula in double (fp32
 * tanhf: a few 2^-24, then one rounding to dt), its backward against
 * dy (1 - (y / cap)^2) from the output, in place too. */
static void test_softcap(void **state) {
    (void)state;
    const float cap = 1.5f;
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 4; s++) {
            size_t n = sizes[s];
            loom_dtype dt = dtypes[d];
            void *x = random_dt(n, dt, -6, 6, 40 + n), *dy = random_dt(n, dt, -1, 1, 41 + n);
            void *y = malloc(n * 4 + 1), *dx = malloc(n * 4 + 1);
            float *want = malloc(n * 4 + 1), *wantd = malloc(n * 4 + 1);
            softcap_fwd(y, x, cap, n, dt);
            softcap_bwd(dx, dy, y, cap, n, dt);
            for (size_t i = 0; i < n; i++) {
                want[i] = (float)(cap * tanh((double)loom_load(x, i, dt) / cap));
                double t = loom_load(y, i, dt) / (double)cap;
                wantd[i] = (float)(loom_load(dy, i, dt) * (1.0 - t * t));
            }
            double u = dt == LOOM_F32 ? 0x1p-24 : dt == LOOM_BF16 ? 0x1p-8 : 0x1p-11;
            float *got = tu_to_f32(y, n, dt), *gotd = tu_to_f32(dx, n, dt);
            TU_ASSERT_CLOSE(got, want, n, 1e-6, u + 1e-6);
            TU_ASSERT_CLOSE(gotd, wantd, n, 1e-6, u + 1e-5);
            softcap_bwd(dy, dy, y, cap, n, dt); /* dx over dy */
            assert_true(tu_bits_equal(dy, dx, n * loom_dtype_size(dt), "softcap_bwd in place"));
            free(x); free(dy); free(y); free(dx); free(want); free(wantd); free(got); free(gotd);
        }
}

/* dst += scale * src in every (dst, src) dtype pair. */
static void test_accumulate(void **state) {
    (void)state;
    const float scale = 0.625f;
    for (int dd = 0; dd < 3; dd++)
        for (int sd = 0; sd < 3; sd++)
            for (int s = 0; s < 3; s++) {
                size_t n = sizes[s];
                loom_dtype dt = dtypes[dd], st = dtypes[sd];
                void *dst = random_dt(n, dt, -2, 2, 10 + n), *src = random_dt(n, st, -2, 2, 20 + n);
                float *want = malloc(n * sizeof(float) + 1);
                for (size_t i = 0; i < n; i++)
                    want[i] = loom_round_to(
                        (float)((double)loom_load(dst, i, dt) + (double)scale * loom_load(src, i, st)), dt);
                accumulate(dst, dt, src, st, scale, n);
                float *got = tu_to_f32(dst, n, dt);
                /* one ulp of dst's dtype, relative to values up to 3.25 */
                double ulp = dt == LOOM_F32 ? 0x1p-22 : dt == LOOM_BF16 ? 0x1p-6 : 0x1p-9;
                TU_ASSERT_CLOSE(got, want, n, ulp, 0.0);
                free(dst); free(src); free(want); free(got);
            }
}

/* ------------------------------------------------------------ reductions */

static void test_sumsq(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 3; s++) {
            size_t n = sizes[s];
            void *x = random_dt(n, dtypes[d], -2, 2, 30 + n);
            double want = 0.0;
            for (size_t i = 0; i < n; i++) {
                double v = loom_load(x, i, dtypes[d]);
                want += v * v;
            }
            double got = sumsq(x, n, dtypes[d]);
            assert_true(fabs(got - want) <= 1e-12 * want);
            loom_set_threads(1); /* fixed chunking: same bits on any thread count */
            double one = sumsq(x, n, dtypes[d]);
            loom_set_threads(0);
            assert_memory_equal(&one, &got, sizeof got);
            loom_store(x, n / 2, dtypes[d], NAN);
            assert_true(isnan(sumsq(x, n, dtypes[d])));
            loom_store(x, n / 2, dtypes[d], -INFINITY);
            assert_true(isinf(sumsq(x, n, dtypes[d])));
            free(x);
        }
    assert_true(sumsq(NULL, 0, LOOM_F32) == 0.0);
}

static void test_has_nonfinite(void **state) {
    (void)state;
    const float bad[] = { NAN, INFINITY, -INFINITY };
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 3; s++) {
            size_t n = sizes[s];
            loom_dtype dt = dtypes[d];
            void *x = random_dt(n, dt, -2, 2, 40 + n);
            /* the largest finite value of each dtype is still finite */
            float big = dt == LOOM_F32 ? 3.4028235e38f : dt == LOOM_BF16 ? 3.3895314e38f : 65504.0f;
            loom_store(x, 0, dt, -big);
            assert_int_equal(has_nonfinite(x, n, dt), 0);
            for (int b = 0; b < 3; b++) {
                size_t at = n - 1 - (size_t)b * (n / 3);
                float keep = loom_load(x, at, dt);
                loom_store(x, at, dt, bad[b]);
                assert_int_equal(has_nonfinite(x, n, dt), 1);
                loom_store(x, at, dt, keep);
            }
            assert_int_equal(has_nonfinite(x, n, dt), 0);
            free(x);
        }
}

/* --------------------------------------------------------------- dropout */

/* The mask by its definition: lane i % 4 of Philox(seed, offset + i / 4). */
static int mask_ref(size_t i, float p, uint64_t seed, uint64_t offset) {
    uint32_t r[4];
    loom_philox4x32(seed, offset + i / 4, r);
    return loom_u32_to_unit(r[i % 4]) >= p;
}

/* Forward on inputs in [0.5, 1.5) (never 0): out is in * scale or 0 per
 * the reference mask; returns how many were kept. */
static size_t check_dropout_fwd(const void *in, void *out, size_t n, float p, uint64_t seed,
                                uint64_t offset, loom_dtype dt) {
    dropout_fwd(out, in, n, p, seed, offset, dt);
    float scale = 1.0f / (1.0f - p);
    size_t kept = 0, wrong = 0;
    for (size_t i = 0; i < n; i++) {
        int m = mask_ref(i, p, seed, offset);
        float want = m ? loom_round_to(loom_load(in, i, dt) * scale, dt) : 0.0f;
        wrong += loom_load(out, i, dt) != want;
        kept += m;
    }
    assert_int_equal(wrong, 0);
    return kept;
}

static void test_dropout_mask(void **state) {
    (void)state;
    const float p = 0.3f;
    for (int d = 0; d < 3; d++) {
        loom_dtype dt = dtypes[d];
        for (int s = 0; s < 3; s++) {
            size_t n = sizes[s];
            void *in = random_dt(n, dt, 0.5f, 1.5f, 50 + n), *out = malloc(n * 4 + 1);
            size_t kept = check_dropout_fwd(in, out, n, p, 1234, 77, dt);
            if (n > 1000) { /* binomial: within 6 standard deviations of n (1-p) */
                double sd = sqrt(n * p * (1.0 - p));
                assert_true(fabs((double)kept - n * (1.0 - p)) < 6.0 * sd);
            }
            free(in); free(out);
        }
    }
}

/* A window of a larger tensor takes the larger tensor's mask: the windows
 * of D x T ranks (D row blocks, data parallelism's; T column blocks, tensor
 * parallelism's), put back in place, are the whole tensor's dropout, bit for
 * bit, for windows whose starts fall anywhere in a Philox block (whole-row
 * windows too, T 1), and in parallel (many rows). */
static void test_dropout_window(void **state) {
    (void)state;
    const float p = 0.4f;
    /* all rows, width, D, T; the last two run in parallel */
    static const size_t shapes[][4] = {{3, 10, 1, 2}, {7, 6, 1, 3}, {6, 7, 3, 1}, {10, 6, 5, 2},
                                       {6000, 9, 1, 3}, {6002, 9, 2, 1}};
    for (int d = 0; d < 3; d++) {
        loom_dtype dt = dtypes[d];
        size_t es = loom_dtype_size(dt);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            size_t all = shapes[k][0], width = shapes[k][1], D = shapes[k][2], T = shapes[k][3];
            size_t rows = all / D, cols = width / T, n = all * width;
            void *x = random_dt(n, dt, 0.5f, 1.5f, 70 + k), *whole = malloc(n * es), *pieces = malloc(n * es);
            void *in = malloc(rows * cols * es), *out = malloc(rows * cols * es);
            dropout_fwd(whole, x, n, p, 5, 300, dt);
            for (size_t q = 0; q < D; q++)
                for (size_t t = 0; t < T; t++) {
                    size_t row0 = q * rows, col0 = t * cols;
                    for (size_t r = 0; r < rows; r++)
                        memcpy((char *)in + r * cols * es, (char *)x + ((row0 + r) * width + col0) * es, cols * es);
                    dropout_window(out, in, rows, cols, row0, col0, width, p, 5, 300, dt);
                    for (size_t r = 0; r < rows; r++)
                        memcpy((char *)pieces + ((row0 + r) * width + col0) * es, (char *)out + r * cols * es,
                               cols * es);
                }
            assert_true(tu_bits_equal(pieces, whole, n * es, "dropout window"));
            memset(pieces, 0, n * es);
            dropout_window(pieces, x, all, width, 0, 0, width, p, 5, 300, dt); /* the whole: dropout_fwd */
            assert_true(tu_bits_equal(pieces, whole, n * es, "dropout window, whole"));
            free(x); free(whole); free(pieces); free(in); free(out);
        }
    }
}

/* The column kernels (DoRA's, a bias's) against plain loops: colscale scales each column
 * (in place too), coldot's fp64 column sums in row order are the loops'
 * bits, with one thread or many, and coldot_colscale is both in one pass
 * (in place over g). */
static void test_column_kernels(void **state) {
    (void)state;
    enum { COLS = 300 }; /* more than one 256-column block, and a partial one */
    const size_t rows = 700, cols = COLS;
    for (int d = 0; d < 3; d++) {
        loom_dtype dt = dtypes[d];
        size_t es = loom_dtype_size(dt), n = rows * cols;
        void *x = random_dt(n, dt, -1.0f, 1.0f, 80), *g = random_dt(n, dt, -1.0f, 1.0f, 81);
        void *out = malloc(n * es), *ref = malloc(n * es);
        float s[COLS], dot[COLS], dot1[COLS];
        tu_fill_uniform(s, cols, -2.0f, 2.0f, 82);
        colscale(out, x, s, rows, cols, dt);
        for (size_t r = 0; r < rows; r++)
            for (size_t c = 0; c < cols; c++) loom_store(ref, r * cols + c, dt, loom_load(x, r * cols + c, dt) * s[c]);
        assert_true(tu_bits_equal(out, ref, n * es, "colscale"));
        memcpy(out, x, n * es);
        colscale(out, out, s, rows, cols, dt);
        assert_true(tu_bits_equal(out, ref, n * es, "colscale in place"));
        coldot(dot, x, g, rows, cols, dt);
        loom_set_threads(1);
        coldot(dot1, x, g, rows, cols, dt);
        loom_set_threads(0);
        for (size_t c = 0; c < cols; c++) {
            double acc = 0;
            for (size_t r = 0; r < rows; r++)
                acc += (double)loom_load(x, r * cols + c, dt) * (double)loom_load(g, r * cols + c, dt);
            assert_true(dot[c] == (float)acc && dot1[c] == dot[c]);
        }
        /* the fused pass: the same sums, and g scaled in place */
        memcpy(out, g, n * es);
        coldot_colscale(dot1, out, x, out, s, rows, cols, dt);
        colscale(ref, g, s, rows, cols, dt);
        assert_true(memcmp(dot1, dot, sizeof dot) == 0);
        assert_true(tu_bits_equal(out, ref, n * es, "coldot_colscale"));
        /* a bias: rowadd adds it to every row (in place too), colsum sums
         * the columns in fp32 in row order onto what dst holds */
        void *b = random_dt(cols, dt, -1.0f, 1.0f, 83);
        rowadd(out, x, b, rows, cols, dt);
        for (size_t r = 0; r < rows; r++)
            for (size_t c = 0; c < cols; c++)
                loom_store(ref, r * cols + c, dt, loom_load(x, r * cols + c, dt) + loom_load(b, c, dt));
        assert_true(tu_bits_equal(out, ref, n * es, "rowadd"));
        memcpy(out, x, n * es);
        rowadd(out, out, b, rows, cols, dt);
        assert_true(tu_bits_equal(out, ref, n * es, "rowadd in place"));
        for (size_t c = 0; c < cols; c++) dot[c] = dot1[c] = (float)c; /* added to */
        colsum(dot, g, rows, cols, dt);
        loom_set_threads(1);
        colsum(dot1, g, rows, cols, dt);
        loom_set_threads(0);
        for (size_t c = 0; c < cols; c++) {
            float acc = (float)c;
            for (size_t r = 0; r < rows; r++) acc += loom_load(g, r * cols + c, dt);
            assert_true(dot[c] == acc && dot1[c] == acc);
        }
        free(b);
        free(x); free(g); free(out); free(ref);
    }
}

/* Backward with the same (seed, offset) drops the same elements; a
 * different offset gives a different mask; replay and thread count do not
 * change a bit. */
static void test_dropout_replay(void **state) {
    (void)state;
    const size_t n = 100003;
    const float p = 0.25f;
    for (int d = 0; d < 3; d++) {
        loom_dtype dt = dtypes[d];
        size_t es = loom_dtype_size(dt);
        void *x = random_dt(n, dt, 0.5f, 1.5f, 60), *ones = random_dt(n, dt, 1, 1, 61);
        void *y = malloc(n * es), *y2 = malloc(n * es), *dx = malloc(n * es);
        dropout_fwd(y, x, n, p, 99, 1000, dt);
        dropout_bwd(dx, ones, n, p, 99, 1000, dt);
        size_t mismatched = 0, differ = 0;
        for (size_t i = 0; i < n; i++)
            mismatched += (loom_load(y, i, dt) == 0.0f) != (loom_load(dx, i, dt) == 0.0f);
        assert_int_equal(mismatched, 0);
        loom_set_threads(1);
        dropout_fwd(y2, x, n, p, 99, 1000, dt);
        loom_set_threads(0);
        assert_true(tu_bits_equal(y, y2, n * es, "dropout replay"));
        dropout_fwd(y2, x, n, p, 99, 1000 + dropout_blocks(n), dt);
        for (size_t i = 0; i < n; i++)
            differ += (loom_load(y, i, dt) == 0.0f) != (loom_load(y2, i, dt) == 0.0f);
        /* independent masks disagree on 2 p (1 - p) of the elements */
        assert_true(differ > n * 2 * p * (1 - p) / 2);
        free(x); free(ones); free(y); free(y2); free(dx);
    }
}

static void test_dropout_edges(void **state) {
    (void)state;
    const size_t n = 1001;
    void *x = random_dt(n, LOOM_BF16, -1, 1, 70), *y = malloc(n * 2);
    dropout_fwd(y, x, n, 0.0f, 5, 6, LOOM_BF16); /* p = 0 copies */
    assert_true(tu_bits_equal(y, x, n * 2, "p = 0"));
    dropout_fwd(y, x, n, 1.0f, 5, 6, LOOM_BF16); /* p = 1 drops everything */
    for (size_t i = 0; i < n; i++) assert_true(loom_load(y, i, LOOM_BF16) == 0.0f);
    check_dropout_fwd(x, y, n, 0.5f, 5, 6, LOOM_BF16);
    dropout_fwd(x, x, n, 0.5f, 5, 6, LOOM_BF16); /* in place gives the same */
    assert_true(tu_bits_equal(x, y, n * 2, "dropout in place"));
    free(x); free(y);
}

/* ----------------------------------------------------------------- AdamW */

/* The kernels.h formula, in double. */
static void adamw_ref(double *p, double *m, double *v, const float *g, size_t n, double lr,
                      double b1, double b2, double eps, double wd, int t, double gs) {
    for (size_t i = 0; i < n; i++) {
        double gi = g[i] * gs;
        m[i] = b1 * m[i] + (1 - b1) * gi;
        v[i] = b2 * v[i] + (1 - b2) * gi * gi;
        double mhat = m[i] / (1 - pow(b1, t)), vhat = v[i] / (1 - pow(b2, t));
        p[i] -= lr * (mhat / (sqrt(vhat) + eps) + wd * p[i]);
    }
}

/* eps = 0.5 with gradients of about 0.1: there eps is half the denominator,
 * so leaving it out or moving it under the square root fails; with 1e-8
 * and gradients of about 1 it is invisible. */
static void check_adamw(float eps, float g_max) {
    const size_t n = 40000; /* > the parallel threshold */
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, wd = 0.1f, gs = 0.5f;
    float *p = malloc(n * 4), *m = calloc(n, 4), *v = calloc(n, 4), *g = malloc(n * 4);
    double *pd = malloc(n * 8), *md = calloc(n, 8), *vd = calloc(n, 8);
    tu_fill_uniform(p, n, -1, 1, 80);
    for (size_t i = 0; i < n; i++) pd[i] = p[i];
    for (int t = 1; t <= 5; t++) {
        tu_fill_uniform(g, n, -g_max, g_max, 80 + (uint64_t)t);
        adamw_step(p, m, v, g, n, lr, b1, b2, eps, wd, t, gs);
        adamw_ref(pd, md, vd, g, n, lr, b1, b2, eps, wd, t, gs);
    }
    float *pf = malloc(n * 4), *mf = malloc(n * 4), *vf = malloc(n * 4);
    for (size_t i = 0; i < n; i++) { pf[i] = (float)pd[i]; mf[i] = (float)md[i]; vf[i] = (float)vd[i]; }
    /* fp32 arithmetic: m and v (|.| < 1) within 4 ulps of 1 (2^-24 each);
     * p (|p| < 2) picks up about one ulp (2^-23) per step: allow 8. */
    TU_ASSERT_CLOSE(m, mf, n, 4 * 0x1p-24, 0.0);
    TU_ASSERT_CLOSE(v, vf, n, 4 * 0x1p-24, 0.0);
    TU_ASSERT_CLOSE(p, pf, n, 8 * 0x1p-23, 0.0);
    free(p); free(m); free(v); free(g); free(pd); free(md); free(vd);
    free(pf); free(mf); free(vf);
}

static void test_adamw(void **state) {
    (void)state;
    check_adamw(1e-8f, 2.0f);
    check_adamw(0.5f, 0.2f);
}

/* The AVX-512F, AVX2 and portable paths do the same fp32 operations: same
 * bits. */
static void test_paths_agree(void **state) {
    (void)state;
    const size_t n = 40003;
    static const char *const levels[3] = {"portable", "avx2", "native"}; /* as far as the CPU has them */
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    float *p[3], *m[3], *v[3], *g = malloc(n * 4), *acc[3];
    void *src = random_dt(n, LOOM_BF16, -2, 2, 90);
    tu_fill_uniform(g, n, -2, 2, 91);
    for (int k = 0; k < 3; k++) {
        p[k] = malloc(n * 4); m[k] = calloc(n, 4); v[k] = calloc(n, 4); acc[k] = malloc(n * 4);
        tu_fill_uniform(p[k], n, -1, 1, 92);
        tu_fill_uniform(acc[k], n, -1, 1, 93);
        assert_int_equal(loom_set_simd_level(levels[k]), LOOM_OK);
        for (int t = 1; t <= 3; t++) adamw_step(p[k], m[k], v[k], g, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t, 0.5f);
        accumulate(acc[k], LOOM_F32, src, LOOM_BF16, 0.37f, n);
    }
    assert_int_equal(loom_set_simd_level(was), LOOM_OK);
    for (int k = 1; k < 3; k++) {
        assert_true(tu_bits_equal(p[0], p[k], n * 4, "adamw param"));
        assert_true(tu_bits_equal(v[0], v[k], n * 4, "adamw v"));
        assert_true(tu_bits_equal(acc[0], acc[k], n * 4, "accumulate"));
    }
    for (int k = 0; k < 3; k++) { free(p[k]); free(m[k]); free(v[k]); free(acc[k]); }
    free(g);
    free(src);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_binary_ops),
        cmocka_unit_test(test_accumulate),
        cmocka_unit_test(test_softcap),
        cmocka_unit_test(test_sumsq),
        cmocka_unit_test(test_has_nonfinite),
        cmocka_unit_test(test_dropout_mask),
        cmocka_unit_test(test_dropout_replay),
        cmocka_unit_test(test_dropout_window),
        cmocka_unit_test(test_column_kernels),
        cmocka_unit_test(test_dropout_edges),
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_paths_agree),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
