/*
 * elementwise.c — add, mul, scale, gradient accumulation, and the two
 * reductions used for gradient norms and overflow checks.
 *
 * Each op is one loop per dtype, sixteen at a time with AVX-512F or eight
 * with AVX2 (the same fp32 operations, so every path gives the same bits),
 * OpenMP-parallel in chunks
 * above PARALLEL_MIN elements. Arithmetic is fp32; results are rounded once
 * to the output dtype.
 * Must never: depend on the thread count for its result (sumsq sums fixed
 * chunks in a fixed order), or allocate.
 */
#include "kernels/kernels.h"
#include "core/simd.h"
#include "kernels/kernel_rows.h"

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

#define CHUNK 16384 /* elements per parallel task (a multiple of 8) */

/* Run BODY with [lo, hi) bound to each chunk of [0, n), in parallel above
 * PARALLEL_MIN elements. */
#define FOR_CHUNKS(n, lo, hi, BODY) do {                                        \
        size_t nch_ = ((n) + CHUNK - 1) / CHUNK;                               \
        _Pragma("omp parallel for schedule(dynamic, 1) if (n > PARALLEL_MIN)") \
        for (size_t c_ = 0; c_ < nch_; c_++) {                                 \
            size_t lo = c_ * CHUNK, hi = lo + CHUNK < (n) ? lo + CHUNK : (n);  \
            BODY;                                                              \
        }                                                                      \
    } while (0)

/* The portable loops over [lo, hi). */
static void add_c(void *out, const void *a, const void *b, size_t lo, size_t hi, loom_dtype dt) {
#define ADD_LOOP(T, LD, ST) { T *o = out; const T *x = a, *y = b; \
        for (size_t i = lo; i < hi; i++) o[i] = ST(LD(x[i]) + LD(y[i])); }
    DISPATCH(dt, ADD_LOOP)
#undef ADD_LOOP
}

static void mul_c(void *out, const void *a, const void *b, size_t lo, size_t hi, loom_dtype dt) {
#define MUL_LOOP(T, LD, ST) { T *o = out; const T *x = a, *y = b; \
        for (size_t i = lo; i < hi; i++) o[i] = ST(LD(x[i]) * LD(y[i])); }
    DISPATCH(dt, MUL_LOOP)
#undef MUL_LOOP
}

static void scale_c(void *out, const void *a, float s, size_t lo, size_t hi, loom_dtype dt) {
#define SCALE_LOOP(T, LD, ST) { T *o = out; const T *x = a; \
        for (size_t i = lo; i < hi; i++) o[i] = ST(LD(x[i]) * s); }
    DISPATCH(dt, SCALE_LOOP)
#undef SCALE_LOOP
}

static void divide_c(void *out, const void *a, float s, size_t lo, size_t hi, loom_dtype dt) {
#define DIVIDE_LOOP(T, LD, ST) { T *o = out; const T *x = a; \
        for (size_t i = lo; i < hi; i++) o[i] = ST(LD(x[i]) / s); }
    DISPATCH(dt, DIVIDE_LOOP)
#undef DIVIDE_LOOP
}

static void accumulate_c(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt, float scale,
                         size_t lo, size_t hi) {
    if (dst_dt == LOOM_F32) { /* the common case: fp32 main_grad */
        float *d = dst;
#define ACC_LOOP(T, LD, ST) { const T *s = src; for (size_t i = lo; i < hi; i++) d[i] += scale * LD(s[i]); }
        DISPATCH(src_dt, ACC_LOOP)
#undef ACC_LOOP
        return;
    }
    for (size_t i = lo; i < hi; i++)
        loom_store(dst, i, dst_dt, loom_load(dst, i, dst_dt) + scale * loom_load(src, i, src_dt));
}

/* The AVX2 loops: eight at a time with the same fp32 operations (no fused
 * multiply-add), the tail by the portable loop, so both paths agree bit for
 * bit. */
#if LOOM_HAVE_X86_SIMD
SIMD_AVX2 static void add_avx2(void *out, const void *a, const void *b, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) simd_store8(out, i, dt, _mm256_add_ps(simd_load8(a, i, dt), simd_load8(b, i, dt)));
    add_c(out, a, b, i, hi, dt);
}

SIMD_AVX2 static void mul_avx2(void *out, const void *a, const void *b, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) simd_store8(out, i, dt, _mm256_mul_ps(simd_load8(a, i, dt), simd_load8(b, i, dt)));
    mul_c(out, a, b, i, hi, dt);
}

SIMD_AVX2 static void scale_avx2(void *out, const void *a, float s, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= hi; i += 8) simd_store8(out, i, dt, _mm256_mul_ps(simd_load8(a, i, dt), vs));
    scale_c(out, a, s, i, hi, dt);
}

SIMD_AVX2 static void divide_avx2(void *out, const void *a, float s, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= hi; i += 8) simd_store8(out, i, dt, _mm256_div_ps(simd_load8(a, i, dt), vs));
    divide_c(out, a, s, i, hi, dt);
}

SIMD_AVX2 static void accumulate_avx2(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt,
                                      float scale, size_t lo, size_t hi) {
    size_t i = lo;
    __m256 vs = _mm256_set1_ps(scale);
    for (; i + 8 <= hi; i += 8)
        simd_store8(dst, i, dst_dt, _mm256_add_ps(simd_load8(dst, i, dst_dt), _mm256_mul_ps(vs, simd_load8(src, i, src_dt))));
    accumulate_c(dst, dst_dt, src, src_dt, scale, i, hi);
}
#endif

/* The same loops sixteen at a time (the tail by the AVX2 loop): the same
 * operations per element, so the same bits. */
#if LOOM_HAVE_SIMD512
SIMD_AVX512 static void add_avx512(void *out, const void *a, const void *b, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    for (; i + 16 <= hi; i += 16)
        simd_store16(out, i, dt, _mm512_add_ps(simd_load16(a, i, dt), simd_load16(b, i, dt)));
    add_avx2(out, a, b, i, hi, dt);
}

SIMD_AVX512 static void mul_avx512(void *out, const void *a, const void *b, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    for (; i + 16 <= hi; i += 16)
        simd_store16(out, i, dt, _mm512_mul_ps(simd_load16(a, i, dt), simd_load16(b, i, dt)));
    mul_avx2(out, a, b, i, hi, dt);
}

SIMD_AVX512 static void scale_avx512(void *out, const void *a, float s, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= hi; i += 16) simd_store16(out, i, dt, _mm512_mul_ps(simd_load16(a, i, dt), vs));
    scale_avx2(out, a, s, i, hi, dt);
}

SIMD_AVX512 static void divide_avx512(void *out, const void *a, float s, size_t lo, size_t hi, loom_dtype dt) {
    size_t i = lo;
    __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= hi; i += 16) simd_store16(out, i, dt, _mm512_div_ps(simd_load16(a, i, dt), vs));
    divide_avx2(out, a, s, i, hi, dt);
}

SIMD_AVX512 static void accumulate_avx512(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt,
                                          float scale, size_t lo, size_t hi) {
    size_t i = lo;
    __m512 vs = _mm512_set1_ps(scale);
    for (; i + 16 <= hi; i += 16)
        simd_store16(dst, i, dst_dt,
                     _mm512_add_ps(simd_load16(dst, i, dst_dt), _mm512_mul_ps(vs, simd_load16(src, i, src_dt))));
    accumulate_avx2(dst, dst_dt, src, src_dt, scale, i, hi);
}
#define PICK(avx512, avx2, c) (simd_avx512() ? (avx512) : simd_avx2() ? (avx2) : (c))
#elif LOOM_HAVE_X86_SIMD
#define PICK(avx512, avx2, c) (simd_avx2() ? (avx2) : (c))
#else
#define PICK(avx512, avx2, c) (c)
#endif

void add_fwd(void *out, const void *a, const void *b, size_t n, loom_dtype dt) {
    FOR_CHUNKS(n, lo, hi, PICK(add_avx512, add_avx2, add_c)(out, a, b, lo, hi, dt));
}

void mul_fwd(void *out, const void *a, const void *b, size_t n, loom_dtype dt) {
    FOR_CHUNKS(n, lo, hi, PICK(mul_avx512, mul_avx2, mul_c)(out, a, b, lo, hi, dt));
}

void scale_fwd(void *out, const void *a, float s, size_t n, loom_dtype dt) {
    FOR_CHUNKS(n, lo, hi, PICK(scale_avx512, scale_avx2, scale_c)(out, a, s, lo, hi, dt));
}

void divide_fwd(void *out, const void *a, float d, size_t n, loom_dtype dt) {
    FOR_CHUNKS(n, lo, hi, PICK(divide_avx512, divide_avx2, divide_c)(out, a, d, lo, hi, dt));
}

/* Gemma 2's logits: x / c, tanh, times c, in fp32 and rounded once (tanhf
 * has no vector form here: one model's logits, once a step). */
void softcap_fwd(void *out, const void *x, float cap, size_t n, loom_dtype dt) {
    FOR_CHUNKS(n, lo, hi, for (size_t i = lo; i < hi; i++) loom_store(out, i, dt, cap * tanhf(loom_load(x, i, dt) / cap)));
}

/* dx = dy (1 - (y / c)^2) over [lo, hi): softcap_bwd. */
static void softcap_bwd_range(void *dx, const void *dy, const void *y, float cap, size_t lo, size_t hi,
                              loom_dtype dt) {
    for (size_t i = lo; i < hi; i++) {
        float t = loom_load(y, i, dt) / cap, t2 = t * t; /* a rounded y may exceed cap: tanh's derivative is >= 0 */
        loom_store(dx, i, dt, loom_load(dy, i, dt) * (1.0f - (t2 < 1.0f ? t2 : 1.0f)));
    }
}

/* dx = dy (1 - (y / c)^2), y the forward's output (tanh's derivative from
 * its result, as PyTorch's tanh backward takes it). dx may be dy. */
void softcap_bwd(void *dx, const void *dy, const void *y, float cap, size_t n, loom_dtype dt) {
    FOR_CHUNKS(n, lo, hi, softcap_bwd_range(dx, dy, y, cap, lo, hi, dt));
}

void accumulate(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt,
                float scale, size_t n) {
    FOR_CHUNKS(n, lo, hi, PICK(accumulate_avx512, accumulate_avx2, accumulate_c)(dst, dst_dt, src, src_dt, scale, lo, hi));
}

enum { COL_BLOCK = 256 }; /* columns a task converts at a time */

void rowadd(void *out, const void *x, const void *b, size_t rows, size_t cols, loom_dtype dt) {
    size_t es = loom_dtype_size(dt);
    #pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (size_t r = 0; r < rows; r++) /* one row a call: no parallel region per row */
        PICK(add_avx512, add_avx2, add_c)((char *)out + r * cols * es, (const char *)x + r * cols * es, b, 0, cols, dt);
}

void colsum(float *dst, const void *g, size_t rows, size_t cols, loom_dtype dt) {
    size_t nb = (cols + COL_BLOCK - 1) / COL_BLOCK;
    #pragma omp parallel for schedule(dynamic, 1) if (rows * cols > 65536)
    for (size_t b = 0; b < nb; b++) {
        float v[COL_BLOCK];
        size_t c0 = b * COL_BLOCK, n = cols - c0 < COL_BLOCK ? cols - c0 : COL_BLOCK;
        for (size_t r = 0; r < rows; r++) {
            row_load(v, g, r * cols + c0, (int)n, dt);
            for (size_t c = 0; c < n; c++) dst[c0 + c] += v[c];
        }
    }
}

/* Each row's columns [c0, c0 + n) widened to fp32 (the vector conversions
 * of row_load), scaled, and narrowed back: the same bits as element by
 * element. */
void colscale(void *out, const void *x, const float *s, size_t rows, size_t cols, loom_dtype dt) {
    size_t nb = (cols + COL_BLOCK - 1) / COL_BLOCK;
    #pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (size_t r = 0; r < rows; r++) {
        float v[COL_BLOCK];
        for (size_t b = 0; b < nb; b++) {
            size_t c0 = b * COL_BLOCK, n = cols - c0 < COL_BLOCK ? cols - c0 : COL_BLOCK, i = r * cols + c0;
            row_load(v, x, i, (int)n, dt); /* no parallel region per row */
            for (size_t c = 0; c < n; c++) v[c] *= s[c0 + c];
            row_store(out, i, v, (int)n, dt);
        }
    }
}

/* coldot, and with out not NULL colscale(g, s) into out in the same pass. */
static void coldot_pass(float *dst, void *out, const void *x, const void *g, const float *s, size_t rows, size_t cols,
                        loom_dtype dt) {
    size_t nb = (cols + COL_BLOCK - 1) / COL_BLOCK;
    /* a task a block of columns: each column's sum in row order */
    #pragma omp parallel for schedule(dynamic, 1) if (rows * cols > 65536)
    for (size_t b = 0; b < nb; b++) {
        double acc[COL_BLOCK] = {0};
        float xv[COL_BLOCK], gv[COL_BLOCK];
        size_t c0 = b * COL_BLOCK, n = cols - c0 < COL_BLOCK ? cols - c0 : COL_BLOCK;
        for (size_t r = 0; r < rows; r++) {
            size_t i = r * cols + c0;
            row_load(xv, x, i, (int)n, dt);
            row_load(gv, g, i, (int)n, dt);
            for (size_t c = 0; c < n; c++) acc[c] += (double)xv[c] * (double)gv[c];
            if (!out) continue;
            for (size_t c = 0; c < n; c++) gv[c] *= s[c0 + c];
            row_store(out, i, gv, (int)n, dt);
        }
        for (size_t c = 0; c < n; c++) dst[c0 + c] = (float)acc[c];
    }
}

void coldot(float *dst, const void *x, const void *g, size_t rows, size_t cols, loom_dtype dt) {
    coldot_pass(dst, NULL, x, g, NULL, rows, cols, dt);
}

void coldot_colscale(float *dst, void *out, const void *x, const void *g, const float *s, size_t rows, size_t cols,
                     loom_dtype dt) {
    coldot_pass(dst, out, x, g, s, rows, cols, dt);
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

#if LOOM_HAVE_X86_SIMD
/* Squares summed in fp64 over four lanes per half, then the lanes in a fixed
 * order, then the tail. */
SIMD_AVX2 static double sumsq_range_avx2(const void *x, size_t lo, size_t hi, loom_dtype dt) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 v = simd_load8(x, i, dt);
        __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        s0 = _mm256_fmadd_pd(a, a, s0);
        s1 = _mm256_fmadd_pd(b, b, s1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + sumsq_range(x, i, hi, dt);
}
#endif

double sumsq(const void *x, size_t n, loom_dtype dt) {
    /* The chunking depends on n only, so the result is the same for any
     * number of threads. */
    size_t chunk = (n + SUMSQ_CHUNKS - 1) / SUMSQ_CHUNKS;
    if (chunk < SUMSQ_MIN_CHUNK) chunk = SUMSQ_MIN_CHUNK;
    size_t nchunks = (n + chunk - 1) / chunk;
    double part[SUMSQ_CHUNKS];
    #pragma omp parallel for schedule(dynamic, 1) if (nchunks > 1)
    for (size_t c = 0; c < nchunks; c++) {
        size_t hi = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        part[c] = PICK(sumsq_range_avx2, sumsq_range_avx2, sumsq_range)(x, c * chunk, hi, dt);
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
        #pragma omp parallel for schedule(dynamic, 16384) reduction(| : bad) if (n > PARALLEL_MIN)
        for (size_t i = 0; i < n; i++) bad |= (loom_f32_bits(p[i]) & 0x7f800000u) == 0x7f800000u;
    } else {
        const uint16_t *p = x;
        uint16_t e = dt == LOOM_BF16 ? 0x7f80u : 0x7c00u;
        #pragma omp parallel for schedule(dynamic, 16384) reduction(| : bad) if (n > PARALLEL_MIN)
        for (size_t i = 0; i < n; i++) bad |= (p[i] & e) == e;
    }
    return bad;
}
