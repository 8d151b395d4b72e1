/*
 * cmd_export.c — `loom export`: write a model (a model directory or a
 * training checkpoint) as a Hugging Face LLaMA directory (config.json and
 * model.safetensors with Hugging Face tensor names, fp32, bf16 or fp16) or as
 * one GGUF file for llama.cpp (also in Q8_0).
 */
#include "cli.h"

#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* The tokenizer at tok_path, checked against the model's vocabulary. */
static loom_status load_tokenizer(const char *tok_path, const loom_llama *m, loom_tokenizer **tok) {
    LOOM_TRY(loom_tokenizer_load(tok_path, tok));
    if (loom_tokenizer_vocab_size(*tok) <= m->cfg.vocab_size) return LOOM_OK;
    loom_status st = loom_error(LOOM_ERR_INVALID, "the tokenizer %s has %d tokens but the model only %d: give the "
                                "tokenizer the model was trained with", tok_path, loom_tokenizer_vocab_size(*tok),
                                m->cfg.vocab_size);
    loom_tokenizer_free(*tok);
    *tok = NULL;
    return st;
}

static int run(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *dtype = "fp32", *format = "hf", *tokenizer = NULL, *adapter = NULL;
    const flag flags[] = {
        {"model", FLAG_STRING, &model, "DIR", "model directory or checkpoint (config.json + model.safetensors or its shards' index)"},
        {"out", FLAG_STRING, &out, "PATH", "output: a directory (created) for hf, a file for gguf"},
        {"format", FLAG_STRING, &format, "F", "hf (config.json + model.safetensors, the default) or gguf (one file for llama.cpp)"},
        {"dtype", FLAG_STRING, &dtype, "D", "stored dtype: fp32, bf16 or fp16, for gguf also q8_0 (default fp32; gguf keeps norm weights fp32)"},
        {"tokenizer", FLAG_STRING, &tokenizer, "FILE", "tokenizer to ship with the model: loom's, or a Hugging Face BPE, copied; gguf needs loom's (default: the model's tokenizer.json, if any)"},
        {"adapter", FLAG_STRING, &adapter, "DIR", "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to merge into the model's weights"},
    };
    int rc = cli_parse(&cmd_export, flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc > 0 ? 0 : 2;
    if (!model || !out) return cli_usage_error("export", "--model DIR and --out PATH are required");
    int gguf = strcmp(format, "gguf") == 0;
    if (!gguf && strcmp(format, "hf") != 0)
        return cli_usage_error("export", "--format must be hf or gguf, not '%s'", format);
    loom_dtype dt = LOOM_F32;
    loom_gguf_type gt = LOOM_GGUF_F32;
    if (gguf ? loom_gguf_type_parse(dtype, &gt) != LOOM_OK : loom_dtype_parse(dtype, &dt) != LOOM_OK)
        return cli_usage_error("export", "--dtype: %s%s", loom_last_error(),
                               !gguf && strcasecmp(dtype, "q8_0") == 0 ? " (q8_0 is for --format gguf)" : "");
    struct stat sb;
    size_t out_len = strlen(out);
    if (gguf && out[out_len - 1] == '/')
        return cli_usage_error("export", "--out %s ends in '/'; --format gguf writes one file (e.g. --out "
                               "%smodel.gguf)", out, out);
    if (gguf && stat(out, &sb) == 0 && S_ISDIR(sb.st_mode))
        return cli_usage_error("export", "%s is a directory; --format gguf writes one file (e.g. --out model.gguf)", out);
    /* A dataset directory would get this model's tokenizer over the one its
     * shards were made with. */
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/train_000000.bin", out);
    if (!gguf && access(probe, F_OK) == 0)
        return cli_usage_error("export", "%s holds token shards (train_000000.bin): exporting there would replace "
                               "the tokenizer they were made with; use another --out", out);
    if (tokenizer && access(tokenizer, R_OK) != 0)
        return cli_usage_error("export", "cannot read the tokenizer %s", tokenizer);
    if ((rc = cli_check_model_dir("export", model))) return rc;
    char own_tok[4200];
    snprintf(own_tok, sizeof own_tok, "%s/tokenizer.json", model);
    if (!tokenizer && access(own_tok, R_OK) == 0) tokenizer = own_tok;
    if (gguf && !tokenizer)
        return cli_usage_error("export", "%s has no tokenizer.json, and a GGUF file must carry the vocabulary: give "
                               "the tokenizer the model was trained with, --tokenizer FILE", model);
    loom_precision prec = {LOOM_F32, 0};
    loom_llama *m = NULL;
    loom_tokenizer *tok = NULL;
    loom_status st = loom_model_dir_load(model, prec, &m);
    int64_t n_weights = st == LOOM_OK ? loom_llama_n_weights(m) : 0;
    if (st == LOOM_OK && adapter) st = loom_lora_load_peft(m, adapter); /* saved merged */
    if (st == LOOM_OK && tokenizer) st = load_tokenizer(tokenizer, m, &tok);
    if (st == LOOM_OK) st = gguf ? loom_llama_save_gguf(m, gt, tok, out) : loom_model_dir_save(m, dt, tokenizer, out);
    loom_tokenizer_free(tok);
    if (st == LOOM_OK)
        fprintf(stderr, "export: %lld parameters as %s %s to %s%s%s%s\n", (long long)n_weights,
                gguf ? "GGUF" : "Hugging Face", gguf ? loom_gguf_type_name(gt) : loom_dtype_name(dt), out,
                adapter ? ", the adapter " : "", adapter ? adapter : "",
                tokenizer ? "" : " (no tokenizer: the model directory has no tokenizer.json)");
    loom_llama_free(m);
    return st == LOOM_OK ? 0 : cli_fail("export", st);
}

const command cmd_export = {
    "export",
    "export a model as a Hugging Face LLaMA directory or a GGUF file for llama.cpp",
    "export --model DIR --out PATH [--format hf|gguf] [--dtype fp32|bf16|fp16|q8_0] [--tokenizer FILE] "
    "[--adapter DIR]",
    "--format gguf writes one GGUF file (version 3) that llama.cpp runs as a \"llama\"\n"
    "model: the weights under llama.cpp's names (q/k rows reordered for its RoPE), the\n"
    "tokenizer as a byte-level BPE vocabulary with <|endoftext|> as BOS and EOS;\n"
    "--dtype q8_0 stores the matrices in ggml's 8-bit blocks.\n"
    "--adapter DIR merges a PEFT LoRA adapter (loom train --lora writes one in\n"
    "RUN/adapter) into the weights it adapts: W + lora_alpha/r B A (/sqrt(r) with\n"
    "use_rslora; with use_dora each row then scaled to its magnitude). A\n"
    "generation_config.json beside the model is copied (its eos_token_id tells\n"
    "generators where to stop).\n"
    "Import needs no command: loom train --init DIR and loom generate --model DIR read\n"
    "Hugging Face LLaMA directories (config.json + model.safetensors, or the shards that\n"
    "model.safetensors.index.json names) directly; export writes one model.safetensors.",
    run,
};
