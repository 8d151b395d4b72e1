/*
 * train.h — private to `loom train` (cmd_train.c and train_ckpt.c): its
 * options and the state of one training run, and the checkpoints it writes
 * and resumes from.
 */
#ifndef LOOM_TRAIN_H
#define LOOM_TRAIN_H

#include "cli.h"
#include "train_report.h"

#include <stdio.h>

typedef struct train_opts {
    const char *data, *out, *preset, *config, *init, *resume, *dump_grads, *dump_logits, *tokenizer, *lora_init;
    const char *precision, *master_grad, *recompute, *recompute_mode;
    int batch, seq, grad_accum, steps, warmup, seed, threads, eval_every, eval_batches, ckpt_every, keep;
    int log_every, check_grads, tie, tp, zero, overlap, bucket_size, recompute_blocks;
    const char *overlap_flag;
    float lr, min_lr, weight_decay, clip;
    const char *schedule; /* learning rate after warmup: cosine, linear, constant, wsd */
    double decay_frac;    /* wsd: the share of the steps that decays */
    loom_lr_schedule sched;
    float recompute_budget; /* MiB of activations a step may use; 0: no plan */
    int lora;               /* LoRA rank; 0: train every weight */
    float lora_alpha;       /* the rank (a scale of 1) when not given */
    const char *lora_targets;
    unsigned lora_target_set;
    int lora_targets_given; /* lora_target_set came from --lora-init's adapter */
    float lora_dropout;     /* on the adapters' inputs while training; 0: none */
    int lora_rslora;        /* alpha / sqrt(rank) (PEFT's use_rslora) */
    int lora_dora;          /* DoRA's magnitudes (PEFT's use_dora) */
} train_opts;

typedef struct trainer {
    train_opts o;
    loom_llama *m;
    loom_dist_optim *opt;
    loom_comm *world;
    loom_dist dist;
    int leader;   /* world rank 0: prints, writes metrics and plots */
    loom_dataloader *train, *val;
    loom_loss_scaler scaler;
    loom_train_state state;
    int32_t *inputs, *targets;
    char tokenizer_path[4096];
    int has_tokenizer;
    FILE *metrics;
    train_report report;
    double first_loss;  /* loss of the first micro-batch, for --dump-logits */
    int masked;         /* the training shards have loss masks: steps weigh micro-batches by their targets */
    double *weights;    /* (grad_accum) with masks: each micro-batch's share of the step's targets */
    int last_saved;     /* step of the checkpoint this run last wrote or resumed from, -1 */
    int interrupted;    /* the signal that stopped training early (checkpoint saved), or 0 */
    int usage;          /* the failure is a flag the model cannot take (exit 2, not 1) */
} trainer;

/* The optimizer's parameters are m->params[first ..): all of them, or a
 * LoRA model's adapters (its own weights are frozen). */
static inline int train_first_trainable(const loom_llama *m) { return m->lora.rank ? m->n_base : 0; }

/* Write checkpoint <out>/ckpt-<step> (every rank takes part; the ranks of
 * data-parallel group 0 write), then prune to --keep. Nothing when this step
 * was saved or resumed from already. Errors: the checkpoint exists but this
 * run did not write it (LOOM_ERR_STATE), weights that are not finite
 * (LOOM_ERR_NUMERIC: nothing written, the earlier checkpoints kept), I/O. */
loom_status train_save_checkpoint(trainer *t);
/* Resume from checkpoint dir: weights, moments, step, RNG, data position,
 * loss scaler; notes on stderr what differs from the run that wrote it.
 * Weights and (without ZeRO) moments are read in place: after an error the
 * model and optimizer are partly overwritten, and the run must stop. */
loom_status train_restore(trainer *t, const char *dir);

#endif
