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
#include "loom/amp.h"
#include "loom/dist.h"

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
 * in the same order, for every step); a frozen parameter gets none and is
 * never stepped. Free with loom_adamw_free. */
loom_status loom_adamw_new(const loom_adamw_config *cfg, loom_param *const *params, int n, loom_adamw **out);
void loom_adamw_free(loom_adamw *opt);
/* One step with learning rate lr; gradients are multiplied by
 * grad_multiplier first. Increments the step count. */
loom_status loom_adamw_step(loom_adamw *opt, float lr, float grad_multiplier);
int loom_adamw_steps(const loom_adamw *opt);
/* Moments of parameter i (borrowed; numel floats each; NULL for a frozen
 * one), for checkpoints. */
float *loom_adamw_m(loom_adamw *opt, int i);
float *loom_adamw_v(loom_adamw *opt, int i);
void loom_adamw_set_steps(loom_adamw *opt, int steps);

/* ------------------------------------------- data parallel and ZeRO-1 */

/* The optimizer of a (possibly) distributed job:
 *  - one process: AdamW as above;
 *  - data parallel: every fp32 main_grad moves into one flat buffer (the
 *    optimizer owns it; gradients in bf16/f16 are converted into it), which
 *    is all-reduced (sum, fp32) in place in buckets of about bucket_floats
 *    (0: 1M floats, 4 MiB), last parameters first. With loom_dist_optim_watch_backward a bucket starts
 *    as soon as backward has completed its gradients, overlapping the
 *    communication with the rest of backward; every rank takes the same step;
 *  - zero = 1 (ZeRO-1): the fp32 masters and both AdamW moments are sharded
 *    across the DP ranks: buckets are reduce-scattered, each rank updates its
 *    shard, and the updated masters are all-gathered into every compute copy.
 *    Between steps a rank holds 1/dp_size of the masters (when the compute
 *    dtype is f32 the compute copy is the master and stays whole).
 * With tensor parallelism the global gradient norm sums split parameters
 * over the TP group and counts replicated ones once. The loss scale must
 * already fold in 1/(dp_size) so that summed gradients are averages. */
typedef struct loom_dist_optim loom_dist_optim;

/* params: the trainable parameters only (a frozen one is refused,
 * LOOM_ERR_INVALID: a LoRA model passes its adapters). */
loom_status loom_dist_optim_new(const loom_adamw_config *cfg, loom_param *const *params, int n, const loom_dist *dist,
                                int zero, size_t bucket_floats, loom_dist_optim **out);
void loom_dist_optim_free(loom_dist_optim *o);
/* After the last backward of a step: make gradients global, check for
 * NaN/Inf and compute the norm and multiplier (as loom_amp_prepare_step). */
loom_status loom_dist_optim_prepare(loom_dist_optim *o, const loom_loss_scaler *scaler, float max_norm,
                                    loom_step_info *info);
/* Call before the backward of a step's last micro-batch: gradient buckets
 * start during that backward (see loom_set_backward_hook); prepare finishes
 * them. A parameter used again after its uses seemed complete makes
 * prepare fail with a message (then do not watch). */
void loom_dist_optim_watch_backward(loom_dist_optim *o);
/* Update: with ZeRO-1 the flat gradient buffer is reused for the gather and
 * the gradients are zero afterwards. */
loom_status loom_dist_optim_step(loom_dist_optim *o, float lr, float grad_multiplier);
/* ZeRO-1: give every parameter its whole fp32 master again (collective over
 * the DP group; between steps, e.g. to save or load a checkpoint), and
 * take them back (keep this rank's shard). The whole masters live in the
 * gradient buffer, lent to the parameters (no new memory). Until they are
 * taken back no backward may run (a gradient written asserts, whatever its
 * dtype), watch_backward starts nothing and prepare refuses
 * (LOOM_ERR_STATE); fp32 gradients, which live in that buffer, read as
 * zero and zero_grad leaves them be. Taking the masters back zeroes the
 * buffer; freeing the optimizer gives the parameters their own copies.
 * No-ops without sharded masters. */
loom_status loom_dist_optim_unshard_masters(loom_dist_optim *o);
loom_status loom_dist_optim_reshard_masters(loom_dist_optim *o);
int loom_dist_optim_steps(const loom_dist_optim *o);
/* Gradient buckets (0 in a single process); *early: how many of them the
 * last step started during backward. */
int loom_dist_optim_buckets(const loom_dist_optim *o, int *early);
void loom_dist_optim_set_steps(loom_dist_optim *o, int steps);
/* A checkpoint's access to the AdamW moments, one parameter and one moment
 * at a time (kind 0: m, 1: v; i indexes the model's parameters; values are
 * this rank's tensor-parallel shard, numel floats), so that saving or
 * restoring never holds a second copy of the optimizer state. */
typedef struct loom_moments_io {
    /* The moment itself (read it to save, write it to restore), or NULL
     * when this rank does not hold it whole (ZeRO): then get and set. */
    float *(*view)(void *user, int i, int kind);
    /* Copy it into out. With ZeRO a collective over the data-parallel
     * group (a gather to DP rank 0): every DP rank calls it for the same i
     * and kind in the same order, and out is written on DP rank 0 only
     * (the others may pass NULL). */
    loom_status (*get)(void *user, int i, int kind, float *out);
    /* Take it from in (each rank keeps what it holds; no communication). */
    void (*set)(void *user, int i, int kind, const float *in);
    void *user;
} loom_moments_io;

/* The optimizer's moments as a loom_moments_io over the model's
 * parameters, the optimizer's parameter j being the model's first + j
 * (first: how many frozen parameters precede the trainable ones; they have
 * no moments). Borrows o. */
loom_moments_io loom_dist_optim_moments_io(loom_dist_optim *o, int first);
/* What a checkpoint save asks of the ranks that do not write (DP rank
 * other than 0): with ZeRO, take part in the gathers of every moment, in
 * the order a checkpoint reads them (parameter by parameter, m then v);
 * without ZeRO nothing. */
loom_status loom_dist_optim_serve_moments(loom_dist_optim *o);

/* Linear warmup over `warmup` steps to max_lr, then cosine decay to min_lr
 * at `total` steps. step counts from 0. */
float loom_lr_cosine(int step, int warmup, int total, float max_lr, float min_lr);

/* Learning-rate schedules. Each warms up linearly, max_lr * (step + 1) /
 * warmup for step < warmup, then, with p the share of the decay done:
 *  - COSINE: min + (max - min) (1 + cos(pi p)) / 2, p over warmup .. total;
 *  - LINEAR: max + (min - max) p, p over warmup .. total;
 *  - CONSTANT: max (min_lr is not used);
 *  - WSD (warmup, stable, decay): max until the last decay_frac of the
 *    steps, D = round(decay_frac * total) of them, at least 1, from
 *    start = max(total - D, warmup), then linear to min, reaching it at the
 *    last step: p = (step - start + 1) / (total - start).
 * For COSINE and LINEAR p = (step - start) / (total - start), start the end
 * of warmup; from step `total` on, min_lr (max_lr for CONSTANT). decay_frac
 * is in (0, 1] (used by WSD only). */
typedef enum loom_lr_schedule { LOOM_LR_COSINE, LOOM_LR_LINEAR, LOOM_LR_CONSTANT, LOOM_LR_WSD } loom_lr_schedule;
/* "cosine", "linear", "constant", "wsd" -> schedule; LOOM_ERR_INVALID
 * naming them. */
loom_status loom_lr_schedule_parse(const char *name, loom_lr_schedule *out);
const char *loom_lr_schedule_name(loom_lr_schedule s);
float loom_lr_at(loom_lr_schedule s, int step, int warmup, int total, float max_lr, float min_lr, double decay_frac);

#ifdef __cplusplus
}
#endif
#endif
