/*
 * cmd_export.c — `loom export`: write a model (a model directory or a
 * training checkpoint) as a Hugging Face LLaMA directory: config.json and
 * model.safetensors with Hugging Face tensor names, in fp32, bf16 or fp16.
 */
#include "cli.h"

#include <string.h>
#include <unistd.h>

static int run(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *dtype = "fp32";
    const flag flags[] = {
        {"model", FLAG_STRING, &model, "DIR", "model directory or checkpoint (config.json + model.safetensors or its shards' index)"},
        {"out", FLAG_STRING, &out, "DIR", "output directory (created)"},
        {"dtype", FLAG_STRING, &dtype, "D", "stored dtype: fp32, bf16 or fp16 (default fp32)"},
    };
    int rc = cli_parse(&cmd_export, flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc > 0 ? 0 : 2;
    if (!model || !out) return cli_usage_error("export", "--model DIR and --out DIR are required");
    loom_dtype dt;
    if (loom_dtype_parse(dtype, &dt) != LOOM_OK) return cli_usage_error("export", "%s", loom_last_error());
    /* A dataset directory would get this model's tokenizer over the one its
     * shards were made with. */
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/train_000000.bin", out);
    if (access(probe, F_OK) == 0)
        return cli_usage_error("export", "%s holds token shards (train_000000.bin): exporting there would replace "
                               "the tokenizer they were made with; use another --out", out);
    if ((rc = cli_check_model_dir("export", model))) return rc;
    loom_precision prec = {LOOM_F32, 0};
    loom_llama *m = NULL;
    loom_status st = loom_model_dir_load(model, prec, &m);
    char tok[4200];
    snprintf(tok, sizeof tok, "%s/tokenizer.json", model);
    if (st == LOOM_OK) st = loom_model_dir_save(m, dt, access(tok, R_OK) == 0 ? tok : NULL, out);
    if (st == LOOM_OK)
        fprintf(stderr, "export: %lld parameters as %s to %s\n", (long long)loom_llama_n_weights(m), loom_dtype_name(dt), out);
    loom_llama_free(m);
    return st == LOOM_OK ? 0 : cli_fail("export", st);
}

const command cmd_export = {
    "export",
    "export a model as a Hugging Face LLaMA directory (safetensors + config.json)",
    "export --model DIR --out DIR [--dtype fp32|bf16|fp16]",
    "Import needs no command: loom train --init DIR and loom generate --model DIR read\n"
    "Hugging Face LLaMA directories (config.json + model.safetensors, or the shards that\n"
    "model.safetensors.index.json names) directly; export writes one model.safetensors.",
    run,
};
