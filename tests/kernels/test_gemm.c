/*
 * test_gemm.c — gemm against gemm_ref for every dtype combination, all four
 * transposes, odd sizes, padded leading dimensions, alpha, beta and bias, on
 * the portable backend and (when built in) on oneDNN; the primitive cache;
 * argument errors.
 *
 * Tolerance, per element: both sides see the same inputs (already rounded
 * to the input dtype), so they differ only by fp32 accumulation, which is
 * bounded by (K + 4) * 2^-24 * mag, with mag = |alpha| |A|·|B| + |beta C| +
 * |bias| (the classic dot-product error bound, plus the scale, beta and bias
 * roundings). A bf16/fp16 C is rounded once more, so one ulp of C's dtype
 * is added.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "kernels/gemm_internal.h"
#include "loom/ops.h"

typedef struct gcase {
    int ta, tb, M, N, K, pad;
    float alpha, beta;
    int has_bias;
    loom_dtype ab, c, bias_dt;
} gcase;

typedef struct gbufs {
    void *A, *B, *C, *Cref, *bias;
    float *absA, *absB, *absC, *absbias, *mag; /* for the error bound */
    int lda, ldb, ldc;
    size_t nA, nB, nC;
} gbufs;

static const loom_dtype combos[][2] = { /* (A/B dtype, C dtype) */
    { LOOM_F32, LOOM_F32 }, { LOOM_BF16, LOOM_F32 }, { LOOM_BF16, LOOM_BF16 },
    { LOOM_F16, LOOM_F32 }, { LOOM_F16, LOOM_F16 },
};
#define N_COMBOS (int)(sizeof combos / sizeof combos[0])

static uint64_t seed_counter = 1;

/* n random values in [-1, 1) stored as dt, and their absolute values in f32. */
static void *random_buf(size_t n, loom_dtype dt, float **abs_out) {
    float *f = malloc(n * sizeof(float) + 1);
    tu_fill_uniform(f, n, -1.0f, 1.0f, seed_counter++);
    void *p = tu_from_f32(f, n, dt);
    for (size_t i = 0; i < n; i++) f[i] = fabsf(loom_load(p, i, dt));
    *abs_out = f;
    return p;
}

static void make_bufs(const gcase *c, gbufs *b) {
    int rows_a = c->ta ? c->K : c->M, cols_a = c->ta ? c->M : c->K;
    int rows_b = c->tb ? c->N : c->K, cols_b = c->tb ? c->K : c->N;
    b->lda = cols_a + c->pad; b->ldb = cols_b + c->pad; b->ldc = c->N + c->pad;
    b->nA = (size_t)rows_a * b->lda; b->nB = (size_t)rows_b * b->ldb;
    b->nC = (size_t)c->M * b->ldc;
    b->A = random_buf(b->nA, c->ab, &b->absA);
    b->B = random_buf(b->nB, c->ab, &b->absB);
    b->C = random_buf(b->nC, c->c, &b->absC);
    if (c->beta == 0.0f) /* C must not be read: poison it */
        for (size_t i = 0; i < b->nC; i++) loom_store(b->C, i, c->c, NAN);
    b->Cref = malloc(b->nC * loom_dtype_size(c->c) + 1);
    memcpy(b->Cref, b->C, b->nC * loom_dtype_size(c->c));
    b->bias = random_buf((size_t)c->N, c->bias_dt, &b->absbias);
    b->mag = malloc(b->nC * sizeof(float) + 1);
}

static void free_bufs(gbufs *b) {
    free(b->A); free(b->B); free(b->C); free(b->Cref); free(b->bias);
    free(b->absA); free(b->absB); free(b->absC); free(b->absbias); free(b->mag);
}

/* One ulp of dtype dt at the magnitude of v (0 for fp32: covered by gamma). */
static double ulp_of(double v, loom_dtype dt) {
    if (dt == LOOM_F32) return 0.0;
    int e;
    frexp(fabs(v), &e); /* |v| = f * 2^e, f in [0.5, 1) */
    int mant = dt == LOOM_BF16 ? 7 : 10, min_e = dt == LOOM_BF16 ? -133 : -24;
    int ue = e - 1 - mant;
    return ldexp(1.0, ue < min_e ? min_e : ue);
}

static void describe(const gcase *c, const char *backend) {
    fprintf(stderr, "  case: %s ab=%s c=%s ta=%d tb=%d M=%d N=%d K=%d pad=%d alpha=%g beta=%g bias=%s\n",
            backend, loom_dtype_name(c->ab), loom_dtype_name(c->c), c->ta, c->tb, c->M, c->N,
            c->K, c->pad, (double)c->alpha, (double)c->beta,
            c->has_bias ? loom_dtype_name(c->bias_dt) : "none");
}

/* Count elements outside the tolerance; padding of C must be untouched. */
static int count_bad(const gcase *c, const gbufs *b) {
    int bad = 0;
    double gamma = (c->K + 4) * ldexp(1.0, -24);
    size_t es = loom_dtype_size(c->c);
    for (int i = 0; i < c->M; i++) {
        for (int j = 0; j < b->ldc; j++) {
            size_t k = (size_t)i * b->ldc + j;
            if (j >= c->N) { /* padding: bit-for-bit unchanged */
                bad += memcmp((char *)b->C + k * es, (char *)b->Cref + k * es, es) != 0;
                continue;
            }
            double got = loom_load(b->C, k, c->c), ref = loom_load(b->Cref, k, c->c);
            double tol = gamma * b->mag[k] + ulp_of(fmax(fabs(got), fabs(ref)), c->c);
            if (!(fabs(got - ref) <= tol)) {
                if (bad++ < 3)
                    fprintf(stderr, "  C[%d,%d] = %.9g, ref %.9g, tol %.3g\n", i, j, got, ref, tol);
            }
        }
    }
    return bad;
}

static void run_case(const gcase *c, const char *backend) {
    gbufs b;
    make_bufs(c, &b);
    const void *bias = c->has_bias ? b.bias : NULL;
    loom_status st = gemm(c->ta, c->tb, c->M, c->N, c->K, c->alpha, b.A, b.lda, b.B, b.ldb,
                          c->ab, c->beta, b.C, b.ldc, c->c, bias, c->bias_dt);
    if (st != LOOM_OK) fprintf(stderr, "gemm failed: %s\n", loom_last_error());
    assert_int_equal(st, LOOM_OK);
    gemm_ref(c->ta, c->tb, c->M, c->N, c->K, c->alpha, b.A, b.lda, b.B, b.ldb, c->ab,
             c->beta, b.Cref, b.ldc, c->c, bias, c->bias_dt);
    /* mag = |alpha| |A|·|B| + |beta| |C| + |bias|, all in fp32 buffers. */
    for (size_t i = 0; i < b.nC; i++) b.mag[i] = c->beta != 0.0f ? b.absC[i] : 0.0f;
    gemm_ref(c->ta, c->tb, c->M, c->N, c->K, fabsf(c->alpha), b.absA, b.lda, b.absB, b.ldb,
             LOOM_F32, fabsf(c->beta), b.mag, b.ldc, LOOM_F32, c->has_bias ? b.absbias : NULL,
             LOOM_F32);
    int bad = count_bad(c, &b);
    if (bad) {
        fprintf(stderr, "%d elements out of tolerance\n", bad);
        describe(c, backend);
    }
    free_bufs(&b);
    assert_int_equal(bad, 0);
}

/* ------------------------------------------------------------- the sweeps */

static const int shapes[][3] = { /* M, N, K */
    { 1, 1, 1 }, { 1, 7, 33 }, { 7, 1, 65 }, { 33, 65, 7 }, { 65, 130, 33 },
    { 130, 33, 129 }, { 7, 7, 1 }, { 2, 17, 300 },
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

/* Every dtype combination, transpose and shape; alpha, beta, bias and
 * padding vary with the case index so each appears with each dtype. */
static void sweep_shapes(const char *backend) {
    int idx = 0;
    for (int d = 0; d < N_COMBOS; d++)
        for (int t = 0; t < 4; t++)
            for (int s = 0; s < N_SHAPES; s++, idx++) {
                gcase c = { .ta = t & 1, .tb = t >> 1, .M = shapes[s][0], .N = shapes[s][1],
                            .K = shapes[s][2], .pad = (idx % 3) * 3,
                            .alpha = idx % 4 == 1 ? -0.75f : 1.0f,
                            .beta = (idx / 2) % 2 ? 1.0f : 0.0f, .has_bias = idx % 5 < 2,
                            .ab = combos[d][0], .c = combos[d][1],
                            .bias_dt = idx % 2 ? LOOM_F32 : combos[d][0] };
                run_case(&c, backend);
            }
}

/* Full factorial of alpha x beta x bias x padding on one odd shape. */
static void sweep_options(const char *backend) {
    static const float alphas[] = { 1.0f, 0.5f, -1.25f }, betas[] = { 0.0f, 1.0f, 0.5f };
    for (int d = 0; d < N_COMBOS; d++)
        for (int t = 0; t < 4; t++)
            for (int o = 0; o < 3 * 3 * 2 * 2; o++) {
                gcase c = { .ta = t & 1, .tb = t >> 1, .M = 13, .N = 33, .K = 65,
                            .pad = (o / 18) ? 5 : 0, .alpha = alphas[o % 3],
                            .beta = betas[(o / 3) % 3], .has_bias = (o / 9) % 2,
                            .ab = combos[d][0], .c = combos[d][1],
                            .bias_dt = t % 2 ? LOOM_F32 : combos[d][0] };
                run_case(&c, backend);
            }
}

/* Sizes past the fallback's blocking (MC, NC, KC) and its thread split. */
static void sweep_large(const char *backend) {
    static const int big[][3] = { { 100, 270, 300 }, { 7, 300, 130 } };
    for (int d = 0; d < N_COMBOS; d++)
        for (int s = 0; s < 2; s++)
            for (int t = 0; t < 4; t += 3) {
                gcase c = { .ta = t & 1, .tb = t >> 1, .M = big[s][0], .N = big[s][1],
                            .K = big[s][2], .pad = 2, .alpha = 1.0f, .beta = (float)(t == 3),
                            .has_bias = t == 0, .ab = combos[d][0], .c = combos[d][1],
                            .bias_dt = LOOM_F32 };
                run_case(&c, backend);
            }
}

static void test_fallback_shapes(void **state) {
    (void)state;
    gemm_set_backend(GEMM_BACKEND_FALLBACK);
    assert_int_equal(gemm_get_backend(), GEMM_BACKEND_FALLBACK);
    gemm_counters before, after;
    gemm_get_counters(&before);
    sweep_shapes("fallback");
    sweep_options("fallback");
    sweep_large("fallback");
    gemm_get_counters(&after);
    assert_int_equal(after.onednn_calls, before.onednn_calls); /* nothing went to oneDNN */
    assert_true(after.fallback_calls > before.fallback_calls);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

static void test_onednn_shapes(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_ONEDNN);
    assert_int_equal(gemm_get_backend(), GEMM_BACKEND_ONEDNN);
    gemm_counters before, after;
    gemm_get_counters(&before);
    sweep_shapes("onednn");
    sweep_options("onednn");
    sweep_large("onednn");
    gemm_get_counters(&after);
    fprintf(stderr, "onednn sweep: %llu calls by oneDNN, %llu by the fallback, %llu refusals\n",
            (unsigned long long)(after.onednn_calls - before.onednn_calls),
            (unsigned long long)(after.fallback_calls - before.fallback_calls),
            (unsigned long long)(after.onednn_rejected - before.onednn_rejected));
    assert_true(after.onednn_calls > before.onednn_calls); /* at least fp32 ran there */
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* The fallback's portable C micro-kernel (what CPUs without AVX2 run). */
static void test_fallback_portable(void **state) {
    (void)state;
    gemm_set_backend(GEMM_BACKEND_FALLBACK);
    loom_set_simd(0);
    sweep_shapes("fallback portable");
    sweep_large("fallback portable");
    loom_set_simd(1);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* The fallback sums each element in the same order whatever the number of
 * threads (its row blocks and slabs change with it, its K slices do not). */
static void test_fallback_thread_invariant(void **state) {
    (void)state;
    enum { M = 200, N = 300, K = 700 };
    float *A = malloc(sizeof(float) * M * K), *B = malloc(sizeof(float) * K * N);
    float *C1 = malloc(sizeof(float) * M * N), *C2 = malloc(sizeof(float) * M * N);
    tu_fill_uniform(A, (size_t)M * K, -1, 1, 11);
    tu_fill_uniform(B, (size_t)K * N, -1, 1, 12);
    gemm_set_backend(GEMM_BACKEND_FALLBACK);
    int nt = loom_get_threads();
    for (int t = 0; t < 2; t++) {
        loom_set_threads(1);
        assert_int_equal(gemm(t, 0, M, N, K, 1.0f, A, t ? M : K, B, N, LOOM_F32, 0.0f, C1, N, LOOM_F32, NULL,
                              LOOM_F32), LOOM_OK);
        loom_set_threads(3);
        assert_int_equal(gemm(t, 0, M, N, K, 1.0f, A, t ? M : K, B, N, LOOM_F32, 0.0f, C2, N, LOOM_F32, NULL,
                              LOOM_F32), LOOM_OK);
        assert_true(tu_bits_equal(C1, C2, sizeof(float) * M * N, "1 vs 3 threads"));
    }
    loom_set_threads(nt);
    gemm_set_backend(GEMM_BACKEND_AUTO);
    free(A); free(B); free(C1); free(C2);
}

/* Half-precision inputs widened to fp32 for oneDNN: every sweep, a deep K
 * that makes the row chunks small (several chunks plus a remainder), with C
 * fp32 (written by oneDNN, beta = 1) and C half (finished by loom), and tiles
 * of several row and column chunks. */
static void test_widen_shapes(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_WIDEN);
    assert_int_equal(gemm_get_backend(), GEMM_BACKEND_WIDEN);
    gemm_counters before, after;
    gemm_get_counters(&before);
    gemm_widen_set_budgets((size_t)1 << 20, (size_t)1 << 19); /* small enough to chunk the cases below */
    sweep_shapes("widen");
    sweep_options("widen");
    sweep_large("widen");
    for (int t = 0; t < 4; t++) {
        gcase c = { .ta = t & 1, .tb = t >> 1, .M = 130, .N = 8, .K = 20000, .pad = 1, .alpha = 1.0f,
                    .beta = (float)(t % 2), .has_bias = t >= 2, .ab = t % 2 ? LOOM_BF16 : LOOM_F16,
                    .c = t < 2 ? LOOM_F32 : (t % 2 ? LOOM_BF16 : LOOM_F16), .bias_dt = LOOM_F32 };
        run_case(&c, "widen chunks");
    }
    /* Several column chunks as well (a bias offset per chunk), C fp32 (bias
     * added by oneDNN) and C half (bias added by loom). */
    for (int t = 0; t < 2; t++) {
        gcase c = { .ta = t, .tb = 1 - t, .M = 40, .N = 300, .K = 5000, .alpha = 1.0f, .beta = 0.5f,
                    .has_bias = 1, .ab = LOOM_BF16, .c = t ? LOOM_BF16 : LOOM_F32, .bias_dt = LOOM_F32 };
        run_case(&c, "widen tiles");
    }
    gemm_get_counters(&after);
    assert_true(after.widened_calls > before.widened_calls);
    gemm_widen_set_budgets(0, 0);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* A transposed A whose stride is a multiple of 2 KiB (512 floats) is copied
 * to a padded stride first (oneDNN packs it slowly), and so is B of such a
 * call. fp32 copies the stored window when C is wide enough to repay it;
 * half types are widened into dense panels anyway, which get a padded
 * stride when the window's own width is critical. The copies are exact, so
 * the results hold the usual bound; the counter shows which calls were
 * padded. */
static void test_padded_strides(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    static const struct { int ta, tb, M, N, K, pad, beta, bias, f32_padded, widen_padded; } cases[] = {
        {1, 0, 512, 512, 40, 0, 0, 1, 1, 1},  /* both operands */
        {1, 0, 509, 100, 33, 3, 1, 0, 1, 0},  /* A's window 509 of 512 (dense 509 is fine) */
        {1, 1, 512, 70, 20, 0, 1, 1, 1, 1},   /* A alone (B is transposed) */
        {1, 0, 100, 509, 24, 3, 0, 0, 0, 0},  /* B's window alone: not worth a copy */
        {0, 0, 100, 512, 512, 0, 1, 0, 0, 0}, /* NN: as given */
        {0, 1, 100, 70, 512, 0, 0, 0, 0, 0},  /* NT: as given */
        {1, 0, 512, 40, 16, 0, 0, 0, 0, 1},   /* N < 64: no fp32 copy; the widening pads for free */
    };
    for (int be = 0; be < 2; be++) {
        gemm_set_backend(be ? GEMM_BACKEND_WIDEN : GEMM_BACKEND_ONEDNN);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            gemm_counters before, after;
            gcase c = { .ta = cases[i].ta, .tb = cases[i].tb, .M = cases[i].M, .N = cases[i].N, .K = cases[i].K,
                        .pad = cases[i].pad, .alpha = 1.0f, .beta = (float)cases[i].beta,
                        .has_bias = cases[i].bias, .ab = be ? LOOM_BF16 : LOOM_F32, .c = LOOM_F32,
                        .bias_dt = LOOM_F32 };
            uint64_t want = (uint64_t)(be ? cases[i].widen_padded : cases[i].f32_padded);
            gemm_get_counters(&before);
            run_case(&c, be ? "widen padded" : "onednn padded");
            gemm_get_counters(&after);
            if (after.padded_calls - before.padded_calls != want) describe(&c, "padding");
            assert_int_equal(after.padded_calls - before.padded_calls, want);
        }
    }
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* Widened calls cut into chunks whose last one is 512 wide (a critical
 * stride when dense) while the full chunks are not: each chunk gets its own
 * stride within the panel's allocation, C fp32 (direct) and bf16. */
static void test_widen_padded_chunks(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_WIDEN);
    for (int t = 0; t < 4; t++) {
        int direct = t < 2;
        /* K = 16: chunks of 528 and a last one of 512, in both dimensions */
        gemm_widen_set_budgets(16 * 600, direct ? 16 * 600 : 528 * 600);
        gcase c = { .ta = 1, .tb = t & 1, .M = 1040, .N = 1040, .K = 16, .alpha = 1.0f, .beta = (float)(t & 1),
                    .ab = LOOM_BF16, .c = direct ? LOOM_F32 : LOOM_BF16, .bias_dt = LOOM_F32 };
        gemm_counters before, after;
        gemm_get_counters(&before);
        run_case(&c, "widen padded chunks");
        gemm_get_counters(&after);
        assert_int_equal(after.padded_calls - before.padded_calls, 1); /* the last chunks were padded */
    }
    gemm_widen_set_budgets(0, 0);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* ------------------------------------------------------------- edge cases */

/* K = 0: C = beta * C + bias, on both backends. */
static void test_k_zero(void **state) {
    (void)state;
    for (int be = GEMM_BACKEND_ONEDNN; be <= GEMM_BACKEND_FALLBACK; be++) {
        gemm_set_backend((gemm_backend)be);
        for (int d = 0; d < N_COMBOS; d++) {
            gcase c = { .M = 5, .N = 9, .K = 0, .pad = 1, .alpha = 1.0f, .beta = 0.5f,
                        .has_bias = 1, .ab = combos[d][0], .c = combos[d][1],
                        .bias_dt = LOOM_F32 };
            run_case(&c, be == GEMM_BACKEND_ONEDNN ? "onednn/auto" : "fallback");
        }
    }
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* Two beta = 1 calls sum two products into fp32 C, as weight gradients
 * accumulate into main_grad across micro-batches. */
static void test_accumulate_twice(void **state) {
    (void)state;
    for (int be = GEMM_BACKEND_ONEDNN; be <= GEMM_BACKEND_FALLBACK; be++) {
        gemm_set_backend((gemm_backend)be);
        gcase c = { .ta = 1, .M = 40, .N = 24, .K = 70, .alpha = 1.0f, .beta = 1.0f,
                    .ab = LOOM_BF16, .c = LOOM_F32, .bias_dt = LOOM_F32 };
        gbufs b1, b2;
        make_bufs(&c, &b1);
        make_bufs(&c, &b2);
        for (int r = 0; r < 2; r++) { /* second product into the first's C */
            gbufs *b = r ? &b2 : &b1;
            assert_int_equal(gemm(1, 0, c.M, c.N, c.K, 1.0f, b->A, b->lda, b->B, b->ldb,
                                  c.ab, 1.0f, b1.C, b1.ldc, c.c, NULL, LOOM_F32), LOOM_OK);
            gemm_ref(1, 0, c.M, c.N, c.K, 1.0f, b->A, b->lda, b->B, b->ldb, c.ab, 1.0f,
                     b1.Cref, b1.ldc, c.c, NULL, LOOM_F32);
        }
        float *got = tu_to_f32(b1.C, b1.nC, LOOM_F32), *ref = tu_to_f32(b1.Cref, b1.nC, LOOM_F32);
        /* |C0| <= 1 and each product |.| <= K: bound 2 (K+4) u (K + 1). */
        double atol = 2.0 * (c.K + 4) * ldexp(1.0, -24) * (c.K + 1);
        TU_ASSERT_CLOSE(got, ref, b1.nC, atol, 0.0);
        free(got); free(ref);
        free_bufs(&b1); free_bufs(&b2);
    }
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* gemm_ref's transposed indexing agrees with explicitly transposed copies. */
static void test_ref_transpose(void **state) {
    (void)state;
    enum { M = 5, N = 6, K = 7 };
    float A[M * K], B[K * N], At[K * M], Bt[N * K], C0[M * N], C1[M * N];
    tu_fill_uniform(A, M * K, -1, 1, 11);
    tu_fill_uniform(B, K * N, -1, 1, 12);
    for (int i = 0; i < M; i++) for (int k = 0; k < K; k++) At[k * M + i] = A[i * K + k];
    for (int k = 0; k < K; k++) for (int j = 0; j < N; j++) Bt[j * K + k] = B[k * N + j];
    gemm_ref(0, 0, M, N, K, 1.0f, A, K, B, N, LOOM_F32, 0.0f, C0, N, LOOM_F32, NULL, LOOM_F32);
    for (int t = 1; t < 4; t++) {
        gemm_ref(t & 1, t >> 1, M, N, K, 1.0f, t & 1 ? At : A, t & 1 ? M : K, t >> 1 ? Bt : B,
                 t >> 1 ? K : N, LOOM_F32, 0.0f, C1, N, LOOM_F32, NULL, LOOM_F32);
        assert_true(tu_bits_equal(C0, C1, sizeof C0, "ref transpose"));
    }
    /* and one element by hand */
    double s = 0.0;
    for (int k = 0; k < K; k++) s += (double)A[2 * K + k] * B[k * N + 3];
    assert_float_equal(C0[2 * N + 3], (float)s, 0.0f);
}

static void test_invalid_args(void **state) {
    (void)state;
    float A[64] = { 0 }, B[64] = { 0 }, C[64] = { 0 };
    uint16_t H[64] = { 0 };
    struct { int ta, tb, M, N, K, lda, ldb, ldc; loom_dtype ab, c; } bad[] = {
        { 0, 0, -1, 4, 4, 4, 4, 4, LOOM_F32, LOOM_F32 },  /* negative M */
        { 0, 0, 4, 4, 4, 3, 4, 4, LOOM_F32, LOOM_F32 },   /* lda < K */
        { 1, 0, 4, 2, 2, 2, 2, 2, LOOM_F32, LOOM_F32 },   /* trans: lda < M */
        { 0, 1, 2, 4, 2, 2, 1, 4, LOOM_F32, LOOM_F32 },   /* trans: ldb < K */
        { 0, 0, 4, 4, 4, 4, 4, 3, LOOM_F32, LOOM_F32 },   /* ldc < N */
        { 0, 0, 4, 4, 4, 4, 4, 4, LOOM_F16, LOOM_BF16 },  /* C dtype mismatch */
        { 0, 0, 4, 4, 4, 4, 4, 4, (loom_dtype)9, LOOM_F32 },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        loom_clear_error();
        const void *a = bad[i].ab == LOOM_F32 ? (const void *)A : H;
        void *c = bad[i].c == LOOM_F32 ? (void *)C : H;
        loom_status st = gemm(bad[i].ta, bad[i].tb, bad[i].M, bad[i].N, bad[i].K, 1.0f, a,
                              bad[i].lda, bad[i].ab == LOOM_F32 ? (const void *)B : H,
                              bad[i].ldb, bad[i].ab, 0.0f, c, bad[i].ldc, bad[i].c, NULL, LOOM_F32);
        assert_int_equal(st, LOOM_ERR_INVALID);
        assert_true(strlen(loom_last_error()) > 0);
    }
    assert_int_equal(gemm(0, 0, 0, 4, 4, 1.0f, NULL, 4, B, 4, LOOM_F32, 0.0f, NULL, 4,
                          LOOM_F32, NULL, LOOM_F32), LOOM_OK); /* empty: nothing to do */
    assert_int_equal(gemm(0, 0, 2, 2, 2, 1.0f, NULL, 2, B, 2, LOOM_F32, 0.0f, C, 2,
                          LOOM_F32, NULL, LOOM_F32), LOOM_ERR_INVALID);
}

static void test_backend_choice(void **state) {
    (void)state;
    gemm_backend want = gemm_have_onednn() ? GEMM_BACKEND_ONEDNN : GEMM_BACKEND_FALLBACK;
    gemm_set_backend(GEMM_BACKEND_AUTO);
    assert_int_equal(gemm_get_backend(), want);
    gemm_set_backend(GEMM_BACKEND_ONEDNN);
    assert_int_equal(gemm_get_backend(), want);
    gemm_set_backend(GEMM_BACKEND_FALLBACK);
    assert_int_equal(gemm_get_backend(), GEMM_BACKEND_FALLBACK);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* ------------------------------------------------------ the primitive cache */

static loom_status small_call(int M, int ldc, loom_dtype ab, float *C) {
    static float Af[64 * 64], Bf[64 * 64];
    static uint16_t Ah[64 * 64], Bh[64 * 64];
    int f32 = ab == LOOM_F32;
    return gemm(0, 0, M, 8, 16, 1.0f, f32 ? (void *)Af : Ah, 16, f32 ? (void *)Bf : Bh, 8, ab,
                0.0f, C, ldc, LOOM_F32, NULL, LOOM_F32);
}

/* The same call twice creates one primitive; a new ldc creates another; a
 * refused combination is tried once and then served by the fallback. */
static void test_cache_reuse(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_ONEDNN);
    gemm_onednn_cache_clear();
    static float C[64 * 64];
    gemm_counters c0, c1, c2, c3;
    gemm_get_counters(&c0);
    assert_int_equal(small_call(4, 8, LOOM_F32, C), LOOM_OK);
    gemm_get_counters(&c1);
    assert_int_equal(c1.onednn_created - c0.onednn_created, 1);
    assert_int_equal(small_call(4, 8, LOOM_F32, C), LOOM_OK);
    gemm_get_counters(&c2);
    assert_int_equal(c2.onednn_created, c1.onednn_created);
    assert_int_equal(c2.onednn_hits - c1.onednn_hits, 1);
    assert_int_equal(c2.onednn_calls - c0.onednn_calls, 2);
    assert_int_equal(small_call(4, 9, LOOM_F32, C), LOOM_OK); /* another ldc */
    gemm_get_counters(&c3);
    assert_int_equal(c3.onednn_created - c2.onednn_created, 1);
    for (int r = 0; r < 3; r++) assert_int_equal(small_call(4, 8, LOOM_BF16, C), LOOM_OK);
    gemm_counters c4;
    gemm_get_counters(&c4);
    /* bf16 is built or refused once, whatever this CPU supports */
    assert_int_equal((c4.onednn_created + c4.onednn_rejected) -
                     (c3.onednn_created + c3.onednn_rejected), 1);
    assert_int_equal((c4.onednn_calls - c3.onednn_calls) + (c4.fallback_calls - c3.fallback_calls), 3);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* A primitive is made for a thread count: after loom_set_threads the same
 * call gets a new one, and back at the first count the first is reused. */
static void test_cache_keys_threads(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_ONEDNN);
    gemm_onednn_cache_clear();
    static float C[64 * 64];
    int threads = loom_get_threads();
    gemm_counters c0, c1, c2, c3;
    loom_set_threads(2);
    gemm_get_counters(&c0);
    assert_int_equal(small_call(4, 8, LOOM_F32, C), LOOM_OK);
    loom_set_threads(1);
    assert_int_equal(small_call(4, 8, LOOM_F32, C), LOOM_OK);
    gemm_get_counters(&c1);
    assert_int_equal(c1.onednn_created - c0.onednn_created, 2);
    loom_set_threads(2);
    assert_int_equal(small_call(4, 8, LOOM_F32, C), LOOM_OK);
    gemm_get_counters(&c2);
    assert_int_equal(c2.onednn_created, c1.onednn_created);
    loom_set_threads(1);
    assert_int_equal(small_call(4, 8, LOOM_F32, C), LOOM_OK);
    gemm_get_counters(&c3);
    assert_int_equal(c3.onednn_created, c2.onednn_created);
    loom_set_threads(threads);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* The GEMMs of a training step (sizes that are multiples of 16, three
 * transposes, beta 0 and 1: 18 keys, fewer than the cache holds) are
 * created once; a second round creates none. */
static void test_cache_holds_a_step(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_ONEDNN);
    gemm_onednn_cache_clear();
    enum { R = 64 };
    static const int nk[][2] = { { 288, 288 }, { 768, 288 }, { 288, 768 } };
    float *A = calloc((size_t)R * 768, sizeof(float)), *B = calloc((size_t)768 * 768, sizeof(float));
    float *C = calloc((size_t)768 * 768, sizeof(float));
    gemm_counters c[3];
    gemm_get_counters(&c[0]);
    for (int round = 0; round < 2; round++) {
        for (int s = 0; s < 3; s++)
            for (int beta = 0; beta < 2; beta++) {
                int N = nk[s][0], K = nk[s][1];
                /* y = x W^T (R, N); dx = dy W (R, K); dW += dy^T x (N, K) */
                assert_int_equal(gemm(0, 1, R, N, K, 1.0f, A, K, B, K, LOOM_F32, (float)beta, C, N, LOOM_F32, NULL,
                                      LOOM_F32), LOOM_OK);
                assert_int_equal(gemm(0, 0, R, K, N, 1.0f, A, N, B, K, LOOM_F32, (float)beta, C, K, LOOM_F32, NULL,
                                      LOOM_F32), LOOM_OK);
                assert_int_equal(gemm(1, 0, N, K, R, 1.0f, A, N, B, K, LOOM_F32, (float)beta, C, K, LOOM_F32, NULL,
                                      LOOM_F32), LOOM_OK);
            }
        gemm_get_counters(&c[round + 1]);
    }
    assert_int_equal(c[1].onednn_created - c[0].onednn_created, 18);
    assert_int_equal(c[2].onednn_created - c[1].onednn_created, 0);
    assert_int_equal(c[2].onednn_hits - c[1].onednn_hits, 18);
    loom_gemm_stats pub; /* the public view of the same counters */
    loom_gemm_get_stats(&pub);
    assert_int_equal(pub.primitives_created, c[2].onednn_created);
    assert_int_equal(pub.onednn_calls, c[2].onednn_calls);
    assert_int_equal(pub.padded_calls, c[2].padded_calls);
    free(A); free(B); free(C);
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* More distinct shapes than the cache holds: eviction keeps results right. */
static void test_cache_eviction(void **state) {
    (void)state;
    if (!gemm_have_onednn()) skip();
    gemm_set_backend(GEMM_BACKEND_ONEDNN);
    for (int r = 0; r < 2; r++)
        for (int m = 1; m <= 80; m++) {
            gcase c = { .M = m, .N = 3, .K = 5, .alpha = 1.0f, .beta = 1.0f,
                        .ab = LOOM_F32, .c = LOOM_F32, .bias_dt = LOOM_F32 };
            run_case(&c, "onednn eviction");
        }
    gemm_set_backend(GEMM_BACKEND_AUTO);
}

/* GEMMs issued from two threads at once share the cache safely. */
static void test_concurrent_calls(void **state) {
    (void)state;
    int failures = 0;
    for (int be = GEMM_BACKEND_ONEDNN; be <= GEMM_BACKEND_FALLBACK; be++) {
        gemm_set_backend((gemm_backend)be);
        #pragma omp parallel for num_threads(2) schedule(static, 1) reduction(+ : failures)
        for (int r = 0; r < 8; r++) {
            enum { M = 20, N = 30, K = 40 };
            float A[M * K], B[K * N], C[M * N], R[M * N];
            tu_fill_uniform(A, M * K, -1, 1, 100 + (uint64_t)r);
            tu_fill_uniform(B, K * N, -1, 1, 200 + (uint64_t)r);
            failures += gemm(0, 1, M, N, K, 1.0f, A, K, B, K, LOOM_F32, 0.0f, C, N,
                             LOOM_F32, NULL, LOOM_F32) != LOOM_OK;
            gemm_ref(0, 1, M, N, K, 1.0f, A, K, B, K, LOOM_F32, 0.0f, R, N, LOOM_F32, NULL,
                     LOOM_F32);
            failures += tu_close_ratio(C, R, M * N, (K + 4) * ldexp(1.0, -24) * K, 0.0,
                                       "concurrent") > 1.0;
        }
    }
    gemm_set_backend(GEMM_BACKEND_AUTO);
    assert_int_equal(failures, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ref_transpose),
        cmocka_unit_test(test_invalid_args),
        cmocka_unit_test(test_backend_choice),
        cmocka_unit_test(test_fallback_shapes),
        cmocka_unit_test(test_onednn_shapes),
        cmocka_unit_test(test_widen_shapes),
        cmocka_unit_test(test_padded_strides),
        cmocka_unit_test(test_widen_padded_chunks),
        cmocka_unit_test(test_fallback_portable),
        cmocka_unit_test(test_fallback_thread_invariant),
        cmocka_unit_test(test_k_zero),
        cmocka_unit_test(test_accumulate_twice),
        cmocka_unit_test(test_cache_reuse),
        cmocka_unit_test(test_cache_keys_threads),
        cmocka_unit_test(test_cache_holds_a_step),
        cmocka_unit_test(test_cache_eviction),
        cmocka_unit_test(test_concurrent_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
