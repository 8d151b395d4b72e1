/*
 * train_ckpt.c — `loom train`'s checkpoints: what a run saves (weights,
 * AdamW moments, step, RNG, data position, loss scaler, the shape of the
 * run) and how it resumes from them, saying what changed since.
 *
 * Must never: write a checkpoint of weights that are not finite, or one over
 * a checkpoint this run did not write.
 */
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The file name of training shard i (NULL past the last). */
static const char *shard_name(const loom_dataloader *dl, uint64_t i) {
    const char *path = loom_dataloader_shard_path(dl, (size_t)i), *slash = path ? strrchr(path, '/') : NULL;
    return slash ? slash + 1 : path;
}

/* The settings that shape the updates, as flags with their values (%.9g:
 * a float prints back to itself). */
static void optimizer_settings(const train_opts *o, char *buf, size_t n) {
    snprintf(buf, n, "--steps %d --lr %.9g --min-lr %.9g --warmup %d --schedule %s --decay-frac %.9g "
             "--weight-decay %.9g --clip %.9g", o->steps, (double)o->lr, (double)o->min_lr, o->warmup, o->schedule,
             o->decay_frac, (double)o->weight_decay, (double)o->clip);
}

/* A setting's value for people: a number as %g (0.002, not 0.00200000009). */
static const char *shown(const char *v, char *buf, size_t n) {
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end) return v;
    snprintf(buf, n, "%g", x);
    return buf;
}

/* Say which of those settings differ from the checkpoint's run: the
 * learning rate and the updates follow this run's. */
static void note_changed_optimizer(const trainer *t) {
    const char *then = t->state.optimizer;
    if (!t->leader || !then[0]) return; /* not recorded */
    char now[sizeof t->state.optimizer], diff[1024] = "";
    optimizer_settings(&t->o, now, sizeof now);
    /* Both are "--flag value" pairs in the same order. */
    const char *a = then, *b = now;
    size_t used = 0;
    for (;;) {
        char fa[64], va[64], fb[64], vb[64];
        int na = 0, nb = 0;
        if (sscanf(a, "%63s %63s%n", fa, va, &na) != 2 || sscanf(b, "%63s %63s%n", fb, vb, &nb) != 2) break;
        if (strcmp(fa, fb)) break; /* another trainer's spelling: compare no further */
        if (strcmp(va, vb) && used < sizeof diff) {
            char sa[64], sb[64];
            used += (size_t)snprintf(diff + used, sizeof diff - used, "%s%s %s -> %s", used ? ", " : "", fa,
                                     shown(va, sa, sizeof sa), shown(vb, sb, sizeof sb));
        }
        a += na;
        b += nb;
    }
    if (diff[0])
        fprintf(stderr, "train: note: the checkpoint's run used other settings (%s): the learning rate and the "
                "updates follow this run's from here\n", diff);
}

static void capture_state(trainer *t) {
    optimizer_settings(&t->o, t->state.optimizer, sizeof t->state.optimizer);
    loom_rng *rng = loom_rng_default();
    t->state.rng_seed = rng->seed;
    t->state.rng_offset = rng->offset;
    loom_dataloader_get_position(t->train, &t->state.data);
    t->state.loss_scale = t->scaler.scale;
    t->state.scaler_good_steps = t->scaler.good_steps;
    t->state.scaler_skipped = t->scaler.skipped_steps;
    t->state.loss_scaling = t->scaler.enabled;
    t->state.batch = t->o.batch;
    t->state.seq = t->o.seq;
    t->state.grad_accum = t->o.grad_accum;
    t->state.dp_size = t->dist.dp_size;
    t->state.data_shards = (int)loom_dataloader_num_shards(t->train);
    const char *shard = shard_name(t->train, t->state.data.shard);
    snprintf(t->state.data_shard_name, sizeof t->state.data_shard_name, "%s", shard ? shard : "");
}

/* A checkpoint's data position is an index into the sorted shards: say so
 * when the shards are not those it was taken on (more, fewer, renamed). */
static void note_changed_shards(const trainer *t) {
    const loom_train_state *c = &t->state;
    if (!t->leader || c->data_shards <= 0) return; /* not recorded */
    int now = (int)loom_dataloader_num_shards(t->train);
    const char *shard = shard_name(t->train, c->data.shard);
    if (now == c->data_shards && shard && !strcmp(shard, c->data_shard_name)) return;
    fprintf(stderr, "train: note: the training shards changed since the checkpoint (%d then, %d now; it was reading "
            "%s, shard %llu now is %s): training continues at that index and offset, not where the first run "
            "would have read\n", c->data_shards, now, c->data_shard_name[0] ? c->data_shard_name : "?",
            (unsigned long long)c->data.shard, shard ? shard : "past the last");
}

/* Weights that are NaN or Inf are never saved: a checkpoint of a diverged
 * run would prune the good ones it follows. Every rank checks its part. */
static loom_status check_masters_finite(trainer *t, const char *dir) {
    int bad = 0; /* 1 + the index of the first weight that is not finite */
    for (int i = train_first_trainable(t->m); i < t->m->n_params && !bad; i++) { /* frozen ones never change */
        loom_param *p = t->m->params[i];
        const float *v = loom_param_master(p);
        size_t n = (size_t)loom_param_numel(p);
        for (size_t k = 0; k < n; k++)
            if (!isfinite(v[k])) { bad = i + 1; break; }
    }
    LOOM_TRY(loom_comm_allreduce_max_int(t->world, &bad, 1));
    if (bad)
        return loom_error(LOOM_ERR_NUMERIC, "step %d: weight %s holds NaN or Inf: training diverged, so checkpoint %s "
                          "is not written and the earlier ones are kept; resume from one of them with a lower --lr",
                          t->state.step, t->m->params[bad - 1]->name, dir);
    return LOOM_OK;
}

/* Every rank takes part (moments are gathered over DP with ZeRO, tensors
 * over TP); the ranks of data-parallel group 0 write, TP rank 0 of it. */
loom_status train_save_checkpoint(trainer *t) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/ckpt-%08d", t->o.out, t->state.step);
    if (t->state.step == t->last_saved) return LOOM_OK; /* saved (or resumed from) already */
    struct stat sb;
    int exists = t->leader && stat(dir, &sb) == 0;
    LOOM_TRY(loom_comm_allreduce_max_int(t->world, &exists, 1));
    if (exists)
        return loom_error(LOOM_ERR_STATE, "checkpoint %s exists but this run did not write it; use a new --out or "
                          "remove that checkpoint", dir);
    capture_state(t);
    loom_llama *m = t->m;
    loom_status st = loom_dist_optim_unshard_masters(t->opt); /* ZeRO-1: whole masters for the file */
    if (st == LOOM_OK) st = check_masters_finite(t, dir);
    /* The optimizer's own moments (frozen weights have none), read where
     * they lie (a large model has no room for a copy), or, sharded by ZeRO,
     * gathered tensor by tensor as the file is written: the ranks of
     * data-parallel group 0 write, the others take part in the gathers. */
    loom_moments_io io = loom_dist_optim_moments_io(t->opt, train_first_trainable(m));
    if (st == LOOM_OK)
        st = t->dist.dp_rank == 0 ? loom_checkpoint_save_io(dir, m, &io, loom_dist_optim_steps(t->opt), &t->state,
                                                             t->has_tokenizer ? t->tokenizer_path : NULL)
                                  : loom_dist_optim_serve_moments(t->opt);
    if (st == LOOM_OK) st = loom_dist_optim_reshard_masters(t->opt);
    LOOM_TRY(st);
    t->last_saved = t->state.step;
    if (t->leader) {
        LOOM_TRY(loom_checkpoint_prune(t->o.out, t->o.keep));
        fprintf(stderr, "train: checkpoint %s\n", dir);
    }
    return loom_comm_barrier(t->world);
}

loom_status train_restore(trainer *t, const char *dir) {
    loom_llama *m = t->m;
    /* Straight into the optimizer's own moments, or, with ZeRO, each
     * rank's part of them, one tensor at a time. */
    loom_moments_io io = loom_dist_optim_moments_io(t->opt, train_first_trainable(m));
    int adam_steps = 0;
    loom_status st = loom_dist_optim_unshard_masters(t->opt);
    if (st == LOOM_OK) st = loom_checkpoint_load_io(dir, m, &io, &adam_steps, &t->state);
    if (st == LOOM_OK) st = loom_dist_optim_reshard_masters(t->opt);
    loom_dist_optim_set_steps(t->opt, adam_steps);
    LOOM_TRY(st);
    loom_rng *rng = loom_rng_default();
    rng->seed = t->state.rng_seed;
    rng->offset = t->state.rng_offset;
    note_changed_shards(t);
    note_changed_optimizer(t);
    LOOM_TRY(loom_dataloader_set_position(t->train, &t->state.data));
    if (t->state.loss_scaling < 0 || t->state.loss_scaling == t->scaler.enabled) {
        t->scaler.scale = t->state.loss_scale;
        t->scaler.good_steps = t->state.scaler_good_steps;
        t->scaler.skipped_steps = t->state.scaler_skipped;
    } else if (t->leader) {
        fprintf(stderr, "train: the checkpoint was trained %s fp16 loss scaling; the loss scaler starts afresh\n",
                t->state.loss_scaling ? "with" : "without");
    }
    t->last_saved = t->state.step;
    const loom_train_state *c = &t->state;
    if (t->leader && c->batch > 0 &&
        (c->batch != t->o.batch || c->seq != t->o.seq || c->grad_accum != t->o.grad_accum || c->dp_size != t->dist.dp_size))
        fprintf(stderr, "train: note: the checkpoint's run used --batch %d --seq %d --grad-accum %d on %d data-parallel "
                "rank(s), this one --batch %d --seq %d --grad-accum %d on %d: it continues, but not as the first run "
                "would have\n", c->batch, c->seq, c->grad_accum, c->dp_size, t->o.batch, t->o.seq, t->o.grad_accum,
                t->dist.dp_size);
    if (t->leader) fprintf(stderr, "train: resumed from %s at step %d\n", dir, t->state.step);
    return LOOM_OK;
}
