/*
 * fuzz_adapter.c — loom_lora_load_peft with any bytes as a PEFT adapter's
 * adapter_config.json, beside a valid adapter_model.safetensors (rank 2 on
 * v_proj and up_proj of a tiny model): the setting is applied or refused
 * with a status, never a fault; an applied one has its adapters and a
 * valid LoRA setting. The corpus seed is that adapter's own config.
 */
#define _GNU_SOURCE /* nftw */
#include "fuzz_util.h"

#include <ftw.h>
#include <stdlib.h>
#include <string.h>

static char dir[256];
static const loom_llama_config cfg = {.dim = 8, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 16,
                                      .vocab_size = 16, .max_seq = 8, .rope_theta = 10000.0f, .norm_eps = 1e-5f};

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

static void remove_dir(void) { nftw(dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS); }

static loom_llama *base_model(void) {
    loom_precision prec = {LOOM_F32, 0};
    loom_llama *m;
    if (loom_llama_new(&cfg, prec, &m) != LOOM_OK) abort();
    return m;
}

/* The adapter directory, once (removed when the process exits). */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    loom_set_threads(1);
    snprintf(dir, sizeof dir, "/dev/shm/loom-fuzz-%ld-adapter", (long)getpid());
    loom_llama *m = base_model();
    loom_lora_config lc = {.rank = 2, .alpha = 4.0f, .targets = (1u << LOOM_LORA_V) | (1u << LOOM_LORA_UP)};
    if (loom_llama_add_lora(m, &lc, 1) != LOOM_OK || loom_lora_save_peft(m, dir, NULL) != LOOM_OK) abort();
    atexit(remove_dir);
    loom_llama_free(m);
    loom_llama *back = base_model(); /* the unfuzzed adapter loads: the harness reaches the success path */
    if (loom_lora_load_peft(back, dir) != LOOM_OK) abort();
    loom_llama_free(back);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[300];
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    fuzz_write_file(path, data, size);
    loom_llama *m = base_model();
    if (loom_lora_load_peft(m, dir) == LOOM_OK &&
        (m->lora.rank != 2 || !(m->lora.alpha > 0.0f) || !(m->lora.dropout >= 0.0f && m->lora.dropout < 1.0f) ||
         m->n_params != m->n_base + 4))
        abort();
    loom_llama_free(m);
    return 0;
}
