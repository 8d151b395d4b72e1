/*
 * gemm_widen.c — bf16/f16 GEMMs through oneDNN's fp32 matmul, for CPUs on
 * which oneDNN refuses the half types (no AVX-512 bf16/fp16: it has no
 * kernel for them there). The inputs are widened to fp32 (exactly: every
 * half value is an fp32 value), so the result is the contract's fp32
 * accumulation of the same products; only the summation order is oneDNN's.
 *
 * C is done in tiles of up to mch rows x nch columns, all of K each: op(B)'s
 * column panel is converted once per column chunk and op(A)'s rows once per
 * tile, so the scratch stays within budget_b + budget_a + budget_c floats (plus
 * up to 32 padding columns per panel: widened_stride) whatever the sizes
 * (conversions cost O(1/nch) of the products). When C is fp32 (e.g. dW
 * accumulating into main_grad with beta = 1) oneDNN writes C directly;
 * otherwise it writes an fp32 tile that is finished here (alpha, beta * C,
 * bias, one rounding to C's dtype). A tile oneDNN refuses (it should not) is
 * computed by the fallback, so a call never half-fails.
 *
 * Owns: nothing across calls; scratch from loom_alloc(WORKSPACE).
 * Must never: read C when beta == 0, or write outside C's M x N window.
 */
#include "kernels/gemm_internal.h"
#include "kernels/kernel_rows.h"

#include <omp.h>

/* Default budgets, 8 MiB each: the model's GEMMs (up to 2048 tokens x a
 * few thousand features) take one to four oneDNN calls each. Budgets a
 * quarter of this made bf16 steps of the `small` preset 15-20% slower;
 * twice this was no faster and raised peak RSS (scratch stays cached). */
#define WIDEN_B_FLOATS (1 << 21) /* the most of op(B)'s converted panel */
#define WIDEN_FLOATS (1 << 21)   /* the most of op(A)'s rows, and of an fp32 C tile */
#define CHUNK_ALIGN 16           /* rows / columns per chunk: a multiple of this */

static int budget_b = WIDEN_B_FLOATS, budget_a = WIDEN_FLOATS;

void gemm_widen_set_budgets(size_t b_floats, size_t floats) {
    budget_b = b_floats ? (int)b_floats : WIDEN_B_FLOATS;
    budget_a = floats ? (int)floats : WIDEN_FLOATS;
}

/* dst (rows, cols) fp32, row stride ldd = src's rows x cols window at
 * (r0, c0), row stride ld, converted from dt. */
static void widen_block(float *dst, int ldd, const void *src, int ld, int r0, int c0, int rows, int cols,
                        loom_dtype dt) {
    #pragma omp parallel for schedule(dynamic, 32) if ((size_t)rows * cols > 32768)
    for (int r = 0; r < rows; r++)
        row_load(dst + (size_t)r * ldd, src, (size_t)(r0 + r) * ld + c0, cols, dt);
}

/* The stride of a widened (K, cols) operand of a trans_a call: padded when
 * the dense one is critical for oneDNN's transposed-A packing (gemm.c).
 * Unlike gemm.c's fp32 copies, B's panel is padded whether or not A's is:
 * the widening writes the panel anyway, so its padding costs nothing. */
static int widened_stride(int cols, int trans_a) {
    return trans_a && stride_critical((size_t)cols, LOOM_F32) ? gemm_padded_stride(cols, LOOM_F32) : cols;
}

/* Rows [m0, m0 + m) x columns [n0, n0 + n) of C = alpha * c32 + beta * C
 * + bias. c32: (m, n). */
static void finish_tile(const gemm_args *g, const float *c32, int m0, int m, int n0, int n) {
    float *bias = NULL;
    if (g->bias) {
        bias = workspace_floats((size_t)n);
        row_load(bias, g->bias, (size_t)n0, n, g->bias_dt);
    }
    int nt = omp_get_max_threads();
    float *rows = workspace_floats((size_t)nt * n);
    #pragma omp parallel for schedule(dynamic, 32) if ((size_t)m * n > 32768)
    for (int i = 0; i < m; i++) {
        float *row = rows + (size_t)omp_get_thread_num() * n; /* (n) */
        const float *a = c32 + (size_t)i * n;
        size_t ci = (size_t)(m0 + i) * g->ldc + n0;
        if (g->alpha == 1.0f && g->beta == 0.0f && !bias) { /* the common case: a conversion */
            row_store(g->C, ci, a, n, g->c_dt);
            continue;
        }
        if (g->beta != 0.0f) {
            row_load(row, g->C, ci, n, g->c_dt);
            for (int j = 0; j < n; j++) row[j] = g->alpha * a[j] + g->beta * row[j];
        } else {
            for (int j = 0; j < n; j++) row[j] = g->alpha * a[j];
        }
        if (bias)
            for (int j = 0; j < n; j++) row[j] += bias[j];
        row_store(g->C, ci, row, n, g->c_dt);
    }
    loom_free(rows);
    loom_free(bias);
}

/* The sub-problem of the tile at (m0, n0), m x n, on the original buffers. */
static gemm_args tile_args(const gemm_args *g, int m0, int m, int n0, int n) {
    gemm_args s = *g;
    s.M = m;
    s.N = n;
    size_t es = loom_dtype_size(g->ab_dt);
    s.A = (const char *)g->A + (g->trans_a ? (size_t)m0 : (size_t)m0 * g->lda) * es;
    s.B = (const char *)g->B + (g->trans_b ? (size_t)n0 * g->ldb : (size_t)n0) * es;
    s.C = (char *)g->C + ((size_t)m0 * g->ldc + n0) * loom_dtype_size(g->c_dt);
    if (g->bias) s.bias = (const char *)g->bias + (size_t)n0 * loom_dtype_size(g->bias_dt);
    return s;
}

/* C direct from oneDNN: fp32 C, and a bias oneDNN can add as the contract says. */
static int direct_ok(const gemm_args *g) {
    return g->c_dt == LOOM_F32 && (!g->bias || (g->alpha == 1.0f && g->bias_dt == LOOM_F32));
}

/* Chunk length along a dimension of size n whose other factor is `other`,
 * within `budget` floats: n when it fits, else the fewest equal chunks that
 * do (rounded up to CHUNK_ALIGN). */
static int chunk_len(int n, int other, int budget) {
    int most = budget / (other > 0 ? other : 1) / CHUNK_ALIGN * CHUNK_ALIGN;
    if (most < CHUNK_ALIGN) most = CHUNK_ALIGN;
    if (n <= most) return n;
    int chunks = (n + most - 1) / most;
    return ((n + chunks - 1) / chunks + CHUNK_ALIGN - 1) / CHUNK_ALIGN * CHUNK_ALIGN;
}

loom_status gemm_widen(const gemm_args *g, int *handled) {
    *handled = 0;
    if (g->ab_dt == LOOM_F32 || g->K == 0 || !gemm_onednn_available()) return LOOM_OK;
    *handled = 1;
    GEMM_COUNT(widened_calls);
    int M = g->M, N = g->N, K = g->K, direct = direct_ok(g);
    int nch = chunk_len(N, K, budget_b);                /* op(B) panel: (K, nch) */
    /* op(A) rows (mch, K) and, unless C comes direct, the C tile (mch, nch)
     * within one budget: chunk_len shrinks as its other factor grows. */
    int mch = chunk_len(M, !direct && nch > K ? nch : K, budget_a);
    /* Stored (K, n) panels of op(B) and (K, m) rows of op(A) of a trans_a
     * call get padded strides where the dense ones are critical. */
    int ldb32 = g->trans_b ? K : widened_stride(nch, g->trans_a);
    int lda32 = g->trans_a ? widened_stride(mch, 1) : K;
    float *b32 = loom_alloc((size_t)K * (g->trans_b ? nch : ldb32) * sizeof(float), LOOM_MEM_WORKSPACE);
    float *a32 = loom_alloc((size_t)(g->trans_a ? K * (size_t)lda32 : (size_t)mch * K) * sizeof(float),
                            LOOM_MEM_WORKSPACE);
    float *c32 = direct ? NULL : loom_alloc((size_t)mch * nch * sizeof(float), LOOM_MEM_WORKSPACE);
    loom_status st = b32 && a32 && (direct || c32) ? LOOM_OK : LOOM_ERR_NOMEM;
    int padded = 0; /* some panel got a padded stride */
    for (int n0 = 0; n0 < N && st == LOOM_OK; n0 += nch) {
        int n = N - n0 < nch ? N - n0 : nch;
        int ldb = g->trans_b ? K : widened_stride(n, g->trans_a);
        LOOM_ASSERT(g->trans_b || ldb <= ldb32); /* n <= nch, both multiples of 16 or n the last */
        padded |= !g->trans_b && ldb != n;
        if (g->trans_b) widen_block(b32, ldb, g->B, g->ldb, n0, 0, n, K, g->ab_dt); /* (n, K) */
        else widen_block(b32, ldb, g->B, g->ldb, 0, n0, K, n, g->ab_dt);            /* (K, n) */
        for (int m0 = 0; m0 < M && st == LOOM_OK; m0 += mch) {
            int m = M - m0 < mch ? M - m0 : mch;
            gemm_args w = tile_args(g, m0, m, n0, n);
            int lda = g->trans_a ? widened_stride(m, 1) : K;
            LOOM_ASSERT(!g->trans_a || lda <= lda32);
            padded |= g->trans_a && lda != m;
            if (g->trans_a) widen_block(a32, lda, g->A, g->lda, 0, m0, K, m, g->ab_dt); /* (K, m) */
            else widen_block(a32, lda, g->A, g->lda, m0, 0, m, K, g->ab_dt);            /* (m, K) */
            w.A = a32;
            w.lda = lda;
            w.B = b32;
            w.ldb = ldb;
            w.ab_dt = LOOM_F32;
            if (!direct) { /* c32 = op(A) op(B), finished below */
                w.C = c32;
                w.ldc = n;
                w.c_dt = LOOM_F32;
                w.alpha = 1.0f;
                w.beta = 0.0f;
                w.bias = NULL;
            }
            int done = 0;
            st = gemm_onednn(&w, &done);
            if (st == LOOM_OK && !done) {
                gemm_args f = tile_args(g, m0, m, n0, n); /* refused: the fallback does this tile */
                st = gemm_fallback(&f);
                continue;
            }
            if (st == LOOM_OK && !direct) finish_tile(g, c32, m0, m, n0, n);
        }
    }
    if (st == LOOM_OK && padded) GEMM_COUNT(padded_calls);
    loom_free(a32);
    loom_free(b32);
    loom_free(c32);
    return st;
}
