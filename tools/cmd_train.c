/*
 * cmd_train.c — `loom train`: the training loop. Data from llm.c shards,
 * AdamW on fp32 masters with warmup + cosine, clipping, dynamic loss scaling
 * for fp16, recompute per block, validation, exact-resume checkpoints on a
 * schedule and on SIGINT/SIGTERM, metrics as JSON lines, an SVG loss plot.
 */
#include "cli.h"
#include "train_report.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static volatile sig_atomic_t stop_signal;
static void on_signal(int sig) { stop_signal = sig; }

typedef struct train_opts {
    const char *data, *out, *preset, *config, *init, *resume, *dump_grads, *dump_logits, *tokenizer;
    const char *precision, *master_grad, *recompute, *recompute_mode;
    int batch, seq, grad_accum, steps, warmup, seed, threads, eval_every, eval_batches, ckpt_every, keep;
    int log_every, check_grads, tie;
    float lr, min_lr, weight_decay, clip;
} train_opts;

typedef struct trainer {
    train_opts o;
    loom_llama *m;
    loom_adamw *opt;
    loom_dataloader *train, *val;
    loom_loss_scaler scaler;
    loom_train_state state;
    int32_t *inputs, *targets;
    char tokenizer_path[4096];
    int has_tokenizer;
    FILE *metrics;
    train_report report;
    double first_loss;  /* loss of the first micro-batch, for the dumps */
} trainer;

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
    if (o->batch <= 0 || o->grad_accum <= 0 || o->steps <= 0 || o->seq < 0)
        return cli_usage_error("train", "--batch, --grad-accum and --steps must be positive");
    if (!(o->lr > 0.0f) || o->min_lr < 0.0f || o->warmup < 0 || o->clip < 0.0f || o->weight_decay < 0.0f)
        return cli_usage_error("train", "--lr must be positive; --min-lr, --warmup, --clip, --weight-decay >= 0");
    if (o->keep <= 0 || o->eval_every < 0 || o->ckpt_every < 0 || o->eval_batches <= 0 || o->log_every <= 0)
        return cli_usage_error("train", "--keep, --eval-batches, --log-every must be positive; --eval-every, --ckpt-every >= 0");
    return 0;
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
        snprintf(path, sizeof path, "%s/config.json", resume_dir);
        LOOM_TRY(loom_llama_config_load(path, &cfg));
    } else if (o->init) {
        snprintf(path, sizeof path, "%s/config.json", o->init);
        LOOM_TRY(loom_llama_config_load(path, &cfg));
    } else if (o->config) {
        LOOM_TRY(loom_llama_config_load(o->config, &cfg));
    } else {
        LOOM_TRY(loom_llama_preset(o->preset, &cfg));
        cfg.tie_embeddings = o->tie;
    }
    if (t->o.seq == 0) t->o.seq = cfg.max_seq < 256 ? cfg.max_seq : 256;
    if (t->o.seq > cfg.max_seq)
        return loom_error(LOOM_ERR_INVALID, "--seq %d is longer than the model's context (%d)", t->o.seq, cfg.max_seq);
    LOOM_TRY(loom_llama_new(&cfg, prec, &t->m));
    t->m->recompute.mode = mode;
    loom_llama_init_weights(t->m, (uint64_t)o->seed);
    if (o->init && !resume_dir) {
        snprintf(path, sizeof path, "%s/model.safetensors", o->init);
        LOOM_TRY(loom_llama_load_weights(t->m, path));
    }
    loom_adamw_config ac = loom_adamw_defaults();
    ac.weight_decay = o->weight_decay;
    return loom_adamw_new(&ac, t->m->params, t->m->n_params, &t->opt);
}

static loom_status open_data(trainer *t) {
    const train_opts *o = &t->o;
    loom_dataloader_options dl = {o->batch, o->seq, 0, 1, t->m->cfg.vocab_size, "train"};
    LOOM_TRY(loom_dataloader_open(o->data, &dl, &t->train));
    dl.split = "val";
    if (o->eval_every > 0 && loom_dataloader_open(o->data, &dl, &t->val) != LOOM_OK) {
        fprintf(stderr, "train: no validation data (%s); validation is off\n", loom_last_error());
        t->val = NULL;
    }
    t->inputs = malloc((size_t)o->batch * (size_t)o->seq * sizeof *t->inputs);
    t->targets = malloc((size_t)o->batch * (size_t)o->seq * sizeof *t->targets);
    if (!t->inputs || !t->targets) return loom_error(LOOM_ERR_NOMEM, "train: out of memory for batches");
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

static loom_status forward_backward(trainer *t, double *loss_sum) {
    const train_opts *o = &t->o;
    float seed = t->scaler.scale / (float)o->grad_accum;
    for (int k = 0; k < o->grad_accum; k++) {
        LOOM_TRY(loom_dataloader_next(t->train, t->inputs, t->targets));
        loom_tensor *loss = NULL, *logits = NULL;
        int dump = k == 0 && t->state.step == 0 && o->dump_logits;
        LOOM_TRY(loom_llama_forward(t->m, t->inputs, t->targets, o->batch, o->seq, &loss, dump ? &logits : NULL));
        float l = loom_tensor_get(loss, 0);
        if (k == 0) t->first_loss = l;
        if (dump) {
            loom_status st = dump_logits(t, logits);
            loom_tensor_release(logits);
            if (st != LOOM_OK) { loom_tensor_release(loss); return st; }
        }
        loom_status st = loom_backward(loss, seed);
        loom_tensor_release(loss);
        LOOM_TRY(st);
        *loss_sum += l / o->grad_accum;
    }
    t->state.tokens_seen += (uint64_t)o->grad_accum * (uint64_t)o->batch * (uint64_t)o->seq;
    return LOOM_OK;
}

static loom_status dump_grads(trainer *t) {
    loom_safetensors_writer *w;
    LOOM_TRY(loom_safetensors_writer_init(&w));
    loom_llama *m = t->m;
    float **bufs = calloc((size_t)m->n_params, sizeof *bufs);
    loom_status st = bufs ? LOOM_OK : LOOM_ERR_NOMEM;
    for (int i = 0; i < m->n_params && st == LOOM_OK; i++) {
        loom_param *p = m->params[i];
        size_t n = (size_t)loom_param_numel(p);
        bufs[i] = malloc(n * sizeof(float) + 1);
        if (!bufs[i]) { st = loom_error(LOOM_ERR_NOMEM, "dump-grads: out of memory"); break; }
        loom_param_read_grad(p, bufs[i]);
        /* Unscale (a power of two: exact) so files compare across precisions. */
        for (size_t k = 0; k < n; k++) bufs[i][k] /= t->scaler.scale;
        st = loom_safetensors_writer_add(w, p->name, LOOM_SAFETENSORS_F32, p->tensor->shape, p->tensor->ndim, bufs[i]);
    }
    char v[64];
    snprintf(v, sizeof v, "%.9g", t->first_loss);
    if (st == LOOM_OK) st = loom_safetensors_writer_set_metadata(w, "loss", v);
    if (st == LOOM_OK) st = loom_safetensors_writer_write(w, t->o.dump_grads);
    for (int i = 0; bufs && i < m->n_params; i++) free(bufs[i]);
    free(bufs);
    loom_safetensors_writer_free(w);
    return st;
}

static loom_status train_step(trainer *t, step_result *r) {
    const train_opts *o = &t->o;
    memset(r, 0, sizeof *r);
    loom_llama_zero_grad(t->m);
    LOOM_TRY(forward_backward(t, &r->loss));
    if (o->check_grads) {
        char report[4096];
        loom_status st = loom_grad_audit(t->m->params, t->m->n_params, report, sizeof report);
        if (st != LOOM_OK) return st;
    }
    loom_amp_prepare_step(t->m->params, t->m->n_params, &t->scaler, o->clip, &r->info);
    r->lr = loom_lr_cosine(t->state.step, o->warmup, o->steps, o->lr, o->min_lr);
    if (r->info.found_inf) {
        r->skipped = 1;
        if (!t->scaler.enabled)
            return loom_error(LOOM_ERR_NUMERIC, "step %d: the gradients contain NaN or Inf (loss %g); training "
                              "diverged: lower --lr, keep --clip on, or resume from an earlier checkpoint",
                              t->state.step + 1, r->loss);
    } else {
        LOOM_TRY(loom_adamw_step(t->opt, r->lr, r->info.grad_multiplier));
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
    double sum = 0.0;
    loom_no_grad_enter();
    loom_status st = LOOM_OK;
    for (int k = 0; k < o->eval_batches && st == LOOM_OK; k++) {
        st = loom_dataloader_next(t->val, t->inputs, t->targets);
        loom_tensor *loss = NULL;
        if (st == LOOM_OK) st = loom_llama_forward(t->m, t->inputs, t->targets, o->batch, o->seq, &loss, NULL);
        if (st == LOOM_OK) sum += loom_tensor_get(loss, 0);
        loom_tensor_release(loss);
    }
    loom_no_grad_exit();
    *val_loss = sum / o->eval_batches;
    return st;
}

/* ---------------------------------------------------------- checkpoints */

static void capture_state(trainer *t) {
    loom_rng *rng = loom_rng_default();
    t->state.rng_seed = rng->seed;
    t->state.rng_offset = rng->offset;
    loom_dataloader_get_position(t->train, &t->state.data);
    t->state.loss_scale = t->scaler.scale;
    t->state.scaler_good_steps = t->scaler.good_steps;
    t->state.scaler_skipped = t->scaler.skipped_steps;
}

static loom_status save_checkpoint(trainer *t) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/ckpt-%08d", t->o.out, t->state.step);
    struct stat sb;
    if (stat(dir, &sb) == 0) return LOOM_OK; /* this step is saved already */
    capture_state(t);
    LOOM_TRY(loom_checkpoint_save(dir, t->m, t->opt, &t->state, t->has_tokenizer ? t->tokenizer_path : NULL));
    LOOM_TRY(loom_checkpoint_prune(t->o.out, t->o.keep));
    fprintf(stderr, "train: checkpoint %s\n", dir);
    return LOOM_OK;
}

static loom_status restore(trainer *t, const char *dir) {
    LOOM_TRY(loom_checkpoint_load(dir, t->m, t->opt, &t->state));
    loom_rng *rng = loom_rng_default();
    rng->seed = t->state.rng_seed;
    rng->offset = t->state.rng_offset;
    LOOM_TRY(loom_dataloader_set_position(t->train, &t->state.data));
    t->scaler.scale = t->state.loss_scale;
    t->scaler.good_steps = t->state.scaler_good_steps;
    t->scaler.skipped_steps = t->state.scaler_skipped;
    fprintf(stderr, "train: resumed from %s at step %d\n", dir, t->state.step);
    return LOOM_OK;
}

/* ------------------------------------------------------------------ run */

static void cleanup(trainer *t) {
    loom_adamw_free(t->opt);
    loom_llama_free(t->m);
    loom_dataloader_close(t->train);
    loom_dataloader_close(t->val);
    free(t->inputs);
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
            LOOM_TRY(dump_grads(t));
            fprintf(stderr, "train: wrote gradients of the first step to %s\n", o->dump_grads);
            return LOOM_OK;
        }
        double dt = cli_now() - t0;
        train_report_step(&t->report, t->metrics, t->state.step, o->steps, r.loss, r.lr, r.info.grad_norm,
                          (double)o->grad_accum * o->batch * o->seq / dt, dt, t->scaler.scale, r.skipped,
                          (cli_now() - t_start) / (t->state.step - first_step) * (o->steps - t->state.step));
        if (t->val && o->eval_every > 0 && (t->state.step % o->eval_every == 0 || t->state.step == o->steps)) {
            double vl;
            LOOM_TRY(evaluate(t, &vl));
            train_report_val(&t->report, t->metrics, t->state.step, vl);
        }
        if (o->ckpt_every > 0 && t->state.step % o->ckpt_every == 0 && t->state.step < o->steps)
            LOOM_TRY(save_checkpoint(t));
        if (stop_signal) {
            train_report_end_line(&t->report);
            fprintf(stderr, "train: %s received at step %d; saving a checkpoint\n",
                    stop_signal == SIGINT ? "SIGINT" : "SIGTERM", t->state.step);
            LOOM_TRY(save_checkpoint(t));
            fprintf(stderr, "train: resume with: loom train ... --resume %s\n", o->out);
            return LOOM_OK;
        }
    }
    train_report_end_line(&t->report);
    LOOM_TRY(save_checkpoint(t));
    char model_dir[4200];
    snprintf(model_dir, sizeof model_dir, "%s/model", o->out);
    LOOM_TRY(loom_model_dir_save(t->m, LOOM_F32, t->has_tokenizer ? t->tokenizer_path : NULL, model_dir));
    fprintf(stderr, "train: done; model in %s\n", model_dir);
    return LOOM_OK;
}

static int run(int argc, char **argv) {
    trainer t;
    memset(&t, 0, sizeof t);
    train_opts *o = &t.o;
    *o = (train_opts){.out = "out", .preset = "tiny", .precision = "bf16", .master_grad = "on",
                      .recompute = "none", .recompute_mode = "nonreentrant", .batch = 8, .seq = 0,
                      .grad_accum = 1, .steps = 100, .warmup = 10, .seed = 1337, .threads = 0, .eval_every = 50,
                      .eval_batches = 4, .ckpt_every = 0, .keep = 2, .log_every = 1, .lr = 1e-3f, .min_lr = -1.0f,
                      .weight_decay = 0.1f, .clip = 1.0f};
    const flag flags[] = {
        {"data", FLAG_STRING, &o->data, "DIR", "token shards (train_*.bin, val_*.bin) and tokenizer.json (required)"},
        {"out", FLAG_STRING, &o->out, "DIR", "output: checkpoints, metrics, plot, final model (default out)"},
        {"preset", FLAG_STRING, &o->preset, "NAME", "model preset: tiny or small (default tiny)"},
        {"config", FLAG_STRING, &o->config, "FILE", "model from a Hugging Face config.json instead of a preset"},
        {"tie-embeddings", FLAG_BOOL, &o->tie, NULL, "share the embedding and lm_head weights (presets)"},
        {"init", FLAG_STRING, &o->init, "DIR", "start from the weights of a model directory"},
        {"resume", FLAG_STRING, &o->resume, "DIR", "continue from a checkpoint (or the latest in DIR)"},
        {"batch", FLAG_INT, &o->batch, "B", "sequences per micro-batch (default 8)"},
        {"seq", FLAG_INT, &o->seq, "T", "sequence length (default min(256, context))"},
        {"grad-accum", FLAG_INT, &o->grad_accum, "K", "micro-batches per optimizer step (default 1)"},
        {"steps", FLAG_INT, &o->steps, "N", "optimizer steps in total (default 100)"},
        {"lr", FLAG_FLOAT, &o->lr, "X", "peak learning rate (default 1e-3)"},
        {"min-lr", FLAG_FLOAT, &o->min_lr, "X", "final learning rate of the cosine (default lr/10)"},
        {"warmup", FLAG_INT, &o->warmup, "N", "linear warmup steps (default 10)"},
        {"weight-decay", FLAG_FLOAT, &o->weight_decay, "X", "AdamW decoupled weight decay, not on norms (default 0.1)"},
        {"clip", FLAG_FLOAT, &o->clip, "X", "clip the global gradient norm to X; 0 disables (default 1.0)"},
        {"precision", FLAG_STRING, &o->precision, "P", "fp32, bf16 or fp16 (default bf16)"},
        {"master-grad", FLAG_STRING, &o->master_grad, "on|off", "fp32 main_grad for every weight (default on)"},
        {"recompute", FLAG_STRING, &o->recompute, "MODE", "none, selective or full (default none)"},
        {"recompute-mode", FLAG_STRING, &o->recompute_mode, "M", "full recompute: reentrant or nonreentrant (default)"},
        {"seed", FLAG_INT, &o->seed, "N", "seed for initialisation (default 1337)"},
        {"threads", FLAG_INT, &o->threads, "N", "OpenMP threads (default: all cores)"},
        {"eval-every", FLAG_INT, &o->eval_every, "N", "validation loss every N steps; 0 disables (default 50)"},
        {"eval-batches", FLAG_INT, &o->eval_batches, "N", "validation batches per evaluation (default 4)"},
        {"ckpt-every", FLAG_INT, &o->ckpt_every, "N", "checkpoint every N steps; 0: only at the end (default 0)"},
        {"keep", FLAG_INT, &o->keep, "K", "checkpoints to keep (default 2)"},
        {"log-every", FLAG_INT, &o->log_every, "N", "plain progress line every N steps when not a terminal (default 1)"},
        {"check-grads", FLAG_BOOL, &o->check_grads, NULL, "gradient audit after every backward"},
        {"dump-grads", FLAG_STRING, &o->dump_grads, "FILE", "write the first step's gradients (fp32 safetensors) and exit"},
        {"dump-logits", FLAG_STRING, &o->dump_logits, "FILE", "write the first micro-batch's logits and loss (fp32 safetensors)"},
    };
    int n_flags = (int)(sizeof flags / sizeof flags[0]);
    int rc = cli_parse(&cmd_train, flags, n_flags, argc, argv);
    if (rc) return rc > 0 ? 0 : 2;
    if (!o->data) return cli_usage_error("train", "--data DIR is required (make shards with loom tokenize)");
    if (o->min_lr < 0.0f) o->min_lr = o->lr / 10.0f;
    loom_precision prec = {LOOM_BF16, 1};
    loom_recompute_mode mode = LOOM_RECOMPUTE_NONE;
    if ((rc = parse_settings(&t, &prec, &mode))) return rc;
    if (o->threads > 0) loom_set_threads(o->threads);
    loom_rng_init(loom_rng_default(), (uint64_t)o->seed);
    loom_loss_scaler_init(&t.scaler, prec.compute == LOOM_F16);

    char resume_dir[4096] = "";
    loom_status st = LOOM_OK;
    if (o->resume) st = resolve_resume(o->resume, resume_dir, sizeof resume_dir);
    if (st == LOOM_OK) st = build_model(&t, prec, mode, *resume_dir ? resume_dir : NULL);
    if (st == LOOM_OK) st = open_data(&t);
    if (st == LOOM_OK && *resume_dir) st = restore(&t, resume_dir);
    if (st == LOOM_OK) st = loom_mkdir_p(o->out);
    if (st == LOOM_OK) {
        snprintf(t.tokenizer_path, sizeof t.tokenizer_path, "%s/tokenizer.json", o->data);
        t.has_tokenizer = access(t.tokenizer_path, R_OK) == 0;
        char path[4200];
        snprintf(path, sizeof path, "%s/metrics.jsonl", o->out);
        t.metrics = fopen(path, *resume_dir ? "a" : "w");
        if (!t.metrics) st = loom_error(LOOM_ERR_IO, "cannot write %s (is the output directory writable?)", path);
    }
    if (st == LOOM_OK) {
        train_report_init(&t.report, o->log_every);
        fprintf(stderr, "train: %lld parameters, %s master_grad=%s recompute=%s, %d x %d sequences of %d tokens per step, %d threads\n",
                (long long)loom_llama_n_weights(t.m), loom_dtype_name(prec.compute), prec.master_grad ? "on" : "off",
                loom_recompute_mode_name(mode), o->grad_accum, o->batch, o->seq, loom_get_threads());
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
        st = train_loop(&t);
        if (st == LOOM_OK && !o->dump_grads) {
            char path[4200];
            snprintf(path, sizeof path, "%s/loss.svg", o->out);
            if (train_report_plot(&t.report, path) == LOOM_OK) fprintf(stderr, "train: loss plot in %s\n", path);
        }
    }
    cleanup(&t);
    return st == LOOM_OK ? 0 : cli_fail("train", st);
}

const command cmd_train = {
    "train",
    "train a LLaMA model on token shards",
    "train --data DIR [--preset tiny|small | --config FILE] [flags]",
    "Progress goes to stderr (a live line on a terminal, plain lines otherwise);\n"
    "metrics.jsonl, loss.svg, checkpoints (ckpt-NNNNNNNN/) and the final model (model/)\n"
    "go to --out. SIGINT or SIGTERM saves a checkpoint and stops; --resume continues\n"
    "bit-for-bit. --recompute selective always uses the non-reentrant machinery.",
    run,
};
