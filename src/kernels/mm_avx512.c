/*
 * mm_avx512.c — mm_f32's AVX-512F tiles: 8 rows x 32 or 16 columns of C in
 * zmm accumulators, each element adding its k products in order with fused
 * multiply-adds (the sums of the AVX2 tile, twice as wide); and the same
 * tiles over bf16 pairs with AVX-512 BF16 dot products (vdpbf16ps), for the
 * attention's products of bf16 inputs.
 *
 * Written with SIMDe's names for the intrinsics. The library compiles this
 * file with -mavx512f -mavx512bf16, where SIMDe maps each name to its
 * instruction, and calls the tiles only when the CPU and the OS have them
 * (simd_avx512(), simd_avx512bf16()). The tests compile it a second time
 * without, as mm_avx512_emulated and mm_bf16_avx512_emulated, where
 * SIMDe computes the same lanes in portable C: the tile logic is tested on
 * machines without AVX-512.
 *
 * Columns are whole vectors only (this SIMDe has no masked loads): the
 * caller does the n % 16 columns left over. Rows past m compute on a
 * repeated row and are not stored.
 */
#if LOOM_HAVE_AVX512

#include <simde/x86/avx512.h>
#include <stddef.h>

#include <stdint.h>

#ifndef MM_AVX512_NAME
#define MM_AVX512_NAME mm_avx512
#define MM_BF16_NAME mm_bf16_avx512
#endif

int MM_AVX512_NAME(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb, float *C,
                   int ldc, int accumulate);
void MM_BF16_NAME(int m, int n16, int kp, const uint32_t *A, size_t rs, size_t ps, const uint32_t *B, int ldb,
                  float *C, int ldc, int accumulate);

#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define DECL(r) simde__m512 c##r##0 = simde_mm512_setzero_ps(), c##r##1 = c##r##0;
#define LOAD(r)                                                                                                   \
    if (accumulate && (r) < rows) {                                                                               \
        c##r##0 = simde_mm512_loadu_ps(C + (size_t)(r) * ldc);                                                    \
        if (w > 1) c##r##1 = simde_mm512_loadu_ps(C + (size_t)(r) * ldc + 16);                                    \
    }
#define STEP(r)                                                                                                   \
    {                                                                                                             \
        simde__m512 x = simde_mm512_set1_ps(A[(size_t)((r) < rows ? (r) : rows - 1) * rs + o]);                  \
        c##r##0 = simde_mm512_fmadd_ps(x, b0, c##r##0);                                                           \
        if (w > 1) c##r##1 = simde_mm512_fmadd_ps(x, b1, c##r##1);                                                \
    }
#define STORE(r)                                                                                                  \
    if ((r) < rows) {                                                                                             \
        simde_mm512_storeu_ps(C + (size_t)(r) * ldc, c##r##0);                                                    \
        if (w > 1) simde_mm512_storeu_ps(C + (size_t)(r) * ldc + 16, c##r##1);                                    \
    }

/* C rows [0, rows <= 8) x columns [0, 16 W), W = 1 or 2 vectors. */
#define TILE(W)                                                                                                  \
    static void tile_8x##W(int rows, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb,      \
                           float *C, int ldc, int accumulate) {                                                   \
        const int w = W; /* vectors per row */                                                                   \
        ROWS(DECL)                                                                                                \
        ROWS(LOAD)                                                                                                \
        for (int d = 0; d < k; d++) {                                                                            \
            const float *b = B + (size_t)d * ldb;                                                                 \
            simde__m512 b0 = simde_mm512_loadu_ps(b), b1 = w > 1 ? simde_mm512_loadu_ps(b + 16) : b0;            \
            size_t o = (size_t)d * ds;                                                                            \
            ROWS(STEP)                                                                                            \
        }                                                                                                         \
        ROWS(STORE)                                                                                               \
    }

TILE(1)
TILE(2)

/* C (m, n16) for the first n16 = n rounded down to 16 columns, in 8 x 32
 * tiles and one 8 x 16 tile when n16 is an odd number of vectors; returns
 * n16. Element (r, d) of op(A) is A[r * rs + d * ds]. */
int MM_AVX512_NAME(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb, float *C,
                   int ldc, int accumulate) {
    int n16 = n / 16 * 16;
    for (int i = 0; i < m; i += 8) {
        int rows = m - i < 8 ? m - i : 8;
        const float *a = A + (size_t)i * rs;
        float *c = C + (size_t)i * ldc;
        int j = 0;
        for (; j + 32 <= n16; j += 32) tile_8x2(rows, k, a, rs, ds, B + j, ldb, c + j, ldc, accumulate);
        if (j < n16) tile_8x1(rows, k, a, rs, ds, B + j, ldb, c + j, ldc, accumulate);
    }
    return n16;
}

/* ------------------------------------------------------------ bf16 pairs */

static simde__m512bh as_bh(simde__m512i v) {
    simde__m512bh r;
    simde_memcpy(&r, &v, sizeof r);
    return r;
}

#define BSTEP(r)                                                                                                  \
    {                                                                                                             \
        simde__m512bh x = as_bh(simde_mm512_set1_epi32((int32_t)A[(size_t)((r) < rows ? (r) : rows - 1) * rs + o])); \
        c##r##0 = simde_mm512_dpbf16_ps(c##r##0, x, b0);                                                          \
        if (w > 1) c##r##1 = simde_mm512_dpbf16_ps(c##r##1, x, b1);                                               \
    }

/* C rows [0, rows <= 8) x columns [0, 16 W) (+)= the sums over kp pairs. */
#define BTILE(W)                                                                                                 \
    static void btile_8x##W(int rows, int kp, const uint32_t *A, size_t rs, size_t ps, const uint32_t *B,     \
                            int ldb, float *C, int ldc, int accumulate) {                                         \
        const int w = W; /* vectors per row */                                                                   \
        ROWS(DECL)                                                                                                \
        ROWS(LOAD)                                                                                                \
        for (int p = 0; p < kp; p++) {                                                                           \
            const uint32_t *b = B + (size_t)p * ldb;                                                              \
            size_t o = (size_t)p * ps;                                                                            \
            simde__m512bh b0 = as_bh(simde_mm512_loadu_si512(b));                                                 \
            simde__m512bh b1 = w > 1 ? as_bh(simde_mm512_loadu_si512(b + 16)) : b0;                              \
            ROWS(BSTEP)                                                                                           \
        }                                                                                                         \
        ROWS(STORE)                                                                                               \
    }

BTILE(1)
BTILE(2)

/* C (m, n16) = A B, or C += A B with accumulate, over bf16 pairs, n16 a
 * multiple of 16: A's pair (r, p) is the 32 bits A[r * rs + p * ps] (two
 * bf16, the lower one first), B (kp, ldb) holds at B[p * ldb + j] the pair
 * p of column j. Each element adds its kp pair products in order, in fp32,
 * to C's value or to 0. */
void MM_BF16_NAME(int m, int n16, int kp, const uint32_t *A, size_t rs, size_t ps, const uint32_t *B, int ldb,
                  float *C, int ldc, int accumulate) {
    for (int i = 0; i < m; i += 8) {
        int rows = m - i < 8 ? m - i : 8;
        const uint32_t *a = A + (size_t)i * rs;
        float *c = C + (size_t)i * ldc;
        int j = 0;
        for (; j + 32 <= n16; j += 32) btile_8x2(rows, kp, a, rs, ps, B + j, ldb, c + j, ldc, accumulate);
        if (j < n16) btile_8x1(rows, kp, a, rs, ps, B + j, ldb, c + j, ldc, accumulate);
    }
}

#endif /* LOOM_HAVE_AVX512 */
