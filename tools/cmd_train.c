/*
 * cmd_train.c — `loom train`: the training loop. Data from llm.c shards,
 * AdamW on fp32 masters with warmup and a decay schedule, clipping, dynamic loss scaling
 * for fp16, recompute per block, validation, exact-resume checkpoints on a
 * schedule and on SIGINT/SIGTERM/SIGUSR1/SIGUSR2, metrics as JSON lines, an
 * SVG loss plot.
 */
#include "train.h"
#include "train_agree.h"
#include "train_stop.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ----------------------------------------------------------------- setup */

static int parse_settings(trainer *t, loom_precision *prec, loom_recompute_mode *mode) {
    const train_opts *o = &t->o;
    if (loom_dtype_parse(o->precision, &prec->compute) != LOOM_OK)
        return cli_usage_error("train", "--precision: %s", loom_last_error());
    if (cli_parse_on_off("train", "master-grad", o->master_grad, &prec->master_grad)) return 2;
    int reentrant;
    if (!strcmp(o->recompute_mode, "reentrant")) reentrant = 1;
    else if (!strcmp(o->recompute_mode, "nonreentrant") || !strcmp(o->recompute_mode, "non-reentrant")) reentrant = 0;
    else return cli_usage_error("train", "--recompute-mode expects reentrant or nonreentrant, got '%s'", o->recompute_mode);
    if (!strcmp(o->recompute, "none")) *mode = LOOM_RECOMPUTE_NONE;
    else if (!strcmp(o->recompute, "full")) *mode = reentrant ? LOOM_RECOMPUTE_REENTRANT : LOOM_RECOMPUTE_NONREENTRANT;
    else if (!strcmp(o->recompute, "selective")) *mode = LOOM_RECOMPUTE_SELECTIVE;
    else return cli_usage_error("train", "--recompute expects none, selective or full, got '%s'", o->recompute);
    if (o->recompute_blocks < 0)
        return cli_usage_error("train", "--recompute-blocks must be >= 0 (0: every block), got %d", o->recompute_blocks);
    if (!(o->recompute_budget >= 0.0f))
        return cli_usage_error("train", "--recompute-budget must be >= 0 MiB (0: no plan)");
    if (o->recompute_budget > 0.0f && o->recompute_blocks > 0)
        return cli_usage_error("train", "--recompute-budget picks the number of blocks itself: drop --recompute-blocks");
    if (o->recompute_budget > 0.0f && *mode == LOOM_RECOMPUTE_NONE)
        *mode = reentrant ? LOOM_RECOMPUTE_REENTRANT : LOOM_RECOMPUTE_NONREENTRANT; /* the plan recomputes in full */
    if (o->recompute_blocks > 0 && *mode == LOOM_RECOMPUTE_NONE)
        return cli_usage_error("train", "--recompute-blocks %d chooses which blocks recompute: give --recompute "
                               "selective or full too", o->recompute_blocks);
    if (o->batch <= 0 || o->grad_accum <= 0 || o->steps <= 0 || o->seq < 0)
        return cli_usage_error("train", "--batch, --grad-accum and --steps must be positive, --seq >= 0 (0: the "
                               "default)");
    if (!(o->lr > 0.0f) || o->min_lr < 0.0f || o->warmup < 0 || o->clip < 0.0f || o->weight_decay < 0.0f)
        return cli_usage_error("train", "--lr must be positive; --min-lr, --warmup, --clip, --weight-decay >= 0");
    if (o->min_lr > o->lr)
        return cli_usage_error("train", "--min-lr %g is above --lr %g: the schedule decays from --lr to --min-lr",
                               (double)o->min_lr, (double)o->lr);
    if (!(o->decay_frac > 0.0 && o->decay_frac <= 1.0))
        return cli_usage_error("train", "--decay-frac must be in (0, 1], got %g", o->decay_frac);
    if (o->dump_logits && o->resume)
        return cli_usage_error("train", "--dump-logits writes the logits of a run's first step, which a resumed run "
                               "does not take: drop --resume (or --dump-logits)");
    if (o->keep <= 0 || o->eval_every < 0 || o->ckpt_every < 0 || o->eval_batches <= 0 || o->log_every <= 0)
        return cli_usage_error("train", "--keep, --eval-batches, --log-every must be positive; --eval-every, --ckpt-every >= 0");
    return 0;
}

/* ------------------------------------------------------ ranks agreeing */

/* The flags every rank must share, one per line: ranks started with
 * different ones train different runs (or hang, or crash, in collectives
 * they no longer call alike). Paths (--data, --out, --init, --config) may
 * differ between machines and are not compared; whether a rank resumes is. */
static void settings_record(const train_opts *o, const char *resume_dir, char *buf, size_t n) {
    snprintf(buf, n,
             "--batch %d\n--seq %d\n--grad-accum %d\n--steps %d\n--lr %a\n--min-lr %a\n--warmup %d\n"
             "--schedule %s\n--decay-frac %a\n"
             "--weight-decay %a\n--clip %a\n--precision %s\n--master-grad %s\n--recompute %s\n"
             "--recompute-mode %s\n--recompute-blocks %d\n--recompute-budget %a\n--seed %d\n--eval-every %d\n"
             "--eval-batches %d\n--ckpt-every %d\n--keep %d\n"
             "--tp %d\n--zero %d\n--overlap %d\n--bucket-size %d\n--preset %s\n--tie-embeddings %d\n"
             "--check-grads %d\n--dump-grads %s\n--dump-logits %s\n--resume %s\n"
             "--lora %d\n--lora-alpha %a\n--lora-targets %u\n--lora-dropout %a\n--lora-rslora %d\n--lora-dora %d\n",
             o->batch, o->seq, o->grad_accum, o->steps, (double)o->lr, (double)o->min_lr, o->warmup, o->schedule,
             o->decay_frac,
             (double)o->weight_decay, (double)o->clip, o->precision, o->master_grad, o->recompute, o->recompute_mode,
             o->recompute_blocks, (double)o->recompute_budget, o->seed, o->eval_every, o->eval_batches, o->ckpt_every,
             o->keep, o->tp, o->zero, o->overlap,
             o->bucket_size, o->preset, o->tie, o->check_grads, o->dump_grads ? "given" : "no",
             o->dump_logits ? "given" : "no", *resume_dir ? "given" : "no", o->lora, (double)o->lora_alpha,
             o->lora_target_set, (double)o->lora_dropout, o->lora_rslora, o->lora_dora);
}

static loom_status agree_on_settings(trainer *t, const char *resume_dir) {
    char mine[TRAIN_AGREE_RECORD];
    settings_record(&t->o, resume_dir, mine, sizeof mine);
    return train_agree_settings(t->world, mine);
}

/* A checkpoint directory has state.safetensors; otherwise look inside. */
static loom_status resolve_resume(const char *path, char *out, size_t n) {
    char probe[4200];
    struct stat sb;
    snprintf(probe, sizeof probe, "%s/state.safetensors", path);
    if (stat(probe, &sb) == 0) { snprintf(out, n, "%s", path); return LOOM_OK; }
    return loom_checkpoint_latest(path, out, n);
}

static loom_status build_model(trainer *t, loom_precision prec, loom_recompute_mode mode, const char *resume_dir) {
    const train_opts *o = &t->o;
    loom_llama_config cfg;
    char path[4200];
    if (resume_dir) {
        /* The model is the checkpoint's; a --config given too must agree. */
        snprintf(path, sizeof path, "%s/config.json", resume_dir);
        LOOM_TRY(loom_llama_config_load(path, &cfg));
        loom_llama_config want;
        if (o->config) {
            LOOM_TRY(loom_llama_config_load(o->config, &want));
            if (!loom_llama_config_same_model(&want, &cfg))
                return loom_error(LOOM_ERR_INVALID, "--config %s describes another model than the checkpoint %s; "
                                  "drop --config when resuming", o->config, resume_dir);
        }
        if (o->init && t->leader)
            fprintf(stderr, "train: --init is ignored when resuming: the weights come from the checkpoint\n");
    } else if (o->init) {
        LOOM_TRY(loom_model_dir_check(o->init));
        snprintf(path, sizeof path, "%s/config.json", o->init);
        LOOM_TRY(loom_llama_config_load(path, &cfg));
    } else if (o->config) {
        LOOM_TRY(loom_llama_config_load(o->config, &cfg));
    } else {
        LOOM_TRY(loom_llama_preset(o->preset, &cfg));
        cfg.tie_embeddings = o->tie;
    }
    LOOM_TRY(train_agree_model(t->world, &cfg)); /* before any collective the model's shapes size */
    if (t->o.seq == 0) t->o.seq = cfg.max_seq < 256 ? cfg.max_seq : 256;
    if (t->o.seq > cfg.max_seq) {
        t->usage = 1;
        return loom_error(LOOM_ERR_INVALID, "--seq %d is longer than the model's context (%d)", t->o.seq, cfg.max_seq);
    }
    if (o->recompute_blocks > cfg.n_layers) {
        t->usage = 1;
        return loom_error(LOOM_ERR_INVALID, "--recompute-blocks %d is more than the model's %d blocks",
                          o->recompute_blocks, cfg.n_layers);
    }
    if (o->lora) { /* the model's own weights frozen from the start: never a gradient or bf16 master */
        loom_lora_config lc = {.rank = o->lora, .alpha = o->lora_alpha, .targets = o->lora_target_set,
                               .dropout = o->lora_dropout, .rslora = o->lora_rslora, .dora = o->lora_dora};
        LOOM_TRY(loom_llama_config_validate(&cfg)); /* so that what is refused below is the LoRA flags */
        loom_status st = loom_llama_new_lora_tp(&cfg, prec, &lc, (uint64_t)o->seed, t->dist.tp, &t->m);
        if (st != LOOM_OK) {
            t->usage = st == LOOM_ERR_INVALID;
            return st;
        }
    } else {
        LOOM_TRY(loom_llama_new_tp(&cfg, prec, t->dist.tp, &t->m));
    }
    LOOM_TRY(loom_llama_set_data_parallel(t->m, t->dist.dp_rank, t->dist.dp_size)); /* its rows of dropout's masks */
    t->m->recompute.mode = mode;
    t->m->recompute.blocks = o->recompute_blocks;
    loom_llama_init_weights(t->m, (uint64_t)o->seed);
    if (o->init && !resume_dir) LOOM_TRY(loom_model_dir_load_weights(t->m, o->init));
    /* --init's directory, absolute, for the adapter's base_model_name_or_path (the checkpoints keep it: a resumed
     * run has it from them); none when it does not fit */
    char base[PATH_MAX];
    if (o->init && !resume_dir && realpath(o->init, base) && strlen(base) < sizeof t->state.init_dir)
        snprintf(t->state.init_dir, sizeof t->state.init_dir, "%s", base);
    /* Where the base stops generating, carried by checkpoints and the final
     * model: the checkpoint's when resuming, else (or when the checkpoint,
     * written before loom carried it, has none) --init's. */
    if (resume_dir) LOOM_TRY(loom_model_dir_load_generation_config(t->m, resume_dir));
    if (o->init && !t->m->generation_config) LOOM_TRY(loom_model_dir_load_generation_config(t->m, o->init));
    if (o->lora_init && !resume_dir) LOOM_TRY(loom_lora_load_peft(t->m, o->lora_init)); /* its A and B */
    if (o->lora_init && resume_dir && t->leader)
        fprintf(stderr, "train: --lora-init is ignored when resuming: the adapters come from the checkpoint\n");
    if (o->recompute_budget > 0.0f) { /* before the optimizer: its hooks must not see the probes */
        loom_recompute_plan plan;
        double bytes = (double)o->recompute_budget * 1048576.0;
        LOOM_TRY(loom_llama_plan_recompute(t->m, mode, o->batch, o->seq,
                                           bytes >= (double)SIZE_MAX ? SIZE_MAX : (size_t)bytes, &plan));
        /* Every rank recomputes the same blocks (a tensor-parallel replay
         * runs the block's collectives again): the largest count any needs. */
        LOOM_TRY(loom_comm_allreduce_max_int(t->world, &plan.blocks, 1));
        t->m->recompute.mode = plan.blocks ? plan.mode : LOOM_RECOMPUTE_NONE;
        t->m->recompute.blocks = plan.blocks;
        const double mib = 1048576.0;
        if (t->leader && plan.blocks == 0)
            fprintf(stderr, "train: --recompute-budget %g MiB: no block needs recomputing, activations %.2f MiB "
                    "(measured)\n", (double)o->recompute_budget, plan.peak_none / mib);
        else if (t->leader)
            fprintf(stderr, "train: --recompute-budget %g MiB: %s recompute of %d of %d blocks, activations %.2f MiB "
                    "(measured: %.2f with none, %.2f with every block)\n", (double)o->recompute_budget,
                    loom_recompute_mode_name(plan.mode), plan.blocks, plan.n_layers, plan.peak / mib,
                    plan.peak_none / mib, plan.peak_all / mib);
    }
    loom_adamw_config ac = loom_adamw_defaults();
    ac.weight_decay = o->weight_decay;
    int first = train_first_trainable(t->m);
    return loom_dist_optim_new(&ac, t->m->params + first, t->m->n_params - first, &t->dist, o->zero,
                               (size_t)o->bucket_size, &t->opt);
}

static loom_status open_data(trainer *t) {
    const train_opts *o = &t->o;
    loom_dataloader_options dl = {o->batch, o->seq, t->dist.dp_rank, t->dist.dp_size, t->m->cfg.vocab_size, "train"};
    LOOM_TRY(loom_dataloader_open(o->data, &dl, &t->train));
    size_t masked = loom_dataloader_num_masked(t->train);
    t->masked = masked > 0; /* the same on every rank: the ranks agree on the data's fingerprint */
    if (masked && t->leader)
        fprintf(stderr, "train: loss masks on %zu of the %zu training shards: the loss is the mean over the targets "
                "they leave (not the prompts), over the step's micro-batches and ranks\n", masked,
                loom_dataloader_num_shards(t->train));
    struct stat sb;
    int is_dir = stat(o->data, &sb) == 0 && S_ISDIR(sb.st_mode);
    dl.split = "val";
    if (o->eval_every > 0 && !is_dir) {
        /* A file or a glob names training shards only: validating on them
         * would report the loss of data the model trains on. */
        if (t->leader) fprintf(stderr, "train: --data is not a directory, so it has no val_*.bin split; validation is off\n");
    } else if (o->eval_every > 0) {
        /* No val_*.bin, or too little of it for one step, is a note; val
         * shards that are there but damaged are an error, as damaged
         * training shards are. */
        loom_status vs = loom_dataloader_open(o->data, &dl, &t->val);
        if (vs == LOOM_ERR_INVALID) {
            if (t->leader) fprintf(stderr, "train: validation is off: %s\n", loom_last_error());
            t->val = NULL;
        } else {
            LOOM_TRY(vs);
        }
    }
    /* Every rank validates or none does: evaluate() is collective. */
    int has_val[2] = {t->val != NULL, t->val == NULL};
    LOOM_TRY(loom_comm_allreduce_max_int(t->world, has_val, 2));
    if (has_val[0] && has_val[1])
        return loom_error(LOOM_ERR_INVALID, "validation shards (val_*.bin in --data) are usable on some ranks only "
                          "(this rank: %s): give every rank the same data, or --eval-every 0",
                          t->val ? "yes" : "no");
    /* tokenizer.json beside the shards goes into checkpoints and the model
     * (a directory's shards are named "<dir>/<file>"). */
    const char *first = loom_dataloader_shard_path(t->train, 0), *slash = first ? strrchr(first, '/') : NULL;
    if (slash) snprintf(t->tokenizer_path, sizeof t->tokenizer_path, "%.*s/tokenizer.json", (int)(slash - first), first);
    else snprintf(t->tokenizer_path, sizeof t->tokenizer_path, "tokenizer.json");
    t->has_tokenizer = access(t->tokenizer_path, R_OK) == 0;
    if (!t->has_tokenizer && t->leader)
        fprintf(stderr, "train: no %s; the model will carry no tokenizer (loom generate needs one: copy it into "
                "the model directory)\n", t->tokenizer_path);
    if (t->has_tokenizer) { /* its ids must fit the model's embedding, before any step runs */
        loom_tokenizer *tok = NULL;
        LOOM_TRY(loom_tokenizer_load(t->tokenizer_path, &tok));
        int nv = loom_tokenizer_vocab_size(tok), mv = t->m->cfg.vocab_size;
        loom_tokenizer_free(tok);
        if (nv > mv)
            return loom_error(LOOM_ERR_INVALID, "%s has %d tokens but the model's vocabulary has %d: use a model "
                              "with vocab_size >= %d (--preset small, or --config), or tokenize with --vocab %d (loom's "
                              "tokenizers)",
                              t->tokenizer_path, nv, mv, nv, mv);
        if (nv < mv && t->leader)
            fprintf(stderr, "train: note: the tokenizer has %d tokens, the model's vocabulary %d; the other %d rows "
                    "of the embedding and lm_head are never used\n", nv, mv, mv - nv);
    }
    /* Masked data reads a step's micro-batches before its first forward. */
    size_t batches = t->masked ? (size_t)o->grad_accum : 1;
    t->inputs = malloc(batches * (size_t)o->batch * (size_t)o->seq * sizeof *t->inputs);
    t->targets = malloc(batches * (size_t)o->batch * (size_t)o->seq * sizeof *t->targets);
    t->weights = malloc((size_t)o->grad_accum * sizeof *t->weights);
    if (!t->inputs || !t->targets || !t->weights) return loom_error(LOOM_ERR_NOMEM, "train: out of memory for batches");
    return LOOM_OK;
}

/* ------------------------------------------------------------- the step */

typedef struct step_result {
    double loss;
    loom_step_info info;
    int skipped;
    float lr;
} step_result;

/* The first micro-batch's logits (B*T, V) as fp32 and its loss, for
 * cross-checks against other implementations. */
static loom_status dump_logits(trainer *t, loom_tensor *logits) {
    int64_t n = loom_tensor_numel(logits);
    float *buf = malloc((size_t)n * sizeof *buf + 1);
    if (!buf) return loom_error(LOOM_ERR_NOMEM, "dump-logits: out of memory");
    loom_tensor_read_f32(logits, buf);
    loom_safetensors_writer *w;
    loom_status st = loom_safetensors_writer_init(&w);
    char v[64];
    snprintf(v, sizeof v, "%.9g", t->first_loss);
    if (st == LOOM_OK) st = loom_safetensors_writer_add(w, "logits", LOOM_SAFETENSORS_F32, logits->shape, logits->ndim, buf);
    if (st == LOOM_OK) st = loom_safetensors_writer_set_metadata(w, "loss", v);
    if (st == LOOM_OK) st = loom_safetensors_writer_write(w, t->o.dump_logits);
    loom_safetensors_writer_free(w);
    free(buf);
    return st;
}

/* Masked data: read the step's micro-batches, and weigh each by its share
 * of the step's targets over every rank, n_k / N, so that the step's loss is
 * the mean over all its targets and a micro-batch without one adds nothing
 * (each micro-batch's loss is the mean over its own targets). *weights gets
 * n_k / N, *n_total N. */
static loom_status read_masked_step(trainer *t, double *weights, double *n_total) {
    const train_opts *o = &t->o;
    size_t bt = (size_t)o->batch * (size_t)o->seq;
    double n = 0.0;
    for (int k = 0; k < o->grad_accum; k++) {
        LOOM_TRY(loom_dataloader_next(t->train, t->inputs + k * bt, t->targets + k * bt));
        weights[k] = 0.0;
        for (size_t i = 0; i < bt; i++) weights[k] += t->targets[k * bt + i] >= 0;
        n += weights[k];
    }
    *n_total = n;
    LOOM_TRY(loom_comm_allreduce_sum_f64(t->dist.dp, n_total, 1));
    for (int k = 0; k < o->grad_accum; k++) weights[k] = *n_total > 0.0 ? weights[k] / *n_total : 0.0;
    return LOOM_OK;
}

static loom_status forward_backward(trainer *t, double *loss_sum, double *n_targets) {
    const train_opts *o = &t->o;
    size_t bt = (size_t)o->batch * (size_t)o->seq;
    /* Gradients are summed over micro-batches and data-parallel ranks. */
    float seed = t->scaler.scale / (float)(o->grad_accum * t->dist.dp_size);
    double *weights = t->weights;
    if (t->masked) LOOM_TRY(read_masked_step(t, weights, n_targets));
    for (int k = 0; k < o->grad_accum; k++) {
        int32_t *inputs = t->inputs, *targets = t->targets;
        if (t->masked) {
            inputs += k * bt;
            targets += k * bt;
            seed = (float)(t->scaler.scale * weights[k]);
        } else {
            LOOM_TRY(loom_dataloader_next(t->train, inputs, targets));
        }
        loom_tensor *loss = NULL, *logits = NULL;
        int dump = k == 0 && t->state.step == 0 && o->dump_logits && t->leader; /* one writer */
        LOOM_TRY(loom_llama_forward(t->m, inputs, targets, o->batch, o->seq, &loss, dump ? &logits : NULL));
        float l = loom_tensor_get(loss, 0);
        if (k == 0) t->first_loss = l;
        if (dump) {
            loom_status st = dump_logits(t, logits);
            loom_tensor_release(logits);
            if (st != LOOM_OK) { loom_tensor_release(loss); return st; }
        }
        /* The last backward starts gradient all-reduces as it goes. */
        if (k == o->grad_accum - 1 && o->overlap && !o->dump_grads) loom_dist_optim_watch_backward(t->opt);
        loom_status st = loom_backward(loss, seed);
        loom_tensor_release(loss);
        LOOM_TRY(st);
        /* Masked: this rank's part of the mean over every rank's targets. */
        *loss_sum += t->masked ? l * weights[k] * t->dist.dp_size : l / o->grad_accum;
    }
    t->state.tokens_seen += (uint64_t)o->grad_accum * (uint64_t)o->batch * (uint64_t)o->seq * (uint64_t)t->dist.dp_size;
    return LOOM_OK;
}

/* The first step's gradients, averaged over data-parallel ranks and
 * gathered over tensor-parallel ranks: comparable with one process. `loss`
 * is the step's, the mean over micro-batches and ranks, the loss whose
 * gradients these are. */
static loom_status dump_grads(trainer *t, double loss) {
    loom_safetensors_writer *w;
    LOOM_TRY(loom_safetensors_writer_init(&w));
    loom_llama *m = t->m;
    float **bufs = calloc((size_t)m->n_params, sizeof *bufs);
    loom_status st = bufs ? LOOM_OK : LOOM_ERR_NOMEM;
    for (int i = 0; i < m->n_params && st == LOOM_OK; i++) {
        loom_param *p = m->params[i];
        size_t n = (size_t)loom_param_numel(p);
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        float *local = malloc(n * sizeof(float) + 1);
        bufs[i] = malloc((size_t)(fs[0] * fs[1]) * sizeof(float) + 1);
        if (!local || !bufs[i]) { free(local); st = loom_error(LOOM_ERR_NOMEM, "dump-grads: out of memory"); break; }
        loom_param_read_grad(p, local);
        st = loom_comm_allreduce_sum_f32(t->dist.dp, local, n);
        if (st == LOOM_OK) st = loom_llama_tp_gather(m, i, local, bufs[i]);
        free(local);
        /* Unscale (a power of two: exact) so files compare across precisions. */
        for (size_t k = 0; st == LOOM_OK && k < (size_t)(fs[0] * fs[1]); k++) bufs[i][k] /= t->scaler.scale;
        if (st == LOOM_OK) st = loom_safetensors_writer_add(w, p->name, LOOM_SAFETENSORS_F32, fs, p->tensor->ndim, bufs[i]);
    }
    char v[64];
    snprintf(v, sizeof v, "%.9g", loss);
    if (st == LOOM_OK) st = loom_safetensors_writer_set_metadata(w, "loss", v);
    if (st == LOOM_OK && t->leader) st = loom_safetensors_writer_write(w, t->o.dump_grads);
    for (int i = 0; bufs && i < m->n_params; i++) free(bufs[i]);
    free(bufs);
    loom_safetensors_writer_free(w);
    return st;
}

static loom_status train_step(trainer *t, step_result *r) {
    const train_opts *o = &t->o;
    memset(r, 0, sizeof *r);
    loom_llama_zero_grad(t->m);
    double n_targets = 1.0;
    LOOM_TRY(forward_backward(t, &r->loss, &n_targets));
    if (t->dist.dp_size > 1) {
        LOOM_TRY(loom_comm_allreduce_sum_f64(t->dist.dp, &r->loss, 1));
        r->loss /= t->dist.dp_size;
    }
    if (o->check_grads) {
        char report[4096];
        loom_status st = loom_grad_audit(t->m->params, t->m->n_params, report, sizeof report);
        if (st != LOOM_OK) return st;
    }
    if (o->dump_grads) return LOOM_OK; /* the caller dumps and stops */
    LOOM_TRY(loom_dist_optim_prepare(t->opt, &t->scaler, o->clip, &r->info));
    r->lr = loom_lr_at(o->sched, t->state.step, o->warmup, o->steps, o->lr, o->min_lr, o->decay_frac);
    if (n_targets == 0.0) {
        /* Every target of the step masked (prompts only): nothing to learn,
         * so no update, not even weight decay; the step counts, skipped. */
        r->skipped = 1;
        r->loss = NAN;
        t->state.step++;
        return LOOM_OK;
    }
    if (r->info.found_inf) {
        r->skipped = 1;
        /* With loss scaling an overflow halves the scale and skips the
         * step; once the scale is at its floor that cannot help. */
        if (!t->scaler.enabled || t->scaler.scale <= LOOM_LOSS_SCALE_MIN)
            return loom_error(LOOM_ERR_NUMERIC, "step %d: the gradients contain NaN or Inf (loss %g)%s; training "
                              "diverged: lower --lr, keep --clip on, or resume from an earlier checkpoint",
                              t->state.step + 1, r->loss,
                              t->scaler.enabled ? " even at the smallest loss scale (2^-16)" : "");
    } else {
        LOOM_TRY(loom_dist_optim_step(t->opt, r->lr, r->info.grad_multiplier));
    }
    if (!isfinite(r->loss) && !t->scaler.enabled)
        return loom_error(LOOM_ERR_NUMERIC, "step %d: the loss is %g; lower --lr or check the data",
                          t->state.step + 1, r->loss);
    loom_loss_scaler_update(&t->scaler, r->info.found_inf);
    t->state.step++;
    return LOOM_OK;
}

static loom_status evaluate(trainer *t, double *val_loss) {
    const train_opts *o = &t->o;
    LOOM_TRY(loom_dataloader_reset(t->val));
    /* With loss masks, the mean over every batch's targets (a batch's loss
     * is the mean over its own); without, every batch has B*T of them. */
    int masked = loom_dataloader_num_masked(t->val) > 0;
    size_t bt = (size_t)o->batch * (size_t)o->seq;
    double sums[2] = {0.0, 0.0}; /* loss (times targets, when masked), targets */
    loom_no_grad_enter();
    loom_status st = LOOM_OK;
    for (int k = 0; k < o->eval_batches && st == LOOM_OK; k++) {
        st = loom_dataloader_next(t->val, t->inputs, t->targets);
        loom_tensor *loss = NULL;
        if (st == LOOM_OK) st = loom_llama_forward(t->m, t->inputs, t->targets, o->batch, o->seq, &loss, NULL);
        double n = 0.0;
        for (size_t i = 0; masked && st == LOOM_OK && i < bt; i++) n += t->targets[i] >= 0;
        if (st == LOOM_OK) sums[0] += masked ? loom_tensor_get(loss, 0) * n : loom_tensor_get(loss, 0);
        sums[1] += n;
        loom_tensor_release(loss);
    }
    loom_no_grad_exit();
    if (st == LOOM_OK) st = loom_comm_allreduce_sum_f64(t->dist.dp, sums, 2);
    *val_loss = masked ? (sums[1] > 0.0 ? sums[0] / sums[1] : NAN) : sums[0] / o->eval_batches / t->dist.dp_size;
    return st;
}

/* ------------------------------------------------------------------ run */

/* Resuming at `step`: metrics.jsonl keeps the lines of steps up to it, so
 * the steps a crashed run logged after its checkpoint are not there twice,
 * and drops a last line the crash left without its newline; the lines kept
 * go into the report (its plot covers the whole run). */
static loom_status trim_metrics(const char *path, int step, train_report *report) {
    void *data = NULL;
    size_t n = 0;
    if (access(path, F_OK) != 0) return LOOM_OK;
    LOOM_TRY(loom_read_file(path, &data, &n));
    char *text = data, *keep = malloc(n + 1);
    size_t k = 0;
    if (!keep) { free(data); return loom_error(LOOM_ERR_NOMEM, "train: out of memory"); }
    for (size_t i = 0; i < n;) {
        size_t e = i;
        while (e < n && text[e] != '\n') e++;
        if (e == n) break; /* a torn last line (no newline): the next record must not be glued to it */
        e++; /* with its newline */
        const char *st = NULL;
        for (size_t j = i; j + 7 <= e && !st; j++)
            if (!memcmp(text + j, "\"step\":", 7)) st = text + j;
        if (!st || atol(st + 7) <= step) {
            memcpy(keep + k, text + i, e - i);
            k += e - i;
        }
        i = e;
    }
    train_report_load(report, keep, k);
    loom_status s = k == n ? LOOM_OK : loom_file_write_atomic(path, keep, k);
    free(keep);
    free(data);
    return s;
}

static void cleanup(trainer *t) {
    /* Masters a save left lent (ZeRO-1) are taken back rather than copied
     * out by the free: the model is freed next, and a copy could not fit. */
    if (t->opt) (void)loom_dist_optim_reshard_masters(t->opt);
    loom_dist_optim_free(t->opt);
    loom_dist_layout_free(&t->dist);
    loom_llama_free(t->m);
    loom_dataloader_close(t->train);
    loom_dataloader_close(t->val);
    free(t->inputs);
    free(t->weights);
    free(t->targets);
    if (t->metrics) fclose(t->metrics);
    train_report_free(&t->report);
}

static loom_status train_loop(trainer *t) {
    const train_opts *o = &t->o;
    double t_start = cli_now();
    int first_step = t->state.step;
    while (t->state.step < o->steps) {
        double t0 = cli_now();
        step_result r;
        LOOM_TRY(train_step(t, &r));
        if (o->dump_grads) {
            LOOM_TRY(dump_grads(t, r.loss));
            if (t->leader) fprintf(stderr, "train: wrote gradients of the first step to %s\n", o->dump_grads);
            return LOOM_OK;
        }
        double dt = cli_now() - t0;
        int early, nb = loom_dist_optim_buckets(t->opt, &early);
        if (t->leader && t->state.step == first_step + 1 && nb > 0 && t->dist.dp_size > 1)
            fprintf(stderr, "train: gradients in %d bucket%s, %d started during backward\n", nb, nb == 1 ? "" : "s", early);
        if (t->leader)
            LOOM_TRY(train_report_step(&t->report, t->metrics, t->state.step, o->steps, r.loss, r.lr, r.info.grad_norm,
                                       (double)o->grad_accum * o->batch * o->seq * t->dist.dp_size / dt, dt,
                                       t->scaler.scale, r.skipped,
                                       (cli_now() - t_start) / (t->state.step - first_step) * (o->steps - t->state.step)));
        if (t->val && o->eval_every > 0 && (t->state.step % o->eval_every == 0 || t->state.step == o->steps)) {
            double vl;
            LOOM_TRY(evaluate(t, &vl));
            if (t->leader) LOOM_TRY(train_report_val(&t->report, t->metrics, t->state.step, vl));
        }
        if (o->ckpt_every > 0 && t->state.step % o->ckpt_every == 0 && t->state.step < o->steps)
            LOOM_TRY(train_save_checkpoint(t));
        int stop = train_stop_requested(); /* all ranks stop at the same step */
        LOOM_TRY(loom_comm_allreduce_max_int(t->world, &stop, 1));
        if (stop) {
            train_report_end_line(&t->report);
            if (t->leader)
                fprintf(stderr, "train: %s received at step %d; saving a checkpoint\n", train_stop_name(stop),
                        t->state.step);
            LOOM_TRY(train_save_checkpoint(t));
            if (t->leader) fprintf(stderr, "train: resume with: loom train ... --resume %s\n", o->out);
            t->interrupted = stop;
            return LOOM_OK;
        }
    }
    train_report_end_line(&t->report);
    LOOM_TRY(train_save_checkpoint(t));
    char model_dir[4200];
    snprintf(model_dir, sizeof model_dir, "%s/model", o->out);
    LOOM_TRY(loom_dist_optim_unshard_masters(t->opt));
    if (t->dist.dp_rank == 0) {
        loom_status st = loom_model_dir_save(t->m, LOOM_F32, t->has_tokenizer ? t->tokenizer_path : NULL, model_dir);
        if (st != LOOM_OK) /* the training is not lost: the final checkpoint holds it */
            return loom_error(st, "%s; the final checkpoint is saved: once that is fixed, `loom train ... --resume "
                              "%s` writes the model without training further, or `loom export --model %s/ckpt-%08d "
                              "--out DIR` writes it elsewhere", loom_last_error(), o->out, o->out, t->state.step);
    }
    if (t->m->lora.rank && loom_lora_peft_unwritable(t->m)) { /* on every rank: none writes one */
        if (t->leader)
            fprintf(stderr, "train: the LoRA adapters are merged into %s; PEFT adapts Phi-3's fused qkv_proj and "
                    "gate_up_proj as one module each, and loom does not write its adapters of their parts in that "
                    "layout, so no PEFT adapter directory is written\n", model_dir);
    } else if (t->m->lora.rank && t->dist.dp_rank == 0) { /* the adapters alone too, for PEFT */
        char adapter_dir[4200];
        snprintf(adapter_dir, sizeof adapter_dir, "%s/adapter", o->out);
        /* The base model's directory as an absolute path, as the first run of a resumed one had it */
        LOOM_TRY(loom_lora_save_peft(t->m, adapter_dir, t->state.init_dir[0] ? t->state.init_dir : NULL));
        if (t->leader) fprintf(stderr, "train: LoRA adapters (PEFT's layout) in %s\n", adapter_dir);
    }
    if (t->leader) fprintf(stderr, "train: done; model in %s\n", model_dir);
    return LOOM_OK;
}

/* The directory that holds checkpoint ckpt (its parent), canonical (no
 * trailing slash, no "."), into run_dir (PATH_MAX); -1 with errno set if
 * ckpt cannot be resolved. */
static int run_dir_of(const char *ckpt, char *run_dir) {
    if (!realpath(ckpt, run_dir)) return -1;
    char *slash = strrchr(run_dir, '/');
    if (slash) slash[slash == run_dir ? 1 : 0] = '\0';
    return 0;
}

/* Whether dir is the directory that holds checkpoint ckpt. */
static int is_run_dir_of(const char *dir, const char *ckpt) {
    char a[PATH_MAX], b[PATH_MAX];
    return realpath(dir, a) && !run_dir_of(ckpt, b) && !strcmp(a, b);
}

/* --out, when not given: the resumed run's directory (the checkpoint's
 * parent), else "out". */
static loom_status choose_out(trainer *t, const char *resume_dir) {
    static char run_dir[PATH_MAX];
    train_opts *o = &t->o;
    if (o->out) return LOOM_OK;
    if (!*resume_dir) {
        o->out = "out";
        return LOOM_OK;
    }
    if (run_dir_of(resume_dir, run_dir))
        return loom_error(LOOM_ERR_IO, "%s: cannot resolve %s", strerror(errno), resume_dir);
    o->out = run_dir;
    if (t->leader) fprintf(stderr, "train: no --out: continuing in %s, the resumed run's directory\n", o->out);
    return LOOM_OK;
}

/* The output directory, created and locked for this run (the leader writes
 * it), checked to hold no other run's checkpoints, with metrics.jsonl
 * opened (trimmed to the resumed step, its losses loaded for the plot). */
static loom_status open_outputs(trainer *t, const char *resume_dir) {
    const train_opts *o = &t->o;
    LOOM_TRY(loom_mkdir_p(o->out));
    if (!t->leader) return LOOM_OK;
    LOOM_TRY(cli_lock_dir(o->out)); /* no other run writes there meanwhile */
    if (o->zero && t->dist.dp_size == 1)
        fprintf(stderr, "train: note: --zero 1 shards across data-parallel ranks; with one, nothing is sharded\n");
    loom_checkpoint_remove_stale(o->out); /* a killed writer's, taking space */
    /* --out's checkpoints must be this run's past: never skip a save
     * because another run left a checkpoint of that step. */
    int newest = loom_checkpoint_newest_step(o->out);
    if (!*resume_dir && newest >= 0)
        return loom_error(LOOM_ERR_STATE, "%s holds checkpoints of an earlier run (newest ckpt-%08d): continue it "
                          "with --resume %s, or use a new --out", o->out, newest, o->out);
    if (*resume_dir && newest >= 0 && !is_run_dir_of(o->out, resume_dir))
        return loom_error(LOOM_ERR_STATE, "%s holds checkpoints of another run (newest ckpt-%08d) than the one being "
                          "resumed (%s): continuing there would mix the two runs' metrics and prune that run's "
                          "checkpoints; use a new --out, or leave --out out to continue in the resumed run's "
                          "directory", o->out, newest, resume_dir);
    if (*resume_dir && newest > t->state.step)
        return loom_error(LOOM_ERR_STATE, "%s holds checkpoints after step %d (newest ckpt-%08d), from the "
                          "run being resumed going further: remove them or use a new --out", o->out,
                          t->state.step, newest);
    char path[4200];
    snprintf(path, sizeof path, "%s/metrics.jsonl", o->out);
    if (*resume_dir) LOOM_TRY(trim_metrics(path, t->state.step, &t->report));
    if (!(t->metrics = fopen(path, *resume_dir ? "a" : "w")))
        return loom_error(LOOM_ERR_IO, "cannot write %s (is the output directory writable?)", path);
    return LOOM_OK;
}

/* --lora-init: the LoRA setting is the adapter's; --lora flags given too
 * must say the same. */
static int lora_from_adapter(train_opts *o) {
    loom_lora_config c;
    /* The base's layers, when its config can be read here (a pattern is
     * checked against them; else against layers 0..127). */
    int n_layers = 0;
    char cfg_path[4200];
    loom_llama_config base;
    if (o->init && snprintf(cfg_path, sizeof cfg_path, "%s/config.json", o->init) < (int)sizeof cfg_path &&
        loom_llama_config_load(cfg_path, &base) == LOOM_OK)
        n_layers = base.n_layers;
    loom_status st = loom_lora_peft_config_layers(o->lora_init, n_layers, &c);
    if (st != LOOM_OK) return cli_fail("train", st);
    if (!o->init && !o->resume)
        return cli_usage_error("train", "--lora-init %s: give the base model the adapter was trained on, --init DIR",
                               o->lora_init);
    unsigned given = 0;
    if (o->lora_targets && loom_lora_targets_parse(o->lora_targets, &given) != LOOM_OK)
        return cli_usage_error("train", "--lora-targets: %s", loom_last_error());
    if ((o->lora && o->lora != c.rank) || (!isnan(o->lora_alpha) && o->lora_alpha != c.alpha) ||
        (o->lora_targets && given != c.targets) || (o->lora_rslora && !c.rslora) || (o->lora_dora && !c.dora))
        return cli_usage_error("train", "--lora flags differ from the adapter %s's setting (r %d, lora_alpha %g%s%s); "
                               "drop them, --lora-init gives them", o->lora_init, c.rank, (double)c.alpha,
                               c.rslora ? ", use_rslora" : "", c.dora ? ", use_dora" : "");
    o->lora = c.rank;
    o->lora_rslora = c.rslora;
    o->lora_dora = c.dora;
    o->lora_alpha = c.alpha;
    if (isnan(o->lora_dropout)) o->lora_dropout = c.dropout; /* a training setting: --lora-dropout may change it */
    o->lora_target_set = c.targets;
    o->lora_targets = NULL; /* the set is given */
    o->lora_targets_given = 1;
    return 0;
}

static void print_summary(const trainer *t, loom_precision prec, loom_recompute_mode mode) {
    const train_opts *o = &t->o;
    char blocks[48] = "";
    mode = t->m->recompute.mode; /* as planned, with --recompute-budget */
    int nb = t->m->recompute.blocks;
    if (mode != LOOM_RECOMPUTE_NONE && nb > 0 && nb < t->m->cfg.n_layers)
        snprintf(blocks, sizeof blocks, " (blocks 1-%d of %d)", nb, t->m->cfg.n_layers);
    fprintf(stderr, "train: %lld parameters, %s master_grad=%s recompute=%s%s, %d x %d sequences of %d tokens "
            "per step and rank, %d threads, %d rank%s (tp %d x dp %d%s)\n",
            (long long)loom_llama_n_weights_full(t->m), loom_dtype_name(prec.compute),
            prec.master_grad ? "on" : "off", loom_recompute_mode_name(mode), blocks, o->grad_accum, o->batch, o->seq,
            loom_get_threads(), t->dist.world_size, t->dist.world_size == 1 ? "" : "s", t->dist.tp_size,
            t->dist.dp_size, o->zero ? ", ZeRO-1" : "");
    if (t->m->lora.rank) {
        char targets[64];
        int64_t trainable = 0;
        for (int i = t->m->n_base; i < t->m->n_params; i++) trainable += loom_param_numel(t->m->params[i]);
        loom_lora_targets_format(t->m->lora.targets, targets, sizeof targets);
        fprintf(stderr, "train: %s rank %d, alpha %g%s on %s, dropout %g: %lld trainable parameters, the model's "
                "own frozen\n", t->m->lora.dora ? "DoRA" : "LoRA", t->m->lora.rank, (double)t->m->lora.alpha,
                t->m->lora.rslora ? " (rsLoRA)" : "", targets, (double)t->m->lora.dropout, (long long)trainable);
    }
    loom_mem_stats ms;
    loom_mem_get_stats(&ms);
    const double mib = 1 << 20;
    fprintf(stderr, "train: memory per rank: weights %.2f MiB (compute copies and fp32 masters), gradients "
            "%.2f MiB, optimizer %.2f MiB\n", ms.current[LOOM_MEM_PARAMS] / mib,
            ms.current[LOOM_MEM_GRADS] / mib, ms.current[LOOM_MEM_OPTIMIZER] / mib);
}

static int run(int argc, char **argv) {
    trainer t;
    memset(&t, 0, sizeof t);
    t.last_saved = -1;
    train_opts *o = &t.o;
    *o = (train_opts){.out = NULL, .preset = NULL, .precision = "bf16", .master_grad = "on", .overlap_flag = "on",
                      .recompute = "none", .recompute_mode = NULL, .batch = 8, .seq = 0,
                      .grad_accum = 1, .tp = 1, .steps = 100, .warmup = 10, .seed = 1337, .threads = 0, .eval_every = 50,
                      .eval_batches = 4, .ckpt_every = 0, .keep = 2, .log_every = 1, .lr = 1e-3f, .min_lr = NAN,
                      .weight_decay = 0.1f, .clip = 1.0f, .schedule = "cosine", .decay_frac = NAN,
                      .lora_alpha = NAN, .lora_dropout = NAN};
    const flag flags[] = {
        {"data", FLAG_STRING, &o->data, "DIR", "token shards (train_*.bin, val_*.bin) and tokenizer.json (required)"},
        {"out", FLAG_STRING, &o->out, "DIR", "output: checkpoints, metrics, plot, final model (default out; with "
                                             "--resume, the resumed run's directory)"},
        {"preset", FLAG_STRING, &o->preset, "NAME", "model preset: tiny or small (default tiny)"},
        {"config", FLAG_STRING, &o->config, "FILE", "model from a Hugging Face config.json instead of a preset (model_type llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, granite, phi3 or smollm3; gemma3, Gemma 3's multimodal, as its text model)"},
        {"tie-embeddings", FLAG_BOOL, &o->tie, NULL, "share the embedding and lm_head weights (presets)"},
        {"init", FLAG_STRING, &o->init, "DIR", "start from the weights of a model directory (its generation_config.json goes into the checkpoints and the final model)"},
        {"resume", FLAG_STRING, &o->resume, "DIR", "continue from a checkpoint (or the latest in DIR)"},
        {"batch", FLAG_INT, &o->batch, "B", "sequences per micro-batch (default 8)"},
        {"seq", FLAG_INT, &o->seq, "T", "sequence length (default min(256, context))"},
        {"grad-accum", FLAG_INT, &o->grad_accum, "K", "micro-batches per optimizer step (default 1)"},
        {"steps", FLAG_INT, &o->steps, "N", "optimizer steps in total (default 100)"},
        {"lr", FLAG_FLOAT, &o->lr, "X", "peak learning rate (default 1e-3)"},
        {"min-lr", FLAG_FLOAT, &o->min_lr, "X", "final learning rate of the decay (default lr/10)"},
        {"warmup", FLAG_INT, &o->warmup, "N", "linear warmup steps (default 10)"},
        {"schedule", FLAG_STRING, &o->schedule, "S", "learning rate after warmup: cosine, linear, constant or wsd "
                                                     "(warmup-stable-decay) (default cosine)"},
        {"decay-frac", FLAG_DOUBLE, &o->decay_frac, "F", "wsd: the last share of the steps, decaying linearly to "
                                                        "--min-lr (default 0.2)"},
        {"weight-decay", FLAG_FLOAT, &o->weight_decay, "X", "AdamW decoupled weight decay, not on norms (default 0.1)"},
        {"clip", FLAG_FLOAT, &o->clip, "X", "clip the global gradient norm to X; 0 disables (default 1.0)"},
        {"precision", FLAG_STRING, &o->precision, "P", "fp32, bf16 or fp16 (default bf16)"},
        {"master-grad", FLAG_STRING, &o->master_grad, "on|off", "fp32 main_grad for every weight (default on)"},
        {"recompute", FLAG_STRING, &o->recompute, "MODE", "none, selective or full (default none)"},
        {"recompute-mode", FLAG_STRING, &o->recompute_mode, "M", "full recompute: reentrant or nonreentrant (default)"},
        {"recompute-blocks", FLAG_INT, &o->recompute_blocks, "N",
         "recompute only the first N blocks, keep the rest's activations (default 0: all)"},
        {"recompute-budget", FLAG_FLOAT, &o->recompute_budget, "MIB",
         "recompute the fewest blocks (full, or --recompute selective) that keep a step's activations within MIB, "
         "measured by probe steps at start (default 0: no plan)"},
        {"lora", FLAG_INT, &o->lora, "R", "LoRA: freeze the model's weights and train rank-R adapters on the "
                                          "--lora-targets linears; DIR/model has them merged, DIR/adapter "
                                          "holds them for PEFT (default 0: off)"},
        {"lora-alpha", FLAG_FLOAT, &o->lora_alpha, "A", "LoRA: the adapters' output is scaled by A/R (default R)"},
        {"lora-rslora", FLAG_BOOL, &o->lora_rslora, NULL,
         "LoRA: scale by A/sqrt(R) instead (rank-stabilised LoRA, PEFT's use_rslora; or --lora-init's)"},
        {"lora-dora", FLAG_BOOL, &o->lora_dora, NULL,
         "LoRA: DoRA, a trained magnitude per output of each adapted linear (PEFT's use_dora; or --lora-init's)"},
        {"lora-targets", FLAG_STRING, &o->lora_targets, "LIST",
         "LoRA: the linears adapted, from q,k,v,o,gate,up,down, or all (default all)"},
        {"lora-dropout", FLAG_FLOAT, &o->lora_dropout, "P",
         "LoRA: dropout on the adapters' inputs while training, in [0, 1) (default 0, or --lora-init's)"},
        {"lora-init", FLAG_STRING, &o->lora_init, "DIR",
         "LoRA: start from this PEFT adapter directory on the --init model: its r, alpha and targets (--lora flags "
         "given must match) and, unless --lora-dropout is given, its dropout"},
        {"seed", FLAG_INT, &o->seed, "N", "seed for initialisation, LoRA's A and the dropout masks (default 1337)"},
        {"threads", FLAG_INT, &o->threads, "N", "OpenMP threads (default: OMP_NUM_THREADS, else the cores this process may use)"},
        {"eval-every", FLAG_INT, &o->eval_every, "N", "validation loss every N steps; 0 disables (default 50)"},
        {"eval-batches", FLAG_INT, &o->eval_batches, "N", "validation batches per evaluation (default 4)"},
        {"ckpt-every", FLAG_INT, &o->ckpt_every, "N", "checkpoint every N steps; 0: only at the end (default 0)"},
        {"keep", FLAG_INT, &o->keep, "K", "checkpoints to keep (default 2)"},
        {"log-every", FLAG_INT, &o->log_every, "N", "plain progress line every N steps when not a terminal (default 1)"},
        {"tp", FLAG_INT, &o->tp, "T", "tensor-parallel ranks per data-parallel group (mpirun; default 1)"},
        {"zero", FLAG_INT, &o->zero, "0|1", "1: shard fp32 masters and AdamW moments across data-parallel ranks (ZeRO-1; default 0)"},
        {"overlap", FLAG_STRING, &o->overlap_flag, "on|off", "start gradient all-reduces during backward (default on)"},
        {"bucket-size", FLAG_INT, &o->bucket_size, "N", "gradient all-reduce bucket, in elements (default 1048576)"},
        {"check-grads", FLAG_BOOL, &o->check_grads, NULL, "gradient audit after every backward"},
        {"dump-grads", FLAG_STRING, &o->dump_grads, "FILE", "write the first step's gradients (fp32 safetensors) and exit"},
        {"dump-logits", FLAG_STRING, &o->dump_logits, "FILE", "write the first micro-batch's logits and loss (fp32 safetensors)"},
    };
    int n_flags = (int)(sizeof flags / sizeof flags[0]);
    int rc = cli_parse(&cmd_train, flags, n_flags, argc, argv);
    if (rc > 0 && loom_dist_launched_ranks() > 1) {
        /* This rank leaves before MPI starts: with status 0 the launcher
         * would let the others wait for it in MPI_Init forever. */
        fprintf(stderr, "loom train: --help in a job of %ld processes: exiting with status 2 so that the launcher "
                        "stops the others (run loom train --help on its own)\n", loom_dist_launched_ranks());
        return 2;
    }
    if (rc) return rc > 0 ? 0 : 2;
    if (!o->data) return cli_usage_error("train", "--data DIR is required (make shards with loom tokenize)");
    /* Flags that would be ignored are refused (or noted, when resuming). */
    if ((o->preset || o->tie) && (o->config || o->init))
        return cli_usage_error("train", "--%s applies to presets; the model comes from --%s (set "
                               "tie_word_embeddings in a config.json)", o->preset ? "preset" : "tie-embeddings",
                               o->config ? "config" : "init");
    if (o->config && o->init && !o->resume)
        return cli_usage_error("train", "--config and --init both give the model: --init's directory has its own "
                               "config.json; drop --config");
    if ((o->preset || o->tie) && o->resume)
        fprintf(stderr, "train: note: --%s is ignored when resuming: the model is the checkpoint's\n",
                o->preset ? "preset" : "tie-embeddings");
    if (o->recompute_mode && strcmp(o->recompute, "full") && !(o->recompute_budget > 0.0f && !strcmp(o->recompute, "none")))
        fprintf(stderr, "train: note: --recompute-mode applies to --recompute full; with %s it changes nothing\n",
                o->recompute);
    if (o->lora < 0) return cli_usage_error("train", "--lora expects a rank >= 1 (0: off), got %d", o->lora);
    if (o->lora_init && (rc = lora_from_adapter(o))) return rc;
    if (!o->lora &&
        (!isnan(o->lora_alpha) || o->lora_targets || !isnan(o->lora_dropout) || o->lora_rslora || o->lora_dora))
        return cli_usage_error("train", "--%s applies to LoRA: give --lora RANK too",
                               o->lora_targets           ? "lora-targets"
                               : !isnan(o->lora_dropout) ? "lora-dropout"
                               : o->lora_rslora          ? "lora-rslora"
                               : o->lora_dora            ? "lora-dora"
                                                         : "lora-alpha");
    if (isnan(o->lora_dropout)) o->lora_dropout = 0.0f; /* not given */
    if (!(o->lora_dropout >= 0.0f && o->lora_dropout < 1.0f))
        return cli_usage_error("train", "--lora-dropout must be in [0, 1), got %g", (double)o->lora_dropout);
    if (!isnan(o->lora_alpha) && !(o->lora_alpha > 0.0f))
        return cli_usage_error("train", "--lora-alpha must be above 0, got %g", (double)o->lora_alpha);
    if (isnan(o->lora_alpha)) o->lora_alpha = (float)o->lora; /* not given (the parser takes finite numbers only) */
    if (o->lora && !o->lora_targets_given &&
        loom_lora_targets_parse(o->lora_targets ? o->lora_targets : "all", &o->lora_target_set) != LOOM_OK)
        return cli_usage_error("train", "--lora-targets: %s", loom_last_error());
    if (!o->preset) o->preset = "tiny";
    if (!o->recompute_mode) o->recompute_mode = "nonreentrant";
    if (loom_lr_schedule_parse(o->schedule, &o->sched) != LOOM_OK)
        return cli_usage_error("train", "--schedule: %s", loom_last_error());
    if (o->sched == LOOM_LR_CONSTANT && !isnan(o->min_lr))
        return cli_usage_error("train", "--min-lr is where a schedule decays to, and --schedule constant does not decay");
    if (o->sched != LOOM_LR_WSD && !isnan(o->decay_frac))
        return cli_usage_error("train", "--decay-frac sizes the decay of --schedule wsd, not of %s", o->schedule);
    if (isnan(o->min_lr)) o->min_lr = o->lr / 10.0f; /* not given (the parser takes finite numbers only) */
    if (isnan(o->decay_frac)) o->decay_frac = 0.2;
    loom_precision prec = {LOOM_BF16, 1};
    loom_recompute_mode mode = LOOM_RECOMPUTE_NONE;
    if ((rc = parse_settings(&t, &prec, &mode))) return rc;
    loom_status taken = train_stop_take(); /* before OpenMP's and MPI's threads exist */
    if (taken != LOOM_OK) return cli_fail("train", taken);
    if ((rc = cli_apply_threads("train", o->threads))) return rc;
    if (o->zero != 0 && o->zero != 1) return cli_usage_error("train", "--zero expects 0 or 1");
    if (o->tp <= 0) return cli_usage_error("train", "--tp must be positive (ranks per tensor-parallel group), got %d", o->tp);
    if (cli_parse_on_off("train", "overlap", o->overlap_flag, &o->overlap)) return 2;
    if (o->bucket_size < 0) return cli_usage_error("train", "--bucket-size must be >= 0 (0: the default)");
    loom_rng_init(loom_rng_default(), (uint64_t)o->seed);
    loom_loss_scaler_init(&t.scaler, prec.compute == LOOM_F16);

    char resume_dir[4096] = "";
    loom_status st = loom_dist_init(&argc, &argv, &t.world);
    if (st == LOOM_OK) st = loom_dist_layout(t.world, o->tp, &t.dist);
    t.leader = loom_comm_rank(t.world) == 0;
    if (st == LOOM_OK && o->resume) st = resolve_resume(o->resume, resume_dir, sizeof resume_dir);
    if (st == LOOM_OK) st = agree_on_settings(&t, resume_dir);
    if (st == LOOM_OK) st = choose_out(&t, resume_dir);
    if (st == LOOM_OK) st = build_model(&t, prec, mode, *resume_dir ? resume_dir : NULL);
    if (st == LOOM_OK) st = open_data(&t);
    if (st == LOOM_OK && *resume_dir) st = train_restore(&t, resume_dir);
    if (st == LOOM_OK) st = train_agree_state(t.world, &t.dist, t.m, t.state.step, t.train, t.val);
    if (st == LOOM_OK && *resume_dir && t.state.step > o->steps)
        st = loom_error(LOOM_ERR_INVALID, "%s is at step %d, past --steps %d: give --steps above %d to train further",
                        resume_dir, t.state.step, o->steps, t.state.step);
    else if (st == LOOM_OK && *resume_dir && t.state.step == o->steps && t.leader)
        fprintf(stderr, "train: the checkpoint is at --steps %d already: no step to take, the model is written as is\n",
                o->steps);
    train_report_init(&t.report, o->log_every);
    if (st == LOOM_OK) st = open_outputs(&t, resume_dir);
    if (st == LOOM_OK) {
        if (t.leader) print_summary(&t, prec, mode);
        train_stop_arm();
        st = train_loop(&t);
        int late = train_stop_requested();
        if (st == LOOM_OK && !t.interrupted && late && t.leader)
            fprintf(stderr, "train: %s arrived after the last step; the final checkpoint and model are saved whole\n",
                    train_stop_name(late));
        if (st == LOOM_OK && !o->dump_grads && t.leader) {
            char path[4200];
            snprintf(path, sizeof path, "%s/loss.svg", o->out);
            if (train_report_plot(&t.report, path) == LOOM_OK) fprintf(stderr, "train: loss plot in %s\n", path);
            else fprintf(stderr, "train: note: no loss plot: %s\n", loom_last_error());
        }
    }
    if (st != LOOM_OK && loom_dist_is_distributed()) {
        /* One rank's failure ends the whole job, never a hang (and no
         * cleanup that could wait on a collective). */
        char msg[1200];
        snprintf(msg, sizeof msg, "loom train: %s", loom_last_error());
        loom_dist_abort(msg, t.usage ? 2 : 1);
    }
    int interrupted = t.interrupted, usage = t.usage;
    cleanup(&t);
    loom_dist_finalize();
    if (st == LOOM_OK && interrupted) return 128 + interrupted; /* 130 SIGINT, 143 SIGTERM, 138 SIGUSR1, 140 SIGUSR2: saved */
    if (st != LOOM_OK && usage) return cli_usage_error("train", "%s", loom_last_error());
    return st == LOOM_OK ? 0 : cli_fail("train", st);
}

const command cmd_train = {
    "train",
    "train a LLaMA model on token shards",
    "train --data DIR [--preset tiny|small | --config FILE] [flags]",
    "Progress goes to stderr (a live line on a terminal, plain lines otherwise);\n"
    "metrics.jsonl, loss.svg, checkpoints (ckpt-NNNNNNNN/) and the final model (model/)\n"
    "go to --out. SIGINT, SIGTERM, SIGUSR1 or SIGUSR2 saves a checkpoint and stops (exit\n"
    "128 + the signal: 130, 143, 138, 140; a second one, or one before training starts,\n"
    "stops at once); under mpirun send SIGUSR1 to mpirun (it follows a forwarded\n"
    "SIGINT/SIGTERM with SIGKILL after a second). --resume continues bit-for-bit with\n"
    "the same flags; other batch or optimizer flags are named, and this run's are used.\n"
    "Under mpirun every rank must get the same training flags (checked at start).\n"
    "--recompute selective always uses the non-reentrant machinery.\n"
    "--lora R fine-tunes rank-R adapters with the model's own weights frozen (bf16\n"
    "ones held as bf16 alone): --out gets model/ (merged) and adapter/ (PEFT's layout),\n"
    "which eval, generate and export take with --adapter DIR.",
    run,
};
