/*
 * kernel_rows.h — private helpers shared by the row-wise kernels (RMSNorm,
 * attention, cross-entropy): fp32 scratch rows converted from/to the
 * activation dtype once, the small vector loops on them, and workspace.
 *
 * Must never: be included outside src/kernels, or hold state.
 */
#ifndef LOOM_KERNEL_ROWS_H
#define LOOM_KERNEL_ROWS_H

#include "loom/core.h"
#include "core/simd.h"

/* dst[0 .. n) = src[off .. off + n) converted to fp32 (AVX2 when available). */
static inline void row_load(float *dst, const void *src, size_t off, int n, loom_dtype dt) {
    convert_to_f32(dst, (const char *)src + off * loom_dtype_size(dt), dt, (size_t)n);
}

/* dst[off .. off + n) = src[0 .. n) rounded to dt. */
static inline void row_store(void *dst, size_t off, const float *src, int n, loom_dtype dt) {
    convert_from_f32((char *)dst + off * loom_dtype_size(dt), dt, src, (size_t)n);
}

/* sum_i a[i] * b[i]. The simd reduction fixes one summation order per build,
 * so results stay deterministic. */
static inline float row_dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += a * x */
static inline void row_axpy(float *y, float a, const float *x, int n) {
    #pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Workspace for a kernel. Kernels return void and have no error channel, so
 * running out of memory for scratch is fatal here; the op layer keeps the
 * sizes small (a few rows per thread). */
static inline float *workspace_floats(size_t n) {
    float *p = (float *)loom_alloc(n * sizeof(float), LOOM_MEM_WORKSPACE);
    LOOM_ASSERT(p != NULL);
    return p;
}

#endif
