/*
 * kernel_rows.h — private helpers shared by the row-wise kernels (RMSNorm,
 * attention, cross-entropy): fp32 scratch rows converted from/to the
 * activation dtype once, the small vector loops and matrix blocks on them,
 * and workspace.
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

/* ---- fp32 building blocks (kernel_rows.c): AVX2 when simd_avx2(), else
 * portable C; each deterministic on its own. */

/* C (m, n) = op(A) (m, k) · B (k, n), or C += op(A) · B when accumulate;
 * op(A) = A stored (m, k), or A^T of A stored (k, m) when trans_a; all
 * row-major fp32 with row strides lda, ldb, ldc. Each element of C adds its
 * k products in order (fused multiply-adds on AVX2), so its value does not
 * depend on m, n, where it sits in C, or the order of the two factors. For the small blocks
 * of attention, not for large GEMMs. */
void mm_f32(int m, int n, int k, const float *A, int lda, int trans_a, const float *B, int ldb, float *C,
            int ldc, int accumulate);
/* mm_f32's AVX-512F tiles (mm_avx512.c), for its callers and tests only:
 * C (m, n16) for n16 = n rounded down to 16 columns (returned); element
 * (r, d) of op(A) is A[r * rs + d * ds]. mm_avx512 needs AVX-512F;
 * mm_avx512_emulated (the tests' build of the same code) runs anywhere. */
typedef int (*mm_tiles_fn)(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb,
                           float *C, int ldc, int accumulate);
int mm_avx512(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb, float *C, int ldc,
              int accumulate);
int mm_avx512_emulated(int m, int n, int k, const float *A, size_t rs, size_t ds, const float *B, int ldb, float *C,
                       int ldc, int accumulate);
/* Tests only: make mm_f32's AVX2 path start with these tiles, as it does
 * with mm_avx512 on AVX-512 CPUs (NULL: the CPU decides again). */
void mm_f32_set_tiles(mm_tiles_fn tiles);

/* Products of bf16 pairs with fp32 sums (AVX-512 BF16, mm_avx512.c):
 * C (m, n16) = A B, or C += A B with accumulate, n16 a multiple of 16; A's
 * pair (r, p) is the 32 bits A[r * rs + p * ps] (two bf16, the lower one
 * first: see row_pairs), B[p * ldb + j] the pair p of column j. Each
 * element adds its kp pair products in order. */
typedef void (*mm_bf16_fn)(int m, int n16, int kp, const uint32_t *A, size_t rs, size_t ps, const uint32_t *B,
                           int ldb, float *C, int ldc, int accumulate);
void mm_bf16_avx512(int m, int n16, int kp, const uint32_t *A, size_t rs, size_t ps, const uint32_t *B, int ldb,
                    float *C, int ldc, int accumulate);
void mm_bf16_avx512_emulated(int m, int n16, int kp, const uint32_t *A, size_t rs, size_t ps, const uint32_t *B,
                             int ldb, float *C, int ldc, int accumulate);
/* The bf16-pair product to use: mm_bf16_avx512 on CPUs with AVX-512 BF16
 * (or what mm_bf16_set_tiles chose), else NULL (callers widen to fp32). */
mm_bf16_fn mm_bf16_tiles(void);
/* Tests only: use these (NULL: the CPU decides again). */
void mm_bf16_set_tiles(mm_bf16_fn tiles);
/* dst[j] = the bf16 pair of a[j] (low 16 bits) and b[j] (high) for j < n:
 * rows of dtype dt, LOOM_F32 (rounded as loom_f32_to_bf16) or LOOM_BF16 (as
 * stored); b NULL gives zero high halves. */
void row_pairs(uint32_t *dst, const void *a, const void *b, loom_dtype dt, int n);
/* dst (cols, rows) = src (rows, cols)^T of 32-bit elements (fp32, or bf16
 * pairs), copied bit for bit; row strides ldd, lds in elements. */
void transpose32(void *dst, int ldd, const void *src, int lds, int rows, int cols);
/* max of x[0 .. n) (-inf for n = 0), NaN elements ignored (as fmaxf). */
float row_max(const float *x, int n);
/* x[i] = exp(x[i] * sc - m) for i < n (the product rounded, then the
 * difference: sc = 1 gives exp(x[i] - m)); returns the sum of the new
 * values. */
float row_exp_sum(float *x, int n, float sc, float m);
/* x[i] *= s */
void row_scale(float *x, float s, int n);
/* sum_i a[i] * b[i] */
float row_dot(const float *a, const float *b, int n);

/* Workspace for a kernel. Kernels return void and have no error channel, so
 * running out of memory for scratch is fatal here; the op layer keeps the
 * sizes small (a few rows per thread). */
static inline float *workspace_floats(size_t n) {
    float *p = (float *)loom_alloc(n * sizeof(float), LOOM_MEM_WORKSPACE);
    LOOM_ASSERT(p != NULL);
    return p;
}

#endif
