/*
 * dropout.c — inverted dropout whose mask is never stored.
 *
 * Element i keeps its value (scaled by 1/(1-p)) when u_i >= p, where u_i is
 * lane i % 4 of Philox(seed, offset + i / 4) mapped to [0, 1). Backward
 * regenerates the same mask from the same (seed, offset), so forward,
 * backward and a recomputed forward all agree bit for bit.
 * Must never: draw random numbers from anything but (seed, offset, i), or
 * depend on the thread count.
 */
#include "kernels/kernels.h"

#define PARALLEL_MIN_BLOCKS 4096

/* out[i] = mask_i * in[i] / (1 - p). Forward and backward are this one map. */
static void dropout_apply(void *out, const void *in, size_t n, float p, uint64_t seed,
                          uint64_t offset, loom_dtype dt) {
    if (p <= 0.0f) {
        if (out != in) memmove(out, in, n * loom_dtype_size(dt));
        return;
    }
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    size_t nblocks = (size_t)dropout_blocks(n);
    #pragma omp parallel for schedule(dynamic, 4096) if (nblocks > PARALLEL_MIN_BLOCKS)
    for (size_t b = 0; b < nblocks; b++) {
        uint32_t r[4];
        loom_philox4x32(seed, offset + b, r);
        for (size_t lane = 0; lane < 4 && 4 * b + lane < n; lane++) {
            size_t i = 4 * b + lane;
            int keep = loom_u32_to_unit(r[lane]) >= p;
            loom_store(out, i, dt, keep ? loom_load(in, i, dt) * scale : 0.0f);
        }
    }
}

void dropout_fwd(void *out, const void *in, size_t n, float p, uint64_t seed,
                 uint64_t offset, loom_dtype dt) {
    dropout_apply(out, in, n, p, seed, offset, dt);
}

void dropout_bwd(void *din, const void *dout, size_t n, float p, uint64_t seed,
                 uint64_t offset, loom_dtype dt) {
    dropout_apply(din, dout, n, p, seed, offset, dt);
}
