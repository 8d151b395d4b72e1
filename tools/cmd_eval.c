/*
 * cmd_eval.c — `loom eval`: the mean loss and perplexity of a model on token
 * shards (by default one pass over a dataset's validation split), with the
 * batches a training run's validation reads.
 */
#include "cli.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* LOOM_ERR_INVALID when the model's tokenizer.json and the one beside a
 * shard (in its directory, where loom tokenize writes it) both exist and
 * differ: the ids would mean other text. */
static loom_status same_tokenizer(const char *model, const loom_dataloader *dl) {
    char a[4200], b[4200];
    struct stat sb;
    snprintf(a, sizeof a, "%s/tokenizer.json", model);
    if (stat(a, &sb) != 0) return LOOM_OK;
    void *x = NULL;
    size_t nx = 0;
    LOOM_TRY(loom_read_file(a, &x, &nx));
    loom_status st = LOOM_OK;
    char last[4200] = ""; /* shards come sorted: a directory's together, read once */
    for (size_t i = 0; st == LOOM_OK && i < loom_dataloader_num_shards(dl); i++) {
        const char *shard = loom_dataloader_shard_path(dl, i), *slash = strrchr(shard, '/');
        int dir_len = slash ? (int)(slash - shard) : 1;
        snprintf(b, sizeof b, "%.*s/tokenizer.json", dir_len, slash ? shard : ".");
        if (!strcmp(b, last) || stat(b, &sb) != 0) continue;
        snprintf(last, sizeof last, "%s", b);
        void *y = NULL;
        size_t ny = 0;
        st = loom_read_file(b, &y, &ny);
        if (st == LOOM_OK && (nx != ny || memcmp(x, y, nx) != 0))
            st = loom_error(LOOM_ERR_INVALID, "%s was made with another tokenizer than the model's (%s differs from "
                            "%s): tokenize the text again with loom tokenize --tokenizer %s --in FILE... --out DIR",
                            shard, b, a, a);
        free(y);
    }
    free(x);
    return st;
}

/* --seq's default: the model's context, but not the 32k to 128k of some
 * imported models, whose activations and attention would not fit. */
#define EVAL_SEQ_CAP 4096
#define EVAL_STR_(x) #x
#define EVAL_STR(x) EVAL_STR_(x)

static int run(int argc, char **argv) {
    const char *model = NULL, *data = NULL, *split = NULL, *precision = "fp32", *adapter = NULL;
    int batch = 8, seq = 0, batches = 0, threads = 0;
    const flag flags[] = {
        {"model", FLAG_STRING, &model, "DIR", "model directory or checkpoint"},
        {"adapter", FLAG_STRING, &adapter, "DIR", "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to apply"},
        {"data", FLAG_STRING, &data, "PATH", "token shards: a dataset directory, a glob or one file"},
        {"split", FLAG_STRING, &split, "S", "which shards of a dataset directory: val or train (default val)"},
        {"batch", FLAG_INT, &batch, "B", "sequences per batch (default 8)"},
        {"seq", FLAG_INT, &seq, "T", "tokens per sequence (default: the model's context length, at most " EVAL_STR(EVAL_SEQ_CAP) ")"},
        {"batches", FLAG_INT, &batches, "N", "N batches from the first, as a run's validation reads them; 0: one pass (default 0)"},
        {"precision", FLAG_STRING, &precision, "P", "compute dtype: fp32, bf16 or fp16 (default fp32)"},
        {"threads", FLAG_INT, &threads, "N", "OpenMP threads (default: OMP_NUM_THREADS, else the cores this process may use)"},
    };
    int rc = cli_parse(&cmd_eval, flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc > 0 ? 0 : 2;
    if (!model || !data) return cli_usage_error("eval", "--model DIR and --data PATH are required");
    if (batch <= 0 || seq < 0 || batches < 0)
        return cli_usage_error("eval", "--batch must be positive, --seq and --batches >= 0");
    if (split && strcmp(split, "val") != 0 && strcmp(split, "train") != 0)
        return cli_usage_error("eval", "--split must be val or train, not '%s'", split);
    struct stat sb;
    int is_dir = stat(data, &sb) == 0 && S_ISDIR(sb.st_mode);
    if (split && !is_dir)
        return cli_usage_error("eval", "--split chooses among a dataset directory's shards; %s is a file or a glob, "
                               "which names its shards itself", data);
    if (!split) split = "val";
    if (seq > 0 && (size_t)batch * (size_t)seq > (size_t)1 << 30)
        return cli_usage_error("eval", "--batch %d x --seq %d is more than 2^30 tokens per batch: lower --batch or "
                               "--seq", batch, seq);
    loom_precision prec = {LOOM_F32, 0};
    if (loom_dtype_parse(precision, &prec.compute) != LOOM_OK) return cli_usage_error("eval", "%s", loom_last_error());
    if ((rc = cli_apply_threads("eval", threads))) return rc;
    if ((rc = cli_check_model_dir("eval", model))) return rc;

    loom_llama *m = NULL;
    loom_dataloader *dl = NULL;
    int32_t *inputs = NULL, *targets = NULL;
    loom_status st = loom_model_dir_load(model, prec, &m);
    if (st == LOOM_OK && adapter) st = loom_lora_load_peft(m, adapter);
    if (st == LOOM_OK && seq == 0) seq = m->cfg.max_seq < EVAL_SEQ_CAP ? m->cfg.max_seq : EVAL_SEQ_CAP;
    if (st == LOOM_OK && seq > m->cfg.max_seq) {
        int max_seq = m->cfg.max_seq;
        loom_llama_free(m);
        return cli_usage_error("eval", "--seq %d is longer than the model's context (%d)", seq, max_seq);
    }
    if (st == LOOM_OK && (size_t)batch * (size_t)seq > (size_t)1 << 30)
        st = loom_error(LOOM_ERR_INVALID, "--batch %d x the default --seq %d is more than 2^30 tokens per batch: "
                        "lower --batch or --seq", batch, seq);
    if (st == LOOM_OK) {
        loom_dataloader_options o = {batch, seq, 0, 1, m->cfg.vocab_size, split};
        st = loom_dataloader_open(data, &o, &dl);
    }
    if (st == LOOM_OK) st = same_tokenizer(model, dl);
    if (st == LOOM_OK) {
        inputs = malloc((size_t)batch * seq * sizeof *inputs);
        targets = malloc((size_t)batch * seq * sizeof *targets);
        if (!inputs || !targets) st = loom_error(LOOM_ERR_NOMEM, "eval: out of memory for a batch");
    }
    /* With loss masks a batch's loss is the mean over its own targets: weigh
     * each by their count, so the result is the mean over every target. */
    int masked = st == LOOM_OK && loom_dataloader_num_masked(dl) > 0;
    double sum = 0.0, n_targets = 0.0;
    int done = 0;
    loom_no_grad_enter();
    while (st == LOOM_OK && (batches == 0 || done < batches)) {
        loom_dataloader_position pos;
        loom_dataloader_get_position(dl, &pos);
        if (batches == 0 && pos.epoch > 0) break; /* one pass; N batches wrap around, as validation does */
        loom_tensor *loss = NULL;
        st = loom_dataloader_next(dl, inputs, targets);
        if (st == LOOM_OK) st = loom_llama_forward(m, inputs, targets, batch, seq, &loss, NULL);
        double n = (double)batch * seq;
        if (masked && st == LOOM_OK) {
            n = 0.0;
            for (size_t i = 0; i < (size_t)batch * seq; i++) n += targets[i] >= 0;
        }
        if (st == LOOM_OK) sum += masked ? loom_tensor_get(loss, 0) * n : loom_tensor_get(loss, 0);
        n_targets += n;
        loom_tensor_release(loss);
        done++;
    }
    loom_no_grad_exit();
    if (st == LOOM_OK && n_targets == 0.0)
        st = loom_error(LOOM_ERR_INVALID, "eval: the loss masks leave no target in these %d batches (prompts only): "
                        "read more batches (--batches 0 reads all)", done);
    if (st == LOOM_OK) {
        double mean = masked ? sum / n_targets : sum / done;
        if (!isfinite(mean))
            st = loom_error(LOOM_ERR_NUMERIC, "the loss is %g: the model's weights or this precision overflow "
                            "(try --precision fp32)", mean);
        else
            printf("eval: data=%s%s%s batches=%d tokens=%lld targets=%lld loss=%.6f ppl=%.4f\n", data,
                   is_dir ? " split=" : "", is_dir ? split : "", done, (long long)done * batch * seq,
                   (long long)n_targets, mean, exp(mean));
    }
    free(inputs);
    free(targets);
    loom_dataloader_close(dl);
    loom_llama_free(m);
    return st == LOOM_OK ? 0 : cli_fail("eval", st);
}

const command cmd_eval = {
    "eval",
    "the loss and perplexity of a model on token shards (a dataset's validation split)",
    "eval --model DIR [--adapter DIR] --data PATH [--split val|train] [--batch B] [--seq T] [--batches N] [--precision P] "
    "[--threads N]",
    "Batches are read as training reads them: B rows of T+1 consecutive tokens from\n"
    "the first shard on; the loss is the mean over the batches' targets (the tokens a\n"
    "loss mask beside a shard does not leave out). With --batches N\n"
    "it reads N batches (wrapping around at the end, as a run's validation does), so\n"
    "it equals the validation loss of a one-process run with the same --batch, --seq,\n"
    "--precision and --eval-batches N. Shards beside a tokenizer.json that differs\n"
    "from the model's are refused.",
    run,
};
