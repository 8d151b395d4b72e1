/*
 * kernel_rows.c — the fp32 building blocks of the row-wise kernels: a small
 * matrix product for attention's blocks, a transpose of 32-bit elements,
 * and row reductions and maps (max, exp-and-sum, scale, dot, bf16 pairs).
 *
 * Each has an AVX2/FMA version and a portable C version, the row maps and
 * exp-and-sum a 16-lane AVX-512F version too; simd_avx512() and
 * simd_avx2() pick one per call. Sums run in a fixed order (8 or 16 lanes,
 * then a fixed horizontal reduction), so results are deterministic for each
 * path; the element-wise values (the exps, the scaled rows, the pairs) are
 * the same bits on the AVX-512F and AVX2 paths.
 * Must never: allocate, or read outside the given rows and columns.
 */
#include "kernels/kernel_rows.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------- portable */

/* Element (r, d) of op(A) is A[r * rs + d * ds]. */
static void mm_c(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb, float *C,
                 int ldc, int accumulate) {
    for (int i = 0; i < m; i++) {
        float *c = C + (size_t)i * ldc;
        if (!accumulate)
            for (int j = 0; j < n; j++) c[j] = 0.0f;
        for (int d = 0; d < k; d++) {
            float a = A[(size_t)i * rs + (size_t)d * ds];
            const float *b = B + (size_t)d * ldb;
            for (int j = 0; j < n; j++) c[j] += a * b[j];
        }
    }
}

static float exp_sum_c(float *x, int n, float sc, float m) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] * sc - m);
        s += x[i];
    }
    return s;
}

static uint32_t bf16_bits_at(const void *row, int j, loom_dtype dt) {
    return dt == LOOM_F32 ? loom_f32_to_bf16(((const float *)row)[j]) : ((const uint16_t *)row)[j];
}

static void pairs_c(uint32_t *dst, const void *a, const void *b, loom_dtype dt, int lo, int n) {
    for (int j = lo; j < n; j++) dst[j] = bf16_bits_at(a, j, dt) | (b ? bf16_bits_at(b, j, dt) << 16 : 0u);
}

/* ----------------------------------------------------------------- AVX2 */

#if LOOM_HAVE_X86_SIMD

/* Lanes [0, n) of a vector set (n clamped to 0..8), for masked loads/stores. */
SIMD_AVX2 static inline __m256i lane_mask(int n) {
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* C rows [0, 4) x columns [0, cols <= 16); element (r, d) of op(A) is
 * A[r * rs + d * ds]. Rows beyond `rows` compute on a repeated row and are
 * not stored. */
SIMD_AVX2 static void mm_tile_4x16(int rows, int cols, int k, const float *A, size_t rs, size_t ds,
                                   const float *B, int ldb, float *C, int ldc, int accumulate) {
    const float *a0 = A, *a1 = A + (rows > 1 ? 1 : 0) * rs, *a2 = A + (rows > 2 ? 2 : rows - 1) * rs;
    const float *a3 = A + (rows > 3 ? 3 : rows - 1) * rs;
    __m256i m0 = lane_mask(cols), m1 = lane_mask(cols - 8);
    __m256 c00, c01, c10, c11, c20, c21, c30, c31;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = _mm256_setzero_ps();
    /* Full-width rows use plain loads and stores: masked stores are slow on
     * some CPUs (AMD). */
#define LOADU(p, mask) _mm256_loadu_ps(p)
#define LOADC(r, LOAD) do { if (r < rows) { c##r##0 = LOAD(C + (size_t)r * ldc, m0); \
        c##r##1 = LOAD(C + (size_t)r * ldc + 8, m1); } } while (0)
    if (accumulate && cols == 16) {
        LOADC(0, LOADU); LOADC(1, LOADU); LOADC(2, LOADU); LOADC(3, LOADU);
    } else if (accumulate) {
        LOADC(0, _mm256_maskload_ps); LOADC(1, _mm256_maskload_ps);
        LOADC(2, _mm256_maskload_ps); LOADC(3, _mm256_maskload_ps);
    }
#undef LOADC
#define STEP(LOAD) do { \
        __m256 b0 = LOAD(B + (size_t)d * ldb, m0), b1 = LOAD(B + (size_t)d * ldb + 8, m1); \
        size_t o = (size_t)d * ds; \
        __m256 x0 = _mm256_broadcast_ss(a0 + o), x1 = _mm256_broadcast_ss(a1 + o); \
        __m256 x2 = _mm256_broadcast_ss(a2 + o), x3 = _mm256_broadcast_ss(a3 + o); \
        c00 = _mm256_fmadd_ps(x0, b0, c00); c01 = _mm256_fmadd_ps(x0, b1, c01); \
        c10 = _mm256_fmadd_ps(x1, b0, c10); c11 = _mm256_fmadd_ps(x1, b1, c11); \
        c20 = _mm256_fmadd_ps(x2, b0, c20); c21 = _mm256_fmadd_ps(x2, b1, c21); \
        c30 = _mm256_fmadd_ps(x3, b0, c30); c31 = _mm256_fmadd_ps(x3, b1, c31); \
    } while (0)
    if (cols == 16)
        for (int d = 0; d < k; d++) STEP(LOADU);
    else
        for (int d = 0; d < k; d++) STEP(_mm256_maskload_ps);
#undef LOADU
#undef STEP
#define STOREU(p, mask, v) _mm256_storeu_ps(p, v)
#define STOREC(r, STORE) do { if (r < rows) { STORE(C + (size_t)r * ldc, m0, c##r##0); \
        STORE(C + (size_t)r * ldc + 8, m1, c##r##1); } } while (0)
    if (cols == 16) {
        STOREC(0, STOREU); STOREC(1, STOREU); STOREC(2, STOREU); STOREC(3, STOREU);
    } else {
        STOREC(0, _mm256_maskstore_ps); STOREC(1, _mm256_maskstore_ps);
        STOREC(2, _mm256_maskstore_ps); STOREC(3, _mm256_maskstore_ps);
    }
#undef STOREU
#undef STOREC
}

/* C rows [0, rows <= 4) x columns [0, 24): twelve accumulators, so each
 * FMA chain has slack beyond the FMA latency (the 4 x 16 tile has exactly
 * eight, the minimum that keeps two FMA pipes busy). */
SIMD_AVX2 static void mm_tile_4x24(int rows, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb,
                                   float *C, int ldc, int accumulate) {
    const float *a0 = A, *a1 = A + (rows > 1 ? 1 : 0) * rs, *a2 = A + (rows > 2 ? 2 : rows - 1) * rs;
    const float *a3 = A + (rows > 3 ? 3 : rows - 1) * rs;
    __m256 c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
    c00 = c01 = c02 = c10 = c11 = c12 = c20 = c21 = c22 = c30 = c31 = c32 = _mm256_setzero_ps();
#define LOADC(r) do { if (accumulate && r < rows) { const float *c = C + (size_t)r * ldc; \
        c##r##0 = _mm256_loadu_ps(c); c##r##1 = _mm256_loadu_ps(c + 8); c##r##2 = _mm256_loadu_ps(c + 16); } } while (0)
    LOADC(0); LOADC(1); LOADC(2); LOADC(3);
#undef LOADC
    for (int d = 0; d < k; d++) {
        const float *b = B + (size_t)d * ldb;
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16);
        size_t o = (size_t)d * ds;
#define ROW(r) do { __m256 x = _mm256_broadcast_ss(a##r + o); c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0); \
        c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1); c##r##2 = _mm256_fmadd_ps(x, b2, c##r##2); } while (0)
        ROW(0); ROW(1); ROW(2); ROW(3);
#undef ROW
    }
#define STOREC(r) do { if (r < rows) { float *c = C + (size_t)r * ldc; _mm256_storeu_ps(c, c##r##0); \
        _mm256_storeu_ps(c + 8, c##r##1); _mm256_storeu_ps(c + 16, c##r##2); } } while (0)
    STOREC(0); STOREC(1); STOREC(2); STOREC(3);
#undef STOREC
}

SIMD_AVX2 static void mm_avx2(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb,
                              float *C, int ldc, int accumulate) {
    int n24 = n / 24 * 24; /* 24-column tiles, then 16-column ones for the rest */
    for (int i = 0; i < m; i += 4) {
        int rows = m - i < 4 ? m - i : 4, j = 0;
        const float *a = A + (size_t)i * rs;
        float *c = C + (size_t)i * ldc;
        for (; j < n24; j += 24) mm_tile_4x24(rows, k, a, rs, ds, B + j, ldb, c + j, ldc, accumulate);
        for (; j < n; j += 16)
            mm_tile_4x16(rows, n - j < 16 ? n - j : 16, k, a, rs, ds, B + j, ldb, c + j, ldc, accumulate);
    }
}

SIMD_AVX2 static float max_avx2(const float *x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int i = 0;
    /* (load, m): a NaN element leaves the lane as it was, as fmaxf does */
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float r = simd_hmax(m);
    for (; i < n; i++) r = fmaxf(r, x[i]);
    return r;
}

SIMD_AVX2 static float exp_sum_avx2(float *x, int n, float sc, float m) {
    __m256 vm = _mm256_set1_ps(m), vsc = _mm256_set1_ps(sc), s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = simd_exp(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vsc), vm));
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
    }
    if (i < n) { /* the tail through the same vector exp, masked */
        __m256i mk = lane_mask(n - i);
        __m256 e = simd_exp(_mm256_sub_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, mk), vsc), vm));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(x + i, mk, e);
        s = _mm256_add_ps(s, e);
    }
    return simd_hsum(s);
}

SIMD_AVX2 static float dot_avx2(const float *a, const float *b, int n) {
    __m256 s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float r = simd_hsum(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* x[0 .. 8k) *= s; returns 8k (the tail is the caller's: same operation). */
SIMD_AVX2 static int scale_avx2(float *x, float s, int n) {
    __m256 vs = _mm256_set1_ps(s);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    return i;
}

/* bf16 bits of eight elements of a row of dtype dt, in the low 16 bits of
 * each 32-bit lane. */
SIMD_AVX2 static inline __m256i bf16_lanes(const void *row, int j, loom_dtype dt) {
    if (dt == LOOM_F32) return simd_bf16_bits(_mm256_loadu_ps((const float *)row + j));
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j)));
}

/* row_pairs for j < 8k; returns 8k (the tail is the caller's). */
SIMD_AVX2 static int pairs_avx2(uint32_t *dst, const void *a, const void *b, loom_dtype dt, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256i v = bf16_lanes(a, j, dt);
        if (b) v = _mm256_or_si256(v, _mm256_slli_epi32(bf16_lanes(b, j, dt), 16));
        _mm256_storeu_si256((__m256i *)(dst + j), v);
    }
    return j;
}

/* dst (8, 8) = src (8, 8)^T, both with row strides (in floats). */
SIMD_AVX2 static void transpose_8x8_avx2(float *dst, size_t ldd, const float *src, size_t lds) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (size_t)i * lds);
    for (int i = 0; i < 8; i += 2) { /* pairs of rows, interleaved */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* quads: 4 x 2-element groups */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) { /* 128-bit halves of quads i and i + 4 */
        _mm256_storeu_ps(dst + (size_t)i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (size_t)(i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

#endif /* LOOM_HAVE_X86_SIMD */

/* ------------------------------------------------------------ AVX-512F */

#if LOOM_HAVE_SIMD512

SIMD_AVX512 static float max_avx512(const float *x, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m); /* NaN ignored: max_avx2 */
    if (i < n) m = _mm512_max_ps(_mm512_mask_loadu_ps(m, (__mmask16)((1u << (n - i)) - 1), x + i), m);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1));
    return simd_hmax(_mm256_max_ps(_mm512_castps512_ps256(m), hi));
}

SIMD_AVX512 static float exp_sum_avx512(float *x, int n, float sc, float m) {
    __m512 vm = _mm512_set1_ps(m), vsc = _mm512_set1_ps(sc), s = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = simd_exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vsc), vm));
        _mm512_storeu_ps(x + i, e);
        s = _mm512_add_ps(s, e);
    }
    if (i < n) { /* the tail through the same vector exp, masked */
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 e = simd_exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vsc), vm));
        _mm512_mask_storeu_ps(x + i, k, e);
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(k, e));
    }
    return simd_hsum16(s);
}

/* x[0 .. 16k) *= s; returns 16k. */
SIMD_AVX512 static int scale_avx512(float *x, float s, int n) {
    __m512 vs = _mm512_set1_ps(s);
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
    return i;
}

SIMD_AVX512 static inline __m512i bf16_lanes16(const void *row, int j, loom_dtype dt) {
    if (dt == LOOM_F32) return simd_bf16_bits16(_mm512_loadu_ps((const float *)row + j));
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j)));
}

/* row_pairs for j < 16k; returns 16k. */
SIMD_AVX512 static int pairs_avx512(uint32_t *dst, const void *a, const void *b, loom_dtype dt, int n) {
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512i v = bf16_lanes16(a, j, dt);
        if (b) v = _mm512_or_si512(v, _mm512_slli_epi32(bf16_lanes16(b, j, dt), 16));
        _mm512_storeu_si512(dst + j, v);
    }
    return j;
}

#endif /* LOOM_HAVE_SIMD512 */

/* ------------------------------------------------------------- dispatch */

static mm_tiles_fn tiles_override;
static mm_bf16_fn bf16_override;

void mm_f32_set_tiles(mm_tiles_fn tiles) { __atomic_store_n(&tiles_override, tiles, __ATOMIC_RELAXED); }

void mm_bf16_set_tiles(mm_bf16_fn tiles) { __atomic_store_n(&bf16_override, tiles, __ATOMIC_RELAXED); }

mm_bf16_fn mm_bf16_tiles(void) {
    if (!simd_avx2()) return NULL;
    mm_bf16_fn f = __atomic_load_n(&bf16_override, __ATOMIC_RELAXED);
#if LOOM_HAVE_AVX512
    if (!f && simd_avx512bf16()) f = mm_bf16_avx512;
#endif
    return f;
}

void mm_f32(int m, int n, int k, const float *A, int lda, int trans_a, const float *B, int ldb, float *C,
            int ldc, int accumulate) {
    if (m <= 0 || n <= 0) return;
    size_t rs = trans_a ? 1 : (size_t)lda, ds = trans_a ? (size_t)lda : 1;
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) {
        mm_tiles_fn tiles = __atomic_load_n(&tiles_override, __ATOMIC_RELAXED);
#if LOOM_HAVE_AVX512
        if (!tiles && simd_avx512()) tiles = mm_avx512;
#endif
        int j = tiles ? tiles(m, n, k, A, rs, ds, B, ldb, C, ldc, accumulate) : 0;
        if (j < n) mm_avx2(m, n - j, k, A, rs, ds, B + j, ldb, C + j, ldc, accumulate);
        return;
    }
#endif
    mm_c(m, n, k, A, rs, ds, B, ldb, C, ldc, accumulate);
}

void transpose32(void *dst, int ldd, const void *src, int lds, int rows, int cols) {
    enum { TB = 8 }; /* blocks of 8 x 8 keep both sides in cache lines */
    char *d = dst;
    const char *s = src;
    for (int i0 = 0; i0 < rows; i0 += TB)
        for (int j0 = 0; j0 < cols; j0 += TB) {
#if LOOM_HAVE_X86_SIMD
            if (i0 + TB <= rows && j0 + TB <= cols && simd_avx2()) { /* moves bits only: any 32-bit data */
                transpose_8x8_avx2((float *)dst + (size_t)j0 * ldd + i0, (size_t)ldd,
                                   (const float *)src + (size_t)i0 * lds + j0, (size_t)lds);
                continue;
            }
#endif
            for (int i = i0; i < rows && i < i0 + TB; i++)
                for (int j = j0; j < cols && j < j0 + TB; j++)
                    memcpy(d + 4 * ((size_t)j * ldd + i), s + 4 * ((size_t)i * lds + j), 4);
        }
}

float row_max(const float *x, int n) {
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) return max_avx512(x, n);
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) return max_avx2(x, n);
#endif
    float m = -INFINITY;
    for (int i = 0; i < n; i++) m = fmaxf(m, x[i]);
    return m;
}

float row_exp_sum(float *x, int n, float sc, float m) {
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) return exp_sum_avx512(x, n, sc, m);
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) return exp_sum_avx2(x, n, sc, m);
#endif
    return exp_sum_c(x, n, sc, m);
}

void row_scale(float *x, float s, int n) {
    int i = 0;
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) i = scale_avx512(x, s, n);
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) i += scale_avx2(x + i, s, n - i);
#endif
    for (; i < n; i++) x[i] *= s;
}

void row_pairs(uint32_t *dst, const void *a, const void *b, loom_dtype dt, int n) {
    int j = 0;
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) j = pairs_avx512(dst, a, b, dt, n);
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2() && j + 8 <= n) { /* the last eight the 16-lane loop left, if any */
        size_t o = (size_t)j * loom_dtype_size(dt);
        j += pairs_avx2(dst + j, (const char *)a + o, b ? (const char *)b + o : NULL, dt, n - j);
    }
#endif
    pairs_c(dst, a, b, dt, j, n);
}

float row_dot(const float *a, const float *b, int n) {
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) return dot_avx2(a, b, n);
#endif
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
