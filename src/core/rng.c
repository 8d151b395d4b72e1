/*
 * rng.c — Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
 * 1, 2, 3", SC 2011). A stream is (seed, offset): the 64-bit seed is the key
 * {low, high}, the 64-bit block offset the low half {c0, c1} of the 128-bit
 * counter (c2 = c3 = 0). Nothing here keeps hidden state beyond the explicit
 * loom_rng struct.
 */
#include "loom/core.h"
#include "core/rng_internal.h"

#include <math.h>

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
