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

enum { CHUNK = 16 }; /* Philox blocks drawn at a time (loom_philox4x32_blocks) */

/* out[i] = mask_{e0 + i} * in[i] / (1 - p): elements e0.. of a tensor's
 * masks. Forward and backward are this one map. */
static void dropout_apply(void *out, const void *in, size_t n, size_t e0, float p, uint64_t seed,
                          uint64_t offset, loom_dtype dt) {
    if (p <= 0.0f) {
        if (out != in) memmove(out, in, n * loom_dtype_size(dt));
        return;
    }
    if (n == 0) return;
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    size_t b0 = e0 / 4, nblocks = (e0 + n - 1) / 4 - b0 + 1, nchunks = (nblocks + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(dynamic, 256) if (nblocks > PARALLEL_MIN_BLOCKS)
    for (size_t c = 0; c < nchunks; c++) {
        uint32_t r[4 * CHUNK];
        size_t cb = b0 + c * CHUNK, m = nblocks - c * CHUNK < CHUNK ? nblocks - c * CHUNK : CHUNK;
        loom_philox4x32_blocks(seed, offset + cb, m, r);
        for (size_t k = 0; k < 4 * m; k++) {
            size_t g = 4 * cb + k; /* the element's index in the whole */
            if (g < e0 || g - e0 >= n) continue;
            size_t i = g - e0;
            int keep = loom_u32_to_unit(r[k]) >= p;
            loom_store(out, i, dt, keep ? loom_load(in, i, dt) * scale : 0.0f);
        }
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
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    #pragma omp parallel for schedule(static) if (rows * cols > 4 * PARALLEL_MIN_BLOCKS)
    for (size_t r = 0; r < rows; r++) {
        uint32_t u[4];
        uint64_t have = UINT64_MAX; /* the Philox block u holds */
        for (size_t c = 0; c < cols; c++) {
            size_t g = (row0 + r) * width + col0 + c, i = r * cols + c;
            if (g / 4 != have) loom_philox4x32(seed, offset + (have = g / 4), u);
            int keep = loom_u32_to_unit(u[g % 4]) >= p;
            loom_store(out, i, dt, keep ? loom_load(in, i, dt) * scale : 0.0f);
        }
    }
}
