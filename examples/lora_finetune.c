/*
 * lora_finetune.c — LoRA fine-tuning through the library: a small LLaMA
 * made with its own weights frozen (loom_llama_new_lora), rank-4 adapters on
 * q, v and down trained for a few AdamW steps in bf16 with fp32 main_grad
 * under full recompute, then saved twice, merged (a plain model directory)
 * and as a PEFT adapter, and the adapter applied to the base again.
 *
 * It prints the loss of each step and the memory the weights, gradients and
 * optimizer hold, and exits with status 1 if the loss did not fall, if a
 * frozen weight moved, or if the base with the reloaded adapter does not
 * compute the trained model's loss.
 *
 * Build: it is built with loom (cmake); run ./lora_finetune [DIR] (DIR, a
 * scratch directory, defaults to a new one under /tmp).
 */
#include "loom/loom.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(expr)                                                                                   \
    do {                                                                                              \
        loom_status st_ = (expr);                                                                     \
        if (st_ != LOOM_OK) {                                                                         \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, loom_last_error()); \
            exit(2);                                                                                  \
        }                                                                                             \
    } while (0)

enum { B = 4, T = 32, STEPS = 12 };

/* A sequence with a rule to learn: each token is the previous one times 5
 * plus 3, modulo the vocabulary. */
static void batch(int32_t *tok, int32_t *tgt, int V) {
    for (int r = 0; r < B; r++) {
        int32_t x = (int32_t)(7 * r + 1) % V;
        for (int t = 0; t < T; t++) {
            tok[r * T + t] = x;
            x = (5 * x + 3) % V;
            tgt[r * T + t] = x;
        }
    }
}

static float loss_of(loom_llama *m, const int32_t *tok, const int32_t *tgt) {
    loom_tensor *loss = NULL;
    loom_no_grad_enter();
    CHECK(loom_llama_forward(m, tok, tgt, B, T, &loss, NULL));
    loom_no_grad_exit();
    float l = loom_tensor_get(loss, 0);
    loom_tensor_release(loss);
    return l;
}

int main(int argc, char **argv) {
    char dir[256];
    if (argc > 1) snprintf(dir, sizeof dir, "%s", argv[1]);
    else snprintf(dir, sizeof dir, "/tmp/loom-lora-example-XXXXXX");
    if (argc <= 1 && !mkdtemp(dir)) return 2;

    loom_llama_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.dim = 64; cfg.n_layers = 2; cfg.n_heads = 4; cfg.n_kv_heads = 2; cfg.ffn_dim = 128;
    cfg.vocab_size = 97; cfg.max_seq = T; cfg.rope_theta = 10000.0f; cfg.norm_eps = 1e-5f;
    loom_precision prec = {LOOM_BF16, 1};
    loom_lora_config lora = {.rank = 4, .alpha = 8.0f,
                             .targets = (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_V) | (1u << LOOM_LORA_DOWN)};

    /* The base model, saved, and the model to fine-tune: its own weights are
     * created frozen (no gradient, no fp32 master in bf16), then set to the
     * base's. */
    loom_llama *base;
    CHECK(loom_llama_new(&cfg, prec, &base));
    loom_llama_init_weights(base, 7);
    char base_dir[512], merged_dir[512], adapter_dir[512];
    snprintf(base_dir, sizeof base_dir, "%s/base", dir);
    snprintf(merged_dir, sizeof merged_dir, "%s/merged", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapter", dir);
    CHECK(loom_model_dir_save(base, LOOM_BF16, NULL, base_dir));
    loom_mem_stats before, after;
    loom_mem_get_stats(&before);
    loom_llama *m;
    CHECK(loom_llama_new_lora(&cfg, prec, &lora, 11, &m));
    CHECK(loom_model_dir_load_weights(m, base_dir));
    m->recompute.mode = LOOM_RECOMPUTE_NONREENTRANT; /* every block recomputed in the backward */

    /* The optimizer over the adapters only: m->params[n_base ..). */
    loom_adamw_config ac = loom_adamw_defaults();
    ac.weight_decay = 0.0f;
    loom_adamw *opt;
    CHECK(loom_adamw_new(&ac, m->params + m->n_base, m->n_params - m->n_base, &opt));
    loom_mem_get_stats(&after);
    printf("the LoRA model: %lld weights, %.3f MiB of them (bf16, frozen ones without an fp32 master), gradients "
           "%.3f MiB, optimizer %.3f MiB (the adapters' only)\n", (long long)loom_llama_n_weights(m),
           (double)(after.current[LOOM_MEM_PARAMS] - before.current[LOOM_MEM_PARAMS]) / 1048576.0,
           (double)(after.current[LOOM_MEM_GRADS] - before.current[LOOM_MEM_GRADS]) / 1048576.0,
           (double)(after.current[LOOM_MEM_OPTIMIZER] - before.current[LOOM_MEM_OPTIMIZER]) / 1048576.0);

    int32_t tok[B * T], tgt[B * T];
    batch(tok, tgt, cfg.vocab_size);
    float first = loss_of(m, tok, tgt), last = first;
    for (int step = 1; step <= STEPS; step++) {
        loom_llama_zero_grad(m);
        loom_tensor *loss = NULL;
        CHECK(loom_llama_forward(m, tok, tgt, B, T, &loss, NULL));
        last = loom_tensor_get(loss, 0);
        CHECK(loom_backward(loss, 1.0f));
        loom_tensor_release(loss);
        CHECK(loom_grad_audit(m->params, m->n_params, NULL, 0)); /* every adapter got its gradient */
        CHECK(loom_adamw_step(opt, 2e-2f, 1.0f));
        printf("step %2d  loss %.4f\n", step, (double)last);
    }
    last = loss_of(m, tok, tgt);
    printf("loss %.4f -> %.4f\n", (double)first, (double)last);

    /* The frozen weights did not move: they are the base's, bit for bit. */
    int moved = 0;
    for (int i = 0; i < m->n_base; i++)
        moved |= memcmp(loom_tensor_data(m->params[i]->tensor), loom_tensor_data(base->params[i]->tensor),
                        loom_tensor_nbytes(base->params[i]->tensor)) != 0;

    /* Saved merged, and as a PEFT adapter; the adapter applied to the base again. */
    CHECK(loom_model_dir_save(m, LOOM_F32, NULL, merged_dir));
    CHECK(loom_lora_save_peft(m, adapter_dir, base_dir));
    loom_llama *again;
    CHECK(loom_model_dir_load(base_dir, prec, &again));
    CHECK(loom_lora_load_peft(again, adapter_dir));
    float reloaded = loss_of(again, tok, tgt);
    printf("base + %s: loss %.4f; merged model in %s\n", adapter_dir, (double)reloaded, merged_dir);

    int ok = last < first && !moved && reloaded == last;
    if (!ok)
        fprintf(stderr, "lora_finetune: %s\n", !(last < first) ? "the loss did not fall"
                                               : moved         ? "a frozen weight moved"
                                                               : "the reloaded adapter computes another loss");
    loom_llama_free(again);
    loom_adamw_free(opt);
    loom_llama_free(m);
    loom_llama_free(base);
    return ok ? 0 : 1;
}
