/*
 * adamw.c — the AdamW update on fp32 master weights and fp32 moments.
 *
 * Bias corrections are computed once per call in double; the per-element
 * arithmetic is fp32 and follows the formula in kernels.h term by term.
 * Weight decay uses the parameter's value before this step's update.
 * Must never: allocate, or depend on the thread count (elements are
 * independent).
 */
#include "kernels/kernels.h"

#include <math.h>

#define PARALLEL_MIN 32768

void adamw_step(float *param, float *m, float *v, const float *grad, size_t n,
                float lr, float b1, float b2, float eps, float wd, int step,
                float grad_scale) {
    double t = step > 0 ? (double)step : 1.0;
    float bc1 = (float)(1.0 - pow((double)b1, t)); /* 1 - b1^t */
    float bc2 = (float)(1.0 - pow((double)b2, t)); /* 1 - b2^t */
    float c1 = 1.0f - b1, c2 = 1.0f - b2;
    #pragma omp parallel for schedule(static) if (n > PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) {
        float g = grad[i] * grad_scale;
        float mi = b1 * m[i] + c1 * g;
        float vi = b2 * v[i] + c2 * g * g;
        float update = (mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * param[i];
        m[i] = mi;
        v[i] = vi;
        param[i] -= lr * update;
    }
}
