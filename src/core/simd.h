/*
 * simd.h — private to src/: the run-time choice between the AVX-512F,
 * AVX2/FMA/F16C and portable C paths of the kernels, and the helpers those
 * paths share (loads and stores of f32/bf16/f16 as fp32 vectors, a vector
 * exp), 8 wide for AVX2 and 16 wide for AVX-512F.
 *
 * One build runs on any x86-64: functions marked SIMD_AVX2 are compiled for
 * AVX2+FMA+F16C and only called when simd_avx2() says the CPU has them (and
 * loom_set_simd / loom_set_simd_level allow them); SIMD_AVX512 functions
 * likewise for AVX-512F under simd_avx512(). Everything else is plain C.
 * Each path is deterministic on its own; they may differ in the last bits
 * of a reduction or an exp, never in a conversion. The 16-wide helpers do
 * lane by lane exactly what the 8-wide ones do, so an element-wise kernel
 * gives the same bits on both.
 */
#ifndef LOOM_SIMD_H
#define LOOM_SIMD_H

#include "loom/core.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define LOOM_HAVE_X86_SIMD 1
#include <immintrin.h>
#include <math.h>
#define SIMD_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define LOOM_HAVE_X86_SIMD 0
#define SIMD_AVX2
#endif

/* 1 when the AVX2 paths are to be taken (CPU support and loom_set_simd).
 * The first call detects the CPU, capped by the environment variable
 * LOOM_SIMD when it names a level (loom_set_simd_level). */
static inline int simd_avx2(void) {
    extern int simd_avx2_state_; /* -1: not yet detected */
    int s = __atomic_load_n(&simd_avx2_state_, __ATOMIC_RELAXED);
    if (s < 0) {
        void simd_detect(void);
        simd_detect();
        s = __atomic_load_n(&simd_avx2_state_, __ATOMIC_RELAXED);
    }
    return s;
}

/* 1 when the AVX-512F tiles are to be taken (CPU and OS support, a build
 * with them, and loom_set_simd); implies simd_avx2(). */
static inline int simd_avx512(void) {
    extern int simd_avx512_state_;
    return simd_avx2() && __atomic_load_n(&simd_avx512_state_, __ATOMIC_RELAXED);
}

/* 1 when the AVX-512 BF16 dot products may be used (as simd_avx512). */
static inline int simd_avx512bf16(void) {
    extern int simd_avx512bf16_state_;
    return simd_avx2() && __atomic_load_n(&simd_avx512bf16_state_, __ATOMIC_RELAXED);
}

/* Bulk conversions on the calling thread (no OpenMP): n elements. */
void convert_to_f32(float *dst, const void *src, loom_dtype dt, size_t n);
void convert_from_f32(void *dst, loom_dtype dt, const float *src, size_t n);

#if LOOM_HAVE_X86_SIMD

/* Eight elements of dtype dt at p[i .. i+8) as fp32. */
SIMD_AVX2 static inline __m256 simd_load8(const void *p, size_t i, loom_dtype dt) {
    if (dt == LOOM_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == LOOM_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16 bits of eight values, round to nearest even, NaN kept quiet
 * (exactly loom_f32_to_bf16), in the low 16 bits of each 32-bit lane. */
SIMD_AVX2 static inline __m256i simd_bf16_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    return _mm256_blendv_epi8(r, q, nan);
}

/* Eight fp32 values stored as dtype dt at p[i .. i+8) (rounded to nearest even). */
SIMD_AVX2 static inline void simd_store8(void *p, size_t i, loom_dtype dt, __m256 v) {
    if (dt == LOOM_F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m128i h;
    if (dt == LOOM_F16) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        __m256i b = simd_bf16_bits(v);
        h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xd8));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

/* Horizontal sum of eight floats, in a fixed order. */
SIMD_AVX2 static inline float simd_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

SIMD_AVX2 static inline float simd_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for eight floats (Cephes expf): x = n ln2 + r with |r| <= ln2/2 and
 * a degree-6 polynomial in r, relative error about 2e-7. Results below
 * 2^-126 flush to 0 (exp(-inf) = 0), x above 127.5 ln2 gives +inf, NaN stays
 * NaN. */
SIMD_AVX2 static inline __m256 simd_exp(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.336544f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_max_ps(lo, _mm256_min_ps(hi, x)); /* operand order keeps NaN */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2 in two steps (Cody-Waite) */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    y = _mm256_andnot_ps(under, y);
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

#endif /* LOOM_HAVE_X86_SIMD */

#if LOOM_HAVE_X86_SIMD && LOOM_HAVE_AVX512
#define LOOM_HAVE_SIMD512 1
#define SIMD_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

/* Sixteen elements of dtype dt at p[i .. i+16) as fp32. */
SIMD_AVX512 static inline __m512 simd_load16(const void *p, size_t i, loom_dtype dt) {
    if (dt == LOOM_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dt == LOOM_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* simd_bf16_bits for sixteen values (exactly loom_f32_to_bf16). */
SIMD_AVX512 static inline __m512i simd_bf16_bits16(__m512 v) {
    __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x0040));
}

/* Sixteen fp32 values stored as dtype dt at p[i .. i+16) (rounded to nearest even). */
SIMD_AVX512 static inline void simd_store16(void *p, size_t i, loom_dtype dt, __m512 v) {
    if (dt == LOOM_F32) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    __m256i h = dt == LOOM_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                               : _mm512_cvtepi32_epi16(simd_bf16_bits16(v));
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
}

/* simd_exp for sixteen floats: the same operations, so the same bits. */
SIMD_AVX512 static inline __m512 simd_exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.336544f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    x = _mm512_max_ps(lo, _mm512_min_ps(hi, x)); /* operand order keeps NaN */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
    return _mm512_mask_mov_ps(y, over, _mm512_set1_ps(INFINITY));
}

/* Horizontal sum of sixteen floats, in a fixed order: the two halves
 * added lane by lane, then simd_hsum. */
SIMD_AVX512 static inline float simd_hsum16(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return simd_hsum(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}
#else
#define LOOM_HAVE_SIMD512 0
#endif

#endif
