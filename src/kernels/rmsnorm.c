/*
 * rmsnorm.c — RMSNorm forward and backward, with plain references.
 *
 * Owns: out = x * rstd * (w + w_offset), rstd = 1 / sqrt(mean(x^2) + eps) per
 * row, and its gradient (w_offset: 0, or Gemma's 1, added to w in fp32). Statistics and sums are fp32 whatever the dtype; a row whose
 * mean square overflows fp32 gives NaN (rstd_of).
 * Must never: let the thread count change a result. dw is reduced over a
 * fixed partition of the rows (RMSNORM_CHUNKS chunks, summed in chunk order),
 * so it is bit-identical run to run and for any number of threads.
 */
#include "kernels/kernels.h"
#include "kernels/kernel_rows.h"

#include <math.h>
#include <omp.h>

/* Row chunks of the dw reduction: fixed, so dw does not depend on threads. */
#define RMSNORM_CHUNKS 64

/* 1 / sqrt(ms + eps), NaN when the mean square overflowed fp32 (|x| near
 * 1e19 and beyond): 1 / sqrt(Inf) would be 0 and the row's output a silent
 * 0, hiding a diverged run from the loss scaler and the NaN checks. */
static float rstd_of(float mean_square, float eps) {
    return isfinite(mean_square) ? 1.0f / sqrtf(mean_square + eps) : NAN;
}

static float row_rstd(const float *x, int C, float eps) { return rstd_of(row_dot(x, x, C) / (float)C, eps); }

/* y[j] = x[j] * r * w[j] (y may be x) */
static void row_normalize_c(float *y, const float *x, const float *w, float r, int C) {
    for (int j = 0; j < C; j++) y[j] = x[j] * r * w[j];
}

/* One row: dx from g (the dout row); dw_part += dout * x * r.
 * dx = r * dout * w - r^3 / C * x * sum(dout * w * x). dx may be g or xr:
 * every element is read before that element is written. */
static void rmsnorm_bwd_row_c(float *dx, const float *g, float *dw_part, const float *xr,
                              const float *wf, float r, int C) {
    float dot = 0.0f;
    for (int j = 0; j < C; j++) {
        dw_part[j] += g[j] * xr[j] * r;
        dot += g[j] * wf[j] * xr[j];
    }
    float c = dot * r * r * r / (float)C;
    for (int j = 0; j < C; j++) dx[j] = r * g[j] * wf[j] - c * xr[j];
}

#if LOOM_HAVE_X86_SIMD
SIMD_AVX2 static void row_normalize_avx2(float *y, const float *x, const float *w, float r, int C) {
    __m256 vr = _mm256_set1_ps(r);
    int j = 0;
    for (; j + 8 <= C; j += 8)
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vr), _mm256_loadu_ps(w + j)));
    row_normalize_c(y + j, x + j, w + j, r, C - j);
}

/* The same terms; the dot product sums eight lanes, then the tail. */
SIMD_AVX2 static void rmsnorm_bwd_row_avx2(float *dx, const float *g, float *dw_part, const float *xr,
                                           const float *wf, float r, int C) {
    __m256 vr = _mm256_set1_ps(r), acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= C; j += 8) {
        __m256 gj = _mm256_loadu_ps(g + j), xj = _mm256_loadu_ps(xr + j);
        _mm256_storeu_ps(dw_part + j, _mm256_add_ps(_mm256_loadu_ps(dw_part + j),
                                                    _mm256_mul_ps(_mm256_mul_ps(gj, xj), vr)));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(gj, _mm256_loadu_ps(wf + j)), xj));
    }
    float dot = simd_hsum(acc);
    for (int t = j; t < C; t++) {
        dw_part[t] += g[t] * xr[t] * r;
        dot += g[t] * wf[t] * xr[t];
    }
    float c = dot * r * r * r / (float)C;
    __m256 vc = _mm256_set1_ps(c);
    for (j = 0; j + 8 <= C; j += 8) {
        __m256 gj = _mm256_loadu_ps(g + j);
        _mm256_storeu_ps(dx + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(vr, gj), _mm256_loadu_ps(wf + j)),
                                               _mm256_mul_ps(vc, _mm256_loadu_ps(xr + j))));
    }
    for (; j < C; j++) dx[j] = r * g[j] * wf[j] - c * xr[j];
}
#endif

static void row_normalize(float *y, const float *x, const float *w, float r, int C) {
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) {
        row_normalize_avx2(y, x, w, r, C);
        return;
    }
#endif
    row_normalize_c(y, x, w, r, C);
}

static void rmsnorm_bwd_row(float *dx, const float *g, float *dw_part, const float *xr, const float *wf, float r,
                            int C) {
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) {
        rmsnorm_bwd_row_avx2(dx, g, dw_part, xr, wf, r, C);
        return;
    }
#endif
    rmsnorm_bwd_row_c(dx, g, dw_part, xr, wf, r, C);
}

/* wf (C) = w + w_offset in fp32. */
static void weight_row(float *wf, const void *w, float w_offset, int C, loom_dtype dt) {
    row_load(wf, w, 0, C, dt);
    if (w_offset != 0.0f)
        for (int j = 0; j < C; j++) wf[j] += w_offset;
}

void rmsnorm_fwd(void *out, float *rstd, const void *x, const void *w, float w_offset,
                 int N, int C, float eps, loom_dtype dt) {
    int nt = omp_get_max_threads();
    float *ws = workspace_floats((size_t)(nt + 1) * C);
    float *wf = ws + (size_t)nt * C; // (C) w + w_offset in fp32
    weight_row(wf, w, w_offset, C, dt);
    #pragma omp parallel for schedule(dynamic, 32)
    for (int i = 0; i < N; i++) {
        size_t o = (size_t)i * C;
        // fp32 rows where they lie; other dtypes through this thread's scratch row
        float *y = dt == LOOM_F32 ? (float *)out + o : ws + (size_t)omp_get_thread_num() * C;
        const float *xr = dt == LOOM_F32 ? (const float *)x + o : y;
        if (dt != LOOM_F32) row_load(y, x, o, C, dt);
        float r = row_rstd(xr, C, eps);
        row_normalize(y, xr, wf, r, C);
        if (dt != LOOM_F32) row_store(out, o, y, C, dt);
        if (rstd) rstd[i] = r;
    }
    loom_free(ws);
}

/* Rows [i0, i1) of the backward; dw_part (C) is this chunk's dw. */
static void rmsnorm_bwd_chunk(void *dx, float *dw_part, float *xr, float *g,
                              const float *wf, const void *dout, const void *x,
                              const float *rstd, int i0, int i1, int C, loom_dtype dt) {
    memset(dw_part, 0, (size_t)C * sizeof(float));
    for (int i = i0; i < i1; i++) {
        size_t o = (size_t)i * C;
        if (dt == LOOM_F32) { // rows where they lie
            rmsnorm_bwd_row((float *)dx + o, (const float *)dout + o, dw_part, (const float *)x + o, wf, rstd[i], C);
        } else {
            row_load(xr, x, o, C, dt);
            row_load(g, dout, o, C, dt);
            rmsnorm_bwd_row(g, g, dw_part, xr, wf, rstd[i], C);
            row_store(dx, o, g, C, dt);
        }
    }
}

void rmsnorm_bwd(void *dx, float *dw, const void *dout, const void *x,
                 const void *w, float w_offset, const float *rstd, int N, int C, loom_dtype dt) {
    int P = N < RMSNORM_CHUNKS ? N : RMSNORM_CHUNKS;
    if (P <= 0) return;
    int nt = omp_get_max_threads();
    float *ws = workspace_floats((size_t)(2 * nt + 1 + P) * C);
    float *wf = ws;                                 // (C)
    float *part = ws + C;                           // (P, C) per-chunk dw
    float *rows = part + (size_t)P * C;             // (nt, 2, C) x and dout rows
    weight_row(wf, w, w_offset, C, dt);
    #pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < P; p++) {
        float *xr = rows + (size_t)omp_get_thread_num() * 2 * C;
        int i0 = (int)((long long)N * p / P), i1 = (int)((long long)N * (p + 1) / P);
        rmsnorm_bwd_chunk(dx, part + (size_t)p * C, xr, xr + C, wf, dout, x, rstd,
                          i0, i1, C, dt);
    }
    // Fixed reduction order: chunk 0, 1, ..., P-1, then into dw.
    #pragma omp parallel for schedule(dynamic, 64)
    for (int j = 0; j < C; j++) {
        float s = 0.0f;
        for (int p = 0; p < P; p++) s += part[(size_t)p * C + j];
        dw[j] += s;
    }
    loom_free(ws);
}

/* ------------------------------------------------------------- references */

void rmsnorm_fwd_ref(void *out, float *rstd, const void *x, const void *w, float w_offset,
                     int N, int C, float eps, loom_dtype dt) {
    for (int i = 0; i < N; i++) {
        size_t row = (size_t)i * C;
        float ss = 0.0f;
        for (int j = 0; j < C; j++) {
            float v = loom_load(x, row + j, dt);
            ss += v * v;
        }
        float r = rstd_of(ss / (float)C, eps);
        for (int j = 0; j < C; j++)
            loom_store(out, row + j, dt, loom_load(x, row + j, dt) * r * (loom_load(w, j, dt) + w_offset));
        if (rstd) rstd[i] = r;
    }
}

void rmsnorm_bwd_ref(void *dx, float *dw, const void *dout, const void *x,
                     const void *w, float w_offset, const float *rstd, int N, int C, loom_dtype dt) {
    for (int i = 0; i < N; i++) {
        size_t row = (size_t)i * C;
        float r = rstd[i], dot = 0.0f;
        for (int j = 0; j < C; j++) {
            float g = loom_load(dout, row + j, dt), xv = loom_load(x, row + j, dt);
            dot += g * (loom_load(w, j, dt) + w_offset) * xv;
            dw[j] += g * xv * r;
        }
        for (int j = 0; j < C; j++) {
            float g = loom_load(dout, row + j, dt), xv = loom_load(x, row + j, dt);
            float d = r * g * (loom_load(w, j, dt) + w_offset) - dot * r * r * r / (float)C * xv;
            loom_store(dx, row + j, dt, d);
        }
    }
}
