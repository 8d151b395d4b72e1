/*
 * gemm_internal.h — private to the GEMM files and their test: the argument
 * bundle passed between the dispatcher (gemm.c), the oneDNN backend
 * (gemm_onednn.c) and the portable fallback (gemm_fallback.c), and counters
 * that let a test see which path ran and whether a primitive was reused.
 */
#ifndef LOOM_GEMM_INTERNAL_H
#define LOOM_GEMM_INTERNAL_H

#include "kernels/kernels.h"

/* One call's arguments, already validated by gemm(). */
typedef struct gemm_args {
    int trans_a, trans_b;
    int M, N, K;
    float alpha, beta;
    const void *A; /* (M, K), or (K, M) stored when trans_a */
    const void *B; /* (K, N), or (N, K) stored when trans_b */
    void *C;       /* (M, N) */
    const void *bias; /* (N) or NULL */
    int lda, ldb, ldc;
    loom_dtype ab_dt, c_dt, bias_dt;
} gemm_args;

/* Counters since process start (monotonic; compare before/after a call). */
typedef struct gemm_counters {
    uint64_t onednn_calls;      /* calls served by oneDNN */
    uint64_t onednn_created;    /* primitives created (cache misses) */
    uint64_t onednn_hits;       /* calls that found their primitive cached */
    uint64_t onednn_rejected;   /* shapes/dtypes oneDNN refused (cached too) */
    uint64_t fallback_calls;    /* calls served by the portable loops */
    uint64_t widened_calls;     /* half-precision calls widened to fp32 for oneDNN */
    uint64_t padded_calls;      /* trans_a calls whose operands were copied (or widened) to padded strides */
} gemm_counters;

void gemm_get_counters(gemm_counters *out);

/* The portable blocked path; handles every valid call. */
loom_status gemm_fallback(const gemm_args *g);

/* The oneDNN path. Sets *handled = 0 (and returns LOOM_OK, C untouched)
 * when oneDNN refuses this combination or is absent: the caller then uses
 * the fallback. Otherwise *handled = 1 and the status is the call's result. */
loom_status gemm_onednn(const gemm_args *g, int *handled);
int gemm_onednn_available(void);

/* Half-precision inputs through oneDNN's fp32 matmul (gemm_widen.c), for
 * when oneDNN refuses the half types. *handled = 0 (C untouched) for fp32
 * inputs, K == 0, or without oneDNN. */
loom_status gemm_widen(const gemm_args *g, int *handled);
/* The stride a copy of rows of `cols` elements of dt gets instead of a
 * critical one (stride_critical: oneDNN packs a transposed A with such a
 * stride slowly; gemm.c). */
int gemm_padded_stride(int cols, loom_dtype dt);
/* Destroy every cached primitive (tests; idle callers only). */
void gemm_onednn_cache_clear(void);

/* Counter bumps shared by the backends (relaxed atomics: cheap, unordered). */
extern gemm_counters gemm_counters_;
#define GEMM_COUNT(field) __atomic_fetch_add(&gemm_counters_.field, 1, __ATOMIC_RELAXED)

#endif
