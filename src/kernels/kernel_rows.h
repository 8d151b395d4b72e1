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

/* dst[0 .. n) = src[off .. off + n) converted to fp32. */
static inline void row_load(float *dst, const void *src, size_t off, int n, loom_dtype dt) {
    if (dt == LOOM_F32) {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
    } else if (dt == LOOM_BF16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = loom_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = loom_f16_to_f32(s[i]);
    }
}

/* dst[off .. off + n) = src[0 .. n) rounded to dt. */
static inline void row_store(void *dst, size_t off, const float *src, int n, loom_dtype dt) {
    if (dt == LOOM_F32) {
        memcpy((float *)dst + off, src, (size_t)n * sizeof(float));
    } else if (dt == LOOM_BF16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) d[i] = loom_f32_to_bf16(src[i]);
    } else {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) d[i] = loom_f32_to_f16(src[i]);
    }
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
