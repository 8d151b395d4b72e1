/*
 * swiglu.c — SiLU and the gates of the LLaMA-family MLPs, forward and
 * backward: SwiGLU (LLaMA's) and GeGLU with the tanh GELU (Gemma's).
 *
 * Owns: silu(x) = x * sigmoid(x), out = silu(gate) * up, out =
 * gelu_tanh(gate) * up, and their gradients, element by element in fp32:
 * sixteen at a time with AVX-512F or eight with AVX2 (the same vector exp,
 * so the same bits), else with expf. Both activations are x * sigmoid(z):
 * z = x for SiLU; z = 2 sqrt(2/pi) (x + 0.044715 x^3) for the tanh GELU,
 * since 0.5 x (1 + tanh(z / 2)) = x sigmoid(z). Their derivative is
 * s (1 + x (1 - s) z'), s = sigmoid(z).
 * OpenMP-parallel in chunks.
 * Must never: read an element after writing it (outputs may alias inputs of
 * the same index).
 */
#include "kernels/kernels.h"
#include "core/simd.h"

#include <float.h>
#include <math.h>

/* Below this many elements a parallel region costs more than it saves. */
#define SWIGLU_PAR_MIN 32768
#define CHUNK 16384 /* elements per task (a multiple of 8) */

/* Which function a chunk computes. */
enum { F_SILU, F_SILU_BWD, F_SWIGLU, F_SWIGLU_BWD, F_GEGLU, F_GEGLU_BWD };

/* The tanh GELU's z = K x (1 + A x^2) and z' = K (1 + 3 A x^2). Its
 * derivative's x (1 - s) z' is held at -FLT_MAX and above: for x below
 * about -1e13 it overflows to -inf where s is 0, and 0 (1 - inf) would be
 * NaN where PyTorch gives 0 (down to about -1.8e19, where its own x^3
 * overflows and it gives NaN; loom 0). A NaN input stays NaN. */
#define GELU_K 1.5957691216057308f /* 2 sqrt(2 / pi) */
#define GELU_A 0.044715f

typedef struct ew_args {
    void *o0, *o1;            /* outputs: out or dx / dgate, dup */
    const void *x, *y, *d;    /* inputs: x or gate, up, dout */
    loom_dtype dt;
} ew_args;

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

static void chunk_c(int f, const ew_args *a, size_t lo, size_t hi) {
    loom_dtype dt = a->dt;
    int gelu = f == F_GEGLU || f == F_GEGLU_BWD;
    for (size_t i = lo; i < hi; i++) {
        float x = loom_load(a->x, i, dt), x2 = x * x;
        float s = sigmoidf(gelu ? GELU_K * x * (1.0f + GELU_A * x2) : x);
        float dz = gelu ? GELU_K * (1.0f + 3.0f * GELU_A * x2) : 1.0f;
        float xz = x * (1.0f - s) * dz;
        if (gelu && xz < -FLT_MAX) xz = -FLT_MAX;
        switch (f) {
        case F_SILU: loom_store(a->o0, i, dt, x * s); break;
        /* d silu(x) / dx = s (1 + x (1 - s)) */
        case F_SILU_BWD: loom_store(a->o0, i, dt, loom_load(a->d, i, dt) * (s * (1.0f + x * (1.0f - s)))); break;
        case F_SWIGLU: case F_GEGLU: loom_store(a->o0, i, dt, x * s * loom_load(a->y, i, dt)); break;
        default: { /* dgate = dout * up * act'(gate); dup = dout * act(gate) */
            float d = loom_load(a->d, i, dt), u = loom_load(a->y, i, dt);
            loom_store(a->o0, i, dt, d * u * (s * (1.0f + xz)));
            loom_store(a->o1, i, dt, d * x * s);
        }
        }
    }
}

#if LOOM_HAVE_X86_SIMD
SIMD_AVX2 static inline __attribute__((always_inline)) void chunk_avx2_dt(int f, const ew_args *a, size_t lo,
                                                                           size_t hi, loom_dtype dt) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), k = _mm256_set1_ps(GELU_K);
    const __m256 c = _mm256_set1_ps(GELU_A), c3 = _mm256_set1_ps(3.0f * GELU_A);
    const __m256 neg_max = _mm256_set1_ps(-FLT_MAX); /* max(neg_max, v) keeps a NaN v */
    int gelu = f == F_GEGLU || f == F_GEGLU_BWD;
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 x = simd_load8(a->x, i, dt), x2 = _mm256_mul_ps(x, x), z = x, t = one;
        if (gelu) { /* the same operations, in the same order, as chunk_c */
            z = _mm256_mul_ps(_mm256_mul_ps(k, x), _mm256_add_ps(one, _mm256_mul_ps(c, x2)));
            t = _mm256_mul_ps(k, _mm256_add_ps(one, _mm256_mul_ps(c3, x2)));
        }
        __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, simd_exp(_mm256_sub_ps(zero, z))));
        __m256 xs = _mm256_mul_ps(x, _mm256_sub_ps(one, s));
        __m256 xz = gelu ? _mm256_max_ps(neg_max, _mm256_mul_ps(xs, t)) : xs;
        __m256 grad = _mm256_mul_ps(s, _mm256_add_ps(one, xz));
        switch (f) {
        case F_SILU: simd_store8(a->o0, i, dt, _mm256_mul_ps(x, s)); break;
        case F_SILU_BWD: simd_store8(a->o0, i, dt, _mm256_mul_ps(simd_load8(a->d, i, dt), grad)); break;
        case F_SWIGLU: case F_GEGLU:
            simd_store8(a->o0, i, dt, _mm256_mul_ps(_mm256_mul_ps(x, s), simd_load8(a->y, i, dt)));
            break;
        default: {
            __m256 d = simd_load8(a->d, i, dt), u = simd_load8(a->y, i, dt);
            simd_store8(a->o0, i, dt, _mm256_mul_ps(_mm256_mul_ps(d, u), grad));
            simd_store8(a->o1, i, dt, _mm256_mul_ps(_mm256_mul_ps(d, x), s));
        }
        }
    }
    chunk_c(f, a, i, hi);
}

/* Calls LOOP(f, a, lo, hi, dt) — an always-inline loop — with f and dt as
 * constants, so each (function, dtype) gets its own copy of the loop with
 * no branch on either left inside it. */
#define CHUNK_SPECIALISED(LOOP, f, a, lo, hi)                                                                    \
    do {                                                                                                         \
        loom_dtype dt_ = (a)->dt;                                                                                \
        if (dt_ == LOOM_BF16) CHUNK_BY_FN(LOOP, f, a, lo, hi, LOOM_BF16);                                        \
        else if (dt_ == LOOM_F16) CHUNK_BY_FN(LOOP, f, a, lo, hi, LOOM_F16);                                     \
        else CHUNK_BY_FN(LOOP, f, a, lo, hi, LOOM_F32);                                                          \
    } while (0)
#define CHUNK_BY_FN(LOOP, f, a, lo, hi, dt)                                                                      \
    do {                                                                                                         \
        switch (f) {                                                                                             \
        case F_SILU: LOOP(F_SILU, a, lo, hi, dt); break;                                                         \
        case F_SILU_BWD: LOOP(F_SILU_BWD, a, lo, hi, dt); break;                                                 \
        case F_SWIGLU: LOOP(F_SWIGLU, a, lo, hi, dt); break;                                                     \
        case F_SWIGLU_BWD: LOOP(F_SWIGLU_BWD, a, lo, hi, dt); break;                                             \
        case F_GEGLU: LOOP(F_GEGLU, a, lo, hi, dt); break;                                                       \
        default: LOOP(F_GEGLU_BWD, a, lo, hi, dt); break;                                                        \
        }                                                                                                        \
    } while (0)

SIMD_AVX2 static void chunk_avx2(int f, const ew_args *a, size_t lo, size_t hi) {
    CHUNK_SPECIALISED(chunk_avx2_dt, f, a, lo, hi);
}
#endif

#if LOOM_HAVE_SIMD512
/* chunk_avx2_dt, sixteen lanes at a time; the tail goes to chunk_avx2. */
SIMD_AVX512 static inline __attribute__((always_inline)) void chunk_avx512_dt(int f, const ew_args *a, size_t lo,
                                                                               size_t hi, loom_dtype dt) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps(), k = _mm512_set1_ps(GELU_K);
    const __m512 c = _mm512_set1_ps(GELU_A), c3 = _mm512_set1_ps(3.0f * GELU_A);
    const __m512 neg_max = _mm512_set1_ps(-FLT_MAX);
    int gelu = f == F_GEGLU || f == F_GEGLU_BWD;
    size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 x = simd_load16(a->x, i, dt), x2 = _mm512_mul_ps(x, x), z = x, t = one;
        if (gelu) {
            z = _mm512_mul_ps(_mm512_mul_ps(k, x), _mm512_add_ps(one, _mm512_mul_ps(c, x2)));
            t = _mm512_mul_ps(k, _mm512_add_ps(one, _mm512_mul_ps(c3, x2)));
        }
        __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, simd_exp16(_mm512_sub_ps(zero, z))));
        __m512 xs = _mm512_mul_ps(x, _mm512_sub_ps(one, s));
        __m512 xz = gelu ? _mm512_max_ps(neg_max, _mm512_mul_ps(xs, t)) : xs;
        __m512 grad = _mm512_mul_ps(s, _mm512_add_ps(one, xz));
        switch (f) {
        case F_SILU: simd_store16(a->o0, i, dt, _mm512_mul_ps(x, s)); break;
        case F_SILU_BWD: simd_store16(a->o0, i, dt, _mm512_mul_ps(simd_load16(a->d, i, dt), grad)); break;
        case F_SWIGLU: case F_GEGLU:
            simd_store16(a->o0, i, dt, _mm512_mul_ps(_mm512_mul_ps(x, s), simd_load16(a->y, i, dt)));
            break;
        default: {
            __m512 d = simd_load16(a->d, i, dt), u = simd_load16(a->y, i, dt);
            simd_store16(a->o0, i, dt, _mm512_mul_ps(_mm512_mul_ps(d, u), grad));
            simd_store16(a->o1, i, dt, _mm512_mul_ps(_mm512_mul_ps(d, x), s));
        }
        }
    }
    chunk_avx2(f, a, i, hi);
}

SIMD_AVX512 static void chunk_avx512(int f, const ew_args *a, size_t lo, size_t hi) {
    CHUNK_SPECIALISED(chunk_avx512_dt, f, a, lo, hi);
}
#endif

static void run(int f, const ew_args *a, size_t n) {
    size_t nch = (n + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(dynamic, 1) if (n > SWIGLU_PAR_MIN)
    for (size_t c = 0; c < nch; c++) {
        size_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
#if LOOM_HAVE_SIMD512
        if (simd_avx512()) {
            chunk_avx512(f, a, lo, hi);
            continue;
        }
#endif
#if LOOM_HAVE_X86_SIMD
        if (simd_avx2()) {
            chunk_avx2(f, a, lo, hi);
            continue;
        }
#endif
        chunk_c(f, a, lo, hi);
    }
}

void silu_fwd(void *out, const void *x, size_t n, loom_dtype dt) {
    ew_args a = {.o0 = out, .x = x, .dt = dt};
    run(F_SILU, &a, n);
}

void silu_bwd(void *dx, const void *dout, const void *x, size_t n, loom_dtype dt) {
    ew_args a = {.o0 = dx, .x = x, .d = dout, .dt = dt};
    run(F_SILU_BWD, &a, n);
}

/* A gate's function f over (gate, up) and, backward, dout (NULL forward). */
static void run_glu(int f, void *o0, void *o1, const void *dout, const void *gate, const void *up, size_t n,
                    loom_dtype dt) {
    ew_args a = {.o0 = o0, .o1 = o1, .x = gate, .y = up, .d = dout, .dt = dt};
    run(f, &a, n);
}

void swiglu_fwd(void *out, const void *gate, const void *up, size_t n, loom_dtype dt) {
    run_glu(F_SWIGLU, out, NULL, NULL, gate, up, n, dt);
}

void swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate,
                const void *up, size_t n, loom_dtype dt) {
    run_glu(F_SWIGLU_BWD, dgate, dup, dout, gate, up, n, dt);
}

void geglu_fwd(void *out, const void *gate, const void *up, size_t n, loom_dtype dt) {
    run_glu(F_GEGLU, out, NULL, NULL, gate, up, n, dt);
}

void geglu_bwd(void *dgate, void *dup, const void *dout, const void *gate,
               const void *up, size_t n, loom_dtype dt) {
    run_glu(F_GEGLU_BWD, dgate, dup, dout, gate, up, n, dt);
}
