/*
 * loom/amp.h — mixed precision: the precision policy, dynamic loss scaling
 * for fp16, found-inf, the global gradient norm and clipping.
 *
 * Unscaling is fused into the optimizer's read of the gradient: gradients
 * (main_grad) are never rewritten in place; loom_amp_prepare_step returns
 * the one multiplier (1/scale times the clipping coefficient) the optimizer
 * applies. With power-of-two scales this equals unscaling main_grad first.
 */
#ifndef LOOM_AMP_H
#define LOOM_AMP_H

#include "loom/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Compute dtype and whether gradients are fp32 main_grads. GEMM inputs and
 * stored activations use `compute`; norms, softmax, loss and reductions are
 * fp32 inside the kernels. */
typedef struct loom_precision {
    loom_dtype compute;
    int master_grad;
} loom_precision;

/* Dynamic loss scaling (fp16): initial 2^16, x2 after `growth_interval`
 * (2000) steps without overflow, x0.5 and skip the step on overflow. For
 * bf16/fp32 it is disabled and the scale stays 1. */
typedef struct loom_loss_scaler {
    int enabled;
    float scale;
    float growth_factor, backoff_factor;
    int growth_interval;
    int good_steps;      /* consecutive steps without overflow */
    long skipped_steps;
} loom_loss_scaler;

/* The scale never backs off below this. */
#define LOOM_LOSS_SCALE_MIN (1.0f / 65536.0f)

void loom_loss_scaler_init(loom_loss_scaler *s, int enabled);
/* After a step: found_inf halves the scale (and counts a skip), otherwise
 * count a good step and grow the scale every growth_interval good steps. */
void loom_loss_scaler_update(loom_loss_scaler *s, int found_inf);

typedef struct loom_step_info {
    int found_inf;        /* a gradient had NaN or Inf: skip the step */
    double grad_norm;     /* global L2 norm of the unscaled gradients */
    float clip_coef;      /* min(1, max_norm / (norm + 1e-6)) */
    float grad_multiplier;/* what the optimizer multiplies gradients by */
} loom_step_info;

/* Check gradients for NaN/Inf, compute the global norm in fp64, and the
 * multiplier for the optimizer. max_norm <= 0 disables clipping. Only
 * trainable parameters count. */
void loom_amp_prepare_step(loom_param *const *params, int n, const loom_loss_scaler *scaler, float max_norm,
                           loom_step_info *info);
/* Sum of squares of all trainable gradients (fp64), and whether any is
 * non-finite: the pieces data parallelism agrees on across ranks. */
double loom_grad_sumsq(loom_param *const *params, int n, int *found_inf);
/* The step's info from those pieces (summed over ranks): found_inf when a
 * gradient is non-finite, or when the unscaled norm or the multiplier would
 * be (a loss scale whose inverse overflows). */
void loom_amp_step_info(double sumsq, int found_inf, const loom_loss_scaler *scaler, float max_norm,
                        loom_step_info *info);

#ifdef __cplusplus
}
#endif
#endif
