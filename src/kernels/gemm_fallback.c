/*
 * gemm_fallback.c — loom's own GEMM: cache-blocked loops around an AVX2/FMA
 * micro-kernel (portable C when the CPU lacks it), fp32 accumulation,
 * OpenMP over blocks of C.
 *
 * Layout (GotoBLAS style): for each slab of up to NC columns of C, op(B) is
 * converted to fp32 and packed once into micro-panels of NR columns
 * (shared by all threads); each task then takes a block of up to MC rows
 * (and a range of the slab's micro-panels), packs op(A) in KC-deep slices
 * into micro-panels of MR rows, and runs the MR x NR register-blocked kernel
 * into an fp32 tile. The tile is finished (alpha, beta * C, bias, conversion
 * to C's dtype) once all of K is summed. bf16/f16 inputs are converted to
 * fp32 while packing, so they run at the fp32 kernel's speed.
 * The K slices depend on K alone and each element of C is summed by one
 * task in slice order, so results do not depend on the number of threads
 * or the partition.
 *
 * Owns: nothing across calls; scratch comes from loom_alloc(WORKSPACE).
 * Must never: read C when beta == 0, or write outside the M x N window of C.
 */
#include "kernels/gemm_internal.h"
#include "kernels/kernel_rows.h"

#include <omp.h>

#define MR 6        /* rows of the micro-kernel */
#define NR 16       /* columns of the micro-kernel (two 8-float vectors) */
#define MC 96       /* rows of A packed per block (multiple of MR) */
#define KC 320      /* most depth of one packed slice; slices are balanced */
#define NC 1024     /* most columns of B packed per slab (multiple of NR) */
#define SLAB_FLOATS (1 << 20) /* packed-B budget: NC shrinks for large K */
#define PARALLEL_MIN_WORK (1 << 18) /* M*N*K below this runs on one thread */

static inline int min_int(int a, int b) { return a < b ? a : b; }
static inline int max_int(int a, int b) { return a > b ? a : b; }
static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
static inline int div_up(int x, int m) { return (x + m - 1) / m; }

/* Depth of the K slices: the fewest slices of at most KC, equally deep. */
static int choose_kc(int K) { return K > 0 ? div_up(K, div_up(K, KC)) : 1; }

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
            else memset(tmp, 0, (size_t)kc * sizeof(float));
            for (int k = 0; k < kc; k++) dst[(size_t)k * MR] = tmp[k];
        }
        return;
    }
    for (int i = mc; i < mcp; i++) tmp[i] = 0.0f;
    for (int k = 0; k < kc; k++) { /* stored (K, M): row k holds op(A)[:, k] */
        row_load(tmp, g->A, (size_t)(k0 + k) * g->lda + i0, mc, g->ab_dt);
        for (int p = 0; p < mcp / MR; p++)
            memcpy(ap + ((size_t)p * kc + k) * MR, tmp + p * MR, MR * sizeof(float));
    }
}

/* ---- micro-kernel: out (MR, NR) = in + a (kc, MR) · b (kc, NR); in == NULL
 * starts from zero. Row strides ldin, ldout; out may be in. */

#if LOOM_HAVE_X86_SIMD
/* The AVX2 kernel: 12 accumulators, two B vectors and one broadcast A value
 * per row and step. */
SIMD_AVX2 static void kernel_6x16_avx2(int kc, const float *restrict a, const float *restrict b,
                                       const float *in, size_t ldin, float *out, size_t ldout) {
#define ROW_LOAD(r) __m256 c##r##0 = in ? _mm256_loadu_ps(in + r * ldin) : _mm256_setzero_ps(), \
        c##r##1 = in ? _mm256_loadu_ps(in + r * ldin + 8) : _mm256_setzero_ps()
#define ROW_FMA(r) do { __m256 a_ = _mm256_broadcast_ss(a + r); \
        c##r##0 = _mm256_fmadd_ps(a_, b0, c##r##0); c##r##1 = _mm256_fmadd_ps(a_, b1, c##r##1); } while (0)
#define ROW_STORE(r) do { _mm256_storeu_ps(out + r * ldout, c##r##0); \
        _mm256_storeu_ps(out + r * ldout + 8, c##r##1); } while (0)
    ROW_LOAD(0); ROW_LOAD(1); ROW_LOAD(2); ROW_LOAD(3); ROW_LOAD(4); ROW_LOAD(5);
    for (int k = 0; k < kc; k++, a += MR, b += NR) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        ROW_FMA(0); ROW_FMA(1); ROW_FMA(2); ROW_FMA(3); ROW_FMA(4); ROW_FMA(5);
    }
    ROW_STORE(0); ROW_STORE(1); ROW_STORE(2); ROW_STORE(3); ROW_STORE(4); ROW_STORE(5);
#undef ROW_LOAD
#undef ROW_FMA
#undef ROW_STORE
}
#endif

/* The portable kernel: the same order of operations, one multiply-add at a
 * time (it rounds twice where FMA rounds once). */
static void kernel_6x16_c(int kc, const float *restrict a, const float *restrict b,
                          const float *in, size_t ldin, float *out, size_t ldout) {
    float t[MR][NR];
    for (int r = 0; r < MR; r++) {
        if (in) memcpy(t[r], in + r * ldin, sizeof t[r]);
        else memset(t[r], 0, sizeof t[r]);
    }
    for (int k = 0; k < kc; k++, a += MR, b += NR)
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NR; j++) t[r][j] += a[r] * b[j];
    for (int r = 0; r < MR; r++) memcpy(out + r * ldout, t[r], sizeof t[r]);
}

typedef void (*kernel_fn)(int kc, const float *restrict a, const float *restrict b,
                          const float *in, size_t ldin, float *out, size_t ldout);

static kernel_fn choose_kernel(void) {
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) return kernel_6x16_avx2;
#endif
    return kernel_6x16_c;
}

/* ---- finishing: C = alpha * t + beta * C + bias, converted to C's dtype */

/* One tile t (rows, cols <= MR, NR; row stride NR) into C at (i, j). */
static void finish_tile(const gemm_args *g, const float *t, int i, int j, int rows, int cols) {
    float bias[NR], row[NR];
    if (g->bias) row_load(bias, g->bias, (size_t)j, cols, g->bias_dt);
    for (int r = 0; r < rows; r++) {
        size_t ci = (size_t)(i + r) * g->ldc + j;
        const float *a = t + r * NR;
        if (g->beta != 0.0f) {
            row_load(row, g->C, ci, cols, g->c_dt);
            for (int c = 0; c < cols; c++) row[c] = g->alpha * a[c] + g->beta * row[c];
        } else {
            for (int c = 0; c < cols; c++) row[c] = g->alpha * a[c];
        }
        if (g->bias)
            for (int c = 0; c < cols; c++) row[c] += bias[c];
        row_store(g->C, ci, row, cols, g->c_dt);
    }
}

#if LOOM_HAVE_X86_SIMD
/* A full MR x NR tile, the same operations eight columns at a time (the
 * same bits as finish_tile). */
SIMD_AVX2 static void finish_tile_avx2(const gemm_args *g, const float *t, int i, int j) {
    __m256 alpha = _mm256_set1_ps(g->alpha), beta = _mm256_set1_ps(g->beta), b0 = alpha, b1 = alpha;
    if (g->bias) {
        b0 = simd_load8(g->bias, (size_t)j, g->bias_dt);
        b1 = simd_load8(g->bias, (size_t)j + 8, g->bias_dt);
    }
    for (int r = 0; r < MR; r++) {
        size_t ci = (size_t)(i + r) * g->ldc + j;
        __m256 v0 = _mm256_mul_ps(alpha, _mm256_loadu_ps(t + r * NR));
        __m256 v1 = _mm256_mul_ps(alpha, _mm256_loadu_ps(t + r * NR + 8));
        if (g->beta != 0.0f) {
            v0 = _mm256_add_ps(v0, _mm256_mul_ps(beta, simd_load8(g->C, ci, g->c_dt)));
            v1 = _mm256_add_ps(v1, _mm256_mul_ps(beta, simd_load8(g->C, ci + 8, g->c_dt)));
        }
        if (g->bias) {
            v0 = _mm256_add_ps(v0, b0);
            v1 = _mm256_add_ps(v1, b1);
        }
        simd_store8(g->C, ci, g->c_dt, v0);
        simd_store8(g->C, ci + 8, g->c_dt, v1);
    }
}
#endif

/* ---- one block of C: rows i0 .. i0+mc, panels q0 .. q1 of the current slab */

typedef struct block {
    int i0, mc;    /* rows of C */
    int j0, q0, q1; /* slab starts at column j0; micro-panels [q0, q1) */
    int nc;        /* columns of the slab */
} block;

/* acc: (round_up(mc, MR), nc) fp32 partial sums between K slices; ap:
 * packed A scratch (MC * KC); bslab: packed B for the slab, micro-panel q at
 * q * K * NR. The last slice's kernel writes a tile that is finished into C
 * at once, so a K that fits one slice never touches acc. */
static void compute_block(const gemm_args *g, kernel_fn kernel, const float *bslab, float *ap,
                          float *acc, const block *bk) {
    int mcp = round_up(bk->mc, MR), kc_max = choose_kc(g->K);
    size_t ldacc = (size_t)(bk->q1 - bk->q0) * NR;
    float tile[MR * NR];
    /* K == 0 still takes one (empty) slice: C = beta * C + bias. */
    for (int k0 = 0; k0 < g->K || k0 == 0; k0 += kc_max) {
        int kc = min_int(kc_max, g->K - k0), first = k0 == 0, last = k0 + kc >= g->K;
        pack_a(ap, g, bk->i0, bk->mc, k0, kc);
        for (int q = bk->q0; q < bk->q1; q++) {
            const float *bp = bslab + (size_t)q * g->K * NR + (size_t)k0 * NR;
            int j = q * NR, cols = min_int(NR, bk->nc - j);
            for (int p = 0; p < mcp / MR; p++) {
                float *cp = acc + (size_t)p * MR * ldacc + (size_t)(q - bk->q0) * NR;
                const float *a = ap + (size_t)p * kc * MR, *in = first ? NULL : cp;
                if (!last) {
                    kernel(kc, a, bp, in, ldacc, cp, ldacc);
                    continue;
                }
                kernel(kc, a, bp, in, ldacc, tile, NR);
                int rows = min_int(MR, bk->mc - p * MR);
#if LOOM_HAVE_X86_SIMD
                if (rows == MR && cols == NR && kernel == kernel_6x16_avx2) {
                    finish_tile_avx2(g, tile, bk->i0 + p * MR, bk->j0 + j);
                    continue;
                }
#endif
                finish_tile(g, tile, bk->i0 + p * MR, bk->j0 + j, rows, cols);
            }
        }
    }
}

/* Rows per block: up to MC, and (when blocks are few) a number of blocks
 * that is a multiple of the thread count, so no thread idles at the end. */
static int choose_mc(int M, int nthreads) {
    int nb = div_up(M, MC);
    if (nb < 8 * nthreads) nb = round_up(nb, nthreads);
    return min_int(MC, max_int(MR, round_up(div_up(M, nb), MR)));
}

/* Columns per slab: up to NC, fewer when K is deep (the packed slab stays
 * within SLAB_FLOATS). */
static int choose_nc(int N, int K) {
    int nc = round_up(min_int(N, NC), NR);
    while (nc > NR && (size_t)K * nc > SLAB_FLOATS) nc = round_up(nc / 2, NR);
    return nc;
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
    int mc = choose_mc(M, nthreads), nblocks = (M + mc - 1) / mc, NCs = choose_nc(N, K);
    /* Few row blocks: also split each slab's columns so every thread works. */
    int nsplit = nblocks >= nthreads ? 1 : min_int(NCs / NR, (nthreads + nblocks - 1) / nblocks);
    size_t slab = (size_t)K * NCs, per_thread = (size_t)MC * KC + (size_t)MC * NCs;
    kernel_fn kernel = choose_kernel();
    float *ws = loom_alloc((slab + (size_t)nthreads * per_thread) * sizeof(float), LOOM_MEM_WORKSPACE);
    if (!ws) return LOOM_ERR_NOMEM;

    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *ap = ws + slab + (size_t)omp_get_thread_num() * per_thread;
        float *acc = ap + (size_t)MC * KC;
        for (int j0 = 0; j0 < N; j0 += NCs) {
            int nc = min_int(NCs, N - j0), nq = (nc + NR - 1) / NR;
            int ns = min_int(nsplit, nq);
            #pragma omp for schedule(static)
            for (int q = 0; q < nq; q++)
                pack_b_panel(ws + (size_t)q * K * NR, g, j0 + q * NR, min_int(NR, nc - q * NR));
            #pragma omp for schedule(static)
            for (int t = 0; t < nblocks * ns; t++) {
                block bk = task_block(t, ns, mc, M, j0, nc);
                compute_block(g, kernel, ws, ap, acc, &bk);
            }
        }
    }
    loom_free(ws);
    return LOOM_OK;
}
