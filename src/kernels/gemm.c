/*
 * gemm.c — the GEMM entry point: argument checks, backend choice, and the
 * plain reference.
 *
 * Owns: the process-wide backend setting, the path counters, and the copies
 * of fp32 operands whose strides oneDNN packs slowly (gemm_onednn_padded).
 * Must never: abort on a bad argument (it returns LOOM_ERR_INVALID), or let
 * a oneDNN refusal reach the caller (the portable loops take over).
 */
#include "kernels/gemm_internal.h"

gemm_counters gemm_counters_;

static int backend_requested = GEMM_BACKEND_AUTO;

void gemm_set_backend(gemm_backend b) {
    __atomic_store_n(&backend_requested, (int)b, __ATOMIC_RELAXED);
}

gemm_backend gemm_get_backend(void) {
    int b = __atomic_load_n(&backend_requested, __ATOMIC_RELAXED);
    if (b == GEMM_BACKEND_FALLBACK || !gemm_onednn_available()) return GEMM_BACKEND_FALLBACK;
    return b == GEMM_BACKEND_WIDEN ? GEMM_BACKEND_WIDEN : GEMM_BACKEND_ONEDNN;
}

int gemm_have_onednn(void) { return gemm_onednn_available(); }

void gemm_get_counters(gemm_counters *out) {
    out->onednn_calls = __atomic_load_n(&gemm_counters_.onednn_calls, __ATOMIC_RELAXED);
    out->onednn_created = __atomic_load_n(&gemm_counters_.onednn_created, __ATOMIC_RELAXED);
    out->onednn_hits = __atomic_load_n(&gemm_counters_.onednn_hits, __ATOMIC_RELAXED);
    out->onednn_rejected = __atomic_load_n(&gemm_counters_.onednn_rejected, __ATOMIC_RELAXED);
    out->fallback_calls = __atomic_load_n(&gemm_counters_.fallback_calls, __ATOMIC_RELAXED);
    out->widened_calls = __atomic_load_n(&gemm_counters_.widened_calls, __ATOMIC_RELAXED);
    out->padded_calls = __atomic_load_n(&gemm_counters_.padded_calls, __ATOMIC_RELAXED);
}

static loom_status check_ld(const char *name, int ld, int row_len, int trans) {
    int need = row_len > 1 ? row_len : 1;
    if (ld < need)
        return loom_error(LOOM_ERR_INVALID,
                          "gemm: %s = %d is smaller than the stored row length %d%s; "
                          "pass the row stride in elements of the stored matrix",
                          name, ld, row_len, trans ? " (the matrix is transposed)" : "");
    return LOOM_OK;
}

static loom_status check_args(const gemm_args *g) {
    if (g->M < 0 || g->N < 0 || g->K < 0)
        return loom_error(LOOM_ERR_INVALID, "gemm: negative size M=%d N=%d K=%d", g->M, g->N, g->K);
    if (!loom_dtype_valid(g->ab_dt) || !loom_dtype_valid(g->c_dt) || (g->bias && !loom_dtype_valid(g->bias_dt)))
        return loom_error(LOOM_ERR_INVALID, "gemm: unknown dtype (ab %d, c %d, bias %d)",
                          (int)g->ab_dt, (int)g->c_dt, (int)g->bias_dt);
    if (g->c_dt != LOOM_F32 && g->c_dt != g->ab_dt)
        return loom_error(LOOM_ERR_INVALID, "gemm: C must be fp32 or the input dtype %s, not %s",
                          loom_dtype_name(g->ab_dt), loom_dtype_name(g->c_dt));
    /* Stored A is (M, K), or (K, M) when transposed; likewise B. */
    LOOM_TRY(check_ld("lda", g->lda, g->trans_a ? g->M : g->K, g->trans_a));
    LOOM_TRY(check_ld("ldb", g->ldb, g->trans_b ? g->K : g->N, g->trans_b));
    LOOM_TRY(check_ld("ldc", g->ldc, g->N, 0));
    int need_ab = g->M > 0 && g->N > 0 && g->K > 0;
    if ((need_ab && (!g->A || !g->B)) || (g->M > 0 && g->N > 0 && !g->C))
        return loom_error(LOOM_ERR_INVALID, "gemm: NULL matrix pointer for M=%d N=%d K=%d",
                          g->M, g->N, g->K);
    return LOOM_OK;
}

/* A row stride that is a multiple of 2 KiB puts the rows that oneDNN's
 * packing of a transposed A reads together into a few cache sets. The dW
 * GEMM of a 512-feature linear (C = dy^T x, both strides 512 floats) ran at
 * 72-79 GFLOP/s, and at 120-135 with both operands first copied to a padded
 * stride, copy included (2048 rows, 2 threads, the Zen 3 of BENCHMARKS.md).
 * A padded alone helps too (a 1024 x 1024 dW: 36 to 29 ms), B alone does
 * not, and NN and NT calls with such strides run at full speed: so A of a
 * trans_a call is copied when its stride is critical, and then B as well
 * when its stride is. Only operands up to PAD_MAX_FLOATS: the lm_head's dy
 * (vocab columns) gains no more than its copy costs. */
#define PAD_MAX_FLOATS ((size_t)1 << 22)
#define PAD_MIN_OTHER 64 /* the other dimension of C: below this the copy outweighs the GEMM */

int gemm_padded_stride(int cols, loom_dtype dt) {
    int ld = cols + 16;
    return stride_critical((size_t)ld, dt) ? ld + 16 : ld;
}

/* The stored rows x cols window of an operand, copied with a padded
 * stride; NULL when it needs no copy (or no memory: the call then runs as
 * given). */
static float *padded_copy(const float *src, int ld, int rows, int cols, int other, int *ld_out) {
    if (!stride_critical((size_t)ld, LOOM_F32) || other < PAD_MIN_OTHER || (size_t)rows * cols > PAD_MAX_FLOATS)
        return NULL;
    int ldp = gemm_padded_stride(cols, LOOM_F32);
    float *dst = loom_alloc((size_t)rows * ldp * sizeof(float), LOOM_MEM_WORKSPACE);
    if (!dst) return NULL; /* the call runs unpadded; its status is what counts */
    #pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (int r = 0; r < rows; r++) memcpy(dst + (size_t)r * ldp, src + (size_t)r * ld, (size_t)cols * sizeof(float));
    *ld_out = ldp;
    return dst;
}

/* fp32 through oneDNN, the operands of a trans_a call with critical
 * strides copied to padded ones first. */
static loom_status gemm_onednn_padded(const gemm_args *g, int *handled) {
    if (!g->trans_a || g->ab_dt != LOOM_F32) return gemm_onednn(g, handled);
    gemm_args p = *g;
    float *a = padded_copy(g->A, g->lda, g->K, g->M, g->N, &p.lda);
    float *b = !a || g->trans_b ? NULL : padded_copy(g->B, g->ldb, g->K, g->N, g->M, &p.ldb);
    if (a) p.A = a;
    if (b) p.B = b;
    loom_status st = gemm_onednn(&p, handled);
    if ((a || b) && *handled) GEMM_COUNT(padded_calls);
    loom_free(a);
    loom_free(b);
    return st;
}

loom_status gemm(int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const void *A, int lda, const void *B, int ldb, loom_dtype ab_dt,
                 float beta, void *C, int ldc, loom_dtype c_dt,
                 const void *bias, loom_dtype bias_dt) {
    gemm_args g = {
        .trans_a = trans_a != 0, .trans_b = trans_b != 0, .M = M, .N = N, .K = K,
        .alpha = alpha, .beta = beta, .A = A, .B = B, .C = C, .bias = bias,
        .lda = lda, .ldb = ldb, .ldc = ldc, .ab_dt = ab_dt, .c_dt = c_dt, .bias_dt = bias_dt,
    };
    LOOM_TRY(check_args(&g));
    if (M == 0 || N == 0) return LOOM_OK;
    /* K == 0 leaves C = beta*C + bias: the fallback handles that edge.
     * bf16/f16 that oneDNN refuses (CPUs without AVX-512 bf16/fp16) run on
     * its fp32 matmul after widening, which beats the fallback there. */
    gemm_backend be = gemm_get_backend();
    if (K > 0 && be != GEMM_BACKEND_FALLBACK) {
        int handled = 0;
        loom_status st = LOOM_OK;
        if (be == GEMM_BACKEND_ONEDNN || ab_dt == LOOM_F32) st = gemm_onednn_padded(&g, &handled);
        if (!handled) st = gemm_widen(&g, &handled);
        if (handled) return st;
    }
    return gemm_fallback(&g);
}

/* Element (i, k) of op(X) for stored X with row stride ld. */
static inline size_t op_index(int trans, int r, int c, int ld) {
    return trans ? (size_t)c * (size_t)ld + (size_t)r : (size_t)r * (size_t)ld + (size_t)c;
}

/* Plain triple loop, double accumulation: the oracle for the tests.
 * A: (M, K), or (K, M) stored when trans_a; B: (K, N), or (N, K) stored
 * when trans_b; C: (M, N); bias: (N). */
void gemm_ref(int trans_a, int trans_b, int M, int N, int K, float alpha,
              const void *A, int lda, const void *B, int ldb, loom_dtype ab_dt,
              float beta, void *C, int ldc, loom_dtype c_dt,
              const void *bias, loom_dtype bias_dt) {
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++)
                acc += (double)loom_load(A, op_index(trans_a, i, k, lda), ab_dt) *
                       (double)loom_load(B, op_index(trans_b, k, j, ldb), ab_dt);
            size_t ci = (size_t)i * (size_t)ldc + (size_t)j;
            double v = (double)alpha * acc;
            if (beta != 0.0f) v += (double)beta * (double)loom_load(C, ci, c_dt);
            if (bias) v += (double)loom_load(bias, (size_t)j, bias_dt);
            loom_store(C, ci, c_dt, (float)v);
        }
    }
}
