/*
 * gemm_fallback.c — the portable GEMM: cache-blocked C loops, fp32
 * accumulation, OpenMP over blocks of rows of C.
 *
 * Layout (GotoBLAS style): for each panel of NC columns of C, op(B) is
 * converted to fp32 and packed once into micro-panels of NR columns
 * (shared by all threads); each thread then takes blocks of MC rows, packs
 * op(A) in KC-deep slices into micro-panels of MR rows, and runs an MR x NR
 * register-blocked kernel into an fp32 tile. The tile is finished
 * (alpha, beta * C, bias, conversion to C's dtype) once all of K is summed.
 * The order of the K sum is fixed, so results do not depend on the number
 * of threads.
 *
 * Owns: nothing across calls; scratch comes from loom_alloc(WORKSPACE).
 * Must never: read C when beta == 0, or write outside the M x N window of C.
 */
#include "kernels/gemm_internal.h"
#include "kernels/kernel_rows.h"

#include <omp.h>

#define MR 6     /* rows of the micro-kernel */
#define NR 16    /* columns of the micro-kernel (two 8-float vectors) */
#define MC 96    /* rows of A packed per block (multiple of MR) */
#define KC 256   /* depth of one packed slice */
#define NC 256   /* columns of B packed per panel (multiple of NR) */
#define PARALLEL_MIN_WORK (1 << 18) /* M*N*K below this runs on one thread */

static inline int min_int(int a, int b) { return a < b ? a : b; }
static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

/* Pack columns j0 .. j0+w of op(B) (w <= NR), all K rows, into
 * bp: (K, NR), zero-padded beyond w. */
static void pack_b_panel(float *bp, const gemm_args *g, int j0, int w) {
    int K = g->K;
    if (!g->trans_b) { /* stored (K, N): row k holds the panel's columns */
        for (int k = 0; k < K; k++) {
            row_load(bp + (size_t)k * NR, g->B, (size_t)k * g->ldb + j0, w, g->ab_dt);
            for (int j = w; j < NR; j++) bp[(size_t)k * NR + j] = 0.0f;
        }
        return;
    }
    float tmp[KC]; /* stored (N, K): row j holds column j of op(B) */
    for (int j = 0; j < NR; j++) {
        for (int k0 = 0; k0 < K; k0 += KC) {
            int kc = min_int(KC, K - k0);
            if (j < w) row_load(tmp, g->B, (size_t)(j0 + j) * g->ldb + k0, kc, g->ab_dt);
            for (int k = 0; k < kc; k++) bp[(size_t)(k0 + k) * NR + j] = j < w ? tmp[k] : 0.0f;
        }
    }
}

/* Pack rows i0 .. i0+mc, depth k0 .. k0+kc of op(A) into ap: micro-panels
 * of (kc, MR), zero-padded beyond mc. */
static void pack_a(float *ap, const gemm_args *g, int i0, int mc, int k0, int kc) {
    float tmp[KC > MC ? KC : MC];
    int mcp = round_up(mc, MR);
    if (!g->trans_a) { /* stored (M, K): row i holds op(A)[i, :] */
        for (int i = 0; i < mcp; i++) {
            float *dst = ap + (size_t)(i / MR) * kc * MR + i % MR;
            if (i < mc) row_load(tmp, g->A, (size_t)(i0 + i) * g->lda + k0, kc, g->ab_dt);
            for (int k = 0; k < kc; k++) dst[(size_t)k * MR] = i < mc ? tmp[k] : 0.0f;
        }
        return;
    }
    for (int k = 0; k < kc; k++) { /* stored (K, M): row k holds op(A)[:, k] */
        row_load(tmp, g->A, (size_t)(k0 + k) * g->lda + i0, mc, g->ab_dt);
        for (int i = 0; i < mcp; i++)
            ap[(size_t)(i / MR) * kc * MR + (size_t)k * MR + i % MR] = i < mc ? tmp[i] : 0.0f;
    }
}

/* ---- micro-kernel: c (MR, NR) with row stride ldc += a (kc, MR) · b (kc, NR) */

typedef float v8f __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* One build runs everywhere; CPUs with AVX2+FMA get the fast clone. */
#define KERNEL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KERNEL_CLONES
#endif

#define LOAD8(p) ({ v8f v_; memcpy(&v_, (p), sizeof v_); v_; })
#define STORE8(p, v) do { v8f v_ = (v); memcpy((p), &v_, sizeof v_); } while (0)
#define ROW_LOAD(r) v8f c##r##0 = LOAD8(c + r * ldc), c##r##1 = LOAD8(c + r * ldc + 8)
#define ROW_FMA(r) do { float a_ = a[r]; c##r##0 += a_ * b0; c##r##1 += a_ * b1; } while (0)
#define ROW_STORE(r) do { STORE8(c + r * ldc, c##r##0); STORE8(c + r * ldc + 8, c##r##1); } while (0)

KERNEL_CLONES
static void kernel_6x16(int kc, const float *restrict a, const float *restrict b,
                        float *restrict c, size_t ldc) {
    ROW_LOAD(0); ROW_LOAD(1); ROW_LOAD(2); ROW_LOAD(3); ROW_LOAD(4); ROW_LOAD(5);
    for (int k = 0; k < kc; k++, a += MR, b += NR) {
        v8f b0 = LOAD8(b), b1 = LOAD8(b + 8);
        ROW_FMA(0); ROW_FMA(1); ROW_FMA(2); ROW_FMA(3); ROW_FMA(4); ROW_FMA(5);
    }
    ROW_STORE(0); ROW_STORE(1); ROW_STORE(2); ROW_STORE(3); ROW_STORE(4); ROW_STORE(5);
}

/* ---- one block of C: rows i0 .. i0+mc, panels q0 .. q1 of the current slab */

typedef struct block {
    int i0, mc;    /* rows of C */
    int j0, q0, q1; /* slab starts at column j0; micro-panels [q0, q1) */
    int nc;        /* columns of the slab */
} block;

/* C[i, j] = alpha * acc + beta * C[i, j] + bias[j] for the block's window. */
static void finish_block(const gemm_args *g, const float *acc, size_t ldacc, const block *bk) {
    int jb = bk->j0 + bk->q0 * NR, w = min_int(bk->q1 * NR, bk->nc) - bk->q0 * NR;
    float bias[NC], row[NC];
    if (g->bias) row_load(bias, g->bias, (size_t)jb, w, g->bias_dt);
    for (int i = 0; i < bk->mc; i++) {
        size_t ci = (size_t)(bk->i0 + i) * g->ldc + jb;
        const float *a = acc + (size_t)i * ldacc;
        if (g->beta != 0.0f) {
            row_load(row, g->C, ci, w, g->c_dt);
            for (int j = 0; j < w; j++) row[j] = g->alpha * a[j] + g->beta * row[j];
        } else {
            for (int j = 0; j < w; j++) row[j] = g->alpha * a[j];
        }
        if (g->bias)
            for (int j = 0; j < w; j++) row[j] += bias[j];
        row_store(g->C, ci, row, w, g->c_dt);
    }
}

/* acc: (round_up(mc, MR), NC) fp32 tile; ap: packed A scratch (MC * KC);
 * bslab: packed B for the slab, micro-panel q at q * K * NR. */
static void compute_block(const gemm_args *g, const float *bslab, float *ap, float *acc,
                          const block *bk) {
    int mcp = round_up(bk->mc, MR);
    size_t ldacc = (size_t)(bk->q1 - bk->q0) * NR;
    memset(acc, 0, (size_t)mcp * ldacc * sizeof(float));
    for (int k0 = 0; k0 < g->K; k0 += KC) {
        int kc = min_int(KC, g->K - k0);
        pack_a(ap, g, bk->i0, bk->mc, k0, kc);
        for (int q = bk->q0; q < bk->q1; q++) {
            const float *bp = bslab + (size_t)q * g->K * NR + (size_t)k0 * NR;
            float *cq = acc + (size_t)(q - bk->q0) * NR;
            for (int p = 0; p < mcp / MR; p++)
                kernel_6x16(kc, ap + (size_t)p * kc * MR, bp, cq + (size_t)p * MR * ldacc, ldacc);
        }
    }
    finish_block(g, acc, ldacc, bk);
}

/* Rows per block: up to MC, smaller when that leaves threads idle. */
static int choose_mc(int M, int nthreads) {
    int per_thread = round_up((M + nthreads - 1) / nthreads, MR);
    return min_int(MC, per_thread > MR ? per_thread : MR);
}

/* Task t of the slab starting at j0 -> its block. */
static block task_block(int t, int nsplit, int mc, int M, int j0, int nc) {
    int nq = (nc + NR - 1) / NR, b = t / nsplit, s = t % nsplit;
    block bk = { .i0 = b * mc, .mc = min_int(mc, M - b * mc), .j0 = j0, .nc = nc };
    bk.q0 = (int)((long)nq * s / nsplit);
    bk.q1 = (int)((long)nq * (s + 1) / nsplit);
    return bk;
}

loom_status gemm_fallback(const gemm_args *g) {
    GEMM_COUNT(fallback_calls);
    int M = g->M, N = g->N, K = g->K;
    double work = (double)M * N * (K > 0 ? K : 1);
    int nthreads = work >= PARALLEL_MIN_WORK ? omp_get_max_threads() : 1;
    int mc = choose_mc(M, nthreads), nblocks = (M + mc - 1) / mc;
    /* Few row blocks: also split each slab's columns so every thread works. */
    int nsplit = nblocks >= nthreads ? 1 : min_int(NC / NR, (nthreads + nblocks - 1) / nblocks);
    size_t slab = (size_t)K * NC, per_thread = (size_t)MC * KC + (size_t)MC * NC;
    float *ws = loom_alloc((slab + (size_t)nthreads * per_thread) * sizeof(float), LOOM_MEM_WORKSPACE);
    if (!ws) return LOOM_ERR_NOMEM;

    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *ap = ws + slab + (size_t)omp_get_thread_num() * per_thread;
        float *acc = ap + (size_t)MC * KC;
        for (int j0 = 0; j0 < N; j0 += NC) {
            int nc = min_int(NC, N - j0), nq = (nc + NR - 1) / NR;
            int ns = min_int(nsplit, nq);
            #pragma omp for schedule(static)
            for (int q = 0; q < nq; q++)
                pack_b_panel(ws + (size_t)q * K * NR, g, j0 + q * NR, min_int(NR, nc - q * NR));
            #pragma omp for schedule(static)
            for (int t = 0; t < nblocks * ns; t++) {
                block bk = task_block(t, ns, mc, M, j0, nc);
                compute_block(g, ws, ap, acc, &bk);
            }
        }
    }
    loom_free(ws);
    return LOOM_OK;
}
