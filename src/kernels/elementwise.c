/*
 * elementwise.c — add, mul, scale, gradient accumulation, and the two
 * reductions used for gradient norms and overflow checks.
 *
 * Each op is one loop per dtype (so conversions inline and the f32 loop
 * vectorizes), OpenMP-parallel above PARALLEL_MIN elements. Arithmetic is
 * fp32; results are rounded once to the output dtype.
 * Must never: depend on the thread count for its result (sumsq sums fixed
 * chunks in a fixed order), or allocate.
 */
#include "kernels/kernels.h"

#define PARALLEL_MIN 32768

/* Loads and stores of one element of each dtype, as fp32. */
#define LD_F32(x) (x)
#define ST_F32(v) (v)
#define LD_BF16(x) loom_bf16_to_f32(x)
#define ST_BF16(v) loom_f32_to_bf16(v)
#define LD_F16(x) loom_f16_to_f32(x)
#define ST_F16(v) loom_f32_to_f16(v)

/* Expand LOOP(T, LD, ST) for the element type and conversions of dt. */
#define DISPATCH(dt, LOOP)                                   \
    switch (dt) {                                            \
    case LOOM_BF16: LOOP(uint16_t, LD_BF16, ST_BF16) break;  \
    case LOOM_F16: LOOP(uint16_t, LD_F16, ST_F16) break;     \
    default: LOOP(float, LD_F32, ST_F32) break;              \
    }

#define PARALLEL_FOR _Pragma("omp parallel for schedule(static) if (n > PARALLEL_MIN)")

void add_fwd(void *out, const void *a, const void *b, size_t n, loom_dtype dt) {
#define ADD_LOOP(T, LD, ST) {                                          \
        T *o = out; const T *x = a, *y = b;                            \
        PARALLEL_FOR for (size_t i = 0; i < n; i++) o[i] = ST(LD(x[i]) + LD(y[i])); }
    DISPATCH(dt, ADD_LOOP)
#undef ADD_LOOP
}

void mul_fwd(void *out, const void *a, const void *b, size_t n, loom_dtype dt) {
#define MUL_LOOP(T, LD, ST) {                                          \
        T *o = out; const T *x = a, *y = b;                            \
        PARALLEL_FOR for (size_t i = 0; i < n; i++) o[i] = ST(LD(x[i]) * LD(y[i])); }
    DISPATCH(dt, MUL_LOOP)
#undef MUL_LOOP
}

void scale_fwd(void *out, const void *a, float s, size_t n, loom_dtype dt) {
#define SCALE_LOOP(T, LD, ST) {                                        \
        T *o = out; const T *x = a;                                    \
        PARALLEL_FOR for (size_t i = 0; i < n; i++) o[i] = ST(LD(x[i]) * s); }
    DISPATCH(dt, SCALE_LOOP)
#undef SCALE_LOOP
}

/* dst (f32) += scale * src: the common case (fp32 main_grad). */
static void accumulate_f32(float *dst, const void *src, loom_dtype src_dt, float scale, size_t n) {
#define ACC_LOOP(T, LD, ST) {                                          \
        const T *s = src;                                              \
        PARALLEL_FOR for (size_t i = 0; i < n; i++) dst[i] += scale * LD(s[i]); }
    DISPATCH(src_dt, ACC_LOOP)
#undef ACC_LOOP
}

void accumulate(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt,
                float scale, size_t n) {
    if (dst_dt == LOOM_F32) {
        accumulate_f32(dst, src, src_dt, scale, n);
        return;
    }
    PARALLEL_FOR
    for (size_t i = 0; i < n; i++)
        loom_store(dst, i, dst_dt, loom_load(dst, i, dst_dt) + scale * loom_load(src, i, src_dt));
}

/* --------------------------------------------------------------- reductions */

#define SUMSQ_CHUNKS 256        /* partial sums, added in order at the end */
#define SUMSQ_MIN_CHUNK 16384

static double sumsq_range(const void *x, size_t lo, size_t hi, loom_dtype dt) {
    double s = 0.0;
#define SUMSQ_LOOP(T, LD, ST) {                                        \
        const T *p = x;                                                \
        for (size_t i = lo; i < hi; i++) { double v = LD(p[i]); s += v * v; } }
    DISPATCH(dt, SUMSQ_LOOP)
#undef SUMSQ_LOOP
    return s;
}

double sumsq(const void *x, size_t n, loom_dtype dt) {
    /* The chunking depends on n only, so the result is the same for any
     * number of threads. */
    size_t chunk = (n + SUMSQ_CHUNKS - 1) / SUMSQ_CHUNKS;
    if (chunk < SUMSQ_MIN_CHUNK) chunk = SUMSQ_MIN_CHUNK;
    size_t nchunks = (n + chunk - 1) / chunk;
    double part[SUMSQ_CHUNKS];
    #pragma omp parallel for schedule(static) if (nchunks > 1)
    for (size_t c = 0; c < nchunks; c++) {
        size_t hi = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        part[c] = sumsq_range(x, c * chunk, hi, dt);
    }
    double s = 0.0;
    for (size_t c = 0; c < nchunks; c++) s += part[c];
    return s;
}

int has_nonfinite(const void *x, size_t n, loom_dtype dt) {
    int bad = 0;
    /* An all-ones exponent field means Inf or NaN. */
    if (dt == LOOM_F32) {
        const float *p = x;
        #pragma omp parallel for schedule(static) reduction(| : bad) if (n > PARALLEL_MIN)
        for (size_t i = 0; i < n; i++) bad |= (loom_f32_bits(p[i]) & 0x7f800000u) == 0x7f800000u;
    } else {
        const uint16_t *p = x;
        uint16_t e = dt == LOOM_BF16 ? 0x7f80u : 0x7c00u;
        #pragma omp parallel for schedule(static) reduction(| : bad) if (n > PARALLEL_MIN)
        for (size_t i = 0; i < n; i++) bad |= (p[i] & e) == e;
    }
    return bad;
}
