/*
 * fuzz_checkpoint.c — loom_checkpoint_load with any bytes as the
 * checkpoint's state.safetensors (a tiny model's checkpoint otherwise
 * whole), into that fp32 model and into a bf16 LoRA one (frozen weights
 * without masters, stored as bf16): the state's tensors and metadata are
 * taken or refused with a status, never a fault. The corpus seeds are the
 * two models' own states.
 */
#define _GNU_SOURCE /* nftw */
#include "fuzz_util.h"

#include <ftw.h>
#include <stdlib.h>
#include <string.h>

enum { N_MAX = 64 };
static loom_llama *model, *lora;
static float *adam_m[N_MAX], *adam_v[N_MAX];
static char dir[256], lora_dir[256];

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

static void remove_dir(void) {
    nftw(dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
    nftw(lora_dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
}

/* Save a checkpoint of a model with 8-wide hidden states once (removed when
 * the process exits). */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    loom_set_threads(1);
    loom_llama_config cfg = {.dim = 8, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 16,
                             .vocab_size = 16, .max_seq = 8, .rope_theta = 10000.0f, .norm_eps = 1e-5f};
    loom_precision prec = {LOOM_F32, 1};
    if (loom_llama_new(&cfg, prec, &model) != LOOM_OK || model->n_params > N_MAX) abort();
    for (int i = 0; i < model->n_params; i++) {
        size_t n = (size_t)loom_param_numel(model->params[i]);
        adam_m[i] = calloc(n, sizeof(float));
        adam_v[i] = calloc(n, sizeof(float));
        if (!adam_m[i] || !adam_v[i]) abort();
    }
    snprintf(dir, sizeof dir, "/dev/shm/loom-fuzz-%ld-ckpt", (long)getpid());
    loom_train_state st;
    memset(&st, 0, sizeof st);
    st.loss_scale = 1.0f;
    if (loom_checkpoint_save(dir, model, adam_m, adam_v, 3, &st, NULL) != LOOM_OK) abort();
    atexit(remove_dir);
    int adam_steps; /* the unfuzzed checkpoint loads: the harness reaches the success path */
    if (loom_checkpoint_load(dir, model, adam_m, adam_v, &adam_steps, &st) != LOOM_OK || adam_steps != 3) abort();
    /* The LoRA model: rank 2 on q and down; its moments are those of the adapters, after n_base. */
    loom_precision half = {LOOM_BF16, 1};
    loom_lora_config lc = {.rank = 2, .alpha = 4.0f, .targets = (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_DOWN)};
    if (loom_llama_new_lora(&cfg, half, &lc, 1, &lora) != LOOM_OK || lora->n_params > N_MAX) abort();
    for (int i = model->n_params; i < lora->n_params; i++) {
        adam_m[i] = calloc(64, sizeof(float)); /* the adapters are at most 16 x 2 */
        adam_v[i] = calloc(64, sizeof(float));
        if (!adam_m[i] || !adam_v[i]) abort();
    }
    snprintf(lora_dir, sizeof lora_dir, "/dev/shm/loom-fuzz-%ld-lora", (long)getpid());
    if (loom_checkpoint_save(lora_dir, lora, adam_m, adam_v, 3, &st, NULL) != LOOM_OK) abort();
    if (loom_checkpoint_load(lora_dir, lora, adam_m, adam_v, &adam_steps, &st) != LOOM_OK) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[300];
    snprintf(path, sizeof path, "%s/state.safetensors", dir);
    fuzz_write_file(path, data, size);
    int adam_steps;
    loom_train_state st;
    (void)loom_checkpoint_load(dir, model, adam_m, adam_v, &adam_steps, &st);
    snprintf(path, sizeof path, "%s/state.safetensors", lora_dir);
    fuzz_write_file(path, data, size);
    (void)loom_checkpoint_load(lora_dir, lora, adam_m, adam_v, &adam_steps, &st);
    return 0;
}
