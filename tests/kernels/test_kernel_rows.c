/*
 * test_kernel_rows.c — the fp32 building blocks of the row-wise kernels
 * against plain loops: the transpose of 32-bit elements, bit for bit (8 x 8 vector blocks and the edges
 * around them, padded strides) and the small matrix product (both
 * orientations of A, overwrite and accumulate, shapes off the 4 x 16 tile),
 * the row maps and reductions (max, exp-and-sum, scale, bf16 pairs), each on
 * the AVX-512F, AVX2 and portable paths.
 */
#include "testutil.h"
#include "kernels/kernel_rows.h"

#include <math.h>
#include <string.h>

static void check_transpose(int rows, int cols, int lds, int ldd) {
    uint32_t *src = malloc(4 * (size_t)rows * lds), *dst = malloc(4 * (size_t)cols * ldd);
    uint64_t x = (uint64_t)(rows * 131 + cols);
    for (size_t i = 0; i < (size_t)rows * lds; i++) { /* any bits: NaN payloads, subnormals */
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        src[i] = (uint32_t)(x >> 32);
    }
    for (size_t i = 0; i < (size_t)cols * ldd; i++) dst[i] = 0x7f800001u; // padding must stay
    transpose32(dst, ldd, src, lds, rows, cols);
    for (int j = 0; j < cols; j++)
        for (int i = 0; i < ldd; i++) {
            uint32_t want = i < rows ? src[(size_t)i * lds + j] : 0x7f800001u;
            if (dst[(size_t)j * ldd + i] != want) fail_msg("transpose %dx%d: (%d, %d)", rows, cols, j, i);
        }
    free(src);
    free(dst);
}

static void test_transpose(void **state) {
    (void)state;
    const int shapes[][2] = {{8, 8}, {16, 48}, {256, 48}, {37, 13}, {3, 8}, {8, 5}, {64, 17}, {1, 1}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int r = shapes[s][0], c = shapes[s][1];
        check_transpose(r, c, c, r);
        check_transpose(r, c, c + 11, r + 5);
    }
}

/* C (m, n) = op(A) B (+ C), each element summed in k order in double: the
 * kernel's fp32 sums must agree to fp32 accumulation error. With `tiles`,
 * that kernel alone (the AVX-512 tiles): it does the first n rounded down
 * to 16 columns and must leave the others as they were. */
static void check_mm_with(int m, int n, int k, int trans_a, int accumulate, mm_tiles_fn tiles) {
    int lda = (trans_a ? m : k) + 3, ldb = n + 2, ldc = n + 5;
    size_t na = (size_t)(trans_a ? k : m) * lda, nb = (size_t)k * ldb, nc = (size_t)m * ldc;
    float *A = malloc(sizeof(float) * na), *B = malloc(sizeof(float) * nb), *C = malloc(sizeof(float) * nc);
    float *want = malloc(sizeof(float) * nc);
    tu_fill_uniform(A, na, -1.0f, 1.0f, 11);
    tu_fill_uniform(B, nb, -1.0f, 1.0f, 12);
    tu_fill_uniform(C, nc, -1.0f, 1.0f, 13);
    memcpy(want, C, sizeof(float) * nc);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double acc = accumulate ? C[(size_t)i * ldc + j] : 0.0;
            for (int d = 0; d < k; d++)
                acc += (double)(trans_a ? A[(size_t)d * lda + i] : A[(size_t)i * lda + d]) * B[(size_t)d * ldb + j];
            want[(size_t)i * ldc + j] = (float)acc;
        }
    if (tiles) {
        int n16 = n / 16 * 16;
        size_t rs = trans_a ? 1 : (size_t)lda, ds = trans_a ? (size_t)lda : 1;
        assert_int_equal(tiles(m, n, k, A, rs, ds, B, ldb, C, ldc, accumulate), n16);
        for (int i = 0; i < m; i++) /* what the tiles do not cover keeps its old value */
            for (int j = n16; j < n; j++) want[(size_t)i * ldc + j] = C[(size_t)i * ldc + j];
        float *before = malloc(sizeof(float) * nc);
        tu_fill_uniform(before, nc, -1.0f, 1.0f, 13);
        for (int i = 0; i < m; i++)
            for (int j = n16; j < n; j++)
                if (C[(size_t)i * ldc + j] != before[(size_t)i * ldc + j]) fail_msg("column %d was written", j);
        free(before);
    } else {
        mm_f32(m, n, k, A, lda, trans_a, B, ldb, C, ldc, accumulate);
    }
    TU_ASSERT_CLOSE(C, want, nc, 1e-5, 1e-5); // also: the padding of each C row is untouched
    free(A); free(B); free(C); free(want);
}

static void check_mm(int m, int n, int k, int trans_a, int accumulate) {
    check_mm_with(m, n, k, trans_a, accumulate, NULL);
}

static void test_mm(void **state) {
    (void)state;
    const int shapes[][3] = {{4, 16, 8}, {64, 64, 48}, {16, 48, 64}, {5, 17, 3}, {1, 1, 1}, {37, 30, 19}, {3, 9, 0},
                             {6, 72, 5}, {2, 50, 7}, {3, 24, 0}, {1, 40, 2}}; /* around the 4 x 24 and 4 x 16 tiles */
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 2; t++)
            for (int acc = 0; acc < 2; acc++) check_mm(shapes[s][0], shapes[s][1], shapes[s][2], t, acc);
}

/* The AVX-512F tiles, built with SIMDe emulating each instruction: the same
 * code the library runs on AVX-512 CPUs, on this one. Shapes around the
 * 8-row and 16/32-column tiles, both orientations of A. */
static void test_mm_avx512_tiles(void **state) {
    (void)state;
#if LOOM_HAVE_AVX512
    const int shapes[][3] = {{8, 32, 8}, {16, 64, 48}, {16, 48, 64}, {5, 17, 3}, {9, 47, 7},
                             {1, 16, 1}, {3, 15, 4}, {37, 80, 19}, {3, 32, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 2; t++)
            for (int acc = 0; acc < 2; acc++) {
                check_mm_with(shapes[s][0], shapes[s][1], shapes[s][2], t, acc, mm_avx512_emulated);
                /* and mm_f32 as an AVX-512 CPU runs it: the tiles, then
                 * the AVX2 tile for the columns they leave */
                mm_f32_set_tiles(mm_avx512_emulated);
                check_mm(shapes[s][0], shapes[s][1], shapes[s][2], t, acc);
                mm_f32_set_tiles(NULL);
            }
#else
    skip(); /* built without SIMDe or -mavx512f: there are no AVX-512 tiles */
#endif
}

/* The AVX-512 BF16 tiles (emulated): C = A B and C += A B over bf16 pairs
 * against the same sums in double, for rows off the 8-row tile and 16/32-
 * column blocks, A's pairs along its rows (rs = lda, ps = 1) and down its
 * columns (rs = 1, ps = lda); on a CPU with AVX-512 BF16 the native tiles
 * too. */
static void test_mm_bf16_tiles(void **state) {
    (void)state;
#if LOOM_HAVE_AVX512
    const int shapes[][3] = {{8, 32, 4}, {16, 64, 24}, {5, 16, 3}, {9, 48, 8}, {1, 16, 1}, {37, 80, 17}, {3, 16, 0}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        for (int t = 0; t < 2; t++)
            for (int acc = 0; acc < 2; acc++) {
                int m = shapes[c][0], n = shapes[c][1], kp = shapes[c][2], ldb = n + 5, ldc = n + 2;
                int lda = t ? m + 3 : kp + 3, arows = t ? kp : m; /* A stored (arows, lda) pairs */
                size_t rs = t ? 1 : (size_t)lda, ps = t ? (size_t)lda : 1;
                size_t na = 2 * (size_t)(arows > 0 ? arows : 1) * lda, nb = 2 * (size_t)(kp > 0 ? kp : 1) * ldb;
                float *af = malloc(sizeof(float) * na), *bf = malloc(sizeof(float) * nb);
                tu_fill_uniform(af, na, -2.0f, 2.0f, 21 + c);
                tu_fill_uniform(bf, nb, -2.0f, 2.0f, 31 + c);
                uint16_t *a16 = tu_from_f32(af, na, LOOM_BF16), *b16 = tu_from_f32(bf, nb, LOOM_BF16);
                size_t nc = (size_t)m * ldc;
                float *C = malloc(sizeof(float) * nc), *want = malloc(sizeof(float) * nc);
                float *C2 = malloc(sizeof(float) * nc);
                tu_fill_uniform(C, nc, -1.0f, 1.0f, 41 + c); /* the row padding must stay */
                memcpy(want, C, sizeof(float) * nc);
                memcpy(C2, C, sizeof(float) * nc);
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        double sum = acc ? want[(size_t)i * ldc + j] : 0.0;
                        for (int q = 0; q < 2 * kp; q++) /* element q & 1 of pair q / 2 */
                            sum += (double)loom_bf16_to_f32(a16[2 * ((size_t)i * rs + (size_t)(q / 2) * ps) + (q & 1)]) *
                                   loom_bf16_to_f32(b16[2 * ((size_t)(q / 2) * ldb + j) + (q & 1)]);
                        want[(size_t)i * ldc + j] = (float)sum;
                    }
                mm_bf16_avx512_emulated(m, n, kp, (const uint32_t *)a16, rs, ps, (const uint32_t *)b16, ldb, C, ldc,
                                        acc);
                TU_ASSERT_CLOSE(C, want, nc, 1e-4, 1e-5);
                if (simd_avx512bf16()) { /* the instructions themselves (their order of the pair's two
                                            * products need not be SIMDe's, so not the same bits) */
                    mm_bf16_avx512(m, n, kp, (const uint32_t *)a16, rs, ps, (const uint32_t *)b16, ldb, C2, ldc, acc);
                    TU_ASSERT_CLOSE(C2, want, nc, 1e-4, 1e-5);
                }
                free(af); free(bf); free(a16); free(b16); free(C); free(C2); free(want);
            }
#else
    skip(); /* built without SIMDe or -mavx512bf16: there are no BF16 tiles */
#endif
}

/* row_pairs against loom_f32_to_bf16 element by element, both paths, fp32
 * rows (ties, NaN, infinities, subnormals among them) and bf16 rows, with
 * and without the high row, lengths off the 8-lane vectors. */
static void test_row_pairs(void **state) {
    (void)state;
    enum { N = 45 };
    float a[N], b[N];
    tu_fill_uniform(a, N, -3.0f, 3.0f, 51);
    tu_fill_uniform(b, N, -3.0f, 3.0f, 52);
    const uint32_t odd[] = {0x3f808000u, 0x3f818000u, 0x7fc00001u, 0xff800000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        memcpy(&a[3 + i], &odd[i], 4);
        memcpy(&b[20 + i], &odd[i], 4);
    }
    uint16_t *a16 = tu_from_f32(a, N, LOOM_BF16), *b16 = tu_from_f32(b, N, LOOM_BF16);
    static const char *const levels[3] = {"portable", "avx2", "native"}; /* as far as the CPU has them */
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    for (int lv = 0; lv < 3; lv++) {
        assert_int_equal(loom_set_simd_level(levels[lv]), LOOM_OK);
        for (int n = 0; n <= N; n += (n < 17 ? 1 : 7))
            for (int hi = 0; hi < 2; hi++) {
                uint32_t got[N], got16[N];
                for (int j = 0; j < N; j++) got[j] = got16[j] = 0xdeadbeefu; /* past n must stay */
                row_pairs(got, a, hi ? b : NULL, LOOM_F32, n);
                row_pairs(got16, a16, hi ? b16 : NULL, LOOM_BF16, n);
                for (int j = 0; j < N; j++) {
                    uint32_t want = j >= n ? 0xdeadbeefu
                                           : loom_f32_to_bf16(a[j]) | (hi ? (uint32_t)loom_f32_to_bf16(b[j]) << 16 : 0u);
                    assert_int_equal(got[j], want);
                    assert_int_equal(got16[j], want);
                }
            }
    }
    assert_int_equal(loom_set_simd_level(was), LOOM_OK);
    free(a16);
    free(b16);
}

/* row_max, row_exp_sum and row_scale on lengths around both vector widths:
 * the max exact (a NaN element ignored, as fmaxf does, on every path), the
 * scaled values exact, the exps (of x * sc - m, sc = 1 and not) within the
 * vector exp's error (portable: libm's) of exp in double, the sum within
 * fp32 reassociation of the exps' own sum, nothing written past n, and the
 * element-wise values the same bits on the AVX-512F and AVX2 paths. */
static void test_row_maps(void **state) {
    (void)state;
    enum { N = 70 };
    float x[N], y[N], e[2][N];
    tu_fill_uniform(x, N, -20.0f, 20.0f, 61);
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    int wide = strncmp(was, "avx512", 6) == 0;
    const float scs[] = {1.0f, 0.125f, 0.37f};
    for (int n = 0; n <= N; n++) {
        float want_max = -INFINITY;
        for (int i = 0; i < n; i++) want_max = x[i] > want_max ? x[i] : want_max;
        assert_true(row_max(x, n) == want_max);
        for (int pos = 0; pos < n; pos += 7) { /* a NaN anywhere: the max of the rest */
            float xn[N], rest = -INFINITY;
            memcpy(xn, x, sizeof x);
            xn[pos] = NAN;
            for (int i = 0; i < n; i++) rest = i != pos && x[i] > rest ? x[i] : rest;
            assert_true(row_max(xn, n) == rest);
        }
        for (int k = 0; k < 3; k++) {
            float sc = scs[k], m = want_max * sc;
            for (int lv = 0; lv < 1 + wide; lv++) {
                assert_int_equal(loom_set_simd_level(lv ? "avx2" : was), LOOM_OK);
                memcpy(e[lv], x, sizeof x);
                float sum = row_exp_sum(e[lv], n, sc, m), own = 0.0f;
                for (int i = 0; i < n; i++) {
                    double want = exp((double)(x[i] * sc - m)); // the difference as the kernel forms it
                    assert_true(fabs(e[lv][i] - want) <= 1e-6 * want + 1e-38);
                    own += e[lv][i];
                }
                for (int i = n; i < N; i++) assert_true(e[lv][i] == x[i]);
                assert_true(fabsf(sum - own) <= 1e-6f * own);
                memcpy(y, x, sizeof x);
                row_scale(y, 0.37f, n);
                for (int i = 0; i < N; i++) assert_true(y[i] == (i < n ? x[i] * 0.37f : x[i]));
            }
            assert_int_equal(loom_set_simd_level(was), LOOM_OK);
            if (wide) assert_true(tu_bits_equal(e[0], e[1], (size_t)n * 4, "exps avx512f vs avx2"));
        }
    }
}

/* loom_simd_name says which paths run: portable when turned off, else the
 * widest this CPU and build take. */
static void test_simd_name(void **state) {
    (void)state;
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    loom_set_simd(0);
    assert_string_equal(loom_simd_name(), "portable");
    loom_set_simd(1);
    const char *want = simd_avx512bf16() ? "avx512-bf16" : simd_avx512() ? "avx512f" : simd_avx2() ? "avx2" : "portable";
    assert_string_equal(loom_simd_name(), want);
    assert_int_equal(loom_set_simd_level(was), LOOM_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_transpose),
        cmocka_unit_test(test_mm),
        cmocka_unit_test(test_mm_avx512_tiles),
        cmocka_unit_test(test_mm_bf16_tiles),
        cmocka_unit_test(test_row_pairs),
        cmocka_unit_test(test_row_maps),
        cmocka_unit_test(test_simd_name),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
