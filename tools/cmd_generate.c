/*
 * cmd_generate.c — `loom generate`: load a model directory and its
 * tokenizer, encode a prompt, sample with a KV cache, print the text.
 */
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <sys/stat.h>

#include <stdlib.h>
#include <string.h>

static int generate(int argc, char **argv, string_list *stop_names);

/* The --stop list the parser allocates is freed on every way out. */
static int run(int argc, char **argv) {
    string_list stop_names = {0};
    int rc = generate(argc, argv, &stop_names);
    free(stop_names.items);
    return rc;
}

static int generate(int argc, char **argv, string_list *stop_names) {
    const char *model = NULL, *prompt = "", *precision = "fp32", *tok_path = NULL, *adapter = NULL;
    /* Sampling flags not given (NAN, INT_MIN) take generation_config.json's
     * (Hugging Face's generate), else loom's defaults: 0.8, 0.95, 0. */
    int n_tokens = 128, seed = 1, threads = 0, top_k = INT_MIN;
    float temperature = NAN, top_p = NAN, rep_penalty = NAN, min_p = NAN;
    const flag flags[] = {
        {"model", FLAG_STRING, &model, "DIR", "model directory (config.json, model.safetensors or its shards' index, tokenizer.json)"},
        {"prompt", FLAG_TEXT, &prompt, "TEXT", "text to continue (default: start of a document)"},
        {"tokens", FLAG_INT, &n_tokens, "N", "tokens to generate (default 128)"},
        {"temperature", FLAG_FLOAT, &temperature, "T", "sampling temperature; 0 is greedy (default: as the model's generation_config.json asks, as Hugging Face's generate reads it: greedy unless its do_sample is true, else its temperature, 1 if none; without the file 0.8)"},
        {"top-p", FLAG_FLOAT, &top_p, "P", "nucleus sampling mass in (0, 1] (default: generation_config.json's top_p, 1 if none; without the file 0.95)"},
        {"top-k", FLAG_INT, &top_k, "K", "sample among the K most probable tokens only, then the nucleus; 0: all (default: generation_config.json's top_k, 50 if none; without the file 0)"},
        {"min-p", FLAG_FLOAT, &min_p, "P", "after top-k and the nucleus, keep only tokens at least P times as probable as the most probable one, P in [0, 1]; 0: none (default: generation_config.json's min_p when it samples, else 0)"},
        {"repetition-penalty", FLAG_FLOAT, &rep_penalty, "R", "Hugging Face's repetition penalty: the logit of every token the prompt or the output holds is divided by R when positive, multiplied when negative; 1: none (default: generation_config.json's repetition_penalty, else 1)"},
        {"seed", FLAG_INT, &seed, "S", "sampling seed (default 1)"},
        {"precision", FLAG_STRING, &precision, "P", "compute dtype: fp32, bf16 or fp16 (default fp32)"},
        {"tokenizer", FLAG_STRING, &tok_path, "FILE", "tokenizer.json, loom's or a Hugging Face BPE (default: the model directory's)"},
        {"adapter", FLAG_STRING, &adapter, "DIR", "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to apply"},
        {"stop", FLAG_LIST, stop_names, "TOKEN...", "also stop at these tokens, each named by the text it decodes to (e.g. <|eot_id|>); the end-of-text token, and the eos_token_id of the model directory's generation_config.json (as Hugging Face's generate), always stop"},
        {"threads", FLAG_INT, &threads, "N", "OpenMP threads (default: OMP_NUM_THREADS, else the cores this process may use)"},
    };
    int rc = cli_parse(&cmd_generate, flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc > 0 ? 0 : 2;
    if (!model) return cli_usage_error("generate", "--model DIR is required");
    if (n_tokens < 0) return cli_usage_error("generate", "--tokens must be >= 0");
    if ((!isnan(temperature) && temperature < 0.0f) || (!isnan(top_p) && !(top_p > 0.0f && top_p <= 1.0f)) ||
        (top_k != INT_MIN && top_k < 0) || (!isnan(rep_penalty) && !(rep_penalty > 0.0f)) ||
        (!isnan(min_p) && !(min_p >= 0.0f && min_p <= 1.0f)))
        return cli_usage_error("generate", "--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0, "
                               "--min-p in [0, 1] and --repetition-penalty > 0");
    loom_precision prec = {LOOM_F32, 0};
    if (loom_dtype_parse(precision, &prec.compute) != LOOM_OK) return cli_usage_error("generate", "%s", loom_last_error());
    if ((rc = cli_apply_threads("generate", threads))) return rc;

    /* The model first: a wrong --model is named as such, not as a missing
     * tokenizer. A training run's --out holds its model in DIR/model. */
    char path[4200];
    struct stat sb;
    if ((rc = cli_check_model_dir("generate", model))) return rc;
    int default_tok = !tok_path;
    if (default_tok) {
        snprintf(path, sizeof path, "%s/tokenizer.json", model);
        tok_path = path;
        if (stat(path, &sb) != 0)
            return cli_usage_error("generate", "%s has no tokenizer.json (a model trained without one beside its "
                                   "data): give the data's with --tokenizer FILE", model);
    }
    loom_tokenizer *tok = NULL;
    loom_llama *m = NULL;
    int32_t *ids = NULL, *out = NULL;
    char *text = NULL;
    loom_status st = loom_tokenizer_load(tok_path, &tok);
    if (st == LOOM_OK) st = loom_model_dir_load(model, prec, &m);
    if (st == LOOM_OK && adapter) st = loom_lora_load_peft(m, adapter);
    if (st == LOOM_OK && loom_tokenizer_vocab_size(tok) > m->cfg.vocab_size)
        st = loom_error(LOOM_ERR_FORMAT, "%s has %d tokens but the model only %d", tok_path,
                        loom_tokenizer_vocab_size(tok), m->cfg.vocab_size);
    size_t plen = strlen(prompt), n_ids = 0;
    if (st == LOOM_OK) {
        ids = malloc((loom_tokenizer_max_ids(tok, plen) + 2) * sizeof *ids);
        out = malloc(((size_t)n_tokens + 1) * sizeof *out);
        if (!ids || !out) st = loom_error(LOOM_ERR_NOMEM, "generate: out of memory");
    }
    if (st == LOOM_OK) {
        int bos = loom_tokenizer_bos(tok);
        if (bos >= 0) ids[n_ids++] = bos; /* documents start with it, as in training */
        size_t n = 0;
        st = loom_tokenizer_encode(tok, prompt, plen, ids + n_ids, loom_tokenizer_max_ids(tok, plen) + 1, &n);
        n_ids += n;
    }
    int n_out = 0, n_stops = 0, n_eos = 0;
    int32_t eos[LOOM_EOS_IDS_MAX];
    if (st == LOOM_OK) st = loom_model_dir_eos_ids(model, eos, LOOM_EOS_IDS_MAX, &n_eos); /* generation_config.json's */
    int32_t *stops = st == LOOM_OK ? malloc(((size_t)stop_names->n + 1 + (size_t)n_eos) * sizeof *stops) : NULL;
    if (st == LOOM_OK && !stops) st = loom_error(LOOM_ERR_NOMEM, "generate: out of memory");
    if (st == LOOM_OK && loom_tokenizer_eot(tok) >= 0) stops[n_stops++] = loom_tokenizer_eot(tok);
    for (int i = 0; st == LOOM_OK && i < n_eos; i++) stops[n_stops++] = eos[i]; /* one the sampler never draws: no stop */
    for (int i = 0; st == LOOM_OK && i < stop_names->n; i++) {
        int32_t id = loom_tokenizer_find(tok, stop_names->items[i], strlen(stop_names->items[i]));
        if (id < 0)
            st = loom_error(LOOM_ERR_INVALID, "generate: --stop %s: no token of %s is spelled so (give a token's "
                            "exact text, such as a special token's name)", stop_names->items[i], tok_path);
        else stops[n_stops++] = id;
    }
    /* The flags given, then generation_config.json's (Hugging Face's generate), else loom's defaults. */
    unsigned given = (isnan(temperature) ? 0u : 1u) | (isnan(top_p) ? 0u : 2u) | (top_k == INT_MIN ? 0u : 4u) |
                     (isnan(rep_penalty) ? 0u : 16u) | (isnan(min_p) ? 0u : 32u);
    unsigned from_file = 0;
    loom_sampler sp = {isnan(temperature) ? 0.8f : temperature, isnan(top_p) ? 0.95f : top_p, (uint64_t)seed,
                       loom_tokenizer_vocab_size(tok), top_k == INT_MIN ? 0 : top_k,
                       isnan(rep_penalty) ? 1.0f : rep_penalty, isnan(min_p) ? 0.0f : min_p};
    if (st == LOOM_OK) st = loom_model_dir_sampler(model, given, &sp, &from_file);
    if (st == LOOM_OK && (from_file & 8u))
        fprintf(stderr, "generate: greedy, as %s/%s asks (its do_sample is not true; --temperature T samples)\n",
                model, LOOM_GENERATION_CONFIG);
    else if (st == LOOM_OK && (from_file & 39u))
        fprintf(stderr, "generate: sampling as %s/%s asks, the flags given over it: temperature %g, top-p %g, "
                "top-k %d, min-p %g\n", model, LOOM_GENERATION_CONFIG, (double)sp.temperature, (double)sp.top_p,
                sp.top_k, (double)sp.min_p);
    if (st == LOOM_OK && (from_file & 16u))
        fprintf(stderr, "generate: repetition penalty %g, as %s/%s asks\n", (double)sp.repetition_penalty, model,
                LOOM_GENERATION_CONFIG);
    if (st == LOOM_OK) st = loom_llama_generate_until(m, ids, (int)n_ids, n_tokens, &sp, stops, n_stops, out, &n_out);
    int ended = 0;
    for (int k = 0; n_out > 0 && k < n_stops; k++) ended |= out[n_out - 1] == stops[k];
    free(stops);
    if (st == LOOM_OK && n_out < n_tokens && !ended && (int)n_ids + n_out >= m->cfg.max_seq)
        fprintf(stderr, "generate: stopped after %d of %d tokens: the model's context (%d tokens) is full\n", n_out,
                n_tokens, m->cfg.max_seq);
    if (st == LOOM_OK && ended) n_out--;
    size_t bytes = 0;
    if (st == LOOM_OK) st = loom_tokenizer_decode(tok, out, (size_t)n_out, NULL, 0, &bytes);
    if (st == LOOM_OK && !(text = malloc(bytes + 1))) st = loom_error(LOOM_ERR_NOMEM, "generate: out of memory");
    if (st == LOOM_OK) st = loom_tokenizer_decode(tok, out, (size_t)n_out, text, bytes, &bytes);
    if (st == LOOM_OK) {
        fwrite(prompt, 1, plen, stdout);
        fwrite(text, 1, bytes, stdout);
        fputc('\n', stdout);
        if (fflush(stdout) != 0 || ferror(stdout)) /* a full disk or a closed pipe: the text is lost */
            st = loom_error(LOOM_ERR_IO, "cannot write the text to standard output: %s%s", strerror(errno),
                            errno == ENOSPC ? " (disk full?)" : "");
    }
    free(text);
    free(ids);
    free(out);
    loom_llama_free(m);
    loom_tokenizer_free(tok);
    return st == LOOM_OK ? 0 : cli_fail("generate", st);
}

const command cmd_generate = {
    "generate",
    "generate text from a trained model (KV cache; greedy when --temperature 0)",
    "generate --model DIR [--adapter DIR] [--prompt TEXT] [--tokens N] [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--repetition-penalty R] [--seed S] "
    "[--stop TOKEN...]",
    NULL,
    run,
};
