/*
 * crossentropy.c — softmax cross-entropy fused with its gradient.
 *
 * Owns: per row, m = max(x), lse = m + log(sum(exp(x - m))) in fp32,
 * loss = lse - x[target] (computed as log(sum) - (x[target] - m) so large
 * logits lose no digits), dlogits = (softmax - onehot) * grad_scale.
 * Must never: write a row of dlogits before reading that row of logits in
 * full (they may alias), or touch rows of other threads.
 */
#include "kernels/kernels.h"
#include "kernels/kernel_rows.h"

#include <math.h>
#include <omp.h>

/* x: (V) logits in fp32, overwritten by the gradient row when want_grad.
 * Returns the row's loss. */
static float crossentropy_row(float *x, int V, int target, float grad_scale, int want_grad) {
    float xt = x[target], m = row_max(x, V);
    float sum = row_exp_sum(x, V, 1.0f, m); // x = exp(x - m)
    if (want_grad) {
        row_scale(x, 1.0f / sum, V);
        x[target] -= 1.0f;
        row_scale(x, grad_scale, V);
    }
    return logf(sum) - (xt - m);
}

void crossentropy_fwd_bwd(float *losses, void *dlogits, const void *logits,
                          const int32_t *targets, int N, int V, int ignore_index,
                          float grad_scale, loom_dtype dt) {
    float *ws = workspace_floats((size_t)V * omp_get_max_threads()); // (threads, V)
    #pragma omp parallel for schedule(dynamic, 8)
    for (int i = 0; i < N; i++) {
        float *x = ws + (size_t)omp_get_thread_num() * V;
        size_t off = (size_t)i * V;
        if (targets[i] == ignore_index) {
            losses[i] = 0.0f;
            if (dlogits) memset((char *)dlogits + off * loom_dtype_size(dt), 0,
                                (size_t)V * loom_dtype_size(dt));
            continue;
        }
        int in_place = dt == LOOM_F32 && dlogits != NULL; // fp32: work in the gradient's own row
        if (in_place) x = (float *)dlogits + off;
        row_load(x, logits, off, V, dt); // nothing to copy when they alias
        losses[i] = crossentropy_row(x, V, targets[i], grad_scale, dlogits != NULL);
        if (dlogits && !in_place) row_store(dlogits, off, x, V, dt);
    }
    loom_free(ws);
}

void crossentropy_fwd_bwd_ref(float *losses, void *dlogits, const void *logits,
                              const int32_t *targets, int N, int V, int ignore_index,
                              float grad_scale, loom_dtype dt) {
    for (int i = 0; i < N; i++) {
        size_t off = (size_t)i * V;
        int t = targets[i];
        if (t == ignore_index) {
            losses[i] = 0.0f;
            for (int j = 0; dlogits && j < V; j++) loom_store(dlogits, off + j, dt, 0.0f);
            continue;
        }
        float m = -INFINITY, sum = 0.0f, xt = loom_load(logits, off + t, dt);
        for (int j = 0; j < V; j++) m = fmaxf(m, loom_load(logits, off + j, dt));
        for (int j = 0; j < V; j++) sum += expf(loom_load(logits, off + j, dt) - m);
        losses[i] = logf(sum) - (xt - m);
        // Each element is read just before it is written: safe when aliased.
        for (int j = 0; dlogits && j < V; j++) {
            float p = expf(loom_load(logits, off + j, dt) - m) / sum;
            loom_store(dlogits, off + j, dt, (p - (j == t ? 1.0f : 0.0f)) * grad_scale);
        }
    }
}
