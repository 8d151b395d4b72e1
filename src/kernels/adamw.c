/*
 * adamw.c — the AdamW update on fp32 master weights and fp32 moments.
 *
 * Bias corrections are computed once per call in double; the per-element
 * arithmetic is fp32 and follows the formula in kernels.h term by term, eight
 * at a time with AVX2 (the same operations: both paths give the same bits).
 * Weight decay uses the parameter's value before this step's update.
 * Must never: allocate, or depend on the thread count (elements are
 * independent).
 */
#include "kernels/kernels.h"
#include "core/simd.h"

#include <math.h>

#define PARALLEL_MIN 32768
#define CHUNK 16384 /* elements per parallel task */

/* Elements [lo, hi): the formula of kernels.h, term by term in fp32. */
static void adamw_range_c(float *param, float *m, float *v, const float *grad, size_t lo, size_t hi,
                          float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                          float grad_scale) {
    float c1 = 1.0f - b1, c2 = 1.0f - b2;
    for (size_t i = lo; i < hi; i++) {
        float g = grad[i] * grad_scale;
        float mi = b1 * m[i] + c1 * g;
        float vi = b2 * v[i] + c2 * g * g;
        float update = (mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * param[i];
        m[i] = mi;
        v[i] = vi;
        param[i] -= lr * update;
    }
}

#if LOOM_HAVE_X86_SIMD
/* The same operations eight at a time (correctly rounded sqrt and divide,
 * no fused multiply-add): bit-identical to the portable loop. */
SIMD_AVX2 static void adamw_range_avx2(float *param, float *m, float *v, const float *grad, size_t lo,
                                       size_t hi, float lr, float b1, float b2, float eps, float wd, float bc1,
                                       float bc2, float grad_scale) {
    const __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2), vc1 = _mm256_set1_ps(1.0f - b1);
    const __m256 vc2 = _mm256_set1_ps(1.0f - b2), vbc1 = _mm256_set1_ps(bc1), vbc2 = _mm256_set1_ps(bc2);
    const __m256 veps = _mm256_set1_ps(eps), vwd = _mm256_set1_ps(wd), vlr = _mm256_set1_ps(lr);
    const __m256 vgs = _mm256_set1_ps(grad_scale);
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), vgs), p = _mm256_loadu_ps(param + i);
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(vb1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(vc1, g));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(vb2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(_mm256_mul_ps(vc2, g), g));
        __m256 den = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(vi, vbc2)), veps);
        __m256 update = _mm256_add_ps(_mm256_div_ps(_mm256_div_ps(mi, vbc1), den), _mm256_mul_ps(vwd, p));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        _mm256_storeu_ps(param + i, _mm256_sub_ps(p, _mm256_mul_ps(vlr, update)));
    }
    adamw_range_c(param, m, v, grad, i, hi, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
}
#endif

void adamw_step(float *param, float *m, float *v, const float *grad, size_t n,
                float lr, float b1, float b2, float eps, float wd, int step,
                float grad_scale) {
    double t = step > 0 ? (double)step : 1.0;
    float bc1 = (float)(1.0 - pow((double)b1, t)); /* 1 - b1^t */
    float bc2 = (float)(1.0 - pow((double)b2, t)); /* 1 - b2^t */
    size_t nch = (n + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(dynamic, 1) if (n > PARALLEL_MIN)
    for (size_t c = 0; c < nch; c++) {
        size_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
#if LOOM_HAVE_X86_SIMD
        if (simd_avx2()) {
            adamw_range_avx2(param, m, v, grad, lo, hi, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
            continue;
        }
#endif
        adamw_range_c(param, m, v, grad, lo, hi, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
    }
}
