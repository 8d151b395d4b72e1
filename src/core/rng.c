/*
 * rng.c — Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
 * 1, 2, 3", SC 2011). A stream is (seed, offset): the 64-bit seed is the key
 * {low, high}, the 64-bit block offset the low half {c0, c1} of the 128-bit
 * counter (c2 = c3 = 0). loom_philox4x32_blocks computes runs of
 * consecutive counters sixteen (AVX-512F) or eight (AVX2) at a time, the
 * same words. Nothing here keeps hidden state beyond the explicit loom_rng
 * struct.
 */
#include "loom/core.h"
#include "core/rng_internal.h"
#include "core/simd.h"

#include <math.h>
#include <string.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static inline void mulhilo(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
    uint64_t p = (uint64_t)a * b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

void loom_philox4x32_rounds(const uint32_t ctr[4], const uint32_t key[2], int rounds,
                            uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < rounds; r++) {
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo(PHILOX_M0, c0, &hi0, &lo0);
        mulhilo(PHILOX_M1, c2, &hi1, &lo1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

void loom_philox4x32_full(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    loom_philox4x32_rounds(ctr, key, 10, out);
}

void loom_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    const uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0, 0};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    loom_philox4x32_full(ctr, key, out);
}

/* Blocks of consecutive counters, several at a time: lane i of vectors c0..c3
 * is counter first + i's state, each round's multiplies split into the even
 * lanes' and the odd lanes' 64-bit products (mul_epu32 reads the low half
 * of each 64-bit lane), the same 32-bit arithmetic as mulhilo. */
#if LOOM_HAVE_X86_SIMD
/* hi and lo halves of m times each 32-bit lane of x (8 lanes). */
SIMD_AVX2 static inline void philox_mulhilo8(__m256i x, __m256i m, __m256i *hi, __m256i *lo) {
    __m256i even = _mm256_mul_epu32(x, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* out[4 i + lane], i < 8: counters first .. first + 7. */
SIMD_AVX2 static void philox_blocks8(uint64_t seed, uint64_t first, uint32_t *out) {
    uint32_t lo[8], hi[8], w[4][8];
    for (int i = 0; i < 8; i++) {
        lo[i] = (uint32_t)(first + (uint64_t)i);
        hi[i] = (uint32_t)((first + (uint64_t)i) >> 32);
    }
    __m256i c0 = _mm256_loadu_si256((const __m256i *)lo), c1 = _mm256_loadu_si256((const __m256i *)hi);
    __m256i c2 = _mm256_setzero_si256(), c3 = c2;
    const __m256i m0 = _mm256_set1_epi32((int)PHILOX_M0), m1 = _mm256_set1_epi32((int)PHILOX_M1);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        __m256i hi0, lo0, hi1, lo1;
        philox_mulhilo8(c0, m0, &hi0, &lo0);
        philox_mulhilo8(c2, m1, &hi1, &lo1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        c1 = lo1;
        c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    _mm256_storeu_si256((__m256i *)w[0], c0);
    _mm256_storeu_si256((__m256i *)w[1], c1);
    _mm256_storeu_si256((__m256i *)w[2], c2);
    _mm256_storeu_si256((__m256i *)w[3], c3);
    for (int i = 0; i < 8; i++)
        for (int l = 0; l < 4; l++) out[4 * i + l] = w[l][i];
}
#endif

#if LOOM_HAVE_SIMD512
/* philox_mulhilo8 on 16 lanes. */
SIMD_AVX512 static inline void philox_mulhilo16(__m512i x, __m512i m, __m512i *hi, __m512i *lo) {
    __m512i even = _mm512_mul_epu32(x, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), m);
    *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

/* out[4 i + lane], i < 16: counters first .. first + 15 (their low words
 * first + i with a carry into the high ones), the four lane vectors
 * transposed into blocks in registers. */
SIMD_AVX512 static void philox_blocks16(uint64_t seed, uint64_t first, uint32_t *out) {
    const __m512i base = _mm512_set1_epi32((int)(uint32_t)first);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i c0 = _mm512_add_epi32(base, iota), c1 = _mm512_set1_epi32((int)(uint32_t)(first >> 32));
    c1 = _mm512_mask_add_epi32(c1, _mm512_cmplt_epu32_mask(c0, base), c1, _mm512_set1_epi32(1));
    __m512i c2 = _mm512_setzero_si512(), c3 = c2;
    const __m512i m0 = _mm512_set1_epi32((int)PHILOX_M0), m1 = _mm512_set1_epi32((int)PHILOX_M1);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        __m512i hi0, lo0, hi1, lo1;
        philox_mulhilo16(c0, m0, &hi0, &lo0);
        philox_mulhilo16(c2, m1, &hi1, &lo1);
        c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32((int)k0));
        c1 = lo1;
        c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32((int)k1));
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    /* within each 128-bit lane L, u_k holds block 4 L + k's four words */
    __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
    __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
    /* then the 4 x 4 transpose of 128-bit lanes: output vector L is lane L of u0 .. u3 */
    __m512i v0 = _mm512_shuffle_i32x4(u0, u1, 0x44), v1 = _mm512_shuffle_i32x4(u2, u3, 0x44);
    __m512i v2 = _mm512_shuffle_i32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
    _mm512_storeu_si512(out, _mm512_shuffle_i32x4(v0, v1, 0x88));
    _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(v0, v1, 0xDD));
    _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(v2, v3, 0x88));
    _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(v2, v3, 0xDD));
}
#endif

void loom_philox4x32_blocks(uint64_t seed, uint64_t first, size_t n, uint32_t *out) {
    size_t i = 0;
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) {
        for (; i + 16 <= n; i += 16) philox_blocks16(seed, first + i, out + 4 * i);
        if (i < n) { /* the last few: sixteen drawn, the first n - i kept */
            uint32_t tail[64];
            philox_blocks16(seed, first + i, tail);
            memcpy(out + 4 * i, tail, 4 * (n - i) * sizeof *tail);
            return;
        }
    }
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2())
        for (; i + 8 <= n; i += 8) philox_blocks8(seed, first + i, out + 4 * i);
#endif
    for (; i < n; i++) loom_philox4x32(seed, first + i, out + 4 * i);
}

void loom_rng_init(loom_rng *rng, uint64_t seed) {
    rng->seed = seed;
    rng->offset = 0;
}

uint64_t loom_rng_reserve(loom_rng *rng, uint64_t n_blocks) {
    uint64_t first = rng->offset;
    rng->offset += n_blocks;
    return first;
}

void loom_rng_uniform(float *out, size_t n, uint64_t seed, uint64_t offset) {
    #pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t b = 0; b < (n + 3) / 4; b++) {
        uint32_t r[4];
        loom_philox4x32(seed, offset + b, r);
        for (size_t j = 0; j < 4 && 4 * b + j < n; j++) out[4 * b + j] = loom_u32_to_unit(r[j]);
    }
}

/* Box-Muller on the 4 lanes of each block: two normals per pair of lanes. */
void loom_rng_normal(float *out, size_t n, float mean, float std, uint64_t seed, uint64_t offset) {
    #pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t b = 0; b < (n + 3) / 4; b++) {
        uint32_t r[4];
        loom_philox4x32(seed, offset + b, r);
        for (int pair = 0; pair < 2; pair++) {
            double u1 = ((double)(r[2 * pair] >> 8) + 1.0) / 16777217.0; /* (0, 1] */
            double u2 = (double)(r[2 * pair + 1] >> 8) / 16777216.0;
            double rad = sqrt(-2.0 * log(u1));
            double z0 = rad * cos(2.0 * M_PI * u2), z1 = rad * sin(2.0 * M_PI * u2);
            size_t i = 4 * b + 2 * (size_t)pair;
            if (i < n) out[i] = mean + std * (float)z0;
            if (i + 1 < n) out[i + 1] = mean + std * (float)z1;
        }
    }
}

loom_rng *loom_rng_default(void) {
    static _Thread_local loom_rng rng = {0x5eed5eedULL, 0};
    return &rng;
}
