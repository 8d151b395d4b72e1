/*
 * gemm_widen.c — bf16/f16 GEMMs through oneDNN's fp32 matmul, for CPUs on
 * which oneDNN refuses the half types (no AVX-512 bf16/fp16: it has no
 * kernel for them there). The inputs are widened to fp32 (exactly: every
 * half value is an fp32 value), so the result is the contract's fp32
 * accumulation of the same products; only the summation order is oneDNN's.
 *
 * op(B) is converted once; rows of C are done in chunks (op(A)'s rows
 * converted per chunk) so scratch stays within WIDEN_FLOATS per buffer
 * whatever M is. When C is fp32 (e.g. dW accumulating into main_grad with
 * beta = 1) oneDNN writes C directly; otherwise it writes an fp32 chunk that
 * is finished here (alpha, beta * C, bias, one rounding to C's dtype).
 * A chunk oneDNN refuses (it should not) is computed by the fallback, so a
 * call never half-fails.
 *
 * Owns: nothing across calls; scratch from loom_alloc(WORKSPACE).
 * Must never: read C when beta == 0, or write outside C's M x N window.
 */
#include "kernels/gemm_internal.h"
#include "kernels/kernel_rows.h"

#include <omp.h>

#define WIDEN_FLOATS (1 << 21) /* 8 MiB: scratch budget for A and C chunks */
#define CHUNK_ALIGN 64         /* rows per chunk: a multiple of this */

/* dst (rows, cols) dense fp32 = src's rows x cols window at (r0, c0), row
 * stride ld, converted from dt. */
static void widen_block(float *dst, const void *src, int ld, int r0, int c0, int rows, int cols,
                        loom_dtype dt) {
    #pragma omp parallel for schedule(static) if ((size_t)rows * cols > 32768)
    for (int r = 0; r < rows; r++)
        row_load(dst + (size_t)r * cols, src, (size_t)(r0 + r) * ld + c0, cols, dt);
}

/* Rows [m0, m0 + m) of C = alpha * c32 + beta * C + bias. c32: (m, N). */
static void finish_rows(const gemm_args *g, const float *c32, int m0, int m) {
    int N = g->N;
    float *bias = NULL;
    if (g->bias) {
        bias = workspace_floats((size_t)N);
        row_load(bias, g->bias, 0, N, g->bias_dt);
    }
    int nt = omp_get_max_threads();
    float *rows = workspace_floats((size_t)nt * N);
    #pragma omp parallel for schedule(static) if ((size_t)m * N > 32768)
    for (int i = 0; i < m; i++) {
        float *row = rows + (size_t)omp_get_thread_num() * N; /* (N) */
        const float *a = c32 + (size_t)i * N;
        size_t ci = (size_t)(m0 + i) * g->ldc;
        if (g->beta != 0.0f) {
            row_load(row, g->C, ci, N, g->c_dt);
            for (int j = 0; j < N; j++) row[j] = g->alpha * a[j] + g->beta * row[j];
        } else {
            for (int j = 0; j < N; j++) row[j] = g->alpha * a[j];
        }
        if (bias)
            for (int j = 0; j < N; j++) row[j] += bias[j];
        row_store(g->C, ci, row, N, g->c_dt);
    }
    loom_free(rows);
    loom_free(bias);
}

/* The sub-problem of rows [m0, m0 + m) of C, on the original buffers. */
static gemm_args row_chunk(const gemm_args *g, int m0, int m) {
    gemm_args s = *g;
    s.M = m;
    size_t es = loom_dtype_size(g->ab_dt);
    s.A = (const char *)g->A + (g->trans_a ? (size_t)m0 : (size_t)m0 * g->lda) * es;
    s.C = (char *)g->C + (size_t)m0 * g->ldc * loom_dtype_size(g->c_dt);
    return s;
}

/* C direct from oneDNN: fp32 C, and a bias oneDNN can add as the contract says. */
static int direct_ok(const gemm_args *g) {
    return g->c_dt == LOOM_F32 && (!g->bias || (g->alpha == 1.0f && g->bias_dt == LOOM_F32));
}

loom_status gemm_widen(const gemm_args *g, int *handled) {
    *handled = 0;
    if (g->ab_dt == LOOM_F32 || g->K == 0 || !gemm_onednn_available()) return LOOM_OK;
    *handled = 1;
    GEMM_COUNT(widened_calls);
    int M = g->M, N = g->N, K = g->K, direct = direct_ok(g);
    int rb = g->trans_b ? N : K, cb = g->trans_b ? K : N; /* stored B */
    int wide = K > N ? K : N;
    int mch = WIDEN_FLOATS / wide / CHUNK_ALIGN * CHUNK_ALIGN;
    if (mch < CHUNK_ALIGN) mch = CHUNK_ALIGN;
    if (mch > M) mch = M;
    float *b32 = loom_alloc((size_t)rb * cb * sizeof(float), LOOM_MEM_WORKSPACE);
    float *a32 = loom_alloc((size_t)mch * K * sizeof(float), LOOM_MEM_WORKSPACE);
    float *c32 = direct ? NULL : loom_alloc((size_t)mch * N * sizeof(float), LOOM_MEM_WORKSPACE);
    loom_status st = b32 && a32 && (direct || c32) ? LOOM_OK : LOOM_ERR_NOMEM;
    if (st == LOOM_OK) widen_block(b32, g->B, g->ldb, 0, 0, rb, cb, g->ab_dt);
    for (int m0 = 0; m0 < M && st == LOOM_OK; m0 += mch) {
        int m = M - m0 < mch ? M - m0 : mch;
        gemm_args w = row_chunk(g, m0, m);
        if (g->trans_a) widen_block(a32, g->A, g->lda, 0, m0, K, m, g->ab_dt); /* (K, m) */
        else widen_block(a32, g->A, g->lda, m0, 0, m, K, g->ab_dt);            /* (m, K) */
        w.A = a32;
        w.lda = g->trans_a ? m : K;
        w.B = b32;
        w.ldb = cb;
        w.ab_dt = LOOM_F32;
        if (!direct) { /* c32 = op(A) op(B), finished below */
            w.C = c32;
            w.ldc = N;
            w.c_dt = LOOM_F32;
            w.alpha = 1.0f;
            w.beta = 0.0f;
            w.bias = NULL;
        }
        int done = 0;
        st = gemm_onednn(&w, &done);
        if (st == LOOM_OK && !done) {
            gemm_args f = row_chunk(g, m0, m); /* refused: the fallback does this chunk */
            st = gemm_fallback(&f);
            continue;
        }
        if (st == LOOM_OK && !direct) finish_rows(g, c32, m0, m);
    }
    loom_free(a32);
    loom_free(b32);
    loom_free(c32);
    return st;
}
