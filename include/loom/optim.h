/*
 * loom/optim.h — AdamW on fp32 master weights and learning-rate schedules.
 *
 * The optimizer reads each parameter's gradient (fp32 main_grad, or the
 * compute-dtype gradient converted on the fly) times a multiplier (unscale
 * and clipping), updates the fp32 master and the fp32 moments, and refreshes
 * the compute copy. Norms and biases (no_weight_decay) get no decay.
 */
#ifndef LOOM_OPTIM_H
#define LOOM_OPTIM_H

#include "loom/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct loom_adamw_config {
    float beta1, beta2, eps, weight_decay;
} loom_adamw_config;

typedef struct loom_adamw loom_adamw;

/* Defaults: beta1 0.9, beta2 0.95, eps 1e-8, weight decay 0.1. */
loom_adamw_config loom_adamw_defaults(void);
/* Moments for each of the n parameters (the array must stay the same,
 * in the same order, for every step). Free with loom_adamw_free. */
loom_status loom_adamw_new(const loom_adamw_config *cfg, loom_param *const *params, int n, loom_adamw **out);
void loom_adamw_free(loom_adamw *opt);
/* One step with learning rate lr; gradients are multiplied by
 * grad_multiplier first. Increments the step count. */
loom_status loom_adamw_step(loom_adamw *opt, float lr, float grad_multiplier);
int loom_adamw_steps(const loom_adamw *opt);
/* Moments of parameter i (borrowed; numel floats each), for checkpoints. */
float *loom_adamw_m(loom_adamw *opt, int i);
float *loom_adamw_v(loom_adamw *opt, int i);
void loom_adamw_set_steps(loom_adamw *opt, int steps);

/* Linear warmup over `warmup` steps to max_lr, then cosine decay to min_lr
 * at `total` steps. step counts from 0. */
float loom_lr_cosine(int step, int warmup, int total, float max_lr, float min_lr);

#ifdef __cplusplus
}
#endif
#endif
