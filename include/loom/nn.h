/*
 * loom/nn.h — layers built on the function interface: the fused linear and
 * the LLaMA model.
 */
#ifndef LOOM_NN_H
#define LOOM_NN_H

#include "loom/recompute.h"
#include "loom/ops.h"
#include "loom/amp.h"
#include "loom/dist.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y = x · W^T + b with x (..., K), W (M, K), b (M) or NULL. Backward
 * accumulates dW straight into W's parameter gradient (fp32 main_grad with
 * master-grad on) with one GEMM (beta = 1), and db into b's. Saves
 * (x, W, b) with b possibly NULL. */
loom_status loom_fused_linear(loom_tensor *x, loom_tensor *w, loom_tensor *b, loom_tensor **out);
const loom_function *loom_fused_linear_function(void);
/* y = base + scale · x · W^T with base (..., M) of x's dtype: one GEMM
 * (alpha = scale, beta = 1) into a copy of base, rounded once. Backward:
 * d base = dy, dx = scale dy · W, and scale dy^T · x into W's gradient as
 * loom_fused_linear does. Saves (x, W). */
loom_status loom_fused_linear_add(loom_tensor *x, loom_tensor *w, float scale, loom_tensor *base, loom_tensor **out);

/* ------------------------------------------------------------------ LLaMA */

/* The activation of the MLP's gate. */
typedef enum loom_activation { LOOM_ACT_SILU = 0, LOOM_ACT_GELU_TANH = 1 } loom_activation;

typedef struct loom_llama_config {
    int dim;          /* C */
    int n_layers;     /* L */
    int n_heads;      /* NH */
    int n_kv_heads;   /* NKV */
    int ffn_dim;      /* hidden size of the gated MLP (SwiGLU, or GeGLU: act) */
    int vocab_size;   /* V */
    int max_seq;      /* T at most */
    float rope_theta;
    float norm_eps;
    int tie_embeddings; /* lm_head shares model.embed_tokens.weight */
    /* RoPE scaling, Hugging Face's rope_scaling (loom_rope_freqs in core.h): none
     * (LOOM_ROPE_DEFAULT, zero), linear (factor), llama3 (all four),
     * longrope (Phi-3's: rope_original_max_pos, the context it was trained
     * at, its short factors rotating a forward within it and its long ones
     * one past it (loom_llama_layer_rope_at; a LLaMA file's longrope caps
     * max_seq at it instead); rope_factor, the context it extends to over
     * that; its attention factor and its short and long factors,
     * rope_n_ext = rotary size / 2 of each) or yarn
     * (rope_factor, rope_original_max_pos, rope_attention_factor and the
     * three fields below). */
    loom_rope_type rope_type;
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_pos;
    float rope_attention_factor;
    int rope_n_ext;
    float rope_short[LOOM_ROPE_EXT_MAX], rope_long[LOOM_ROPE_EXT_MAX];
    float rope_beta_fast, rope_beta_slow; /* yarn's correction range (Hugging Face's 32 and 1) */
    int rope_truncate;                     /* yarn's range floored and ceiled (Hugging Face's default, 1) */
    /* Phi-3's partial_rotary_factor (Phi-4-mini's 0.75; 0 or 1: the whole
     * head): the first int(head size x factor) of each head rotate, the
     * rest pass through (loom_llama_rotary_dim). */
    float partial_rotary_factor;
    /* Biases of the attention's linears (Hugging Face's "<linear>.bias"
     * tensors): qkv_bias on q, k and v (Qwen 2's model, model_type "qwen2"),
     * o_bias on o too (LLaMA's attention_bias, which sets both; o_bias
     * alone has no Hugging Face layout). */
    int qkv_bias, o_bias;
    /* Each attention head's size: 0 for LLaMA's dim / n_heads; else its own
     * (Hugging Face's head_dim: Mistral NeMo's 128 beside a dim of 5120), q
     * then projecting to n_heads x head_dim and o back from it. */
    int head_dim;
    /* Qwen 3's and Gemma 3's RMSNorm of each query and key head (weights of
     * head_dim, q_norm and k_norm; 1 + weight with Gemma's norms) after the
     * projection, before RoPE. */
    int qk_norm;
    /* Hugging Face's attention_dropout: in a training forward (gradients
     * on) each attention probability is dropped with this chance
     * (loom_attention_opts.dropout), the mask the whole global batch's, so
     * data- and tensor-parallel ranks together draw one process's;
     * evaluation and generation, as Hugging Face's, apply none. */
    float attention_dropout;
    /* The MLP's gate: SwiGLU (LOOM_ACT_SILU, zero) or GeGLU with the tanh
     * GELU (LOOM_ACT_GELU_TANH: Gemma's; Hugging Face's hidden_act
     * "gelu_pytorch_tanh"). */
    loom_activation act;
    /* Gemma's model (model_type "gemma"), both set: every RMSNorm scales by
     * 1 + its weight (weights stored as offsets from 1, initialized 0), and
     * the embeddings are multiplied by sqrt(dim) rounded to the compute
     * dtype (loom_llama_embed_scale). */
    int norm_unit_offset, scale_embeddings;
    /* Granite's multipliers (model_type "granite"; each 0: none): the
     * embeddings times embedding_multiplier, each block's attention and MLP
     * outputs times residual_multiplier before their residual adds, the
     * attention's scores times attention_multiplier instead of 1/sqrt(head
     * size) (loom_llama_attn_scale), the logits divided by logits_scaling. */
    float embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling;
    /* Phi-3's files (model_type "phi3"): q, k and v stored as one
     * self_attn.qkv_proj.weight (their rows in that order), gate and up as
     * one mlp.gate_up_proj.weight. The model holds them apart; only the
     * files' layout differs. */
    int fused_proj;
    /* SmolLM3's NoPE layers (model_type "smollm3"): every nope_interval-th
     * block (blocks l with (l + 1) % nope_interval == 0) rotates nothing;
     * 0: every block has RoPE. */
    int nope_interval;
    /* Gemma 2's model (model_type "gemma2", with Gemma's flags): post_norms
     * normalizes each block's attention and MLP outputs before their
     * residual adds (its post_attention_layernorm and
     * post_feedforward_layernorm; the MLP's input norm is then its
     * pre_feedforward_layernorm); the attention's scaled scores softcapped
     * at attn_softcap, the logits at final_softcap (c tanh(x / c); 0:
     * none); the scores scaled by query_pre_attn_scalar^-0.5 (0: the head
     * size's). */
    int post_norms;
    float attn_softcap, final_softcap, query_pre_attn_scalar;
    /* Sliding-window attention (0: none): in the blocks it applies to, the
     * query at position t sees only the sliding_window keys t -
     * sliding_window + 1 .. t. It applies to every block from window_from
     * on (Qwen's max_window_layers; 0 for Mistral's, Phi-3's, Gemma's)
     * except every window_global_interval-th, blocks l with (l + 1) %
     * interval == 0, which keep full attention (Gemma 2's 2, Gemma 3's 6;
     * 0: none).
     * Without a window both are 0. */
    int sliding_window, window_from, window_global_interval;
    /* Gemma 3's model (model_type "gemma3_text": Gemma 2's flags with
     * qk_norm, its q/k norms scaling by 1 + weight too): the blocks with a
     * window rotate with the plain RoPE of this theta (its
     * rope_local_base_freq), the others with rope_theta and the scaling;
     * 0: every block the same. */
    float rope_local_theta;
} loom_llama_config;

/* 1 when block `layer` of cfg applies RoPE (not one of SmolLM3's NoPE blocks). */
int loom_llama_layer_has_rope(const loom_llama_config *cfg, int layer);
/* The sliding window of block `layer` of cfg (loom_attention_opts.window): sliding_window in the
 * blocks it applies to, else 0 (full causal attention). */
int loom_llama_layer_window(const loom_llama_config *cfg, int layer);

/* The scale of the attention's scores: attention_multiplier, else
 * 1/sqrt(head size). */
float loom_llama_attn_scale(const loom_llama_config *cfg);
/* 1 when cfg has any of Granite's multipliers (its Hugging Face class). */
int loom_llama_has_multipliers(const loom_llama_config *cfg);

/* The factor of the embeddings in compute dtype dt: sqrt(dim) rounded to dt
 * with scale_embeddings (as Hugging Face's Gemma computes it), else 1. */
float loom_llama_embed_scale(const loom_llama_config *cfg, loom_dtype dt);

/* The attention's head size of a config: head_dim, or dim / n_heads. */
int loom_llama_head_dim(const loom_llama_config *cfg);
/* The part of each head RoPE turns: int(head size x partial_rotary_factor)
 * as Hugging Face's Phi-3 takes it, or the head size. */
int loom_llama_rotary_dim(const loom_llama_config *cfg);

/* The RoPE of a config: its theta and scaling. */
loom_rope_freqs loom_llama_rope(const loom_llama_config *cfg);
/* The RoPE of block `layer`: Gemma 3's local one (rope_local_theta, no
 * scaling) on its blocks with a window, else loom_llama_rope's. */
loom_rope_freqs loom_llama_layer_rope(const loom_llama_config *cfg, int layer);
/* The RoPE block `layer` of a forward over positions up to `positions` - 1
 * rotates with: loom_llama_layer_rope's, with longrope's long factors
 * (rope_long) in place of the short ones when positions passes the
 * original context (rope_original_max_pos), as Hugging Face's longrope
 * update compares the forward's largest position + 1 with it. A training
 * forward of T tokens passes T; a KV-cache step its last position + 1. */
loom_rope_freqs loom_llama_layer_rope_at(const loom_llama_config *cfg, int layer, int positions);

/* "tiny" (288/6/6/6/768/4096/256) and "small" (512/8/8/8/1376/8192/512). */
loom_status loom_llama_preset(const char *name, loom_llama_config *cfg);
/* Checks every field (positive sizes, heads divide dim, even head size…). */
loom_status loom_llama_config_validate(const loom_llama_config *cfg);
/* 1 when a and b give every weight the same shape (dim, layers, heads, kv
 * heads, head size, ffn, vocabulary, tying, biases, q/k norms) and meaning
 * (Gemma's norm weights are offsets from 1), so weights of one load into the
 * other; max_seq, the RoPE and norm_eps are not compared. */
int loom_llama_config_same_weights(const loom_llama_config *a, const loom_llama_config *b);
/* 1 when a and b compute the same model: the same weights and every other
 * field (max_seq, the RoPE, norm_eps, the activation, the scales; Granite's
 * multipliers by what they do, 0 and 1 the same). */
int loom_llama_config_same_model(const loom_llama_config *a, const loom_llama_config *b);
/* 1 when a and b have the same RoPE: theta and every scaling field. */
int loom_llama_config_same_rope(const loom_llama_config *a, const loom_llama_config *b);

/* The seven linears of a block that LoRA can adapt, in Hugging Face's
 * order (PEFT's target_modules names: q_proj .. down_proj). */
typedef enum loom_lora_target {
    LOOM_LORA_Q, LOOM_LORA_K, LOOM_LORA_V, LOOM_LORA_O, LOOM_LORA_GATE, LOOM_LORA_UP, LOOM_LORA_DOWN, LOOM_LORA_N
} loom_lora_target;

typedef struct loom_llama_layer {
    loom_param *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w_gate, *w_up, *w_down;
    loom_param *bq, *bk, *bv, *bo; /* the attention's biases (NULL: none; loom_llama_config) */
    loom_param *attn_post_norm, *mlp_post_norm; /* Gemma 2's norms of the outputs (NULL: none; post_norms) */
    loom_param *q_norm, *k_norm;   /* Qwen 3's per-head norms (NULL: none) */
    /* LoRA adapters of the linears (NULL: none): A (rank, in), B (out, rank);
     * with DoRA the magnitudes m (out) too. */
    loom_param *lora_a[LOOM_LORA_N], *lora_b[LOOM_LORA_N], *lora_m[LOOM_LORA_N];
} loom_llama_layer;

/* The weight of linear t of a layer (wq .. w_down). */
loom_param *loom_llama_layer_weight(const loom_llama_layer *y, loom_lora_target t);
/* Its bias (q, k, v, o only), or NULL when it has none. */
loom_param *loom_llama_layer_bias(const loom_llama_layer *y, loom_lora_target t);

/* LoRA (Hu et al., 2021, as PEFT computes it): each targeted linear
 * y = x W^T becomes y = x W^T + (alpha / rank) (x A^T) B^T with W frozen
 * and A, B trained; A starts uniform in +-1/sqrt(in) (PEFT's Kaiming
 * uniform), B at zero, so training starts from the base model exactly.
 * targets is a bit set of (1 << loom_lora_target); rank 0 means no LoRA.
 * With dropout, the adapter's input is dropout(x). With rslora the factor
 * is alpha / sqrt(rank) (rank-stabilised LoRA, Kalajdzievski 2023: PEFT's
 * use_rslora), which keeps the update's scale as the rank grows.
 * With dora (weight-decomposed LoRA, Liu et al. 2024: PEFT's use_dora) each
 * adapted linear also trains a magnitude per output, m (out), and computes
 * y = (m / n) (x W^T + s (x A^T) B^T), n the norms of the rows of
 * W + s B A, a constant in the backward (PEFT detaches it); m starts at the
 * norms of W's rows, so training starts from the base model exactly. With
 * dropout in training, y = x W^T + (m / n) (x' W^T + s (x' A^T) B^T) - x' W^T,
 * x' = dropout(x), as PEFT computes it. */
typedef struct loom_lora_config {
    int rank;
    float alpha;
    unsigned targets;
    /* PEFT's lora_dropout: inverted dropout with this probability, in [0, 1),
     * on each adapter's input, in forwards that record gradients (training)
     * only, not in no-grad ones (evaluation) nor in generation; replayed
     * with the same mask by every recompute mode. 0: none. */
    float dropout;
    int rslora; /* 1: alpha / sqrt(rank) */
    int dora;   /* 1: DoRA's magnitudes too */
} loom_lora_config;

/* The factor of the adapters' product: alpha / rank, or alpha / sqrt(rank)
 * with rslora (rounded once to float, as PyTorch rounds PEFT's Python
 * float). */
float loom_lora_scale(const loom_lora_config *c);

#define LOOM_LORA_ALL ((1u << LOOM_LORA_N) - 1u)

/* "q,k,v,o,gate,up,down" (any of them, comma-separated, or "all") into a
 * target set. Errors: LOOM_ERR_INVALID naming the unknown entry. */
loom_status loom_lora_targets_parse(const char *s, unsigned *targets);
/* The set as that list ("q,v"), into buf (n bytes). */
void loom_lora_targets_format(unsigned targets, char *buf, size_t n);
/* "q_proj" .. "down_proj". */
const char *loom_lora_target_name(loom_lora_target t);

typedef struct loom_llama loom_llama;

/* Per-block recompute settings. Blocks 0 .. blocks-1 run under `mode`, the
 * later ones keep their activations (LOOM_RECOMPUTE_NONE), as Megatron's
 * --recompute-num-layers: a step between none and all of the memory saved
 * and the time paid. blocks 0 (the default) or >= n_layers: every block.
 * Gradients are bit-identical whatever the split. */
typedef struct loom_llama_recompute {
    loom_recompute_mode mode;  /* NONE, REENTRANT, NONREENTRANT or SELECTIVE */
    int blocks;                /* how many blocks, from the first, use mode; 0: all */
} loom_llama_recompute;

/* What loom_llama_plan_recompute found: recompute blocks 0 .. blocks-1
 * under mode (blocks 0: none needed). Peaks are activation bytes
 * (LOOM_MEM_ACTIVATIONS) of a forward and backward, as measured. */
typedef struct loom_recompute_plan {
    loom_recompute_mode mode;
    int blocks, n_layers;
    size_t budget;
    size_t peak;      /* with the plan */
    size_t peak_none; /* with no block recomputed */
    size_t peak_all;  /* with every block recomputed */
    int probes;       /* steps at intermediate counts the plan measured */
} loom_recompute_plan;

struct loom_llama {
    loom_llama_config cfg;
    loom_precision prec;
    loom_llama_recompute recompute;
    loom_param *embed, *final_norm, *lm_head; /* lm_head == embed when tied */
    loom_llama_layer *layers;
    loom_param **params;  /* every parameter: the base ones in Hugging Face order, then any LoRA adapters */
    int n_params;
    int n_base;           /* params[0 .. n_base) are the model's own; the rest are LoRA adapters */
    loom_lora_config lora; /* rank 0: no adapters */
    /* The blocks' region arguments, one set per (batch, sequence) shape a
     * forward has used, kept until the model is freed: a replay reads them
     * long after its forward. */
    struct llama_arg_set *block_args;
    /* Tensor parallelism (Megatron): q/k/v and gate/up column-parallel,
     * o and down row-parallel, heads split across the tp_size ranks of
     * tp_comm; embeddings, norms and lm_head replicated. */
    loom_comm *tp_comm;  /* borrowed; NULL or size 1: no tensor parallelism */
    int tp_rank, tp_size;
    int dp_rank, dp_size; /* the replica's place among data-parallel ones (0 of 1 unless set) */
    /* The generation_config.json of the directory it came from (malloc'd
     * text, NULL: none), which its model directories and checkpoints carry
     * (loom_model_dir_load_generation_config, loom_model_dir_save). */
    char *generation_config;
    size_t generation_config_len;
};

/* Allocate a model with zero weights. Free with loom_llama_free. */
loom_status loom_llama_new(const loom_llama_config *cfg, loom_precision prec, loom_llama **out);
/* The same, holding this rank's shard of a tensor-parallel model over
 * tp_comm (borrowed, must outlive the model). Heads and ffn_dim must divide
 * by the group size. */
loom_status loom_llama_new_tp(const loom_llama_config *cfg, loom_precision prec, loom_comm *tp_comm,
                              loom_llama **out);
/* Make m data-parallel replica `rank` of `size`, each training on its
 * equal share of a global batch in rank order (loom's data loader gives
 * rank r rows r B .. r B + B - 1): its dropout then draws its rows of the
 * global batch's masks, so the replicas together draw the masks one
 * process draws at the global batch, and train as it does. Not
 * collective. Errors: LOOM_ERR_INVALID (rank not in [0, size)). */
loom_status loom_llama_set_data_parallel(loom_llama *m, int rank, int size);
/* Full (unsplit) shape of parameter i (rows, cols; cols 1 for vectors). */
void loom_llama_param_full_shape(const loom_llama *m, int i, int64_t shape[2]);
/* Parameter i's full fp32 values (its master, or a frozen bf16 weight's
 * compute copy widened; or its gradient, as fp32) into `full` (rows*cols
 * floats of the full shape). Collective over the TP group. */
loom_status loom_llama_param_gather(loom_llama *m, int i, int grad, float *full);
/* Set parameter i's master and compute copy (a frozen bf16 weight's
 * compute copy alone) from its full values. */
void loom_llama_param_scatter(loom_llama *m, int i, const float *full);
/* Any per-parameter fp32 array (e.g. an optimizer moment) of parameter i:
 * this rank's shard -> full (collective over the TP group), and back. */
loom_status loom_llama_tp_gather(loom_llama *m, int i, const float *local, float *full);
/* Whether every rank of the TP group got this far (collective): st where it
 * failed here, an error naming another rank's failure where it failed
 * there, else LOOM_OK. A rank that cannot take part in a collective (out
 * of memory for its buffer) says so first, so that no rank waits in it. */
loom_status loom_llama_tp_agree(loom_llama *m, loom_status st);
void loom_llama_tp_shard(const loom_llama *m, int i, const float *full, float *local);
void loom_llama_free(loom_llama *m);
/* Normal(0, 0.02) weights, residual projections (o_proj, down_proj) scaled
 * by 1/sqrt(2 L), norms 1; reproducible from the seed alone. DoRA's
 * magnitudes are then reset to the new weights' norms (loom_llama_dora_reset:
 * collective over a TP group). */
void loom_llama_init_weights(loom_llama *m, uint64_t seed);
loom_param *loom_llama_find_param(const loom_llama *m, const char *name);
int64_t loom_llama_n_weights(const loom_llama *m);  /* parameter count of this rank's tensors */
/* Parameter count of the whole model: a tensor-parallel rank's split
 * weights counted at their full size, replicated ones once. */
int64_t loom_llama_n_weights_full(const loom_llama *m);

/* Forward over tokens (B, T) int32. With targets (B, T) (ignore index -1),
 * *loss gets the mean cross-entropy (1-element f32); with logits_out
 * non-NULL it receives the logits (B*T, V) in the compute dtype. Either may
 * be NULL. Records the graph when gradients are enabled; forwards of other
 * shapes (an evaluation) may run before that graph's backward. */
loom_status loom_llama_forward(loom_llama *m, const int32_t *tokens, const int32_t *targets, int B, int T,
                               loom_tensor **loss, loom_tensor **logits_out);
void loom_llama_zero_grad(loom_llama *m);

/* The fewest blocks (from the first) to recompute under mode (selective or
 * full) so that a training step of B x T tokens keeps its activations
 * within `budget` bytes: probe steps (forward and backward on token id 0)
 * measure the peak with none, with every block, and at the count
 * interpolating picks, then one block fewer or more while that fits or
 * not. Costs 2 or more steps of compute, and the no-recompute probe needs
 * that step's full activation memory for a moment; zeroes the gradients;
 * leaves m->recompute and the default RNG as they were (the caller applies
 * plan->blocks: with blocks 0, no recompute) and trims the allocator's
 * cache. Collective over a tensor-parallel group: every rank calls it
 * alike, and must measure the same peaks (an even split does). Errors: LOOM_ERR_INVALID (mode NONE, a shape the
 * model cannot take, or a budget below what recomputing every block takes:
 * the message gives both peaks), LOOM_ERR_NOMEM. */
loom_status loom_llama_plan_recompute(loom_llama *m, loom_recompute_mode mode, int B, int T, size_t budget,
                                      loom_recompute_plan *plan);

/* Add LoRA adapters (cfg: rank >= 1, alpha > 0, a non-empty target set) to
 * every block of m and freeze the model's own parameters
 * (loom_param_freeze): they keep their values (bf16 ones as bf16 only, fp16
 * and fp32 ones with their fp32 master), lose their gradient buffers, and
 * take no optimizer state; the adapters, appended to m->params
 * after n_base, are the trainable parameters, in the model's precision
 * (fp32 masters and main_grad under master-grad). A drawn from (seed,
 * adapter index). Forward, backward, every recompute mode and generation
 * (which refuses tensor parallelism) use the adapters; loom_model_dir_save
 * writes the merged weights W + s B A (s: loom_lora_scale; with DoRA each
 * row scaled to its magnitude). Once per model, before
 * any optimizer is made over its parameters. With tensor parallelism the adapters are split as
 * in loom_llama_new_lora_tp, and dropout draws one process's masks (also
 * over data-parallel ranks: loom_llama_set_data_parallel).
 * Errors: LOOM_ERR_INVALID (bad config, already added),
 * LOOM_ERR_STATE (a data-parallel optimizer holds the gradients already),
 * LOOM_ERR_NOMEM (the model is left without adapters). */
loom_status loom_llama_add_lora(loom_llama *m, const loom_lora_config *cfg, uint64_t seed);
/* loom_llama_new with LoRA adapters (as loom_llama_add_lora), the model's
 * own parameters created frozen: their gradients and bf16 fp32 masters are
 * never allocated, so a large model's peak memory stays at its compute
 * copies (loom_llama_add_lora frees them after the fact). Weights zero,
 * A drawn from seed; load or initialise the model's own weights after
 * (loom_llama_load_weights, loom_llama_init_weights: with DoRA, a model
 * whose weights are written any other way needs loom_llama_dora_reset
 * after, or its magnitudes stay those of the zero weights).
 * Errors: those of both. */
loom_status loom_llama_new_lora(const loom_llama_config *cfg, loom_precision prec, const loom_lora_config *lora,
                                uint64_t seed, loom_llama **out);
/* The same, split over the ranks of tp_comm as loom_llama_new_tp splits a
 * model; the adapters are split as their weights: B's rows where W's rows
 * are (q, k, v, gate, up), A's columns where W's columns are (o, down);
 * DoRA's magnitudes as B's rows, whole for o and down. */
loom_status loom_llama_new_lora_tp(const loom_llama_config *cfg, loom_precision prec, const loom_lora_config *lora,
                                   uint64_t seed, loom_comm *tp_comm, loom_llama **out);
/* Base parameter i's full fp32 values with its adapter merged in (W +
 * s B A, s = loom_lora_scale, with DoRA each row then times m / its norm;
 * the plain values for a parameter without one). Collective over the TP
 * group (W, A, B and split magnitudes are gathered whole). */
loom_status loom_llama_param_merged(loom_llama *m, int i, float *full);
/* The adapter pair of base parameter i, or 0 (a, b untouched) when it has none. */
int loom_llama_lora_of(const loom_llama *m, int i, loom_param **a, loom_param **b);
/* DoRA's norms of linear t of layer l: n[o] = | W[o] + s (B A)[o] | (the
 * rows of the compute copies, summed in fp64; at least FLT_MIN), one per
 * output this rank holds. Collective over the TP group for a row-parallel
 * linear (o, down: the ranks' sums of squares added). Errors:
 * LOOM_ERR_INVALID (no DoRA adapter there), LOOM_ERR_NOMEM. */
loom_status loom_llama_dora_norms(const loom_llama *m, int l, loom_lora_target t, float *n);
/* Set every DoRA magnitude to its norms (loom_llama_dora_norms): each factor
 * m / n is then 1, and with B zero (a new adapter) the model computes the
 * base model exactly, PEFT's start. loom_llama_add_lora,
 * loom_llama_init_weights and loom_llama_load_weights call it (the last
 * two after the model's own weights change). */
loom_status loom_llama_dora_reset(loom_llama *m);

/* ------------------------------------------------------------ generation */

typedef struct loom_sampler {
    float temperature;  /* finite, >= 0; 0: greedy (argmax) */
    float top_p;        /* nucleus sampling threshold in (0, 1]; 1 disables. The smallest set of
                         * most probable tokens whose mass reaches top_p, except that tokens tied
                         * with the least probable one kept are all kept (no id is favoured) */
    uint64_t seed;      /* Philox seed for sampling */
    int vocab_limit;    /* > 0: only ids below it are sampled (a tokenizer smaller than the model's vocab) */
    int top_k;          /* > 0: only the top_k most probable tokens (and any tied with the last) are kept,
                         * before the nucleus is cut from them; 0 disables */
    float repetition_penalty; /* Hugging Face's (CTRL's): before sampling, the logit of every id the prompt
                               * or the output holds is divided by it when positive, multiplied when
                               * negative; 0 or 1: none (loom_llama_generate*, not loom_sample) */
    float min_p;        /* in [0, 1]: after top-k and the nucleus, only tokens at least min_p times as probable
                         * as the most probable one are kept (Hugging Face's min_p); 0 disables */
} loom_sampler;

/* Autoregressive generation with a KV cache (no autograd). The prompt's
 * n_prompt tokens are processed in one pass, then up to n_new tokens are
 * sampled one at a time; generation stops early at `stop_token` (>= 0) or
 * when the context reaches max_seq. out receives the new tokens (room for
 * n_new); *n_out how many. */
loom_status loom_llama_generate(loom_llama *m, const int32_t *prompt, int n_prompt, int n_new,
                                const loom_sampler *sampler, int stop_token, int32_t *out, int *n_out);
/* loom_llama_generate stopping at any of stops[0 .. n_stops) (the stop is
 * the last id in out): an instruct model's turn ends at its own token (Llama
 * 3's "<|eot_id|>"), its text at the end-of-text one.
 * Errors: those of loom_llama_generate; LOOM_ERR_INVALID (n_stops < 0). */
loom_status loom_llama_generate_until(loom_llama *m, const int32_t *prompt, int n_prompt, int n_new,
                                      const loom_sampler *sampler, const int32_t *stops, int n_stops, int32_t *out,
                                      int *n_out);
/* A token id drawn from logits (V floats, overwritten): the argmax when the
 * temperature is 0, else from softmax(logits / temperature) cut to the top_k
 * most probable, then to the top-p nucleus of those, then to those at least
 * min_p times as probable as the most probable (Hugging Face's order; a
 * min_p of 1 or more keeps the largest alone, one not above 0 or NaN
 * none), ids below vocab_limit only (when > 0), with the Philox draw of
 * (seed, counter). loom_sample does not check the sampler:
 * loom_llama_generate does. */
int32_t loom_sample(float *logits, int V, const loom_sampler *sampler, uint64_t counter);
/* Logits (V floats) of the next token after `tokens`, by the KV-cache path;
 * for tests. */
loom_status loom_llama_next_logits(loom_llama *m, const int32_t *tokens, int n, float *logits);

#ifdef __cplusplus
}
#endif
#endif
