/*
 * dropout.c — inverted dropout whose mask is never stored.
 *
 * Element i keeps its value (scaled by 1/(1-p)) when u_i >= p, where u_i is
 * lane i % 4 of Philox(seed, offset + i / 4) mapped to [0, 1). Backward
 * regenerates the same mask from the same (seed, offset), so forward,
 * backward and a recomputed forward all agree bit for bit.
 * A window of a larger tensor (tensor parallelism's split columns, a
 * data-parallel rank's rows of the global batch) takes the larger tensor's
 * mask, element by element.
 * Must never: draw random numbers from anything but (seed, offset, i), or
 * depend on the thread count.
 */
#include "kernels/kernels.h"

#define PARALLEL_MIN_BLOCKS 4096

enum { RUN = 128 }; /* elements whose factors are drawn at a time (32 Philox blocks, 16 at a time) */

void dropout_factors(float *z, size_t n, uint64_t e0, float p, uint64_t seed, uint64_t offset) {
    float keep = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    uint32_t w[RUN + 4];
    for (size_t j0 = 0; j0 < n;) {
        uint64_t e = e0 + j0;
        size_t lane = (size_t)(e % 4), m = n - j0 < RUN ? n - j0 : RUN;
        loom_philox4x32_blocks(seed, offset + e / 4, (lane + m + 3) / 4, w);
        for (size_t j = 0; j < m; j++) z[j0 + j] = loom_u32_to_unit(w[lane + j]) >= p ? keep : 0.0f;
        j0 += m;
    }
}

/* out[i] = in[i] z[i] for the kept (z > 0), exactly 0 for the dropped
 * (whatever in[i] is), i < n: element i at index i0 + i of in and out. */
static void apply_factors(void *out, const void *in, size_t i0, const float *z, size_t n, loom_dtype dt) {
    for (size_t i = 0; i < n; i++)
        loom_store(out, i0 + i, dt, z[i] != 0.0f ? loom_load(in, i0 + i, dt) * z[i] : 0.0f);
}

/* out[i] = mask_{e0 + i} * in[i] / (1 - p): elements e0.. of a tensor's
 * masks, in runs aligned to RUN elements of the whole (each draws whole
 * Philox blocks, sixteen at a time). Forward and backward are this one map. */
static void dropout_apply(void *out, const void *in, size_t n, size_t e0, float p, uint64_t seed,
                          uint64_t offset, loom_dtype dt) {
    if (p <= 0.0f) {
        if (out != in) memmove(out, in, n * loom_dtype_size(dt));
        return;
    }
    if (n == 0) return;
    size_t r0 = e0 / RUN, nruns = (e0 + n - 1) / RUN - r0 + 1;
    #pragma omp parallel for schedule(dynamic, 64) if (n > 4 * PARALLEL_MIN_BLOCKS)
    for (size_t k = 0; k < nruns; k++) {
        float z[RUN];
        size_t g0 = (r0 + k) * RUN, g1 = g0 + RUN; /* the run's elements of the whole, cut to [e0, e0 + n) */
        if (g0 < e0) g0 = e0;
        if (g1 > e0 + n) g1 = e0 + n;
        dropout_factors(z, g1 - g0, g0, p, seed, offset);
        apply_factors(out, in, g0 - e0, z, g1 - g0, dt);
    }
}

void dropout_fwd(void *out, const void *in, size_t n, float p, uint64_t seed,
                 uint64_t offset, loom_dtype dt) {
    dropout_apply(out, in, n, 0, p, seed, offset, dt);
}

void dropout_bwd(void *din, const void *dout, size_t n, float p, uint64_t seed,
                 uint64_t offset, loom_dtype dt) {
    dropout_apply(din, dout, n, 0, p, seed, offset, dt);
}

void dropout_window(void *out, const void *in, size_t rows, size_t cols, size_t row0, size_t col0, size_t width,
                    float p, uint64_t seed, uint64_t offset, loom_dtype dt) {
    if (col0 == 0 && width == cols) { /* whole rows: one contiguous run of the whole's elements */
        dropout_apply(out, in, rows * cols, row0 * width, p, seed, offset, dt);
        return;
    }
    if (p <= 0.0f) {
        if (out != in) memmove(out, in, rows * cols * loom_dtype_size(dt));
        return;
    }
    #pragma omp parallel for schedule(static) if (rows * cols > 4 * PARALLEL_MIN_BLOCKS)
    for (size_t r = 0; r < rows; r++) {
        float z[RUN];
        for (size_t c0 = 0; c0 < cols; c0 += RUN) {
            size_t m = cols - c0 < RUN ? cols - c0 : RUN;
            dropout_factors(z, m, (uint64_t)(row0 + r) * width + col0 + c0, p, seed, offset);
            apply_factors(out, in, r * cols + c0, z, m, dt);
        }
    }
}
