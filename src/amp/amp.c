/*
 * amp.c — dynamic loss scaling, found-inf, global gradient norm, clipping.
 * Must never: modify a gradient (the optimizer applies the multiplier).
 */
#include "loom/amp.h"
#include "kernels/kernels.h"

#include <math.h>

void loom_loss_scaler_init(loom_loss_scaler *s, int enabled) {
    s->enabled = enabled;
    s->scale = enabled ? 65536.0f : 1.0f;
    s->growth_factor = 2.0f;
    s->backoff_factor = 0.5f;
    s->growth_interval = 2000;
    s->good_steps = 0;
    s->skipped_steps = 0;
}

void loom_loss_scaler_update(loom_loss_scaler *s, int found_inf) {
    if (found_inf) s->skipped_steps++;
    if (!s->enabled) return;
    if (found_inf) {
        s->scale *= s->backoff_factor;
        if (s->scale < LOOM_LOSS_SCALE_MIN) s->scale = LOOM_LOSS_SCALE_MIN;
        s->good_steps = 0;
        return;
    }
    if (++s->good_steps >= s->growth_interval) {
        float next = s->scale * s->growth_factor;
        if (isfinite(next)) s->scale = next;
        s->good_steps = 0;
    }
}

double loom_grad_sumsq(loom_param *const *params, int n, int *found_inf) {
    double total = 0.0;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        const loom_param *p = params[i];
        if (!p->trainable) continue;
        size_t k = (size_t)loom_param_numel(p);
        double s = sumsq(p->grad, k, p->grad_dtype);
        /* Squares of finite floats summed in fp64 cannot overflow, so the sum
         * is finite exactly when every element is. */
        if (!isfinite(s)) bad = 1;
        total += s;
    }
    if (found_inf) *found_inf = bad;
    return total;
}

void loom_amp_step_info(double sumsq, int found_inf, const loom_loss_scaler *scaler, float max_norm,
                        loom_step_info *info) {
    float inv_scale = 1.0f / scaler->scale;
    double norm = sqrt(sumsq) * inv_scale;
    /* A scale whose inverse overflows (0, or a denormal from a damaged
     * checkpoint) would make the multiplier Inf and every update NaN from
     * finite gradients: that step is as bad as one with a NaN gradient. */
    info->found_inf = found_inf || !isfinite(sumsq) || !isfinite(inv_scale) || !isfinite(norm);
    info->grad_norm = info->found_inf ? NAN : norm;
    info->clip_coef = 1.0f;
    if (!info->found_inf && max_norm > 0.0f && info->grad_norm > max_norm)
        info->clip_coef = (float)(max_norm / (info->grad_norm + 1e-6));
    info->grad_multiplier = inv_scale * info->clip_coef;
}

void loom_amp_prepare_step(loom_param *const *params, int n, const loom_loss_scaler *scaler, float max_norm,
                           loom_step_info *info) {
    int bad;
    double ss = loom_grad_sumsq(params, n, &bad);
    loom_amp_step_info(ss, bad, scaler, max_norm, info);
}
