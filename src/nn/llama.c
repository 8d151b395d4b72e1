/*
 * llama.c — the LLaMA model: parameters with Hugging Face names, weight
 * initialisation, and the forward pass with each transformer block as a
 * checkpoint region. Every linear is the fused linear.
 */
#include "loom/loom.h"
#include "nn/tp.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct llama_block_args {
    loom_llama *m;
    int layer;
    int B, T;
    int training; /* recorded with gradients: LoRA's dropout applies */
};

/* The arguments of every layer for one (B, T) and one kind of forward
 * (training or not). Sets are never moved or changed once made, so a region
 * recorded by one forward replays with its own shape and kind even after
 * forwards of other shapes or kinds. */
struct llama_arg_set {
    struct llama_arg_set *next;
    struct llama_block_args layer[]; /* n_layers (>= 1), all with the set's B, T */
};

static struct llama_arg_set *arg_set_for(loom_llama *m, int B, int T, int training) {
    for (struct llama_arg_set *s = m->block_args; s; s = s->next)
        if (s->layer[0].B == B && s->layer[0].T == T && s->layer[0].training == training) return s;
    int L = m->cfg.n_layers;
    struct llama_arg_set *s = malloc(sizeof *s + (size_t)L * sizeof s->layer[0]);
    if (!s) return NULL;
    for (int l = 0; l < L; l++) s->layer[l] = (struct llama_block_args){m, l, B, T, training};
    s->next = m->block_args;
    m->block_args = s;
    return s;
}

loom_status loom_llama_preset(const char *name, loom_llama_config *c) {
    memset(c, 0, sizeof *c);
    c->rope_theta = 10000.0f;
    c->norm_eps = 1e-5f;
    if (!strcmp(name, "tiny")) {
        c->dim = 288; c->n_layers = 6; c->n_heads = 6; c->n_kv_heads = 6;
        c->ffn_dim = 768; c->vocab_size = 4096; c->max_seq = 256;
    } else if (!strcmp(name, "small")) {
        c->dim = 512; c->n_layers = 8; c->n_heads = 8; c->n_kv_heads = 8;
        c->ffn_dim = 1376; c->vocab_size = 8192; c->max_seq = 512;
    } else {
        return loom_error(LOOM_ERR_INVALID, "unknown preset '%s': use tiny or small", name);
    }
    return LOOM_OK;
}

loom_rope_freqs loom_llama_rope(const loom_llama_config *c) {
    loom_rope_freqs r;
    memset(&r, 0, sizeof r); /* no stray bytes: the rope op copies it as bytes */
    r.theta = c->rope_theta;
    r.type = c->rope_type;
    r.factor = c->rope_factor;
    r.low_freq_factor = c->rope_low_freq_factor;
    r.high_freq_factor = c->rope_high_freq_factor;
    r.original_max_pos = c->rope_original_max_pos;
    int rd = loom_llama_rotary_dim(c);
    r.rotary_dim = rd < loom_llama_head_dim(c) ? rd : 0;
    if (c->rope_type == LOOM_ROPE_YARN) {
        r.attention_factor = c->rope_attention_factor;
        r.beta_fast = c->rope_beta_fast;
        r.beta_slow = c->rope_beta_slow;
        r.truncate = c->rope_truncate;
    }
    if (c->rope_type == LOOM_ROPE_LONGROPE) { /* the short factors (loom_llama_layer_rope_at: the long ones) */
        r.attention_factor = c->rope_attention_factor;
        r.n_ext = c->rope_n_ext;
        int n = c->rope_n_ext < 0 ? 0 : c->rope_n_ext > LOOM_ROPE_EXT_MAX ? LOOM_ROPE_EXT_MAX : c->rope_n_ext;
        memcpy(r.ext, c->rope_short, sizeof(float) * (size_t)n); /* n_ext as it is: loom_rope_check refuses it */
    }
    return r;
}

loom_rope_freqs loom_llama_layer_rope(const loom_llama_config *c, int layer) {
    if (!(c->rope_local_theta > 0.0f) || !loom_llama_layer_window(c, layer)) return loom_llama_rope(c);
    loom_rope_freqs r;
    memset(&r, 0, sizeof r); /* Gemma 3's rotary_emb_local: the default RoPE of its own base */
    r.theta = c->rope_local_theta;
    r.type = LOOM_ROPE_DEFAULT;
    return r;
}

loom_rope_freqs loom_llama_layer_rope_at(const loom_llama_config *c, int layer, int positions) {
    loom_rope_freqs r = loom_llama_layer_rope(c, layer);
    if (r.type == LOOM_ROPE_LONGROPE && positions > c->rope_original_max_pos) /* Hugging Face's longrope update */
        memcpy(r.ext, c->rope_long, sizeof(float) * (size_t)(r.n_ext < 0 ? 0 : r.n_ext > LOOM_ROPE_EXT_MAX
                                                                                    ? LOOM_ROPE_EXT_MAX : r.n_ext));
    return r;
}

int loom_llama_head_dim(const loom_llama_config *c) {
    return c->head_dim ? c->head_dim : c->n_heads > 0 ? c->dim / c->n_heads : 0;
}

int loom_llama_rotary_dim(const loom_llama_config *c) {
    int hs = loom_llama_head_dim(c);
    /* Python's int(head_dim * factor), the factor as the file says it (0.9, not the float's 0.899999976) */
    double f = c->partial_rotary_factor > 0.0f ? loom_float_decimal(c->partial_rotary_factor) : 1.0;
    return f < 1.0 ? (int)(hs * f) : hs;
}

float loom_llama_embed_scale(const loom_llama_config *c, loom_dtype dt) {
    /* Hugging Face's Gemma: torch.tensor(hidden_size ** 0.5, dtype=dt), a double rounded to float, then to dt */
    return c->scale_embeddings ? loom_round_to((float)sqrt((double)c->dim), dt) : 1.0f;
}

float loom_llama_attn_scale(const loom_llama_config *c) {
    if (c->attention_multiplier > 0.0f) return c->attention_multiplier;                              /* Granite's */
    if (c->query_pre_attn_scalar > 0.0f) return (float)(1.0 / sqrt((double)c->query_pre_attn_scalar)); /* Gemma 2's */
    return 1.0f / sqrtf((float)loom_llama_head_dim(c));
}

int loom_llama_layer_has_rope(const loom_llama_config *c, int layer) {
    return c->nope_interval <= 0 || (layer + 1) % c->nope_interval != 0;
}

int loom_llama_layer_window(const loom_llama_config *c, int layer) {
    if (c->sliding_window <= 0 || layer < c->window_from) return 0;
    int global = c->window_global_interval > 0 && (layer + 1) % c->window_global_interval == 0;
    return global ? 0 : c->sliding_window;
}

/* 1 when a and b give every block the same window. */
static int same_windows(const loom_llama_config *a, const loom_llama_config *b) {
    for (int l = 0; l < a->n_layers; l++)
        if (loom_llama_layer_window(a, l) != loom_llama_layer_window(b, l)) return 0;
    return 1;
}

int loom_llama_has_multipliers(const loom_llama_config *c) {
    return c->embedding_multiplier != 0.0f || c->residual_multiplier != 0.0f || c->attention_multiplier != 0.0f ||
           c->logits_scaling != 0.0f;
}

/* What an RMSNorm of c adds to its weight: Gemma's 1, else 0. */
static float norm_offset(const loom_llama_config *c) { return c->norm_unit_offset ? 1.0f : 0.0f; }

int loom_llama_config_same_weights(const loom_llama_config *a, const loom_llama_config *b) {
    return a->dim == b->dim && a->n_layers == b->n_layers && a->n_heads == b->n_heads &&
           loom_llama_head_dim(a) == loom_llama_head_dim(b) && !a->qk_norm == !b->qk_norm &&
           a->n_kv_heads == b->n_kv_heads && a->ffn_dim == b->ffn_dim && a->vocab_size == b->vocab_size &&
           a->tie_embeddings == b->tie_embeddings && !a->qkv_bias == !b->qkv_bias && !a->o_bias == !b->o_bias &&
           !a->norm_unit_offset == !b->norm_unit_offset && /* Gemma's norm weights are offsets from 1 */
           !a->fused_proj == !b->fused_proj &&              /* Phi-3's files hold q, k, v in one tensor */
           a->nope_interval == b->nope_interval &&          /* SmolLM3's NoPE blocks */
           !a->post_norms == !b->post_norms;                /* Gemma 2's norms of the blocks' outputs */
}

/* A multiplier's effect: 0 (none) is 1. */
static float effective(float m) { return m != 0.0f ? m : 1.0f; }

int loom_llama_config_same_model(const loom_llama_config *a, const loom_llama_config *b) {
    return loom_llama_config_same_weights(a, b) && loom_llama_config_same_rope(a, b) && a->max_seq == b->max_seq &&
           a->norm_eps == b->norm_eps && a->act == b->act && !a->scale_embeddings == !b->scale_embeddings &&
           effective(a->embedding_multiplier) == effective(b->embedding_multiplier) &&
           effective(a->residual_multiplier) == effective(b->residual_multiplier) &&
           effective(a->logits_scaling) == effective(b->logits_scaling) &&
           loom_llama_attn_scale(a) == loom_llama_attn_scale(b) && a->attention_dropout == b->attention_dropout &&
           a->attn_softcap == b->attn_softcap && a->final_softcap == b->final_softcap && same_windows(a, b);
}

int loom_llama_config_same_rope(const loom_llama_config *a, const loom_llama_config *b) {
    size_t n = sizeof(float) * (size_t)(a->rope_n_ext > 0 && a->rope_n_ext <= LOOM_ROPE_EXT_MAX ? a->rope_n_ext : 0);
    return a->rope_theta == b->rope_theta && a->rope_local_theta == b->rope_local_theta &&
           loom_llama_rotary_dim(a) == loom_llama_rotary_dim(b) &&
           a->rope_type == b->rope_type && a->rope_factor == b->rope_factor &&
           a->rope_low_freq_factor == b->rope_low_freq_factor &&
           a->rope_high_freq_factor == b->rope_high_freq_factor && a->rope_original_max_pos == b->rope_original_max_pos &&
           a->rope_attention_factor == b->rope_attention_factor && a->rope_n_ext == b->rope_n_ext &&
           a->rope_beta_fast == b->rope_beta_fast && a->rope_beta_slow == b->rope_beta_slow &&
           !a->rope_truncate == !b->rope_truncate &&
           !memcmp(a->rope_short, b->rope_short, n) && !memcmp(a->rope_long, b->rope_long, n);
}

/* A sliding window as the config class that saves c can say it
 * (loom_llama_config_save): every block (Mistral's, which LLaMA's layout
 * becomes, without attention_bias; Phi-3's), every block from
 * max_window_layers on (Qwen 2's, Qwen 3's), every other block from the
 * first (Gemma 2's) or every block but every N-th (Gemma 3's); Gemma's and
 * Granite's have none, and SmolLM3's (on its NoPE blocks) is not computed. */
static loom_status check_window(const loom_llama_config *c) {
    if (c->sliding_window < 0 || c->window_from < 0 || c->window_global_interval < 0 ||
        (!c->sliding_window && (c->window_from || c->window_global_interval)))
        return loom_error(LOOM_ERR_INVALID, "model config: sliding window %d, from block %d, full attention every %d "
                          "blocks: none may be negative, and the last two need a window", c->sliding_window,
                          c->window_from, c->window_global_interval);
    if (!c->sliding_window) return LOOM_OK;
    int qwen = c->qk_norm || (c->qkv_bias && !c->o_bias);
    const char *why = c->post_norms && c->qk_norm ? (c->window_from || c->window_global_interval < 2
                                                         ? "Gemma 3's is on every block but every N-th" : NULL)
                      : c->post_norms ? (c->window_from || c->window_global_interval != 2
                                             ? "Gemma 2's is on every other block from the first" : NULL)
                      : c->norm_unit_offset || loom_llama_has_multipliers(c) ? "Gemma's and Granite's have none"
                      : c->nope_interval > 0 ? "SmolLM3's is on its NoPE blocks, which loom does not compute"
                      : qwen ? (c->window_global_interval ? "Qwen's are on every block from max_window_layers on"
                                                          : NULL)
                      : c->window_from || c->window_global_interval ? "Mistral's and Phi-3's are on every block"
                      : c->o_bias && !c->fused_proj ? "Mistral's model, LLaMA's with one, has no attention_bias"
                                                    : NULL;
    if (why)
        return loom_error(LOOM_ERR_INVALID, "model config: a sliding window (%d) from block %d with full attention "
                          "every %d blocks has no Hugging Face layout here: %s", c->sliding_window, c->window_from,
                          c->window_global_interval, why);
    return LOOM_OK;
}

loom_status loom_llama_config_validate(const loom_llama_config *c) {
    if (c->dim <= 0 || c->n_layers <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->ffn_dim <= 0 ||
        c->vocab_size <= 0 || c->max_seq <= 0)
        return loom_error(LOOM_ERR_INVALID, "model config: every size must be positive (dim %d, layers %d, heads %d, "
                          "kv heads %d, ffn %d, vocab %d, max seq %d)", c->dim, c->n_layers, c->n_heads,
                          c->n_kv_heads, c->ffn_dim, c->vocab_size, c->max_seq);
    if (c->head_dim < 0 || (!c->head_dim && c->dim % c->n_heads) || loom_llama_head_dim(c) % 2 ||
        !loom_llama_head_dim(c) || (int64_t)c->n_heads * loom_llama_head_dim(c) > (1 << 30))
        return loom_error(LOOM_ERR_INVALID, c->head_dim ? "model config: head_dim %d must be even and positive "
                                                          "(and heads x head_dim at most 2^30)"
                                                        : "model config: dim %d must split into %d heads of even size",
                          c->head_dim ? c->head_dim : c->dim, c->n_heads);
    if (c->n_heads % c->n_kv_heads)
        return loom_error(LOOM_ERR_INVALID, "model config: %d heads is not a multiple of %d kv heads", c->n_heads,
                          c->n_kv_heads);
    if (!(c->rope_theta > 0.0f) || !(c->norm_eps > 0.0f))
        return loom_error(LOOM_ERR_INVALID, "model config: rope_theta and norm_eps must be positive");
    if (!(c->partial_rotary_factor >= 0.0f && c->partial_rotary_factor <= 1.0f) ||
        (c->partial_rotary_factor > 0.0f && c->partial_rotary_factor < 1.0f &&
         (!c->fused_proj || loom_llama_rotary_dim(c) < 2 || loom_llama_rotary_dim(c) % 2)))
        return loom_error(LOOM_ERR_INVALID, "model config: partial_rotary_factor %g is Phi-3's (its class alone turns "
                          "part of each head), in (0, 1], and must leave an even rotary part of 2 or more (%d)",
                          (double)c->partial_rotary_factor, loom_llama_rotary_dim(c));
    loom_rope_freqs r = loom_llama_rope(c);
    if (loom_rope_check(&r) != LOOM_OK) return loom_error(LOOM_ERR_INVALID, "model config: %s", loom_last_error());
    if (c->rope_type == LOOM_ROPE_LONGROPE &&
        (c->rope_n_ext != loom_llama_rotary_dim(c) / 2 || c->rope_original_max_pos <= 0 ||
         !(c->rope_factor >= 1.0f) || !isfinite(c->rope_factor)))
        return loom_error(LOOM_ERR_INVALID, "model config: longrope needs rotary size / 2 (%d) short and long factors "
                          "(it has %d), an original context (%d) of 1 or more and a factor of 1 or more",
                          loom_llama_rotary_dim(c) / 2, c->rope_n_ext, c->rope_original_max_pos);
    for (int i = 0; c->rope_type == LOOM_ROPE_LONGROPE && i < c->rope_n_ext; i++)
        if (!(c->rope_long[i] > 0.0f) || !isfinite(c->rope_long[i]))
            return loom_error(LOOM_ERR_INVALID, "model config: longrope's long factors must be finite and positive");
    if (c->o_bias && !c->qkv_bias)
        return loom_error(LOOM_ERR_INVALID, "model config: a bias on o needs biases on q, k and v (LLaMA's "
                          "attention_bias has all four, Qwen 2's the three)");
    if (c->qk_norm && c->qkv_bias && !c->o_bias)
        return loom_error(LOOM_ERR_INVALID, "model config: q/k norms (Qwen 3's) with biases on q, k and v alone "
                          "(Qwen 2's) have no Hugging Face layout");
    if (c->act != LOOM_ACT_SILU && c->act != LOOM_ACT_GELU_TANH)
        return loom_error(LOOM_ERR_INVALID, "model config: unknown activation %d", (int)c->act);
    if (!c->norm_unit_offset != !c->scale_embeddings)
        return loom_error(LOOM_ERR_INVALID, "model config: norms scaled by 1 + weight and embeddings scaled by "
                          "sqrt(dim) come together (Gemma's model); one alone has no Hugging Face layout");
    if (c->norm_unit_offset && ((c->qk_norm && !c->post_norms) || (c->qkv_bias && !c->o_bias)))
        return loom_error(LOOM_ERR_INVALID, "model config: Gemma's model has no q/k norms (Gemma 3's, with the "
                          "norms of the blocks' outputs, has) and no biases on q, k and v alone (its "
                          "attention_bias puts them on all four)");
    const float mult[4] = {c->embedding_multiplier, c->residual_multiplier, c->attention_multiplier,
                           c->logits_scaling};
    for (int i = 0; i < 4; i++)
        if (!(mult[i] >= 0.0f) || !isfinite(mult[i]))
            return loom_error(LOOM_ERR_INVALID, "model config: Granite's embedding, residual and attention multipliers "
                              "and logits scaling must be finite and positive (0: none)");
    if (loom_llama_has_multipliers(c) && (c->norm_unit_offset || c->qk_norm || (c->qkv_bias && !c->o_bias)))
        return loom_error(LOOM_ERR_INVALID, "model config: Granite's multipliers with Gemma's norms, q/k norms or "
                          "biases on q, k and v alone have no Hugging Face layout");
    if (c->nope_interval < 0 || (c->nope_interval > 0 && (c->fused_proj || c->qk_norm || c->norm_unit_offset ||
                                                          loom_llama_has_multipliers(c) ||
                                                          (c->qkv_bias && !c->o_bias))))
        return loom_error(LOOM_ERR_INVALID, "model config: SmolLM3's NoPE blocks (every %d-th) with Phi-3's files, "
                          "q/k norms, Gemma's norms, Granite's multipliers or biases on q, k and v alone have no "
                          "Hugging Face layout", c->nope_interval);
    if (!(c->attention_dropout >= 0.0f && c->attention_dropout < 1.0f))
        return loom_error(LOOM_ERR_INVALID, "model config: attention_dropout %g must be in [0, 1)",
                          (double)c->attention_dropout);
    if (!(c->attn_softcap >= 0.0f) || !isfinite(c->attn_softcap) || !(c->final_softcap >= 0.0f) ||
        !isfinite(c->final_softcap) || !(c->query_pre_attn_scalar >= 0.0f) || !isfinite(c->query_pre_attn_scalar))
        return loom_error(LOOM_ERR_INVALID, "model config: softcaps and query_pre_attn_scalar must be finite and "
                          "positive (0: none)");
    int gemma2_only = c->attn_softcap > 0.0f || c->final_softcap > 0.0f || c->query_pre_attn_scalar > 0.0f;
    if ((c->post_norms || gemma2_only) &&
        (!c->post_norms || !c->norm_unit_offset || !(c->query_pre_attn_scalar > 0.0f) || c->fused_proj ||
         c->nope_interval || loom_llama_has_multipliers(c)))
        return loom_error(LOOM_ERR_INVALID, "model config: norms of the blocks' outputs, softcaps and "
                          "query_pre_attn_scalar (which Gemma 2's and 3's models need) come together with Gemma's "
                          "norms, without Phi-3's files, NoPE blocks or Granite's multipliers");
    int gemma3 = c->post_norms && c->qk_norm;
    if (!(c->rope_local_theta >= 0.0f) || !isfinite(c->rope_local_theta) ||
        (gemma3 && (!(c->rope_local_theta > 0.0f) || c->sliding_window <= 0)) ||
        (!gemma3 && c->rope_local_theta != 0.0f))
        return loom_error(LOOM_ERR_INVALID, "model config: a local RoPE base (rope_local_base_freq %g) is Gemma 3's, "
                          "whose model (Gemma 2's with q/k norms) needs one, finite and positive, and a sliding "
                          "window (%d)", (double)c->rope_local_theta, c->sliding_window);
    if (c->fused_proj &&
        (c->qkv_bias || c->o_bias || c->qk_norm || c->norm_unit_offset || loom_llama_has_multipliers(c)))
        return loom_error(LOOM_ERR_INVALID, "model config: Phi-3's fused projections with attention biases, q/k "
                          "norms, Gemma's norms or Granite's multipliers have no Hugging Face layout");
    return check_window(c);
}

/* A parameter of m. split: -1 replicated, 0 rows split (column-parallel),
 * 1 columns split (row-parallel) across the TP group; shapes given are
 * full. frozen: created frozen (no gradient, no bf16 master). */
static loom_status add_param(loom_llama *m, const char *name, loom_dtype dt, int ndim, int64_t d0, int64_t d1,
                             int split, int frozen, loom_param **out) {
    int64_t shape[2] = {d0, d1};
    if (split >= 0) shape[split] /= m->tp_size;
    LOOM_TRY(frozen ? loom_param_new_frozen(name, dt, ndim, shape, out)
                    : loom_param_new(name, dt, ndim, shape, m->prec.master_grad, out));
    m->params[m->n_params++] = *out;
    (*out)->tp_split_dim = m->tp_size > 1 ? split : -1;
    if (ndim == 1) (*out)->no_weight_decay = 1;
    return LOOM_OK;
}

loom_status loom_llama_new(const loom_llama_config *cfg, loom_precision prec, loom_llama **out) {
    return loom_llama_new_tp(cfg, prec, NULL, out);
}

static loom_status llama_create(const loom_llama_config *cfg, loom_precision prec, loom_comm *tp_comm, int frozen,
                                loom_llama **out);

loom_status loom_llama_new_tp(const loom_llama_config *cfg, loom_precision prec, loom_comm *tp_comm,
                              loom_llama **out) {
    return llama_create(cfg, prec, tp_comm, 0, out);
}

loom_status loom_llama_set_data_parallel(loom_llama *m, int rank, int size) {
    if (!m || size < 1 || rank < 0 || rank >= size)
        return loom_error(LOOM_ERR_INVALID, "llama: data-parallel rank %d of %d (0 <= rank < size)", rank, size);
    m->dp_rank = rank;
    m->dp_size = size;
    return LOOM_OK;
}

/* frozen: the model's parameters are created frozen (LoRA's base; the
 * caller adds the adapters). */
static loom_status llama_create(const loom_llama_config *cfg, loom_precision prec, loom_comm *tp_comm, int frozen,
                                loom_llama **out) {
    *out = NULL;
    LOOM_TRY(loom_llama_config_validate(cfg));
    int T = tp_comm ? loom_comm_size(tp_comm) : 1;
    if (cfg->n_kv_heads % T || cfg->ffn_dim % T)
        return loom_error(LOOM_ERR_INVALID, "tensor parallel %d: the %d kv heads, %d heads and ffn %d must divide by it",
                          T, cfg->n_kv_heads, cfg->n_heads, cfg->ffn_dim);
    loom_llama *m = calloc(1, sizeof *m);
    if (!m) return loom_error(LOOM_ERR_NOMEM, "llama: out of memory");
    m->cfg = *cfg;
    m->prec = prec;
    m->tp_comm = tp_comm;
    m->tp_size = T;
    m->tp_rank = tp_comm ? loom_comm_rank(tp_comm) : 0;
    m->dp_size = 1;
    int L = cfg->n_layers, C = cfg->dim, HS = loom_llama_head_dim(cfg);
    int Q = cfg->n_heads * HS, KV = cfg->n_kv_heads * HS;
    m->layers = calloc((size_t)L, sizeof *m->layers);
    m->params = calloc(17 * (size_t)L + 3, sizeof *m->params); /* at most 17 a block (spec below) */
    if (!m->layers || !m->params) { loom_llama_free(m); return LOOM_ERR_NOMEM; }
    loom_dtype dt = prec.compute;
    char name[160];
    loom_status st = add_param(m, "model.embed_tokens.weight", dt, 2, cfg->vocab_size, C, -1, frozen, &m->embed);
    for (int l = 0; l < L && st == LOOM_OK; l++) {
        loom_llama_layer *y = &m->layers[l];
        /* Hugging Face's order; a bias splits as its weight's rows (o's is whole) */
        int qb = cfg->qkv_bias, ob = cfg->o_bias, qkn = cfg->qk_norm, pn = cfg->post_norms;
        struct { const char *suffix; int ndim; int64_t d0, d1; int split; loom_param **slot; int has; } spec[] = {
            {"input_layernorm.weight", 1, C, 0, -1, &y->attn_norm, 1},
            {"self_attn.q_proj.weight", 2, Q, C, 0, &y->wq, 1},
            {"self_attn.q_proj.bias", 1, Q, 0, 0, &y->bq, qb},
            {"self_attn.k_proj.weight", 2, KV, C, 0, &y->wk, 1},
            {"self_attn.k_proj.bias", 1, KV, 0, 0, &y->bk, qb},
            {"self_attn.v_proj.weight", 2, KV, C, 0, &y->wv, 1},
            {"self_attn.v_proj.bias", 1, KV, 0, 0, &y->bv, qb},
            {"self_attn.o_proj.weight", 2, C, Q, 1, &y->wo, 1},
            {"self_attn.o_proj.bias", 1, C, 0, -1, &y->bo, ob},
            {"self_attn.q_norm.weight", 1, HS, 0, -1, &y->q_norm, qkn},
            {"self_attn.k_norm.weight", 1, HS, 0, -1, &y->k_norm, qkn},
            /* Gemma 2's norm of the attention's output takes the name LLaMA's MLP input norm has */
            {"post_attention_layernorm.weight", 1, C, 0, -1, &y->attn_post_norm, pn},
            {pn ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight", 1, C, 0, -1, &y->mlp_norm, 1},
            {"mlp.gate_proj.weight", 2, cfg->ffn_dim, C, 0, &y->w_gate, 1},
            {"mlp.up_proj.weight", 2, cfg->ffn_dim, C, 0, &y->w_up, 1},
            {"mlp.down_proj.weight", 2, C, cfg->ffn_dim, 1, &y->w_down, 1},
            {"post_feedforward_layernorm.weight", 1, C, 0, -1, &y->mlp_post_norm, pn},
        };
        for (size_t i = 0; i < sizeof spec / sizeof spec[0] && st == LOOM_OK; i++) {
            if (!spec[i].has) continue;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].suffix);
            st = add_param(m, name, dt, spec[i].ndim, spec[i].d0, spec[i].d1, spec[i].split, frozen,
                           spec[i].slot);
        }
    }
    if (st == LOOM_OK) st = add_param(m, "model.norm.weight", dt, 1, C, 0, -1, frozen, &m->final_norm);
    if (st == LOOM_OK) {
        if (cfg->tie_embeddings) m->lm_head = m->embed;
        else st = add_param(m, "lm_head.weight", dt, 2, cfg->vocab_size, C, -1, frozen, &m->lm_head);
    }
    if (st != LOOM_OK) { loom_llama_free(m); return st; }
    m->n_base = m->n_params;
    *out = m;
    return LOOM_OK;
}

void loom_llama_free(loom_llama *m) {
    if (!m) return;
    for (int i = 0; i < m->n_params; i++) loom_param_free(m->params[i]);
    free(m->params);
    free(m->layers);
    for (struct llama_arg_set *s = m->block_args, *next; s; s = next) {
        next = s->next;
        free(s);
    }
    free(m->generation_config);
    free(m);
}

loom_param *loom_llama_find_param(const loom_llama *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i]->name, name)) return m->params[i];
    return NULL;
}

int64_t loom_llama_n_weights(const loom_llama *m) {
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++) n += loom_param_numel(m->params[i]);
    return n;
}

int64_t loom_llama_n_weights_full(const loom_llama *m) {
    int64_t n = 0, shape[2];
    for (int i = 0; i < m->n_params; i++) {
        loom_llama_param_full_shape(m, i, shape);
        n += shape[0] * shape[1];
    }
    return n;
}

void loom_llama_param_full_shape(const loom_llama *m, int i, int64_t shape[2]) {
    tp_full_shape(m->params[i], m->tp_size, shape);
}

void loom_llama_param_scatter(loom_llama *m, int i, const float *full) {
    loom_param *p = m->params[i];
    if (!loom_param_has_master(p)) { /* a frozen bf16 weight: its shard into its compute copy */
        float *shard = m->tp_size == 1 ? (float *)(uintptr_t)full : malloc((size_t)loom_param_numel(p) * sizeof *shard);
        LOOM_ASSERT(shard != NULL);
        if (shard != full) tp_take_shard(p, m->tp_rank, m->tp_size, full, shard);
        LOOM_ASSERT(loom_param_set_f32(p, shard, loom_param_numel(p)) == LOOM_OK);
        if (shard != full) free(shard);
        return;
    }
    tp_take_shard(p, m->tp_rank, m->tp_size, full, loom_param_master(p));
    loom_param_sync_from_master(p);
}

loom_status loom_llama_tp_gather(loom_llama *m, int i, const float *local, float *full) {
    return tp_gather(m->tp_comm, m->params[i], local, full);
}

void loom_llama_tp_shard(const loom_llama *m, int i, const float *full, float *local) {
    tp_take_shard(m->params[i], m->tp_rank, m->tp_size, full, local);
}

loom_status loom_llama_tp_agree(loom_llama *m, loom_status st) {
    if (m->tp_size == 1) return st;
    int failed = st != LOOM_OK;
    loom_status a = loom_comm_allreduce_max_int(m->tp_comm, &failed, 1);
    if (st != LOOM_OK || a != LOOM_OK) return st != LOOM_OK ? st : a;
    return failed ? loom_error(LOOM_ERR_NOMEM, "another tensor-parallel rank failed (out of memory) before a gather")
                  : LOOM_OK;
}

loom_status loom_llama_param_gather(loom_llama *m, int i, int grad, float *full) {
    loom_param *p = m->params[i];
    const float *src = NULL;
    float *tmp = NULL;
    loom_status st = LOOM_OK;
    if (grad || !loom_param_has_master(p)) {
        tmp = malloc((size_t)loom_param_numel(p) * sizeof(float) + 1);
        if (!tmp) st = loom_error(LOOM_ERR_NOMEM, "gather %s: out of memory", p->name);
        else if (grad) loom_param_read_grad(p, tmp);
        else loom_param_get_f32(p, tmp); /* a frozen bf16 weight, widened */
        src = tmp;
        st = loom_llama_tp_agree(m, st); /* every rank gathers, or none */
    } else {
        src = loom_param_master(p);
    }
    if (st == LOOM_OK) st = tp_gather(m->tp_comm, p, src, full);
    free(tmp);
    return st;
}

void loom_llama_init_weights(loom_llama *m, uint64_t seed) {
    float resid_std = 0.02f / sqrtf(2.0f * (float)m->cfg.n_layers);
    for (int i = 0; i < m->n_base; i++) {
        loom_param *p = m->params[i];
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        size_t n = (size_t)(fs[0] * fs[1]);
        /* The full tensor is drawn on every rank, then sliced: a TP model
         * starts from exactly the weights of the single-process one. */
        int own = p->tp_split_dim < 0 && loom_param_has_master(p);
        float *w = own ? loom_param_master(p) : malloc(n * sizeof *w);
        LOOM_ASSERT(w != NULL);
        if (p->tensor->ndim == 1) { /* norms' weights 1 (Gemma's offsets from 1: 0), biases 0 (Hugging Face's) */
            float v = strstr(p->name, ".bias") || m->cfg.norm_unit_offset ? 0.0f : 1.0f;
            for (size_t k = 0; k < n; k++) w[k] = v;
        } else {
            int resid = strstr(p->name, "o_proj") || strstr(p->name, "down_proj");
            /* Each parameter draws from its own stream: offset i << 40. */
            loom_rng_normal(w, n, 0.0f, resid ? resid_std : 0.02f, seed, (uint64_t)i << 40);
        }
        if (!own) {
            loom_llama_param_scatter(m, i, w);
            free(w);
        } else {
            loom_param_sync_from_master(p);
        }
    }
    LOOM_ASSERT(loom_llama_dora_reset(m) == LOOM_OK); /* DoRA's magnitudes follow the weights */
}

/* ---------------------------------------------------------------- LoRA */

static const char *const lora_module[LOOM_LORA_N] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"};
static const char *const lora_short[LOOM_LORA_N] = {"q", "k", "v", "o", "gate", "up", "down"};

const char *loom_lora_target_name(loom_lora_target t) { return (unsigned)t < LOOM_LORA_N ? lora_module[t] : "?"; }

loom_param *loom_llama_layer_weight(const loom_llama_layer *y, loom_lora_target t) {
    loom_param *const w[LOOM_LORA_N] = {y->wq, y->wk, y->wv, y->wo, y->w_gate, y->w_up, y->w_down};
    return (unsigned)t < LOOM_LORA_N ? w[t] : NULL;
}

loom_param *loom_llama_layer_bias(const loom_llama_layer *y, loom_lora_target t) {
    loom_param *const b[] = {y->bq, y->bk, y->bv, y->bo};
    return (unsigned)t < sizeof b / sizeof *b ? b[t] : NULL;
}

static int piece_is(const char *p, size_t n, const char *name) { return strlen(name) == n && !strncmp(p, name, n); }

float loom_lora_scale(const loom_lora_config *c) {
    double r = (double)c->rank;
    return (float)((double)c->alpha / (c->rslora ? sqrt(r) : r));
}

loom_status loom_lora_targets_parse(const char *s, unsigned *targets) {
    *targets = 0;
    if (s && !strcmp(s, "all")) {
        *targets = LOOM_LORA_ALL;
        return LOOM_OK;
    }
    for (const char *p = s ? s : ""; ; p++) {
        size_t n = strcspn(p, ",");
        int k = 0;
        while (k < LOOM_LORA_N && !piece_is(p, n, lora_short[k]) && !piece_is(p, n, lora_module[k])) k++;
        if (k == LOOM_LORA_N)
            return loom_error(LOOM_ERR_INVALID, "LoRA target \"%.*s\" is not one of q, k, v, o, gate, up, down "
                              "(or q_proj .. down_proj), comma-separated, or all", (int)n, p);
        *targets |= 1u << k;
        p += n;
        if (!*p) return LOOM_OK;
    }
}

void loom_lora_targets_format(unsigned targets, char *buf, size_t n) {
    size_t k = 0;
    if (n) buf[0] = '\0';
    for (int t = 0; t < LOOM_LORA_N && k < n; t++)
        if (targets & (1u << t)) {
            int w = snprintf(buf + k, n - k, "%s%s", k ? "," : "", lora_short[t]);
            if (w > 0) k += (size_t)w;
        }
}

/* The adapters added so far (params[n_base ..)) freed, the layers' slots
 * cleared: the model as it was before loom_llama_add_lora. */
static void drop_adapters(loom_llama *m) {
    for (int i = m->n_base; i < m->n_params; i++) loom_param_free(m->params[i]);
    m->n_params = m->n_base;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        memset(m->layers[l].lora_a, 0, sizeof m->layers[l].lora_a);
        memset(m->layers[l].lora_b, 0, sizeof m->layers[l].lora_b);
        memset(m->layers[l].lora_m, 0, sizeof m->layers[l].lora_m);
    }
}

/* The checks of a LoRA setting for a model of config c over tp ranks. */
static loom_status lora_check(const loom_llama_config *c, const loom_lora_config *cfg) {
    if (cfg->rank < 1 || cfg->rank > c->dim)
        return loom_error(LOOM_ERR_INVALID, "LoRA rank %d: must be 1..%d (the model's dim)", cfg->rank, c->dim);
    if (!(cfg->alpha > 0.0f) || !isfinite(cfg->alpha))
        return loom_error(LOOM_ERR_INVALID, "LoRA alpha %g: must be a finite number above 0", (double)cfg->alpha);
    if (!(cfg->dropout >= 0.0f && cfg->dropout < 1.0f))
        return loom_error(LOOM_ERR_INVALID, "LoRA dropout %g: must be in [0, 1)", (double)cfg->dropout);
    if (!cfg->targets || (cfg->targets & ~LOOM_LORA_ALL))
        return loom_error(LOOM_ERR_INVALID, "LoRA targets 0x%x: must be a non-empty set of the %d linears",
                          cfg->targets, LOOM_LORA_N);
    return LOOM_OK;
}

static loom_status append_adapters(loom_llama *m, const loom_lora_config *cfg, uint64_t seed);

loom_status loom_llama_new_lora(const loom_llama_config *cfg, loom_precision prec, const loom_lora_config *lora,
                                uint64_t seed, loom_llama **out) {
    return loom_llama_new_lora_tp(cfg, prec, lora, seed, NULL, out);
}

loom_status loom_llama_new_lora_tp(const loom_llama_config *cfg, loom_precision prec, const loom_lora_config *lora,
                                   uint64_t seed, loom_comm *tp_comm, loom_llama **out) {
    *out = NULL;
    LOOM_TRY(loom_llama_config_validate(cfg));
    LOOM_TRY(lora_check(cfg, lora));
    loom_llama *m;
    LOOM_TRY(llama_create(cfg, prec, tp_comm, 1, &m));
    loom_status st = append_adapters(m, lora, seed);
    if (st != LOOM_OK) {
        loom_llama_free(m);
        return st;
    }
    *out = m;
    return LOOM_OK;
}

loom_status loom_llama_add_lora(loom_llama *m, const loom_lora_config *cfg, uint64_t seed) {
    if (m->lora.rank)
        return loom_error(LOOM_ERR_INVALID, "LoRA: this model has adapters already (rank %d)", m->lora.rank);
    LOOM_TRY(lora_check(&m->cfg, cfg));
    for (int i = 0; i < m->n_base; i++)
        if (m->params[i]->grad_borrowed)
            return loom_error(LOOM_ERR_STATE, "LoRA: add the adapters before the optimizer is made (%s's gradient "
                              "lives in its buffer)", m->params[i]->name);
    return append_adapters(m, cfg, seed);
}

/* The adapters appended after n_base, the base frozen, m->lora set; on
 * failure the model is as it was. */
static loom_status append_adapters(loom_llama *m, const loom_lora_config *cfg, uint64_t seed) {
    int per = 0;
    for (int t = 0; t < LOOM_LORA_N; t++) per += (cfg->targets >> t) & 1u;
    int each = cfg->dora ? 3 : 2; /* A, B and DoRA's m */
    loom_param **grown = realloc(m->params, (size_t)(m->n_base + each * per * m->cfg.n_layers) * sizeof *grown);
    if (!grown) return loom_error(LOOM_ERR_NOMEM, "LoRA: out of memory");
    m->params = grown;
    loom_status st = LOOM_OK;
    char name[160];
    int k = 0; /* the adapter's ordinal */
    for (int l = 0; l < m->cfg.n_layers && st == LOOM_OK; l++) {
        loom_llama_layer *y = &m->layers[l];
        for (int t = 0; t < LOOM_LORA_N && st == LOOM_OK; t++, k++) {
            if (!(cfg->targets & (1u << t))) { k--; continue; }
            const loom_param *w = loom_llama_layer_weight(y, (loom_lora_target)t);
            int64_t fs[2];
            tp_full_shape(w, m->tp_size, fs);
            int64_t out = fs[0], in = fs[1];
            /* Split as W is: a column-parallel W (rows split) splits B's
             * rows, a row-parallel one (columns split) A's columns. */
            int split_a = w->tp_split_dim == 1 ? 1 : -1, split_b = w->tp_split_dim == 0 ? 0 : -1;
            const char *group = t <= LOOM_LORA_O ? "self_attn" : "mlp";
            snprintf(name, sizeof name, "model.layers.%d.%s.%s.lora_A.weight", l, group, lora_module[t]);
            st = add_param(m, name, m->prec.compute, 2, cfg->rank, in, split_a, 0, &y->lora_a[t]);
            snprintf(name, sizeof name, "model.layers.%d.%s.%s.lora_B.weight", l, group, lora_module[t]);
            if (st == LOOM_OK) st = add_param(m, name, m->prec.compute, 2, out, cfg->rank, split_b, 0, &y->lora_b[t]);
            snprintf(name, sizeof name, "model.layers.%d.%s.%s.lora_magnitude_vector", l, group, lora_module[t]);
            /* DoRA's magnitudes: fp32 in any precision (PEFT keeps them so; a
             * bf16 m would move the output by its rounding, 2^-9, from the
             * first step), split as B's rows (W's outputs); set below */
            if (st == LOOM_OK && cfg->dora) st = add_param(m, name, LOOM_F32, 1, out, 0, split_b, 0, &y->lora_m[t]);
            if (st != LOOM_OK) break;
            /* A: uniform in [-1/sqrt(in), 1/sqrt(in)), its own stream per
             * adapter, drawn whole and sliced (the same A on any number of
             * ranks); B stays zero. */
            size_t n = (size_t)(cfg->rank * in);
            float *v = malloc(n * sizeof *v), bound = 1.0f / sqrtf((float)in);
            if (!v) { st = loom_error(LOOM_ERR_NOMEM, "LoRA: out of memory"); break; }
            /* A's stream by the adapter's ordinal (as A's index without DoRA):
             * the same A with DoRA or without */
            loom_rng_uniform(v, n, seed, (uint64_t)(m->n_base + 2 * k) << 40);
            for (size_t e = 0; e < n; e++) v[e] = (2.0f * v[e] - 1.0f) * bound;
            loom_llama_param_scatter(m, m->n_params - (cfg->dora ? 3 : 2), v);
            free(v);
        }
    }
    if (st != LOOM_OK) {
        drop_adapters(m);
        return st;
    }
    m->lora = *cfg;
    st = loom_llama_dora_reset(m); /* from the compute copies: before the base is frozen */
    if (st != LOOM_OK) { /* out of memory for the norms: the model as it was */
        drop_adapters(m);
        memset(&m->lora, 0, sizeof m->lora);
        return st;
    }
    for (int i = 0; i < m->n_base; i++) LOOM_ASSERT(loom_param_freeze(m->params[i]) == LOOM_OK);
    return LOOM_OK;
}

/* ss[o] = the sum of the squares of row o of full (out, in), in fp64. */
static void rows_sumsq(const float *full, int out, int in, double *ss) {
    #pragma omp parallel for schedule(static) if ((size_t)out * (size_t)in > 65536)
    for (int o = 0; o < out; o++) {
        double sum = 0.0;
        const float *row = full + (size_t)o * (size_t)in;
        for (int k = 0; k < in; k++) sum += (double)row[k] * (double)row[k];
        ss[o] = sum;
    }
}

/* A row's norm from its sum of squares, at least FLT_MIN: a zero row's
 * output is zero whatever DoRA's factor. */
static float dora_norm(double sumsq) {
    float v = (float)sqrt(sumsq);
    return v > FLT_MIN ? v : FLT_MIN;
}

loom_status loom_llama_dora_norms(const loom_llama *m, int l, loom_lora_target t, float *n) {
    const loom_llama_layer *y = l >= 0 && l < m->cfg.n_layers && (unsigned)t < LOOM_LORA_N ? &m->layers[l] : NULL;
    if (!y || !y->lora_m[t]) return loom_error(LOOM_ERR_INVALID, "DoRA: layer %d has no DoRA adapter on linear %d", l, t);
    const loom_param *w = loom_llama_layer_weight(y, t);
    loom_tensor *a = y->lora_a[t]->tensor, *b = y->lora_b[t]->tensor;
    int out = (int)w->tensor->shape[0], in = (int)w->tensor->shape[1], r = m->lora.rank, row_parallel = w->tp_split_dim == 1;
    float *full = loom_alloc((size_t)out * (size_t)in * sizeof *full, LOOM_MEM_WORKSPACE);
    double *ss = loom_alloc((size_t)out * sizeof *ss + 1, LOOM_MEM_WORKSPACE);
    loom_status st = full && ss ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "DoRA: out of memory for the norms of %s",
                                                       w->name);
    /* a row-parallel W's norms are a collective: every rank enters it, or none */
    if (row_parallel) st = loom_llama_tp_agree((loom_llama *)m, st);
    /* W + s B A in fp32 from the compute copies: the weights the forward multiplies by */
    if (st == LOOM_OK) {
        loom_convert(full, LOOM_F32, loom_tensor_data(w->tensor), w->tensor->dtype, (size_t)out * (size_t)in);
        st = loom_gemm(0, 0, out, in, r, loom_lora_scale(&m->lora), loom_tensor_data(b), r, loom_tensor_data(a), in,
                       a->dtype, 1.0f, full, in, LOOM_F32, NULL, LOOM_F32);
    }
    if (st == LOOM_OK) rows_sumsq(full, out, in, ss);
    /* a row-parallel W (columns split): each rank summed its columns (the
     * GEMM fails on every rank or on none: the same shapes) */
    if (st == LOOM_OK && row_parallel) st = loom_comm_allreduce_sum_f64(m->tp_comm, ss, (size_t)out);
    for (int o = 0; st == LOOM_OK && o < out; o++) n[o] = dora_norm(ss[o]);
    loom_free(ss);
    loom_free(full);
    return st;
}

loom_status loom_llama_dora_reset(loom_llama *m) {
    for (int l = 0; l < m->cfg.n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N; t++) {
            loom_param *p = m->layers[l].lora_m[t];
            if (!p) continue;
            float *n = malloc((size_t)loom_param_numel(p) * sizeof *n + 1);
            loom_status st = n ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "DoRA: out of memory");
            if (loom_llama_layer_weight(&m->layers[l], (loom_lora_target)t)->tp_split_dim == 1)
                st = loom_llama_tp_agree(m, st); /* the norms' collective: every rank or none */
            if (st == LOOM_OK) st = loom_llama_dora_norms(m, l, (loom_lora_target)t, n);
            if (st == LOOM_OK) st = loom_param_set_f32(p, n, loom_param_numel(p));
            free(n);
            LOOM_TRY(st);
        }
    return LOOM_OK;
}

/* The layer whose linear *t is base parameter i and has an adapter, or
 * NULL. */
static const loom_llama_layer *adapted_layer(const loom_llama *m, int i, loom_lora_target *t) {
    if (!m->lora.rank || i < 0 || i >= m->n_base) return NULL;
    for (int l = 0; l < m->cfg.n_layers; l++)
        for (int k = 0; k < LOOM_LORA_N; k++)
            if (m->layers[l].lora_a[k] && loom_llama_layer_weight(&m->layers[l], (loom_lora_target)k) == m->params[i]) {
                *t = (loom_lora_target)k;
                return &m->layers[l];
            }
    return NULL;
}

int loom_llama_lora_of(const loom_llama *m, int i, loom_param **a, loom_param **b) {
    loom_lora_target t;
    const loom_llama_layer *y = adapted_layer(m, i, &t);
    if (!y) return 0;
    *a = y->lora_a[t];
    *b = y->lora_b[t];
    return 1;
}

loom_status loom_llama_param_merged(loom_llama *m, int i, float *full) {
    LOOM_TRY(loom_llama_param_gather(m, i, 0, full));
    loom_lora_target t;
    const loom_llama_layer *y = adapted_layer(m, i, &t);
    if (!y) return LOOM_OK;
    loom_param *a = y->lora_a[t], *b = y->lora_b[t];
    /* W (out, in) += s B (out, r) A (r, in) (s: loom_lora_scale), in fp32
     * from the masters (gathered whole under tensor parallelism); with
     * DoRA each row then scaled to its magnitude. */
    int64_t fa[2], fb[2];
    tp_full_shape(a, m->tp_size, fa);
    tp_full_shape(b, m->tp_size, fb);
    int out = (int)fb[0], in = (int)fa[1], r = m->lora.rank;
    float *wa = loom_param_master(a), *wb = loom_param_master(b), *ga = NULL, *gb = NULL;
    loom_status st = LOOM_OK;
    if (m->tp_size > 1) {
        ga = malloc((size_t)(fa[0] * fa[1]) * sizeof *ga);
        gb = malloc((size_t)(fb[0] * fb[1]) * sizeof *gb);
        st = loom_llama_tp_agree(m, ga && gb ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "LoRA merge: out of memory"));
        if (st == LOOM_OK) st = tp_gather(m->tp_comm, a, wa, ga);
        if (st == LOOM_OK) st = tp_gather(m->tp_comm, b, wb, gb);
        wa = ga;
        wb = gb;
    }
    if (st == LOOM_OK)
        st = loom_gemm(0, 0, out, in, r, loom_lora_scale(&m->lora), wb, r, wa, in, LOOM_F32, 1.0f, full, in, LOOM_F32,
                       NULL, LOOM_F32);
    free(ga);
    free(gb);
    const loom_param *mag = y->lora_m[t];
    float *mv = NULL, *gm = NULL;
    if (st == LOOM_OK && mag) { /* DoRA's magnitudes, whole (gathered where W's rows are split) */
        mv = loom_param_master((loom_param *)mag);
        if (m->tp_size > 1 && mag->tp_split_dim >= 0) {
            gm = malloc((size_t)out * sizeof *gm);
            st = loom_llama_tp_agree(m, gm ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "DoRA merge: out of memory"));
            if (st == LOOM_OK) st = tp_gather(m->tp_comm, mag, mv, gm);
            mv = gm;
        }
    }
    double *ss = st == LOOM_OK && mag ? malloc((size_t)out * sizeof *ss) : NULL;
    if (st == LOOM_OK && mag && !ss) st = loom_error(LOOM_ERR_NOMEM, "DoRA merge: out of memory");
    if (st == LOOM_OK && mag) { /* DoRA: each row times m / |row| */
        rows_sumsq(full, out, in, ss);
        for (int o = 0; o < out; o++) {
            float *row = full + (size_t)o * (size_t)in, f = mv[o] / dora_norm(ss[o]);
            for (int k = 0; k < in; k++) row[k] *= f;
        }
    }
    free(ss);
    free(gm);
    return st;
}

void loom_llama_zero_grad(loom_llama *m) {
    for (int i = 0; i < m->n_params; i++) loom_param_zero_grad(m->params[i]);
}

/* ------------------------------------------------------------- forward */

#define RELEASE(...) do { loom_tensor *r_[] = {__VA_ARGS__}; \
    for (size_t i_ = 0; i_ < sizeof r_ / sizeof r_[0]; i_++) loom_tensor_release(r_[i_]); } while (0)

static loom_status dora_output(const struct llama_block_args *a, loom_lora_target t, loom_tensor *xd, loom_tensor *xa,
                               loom_tensor *base, float scale, loom_tensor **out);

/* y + b (b NULL: y), taking y over. */
static loom_status plus_bias(loom_tensor *y, const loom_param *b, loom_tensor **out) {
    if (!b) {
        *out = y;
        return LOOM_OK;
    }
    loom_status st = loom_add_bias(y, b->tensor, out);
    loom_tensor_release(y);
    return st;
}

/* Linear t of the block: x W^T, plus s (dropout(x) A^T) B^T (s:
 * loom_lora_scale; DoRA's column scale after it: dora_output)
 * when it has a LoRA adapter (the dropout only in a training forward); B's
 * GEMM scales its product and adds it to x W^T in one rounding
 * (loom_fused_linear_add), as the KV-cache path does.
 *
 * Under tensor parallelism (Megatron's f = tp_copy, g = tp_reduce):
 *  - column-parallel t (q, k, v, gate, up; B's rows split): x is f(xr),
 *    and the adapter reads xr itself: f(xr A^T) B^T. Its gradient reaches
 *    A and xr whole on every rank (f sums x A^T's over the ranks' B
 *    slices), never through x's f, which sums the ranks' partial W paths;
 *  - row-parallel t (o, down; A's columns split): the output is already
 *    g-reduced, then g(x A^T) B^T is added: B and its gradient whole on
 *    every rank, A's slice and x's from the ranks' own columns; dropout
 *    takes the rank's columns of the whole rows' mask.
 * A data-parallel rank's dropout takes its rows of the global batch's
 * mask (loom_llama_set_data_parallel).
 * Without tensor parallelism f and g are the identity and xr is x.
 * A bias (q, k, v, o: loom_llama_config) is added last, by its own op:
 * after the row-parallel sum (once, not once per rank), outside the adapter
 * and DoRA's scale (PEFT's: the base layer's bias is not scaled), and so the
 * same with an adapter whose B is zero as without one, bit for bit. */
static loom_status block_linear(const struct llama_block_args *a, loom_lora_target t, loom_tensor *x,
                                loom_tensor *xr, loom_tensor **out) {
    const loom_llama *m = a->m;
    const loom_llama_layer *y = &m->layers[a->layer];
    const loom_param *w = loom_llama_layer_weight(y, t), *bias = loom_llama_layer_bias(y, t);
    int row = w->tp_split_dim == 1;
    loom_tensor *base = NULL, *partial = NULL, *xd = NULL, *xa = NULL, *xaf = NULL, *sum = NULL;
    loom_status st = loom_fused_linear(x, w->tensor, NULL, row ? &partial : &base);
    if (st == LOOM_OK && row) st = tp_reduce(m->tp_comm, partial, &base);
    loom_tensor_release(partial);
    *out = NULL;
    if (st != LOOM_OK || !y->lora_a[t]) {
        if (st != LOOM_OK) return st;
        return plus_bias(base, bias, out);
    }
    loom_tensor *in = row || !xr ? x : xr;
    float scale = loom_lora_scale(&m->lora);
    if (a->training && m->lora.dropout > 0.0f) {
        /* this data-parallel rank's rows of the global batch's mask; a
         * row-parallel input's columns of the whole rows' */
        int64_t cols = in->shape[in->ndim - 1], rows = loom_tensor_numel(in) / cols;
        loom_window w = {m->dp_rank * rows, m->dp_size * rows, row ? m->tp_rank * cols : 0, row ? m->tp_size * cols : 0};
        st = loom_dropout_window(in, m->lora.dropout, &w, &xd);
    }
    if (st == LOOM_OK) st = loom_fused_linear(xd ? xd : in, y->lora_a[t]->tensor, NULL, &xa);
    if (st == LOOM_OK) st = row ? tp_reduce(m->tp_comm, xa, &xaf) : tp_copy(m->tp_comm, xa, &xaf);
    if (st == LOOM_OK && y->lora_m[t]) st = dora_output(a, t, xd, xaf, base, scale, &sum);
    else if (st == LOOM_OK) st = loom_fused_linear_add(xaf, y->lora_b[t]->tensor, scale, base, &sum); /* one GEMM */
    RELEASE(base, xd, xa, xaf);
    return st == LOOM_OK ? plus_bias(sum, bias, out) : st;
}

/* DoRA: (m / n) (base + s xa B^T), n the norms of W + s B A, a constant;
 * with dropout (xd) base + (m / n) (xd W^T + s xa B^T) - xd W^T. xa is the
 * adapter's x A^T after its f or g. Under tensor parallelism the output is
 * the rank's columns (column-parallel W: m and n the rank's rows) or whole
 * (row-parallel: m whole, n summed over the ranks' columns), and xd W^T is
 * computed as base is: f(xd) W^T, or g(xd W^T) for the rank's columns. */
static loom_status dora_output(const struct llama_block_args *a, loom_lora_target t, loom_tensor *xd, loom_tensor *xa,
                               loom_tensor *base, float scale, loom_tensor **out) {
    const loom_llama *m = a->m;
    const loom_llama_layer *y = &m->layers[a->layer];
    const loom_param *w = loom_llama_layer_weight(y, t);
    int row = w->tp_split_dim == 1;
    loom_tensor *n = loom_tensor_new_1d(LOOM_F32, y->lora_m[t]->tensor->shape[0], LOOM_MEM_ACTIVATIONS);
    loom_tensor *xdf = NULL, *bdp = NULL, *bd = NULL, *sum = NULL, *scaled = NULL, *neg = NULL, *part = NULL;
    loom_status st = n ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "DoRA: out of memory");
    if (row) st = loom_llama_tp_agree((loom_llama *)m, st); /* the norms' collective: every rank or none */
    if (st == LOOM_OK) st = loom_llama_dora_norms(m, a->layer, t, loom_tensor_data(n));
    if (st == LOOM_OK && xd && !row) st = tp_copy(m->tp_comm, xd, &xdf); /* f(x') */
    if (st == LOOM_OK && xd) st = loom_fused_linear(row ? xd : xdf, w->tensor, NULL, row ? &bdp : &bd);
    if (st == LOOM_OK && xd && row) st = tp_reduce(m->tp_comm, bdp, &bd); /* g(x' W^T) */
    if (st == LOOM_OK) st = loom_fused_linear_add(xa, y->lora_b[t]->tensor, scale, xd ? bd : base, &sum);
    if (st == LOOM_OK) st = loom_dora_scale(sum, y->lora_m[t]->tensor, n, xd ? &scaled : out);
    if (st == LOOM_OK && xd) st = loom_scale(bd, -1.0f, &neg);
    if (st == LOOM_OK && xd) st = loom_add(base, scaled, &part);
    if (st == LOOM_OK && xd) st = loom_add(part, neg, out);
    RELEASE(n, xdf, bdp, bd, sum, scaled, neg, part);
    return st;
}

/* *x replaced by op(*x, v): loom_scale, loom_divide, loom_softcap. */
static loom_status replace_by(loom_tensor **x, loom_status (*op)(loom_tensor *, float, loom_tensor **), float v) {
    loom_tensor *y = NULL;
    loom_status st = op(*x, v, &y);
    loom_tensor_release(*x);
    *x = y;
    return st;
}

/* *x times s, replacing *x, unless s is 0 (none) or 1. */
static loom_status scale_by(loom_tensor **x, float s) {
    return s == 0.0f || s == 1.0f ? LOOM_OK : replace_by(x, loom_scale, s);
}

/* x in dtype dt: x itself when it is, else a cast. */
static loom_status as_dtype(loom_tensor *x, loom_dtype dt, loom_tensor **out) {
    if (x->dtype != dt) return loom_cast(x, dt, out);
    *out = loom_tensor_retain(x);
    return LOOM_OK;
}

/* Each head of *x (B, T, heads, HS) normalized by norm's weight (Qwen 3's
 * q_norm, k_norm); *x is replaced. Under tensor parallelism the weight,
 * whole on every rank, reaches the norm through f (tp_copy): each rank's
 * heads give part of its gradient, which f's backward sums over the ranks.
 * Gradients travel in the dtype of their tensor, so there the norm runs on
 * fp32 casts (the same bits: the bf16 kernel computes in fp32 and rounds
 * once) and the parts are summed in fp32, as one process accumulates them
 * into the fp32 main_grad. In one process f and the casts are the identity. */
static loom_status head_norm(const loom_llama *m, const loom_param *norm, loom_tensor **x) {
    loom_dtype dt = (*x)->dtype, nd = m->tp_size > 1 ? LOOM_F32 : dt;
    loom_tensor *wc = NULL, *w = NULL, *xc = NULL, *n = NULL, *y = NULL;
    loom_status st = as_dtype(norm->tensor, nd, &wc);
    if (st == LOOM_OK) st = tp_copy(m->tp_comm, wc, &w);
    if (st == LOOM_OK) st = as_dtype(*x, nd, &xc);
    if (st == LOOM_OK) st = loom_rmsnorm_ex(xc, w, m->cfg.norm_eps, norm_offset(&m->cfg), &n);
    if (st == LOOM_OK) st = as_dtype(n, dt, &y);
    RELEASE(*x, wc, w, xc, n);
    *x = y;
    return st;
}

/* q/k/v projection then view as (B, T, heads, HS), each head normalized
 * (norm NULL: none; head_norm) and rotated (q, k). */
static loom_status project_heads(const struct llama_block_args *a, loom_lora_target t, loom_tensor *h,
                                 loom_tensor *hn, int heads, int HS, const loom_param *norm,
                                 const loom_rope_freqs *rope, loom_tensor **out) {
    loom_tensor *y = NULL, *y4 = NULL;
    int64_t shape[4] = {a->B, a->T, heads, HS};
    loom_status st = block_linear(a, t, h, hn, &y);
    if (st == LOOM_OK) st = loom_reshape(y, 4, shape, &y4);
    loom_tensor_release(y);
    if (st == LOOM_OK && norm) st = head_norm(a->m, norm, &y4);
    if (st != LOOM_OK || !rope) { *out = y4; return st; }
    st = loom_rope_ex(y4, rope, 0, out);
    loom_tensor_release(y4);
    return st;
}

/* Heads are split across the TP group: each rank runs NH/T query heads and
 * NKV/T kv heads; o_proj's partial sums are all-reduced (g), and the
 * normalised input's gradient is all-reduced (f). */
static loom_status attention_part(const struct llama_block_args *a, loom_tensor *x, loom_tensor **out) {
    const loom_llama *m = a->m;
    const loom_llama_config *c = &m->cfg;
    const loom_llama_layer *y = &m->layers[a->layer];
    int HS = loom_llama_head_dim(c), NH = c->n_heads / m->tp_size, NKV = c->n_kv_heads / m->tp_size;
    loom_tensor *hn = NULL, *h = NULL, *q = NULL, *k = NULL, *v = NULL, *att = NULL, *att2 = NULL;
    int64_t flat[2] = {(int64_t)a->B * a->T, (int64_t)NH * HS};
    loom_status st = loom_rmsnorm_ex(x, y->attn_norm->tensor, c->norm_eps, norm_offset(c), &hn);
    if (st == LOOM_OK) st = tp_copy(m->tp_comm, hn, &h);
    loom_rope_freqs rope = loom_llama_layer_rope_at(c, a->layer, a->T); /* positions 0 .. T - 1 */
    const loom_rope_freqs *r = loom_llama_layer_has_rope(c, a->layer) ? &rope : NULL; /* SmolLM3's NoPE blocks */
    if (st == LOOM_OK) st = project_heads(a, LOOM_LORA_Q, h, hn, NH, HS, y->q_norm, r, &q);
    if (st == LOOM_OK) st = project_heads(a, LOOM_LORA_K, h, hn, NKV, HS, y->k_norm, r, &k);
    if (st == LOOM_OK) st = project_heads(a, LOOM_LORA_V, h, hn, NKV, HS, NULL, NULL, &v);
    loom_attention_opts ao = {.scale = loom_llama_attn_scale(c), .softcap = c->attn_softcap,
                              .window = loom_llama_layer_window(c, a->layer)};
    if (a->training && c->attention_dropout > 0.0f) { /* this rank's rows and heads of the whole batch's mask */
        ao.dropout = c->attention_dropout;
        ao.dropout_at = (loom_window){(int64_t)m->dp_rank * a->B, (int64_t)m->dp_size * a->B, (int64_t)m->tp_rank * NH,
                                      (int64_t)m->tp_size * NH};
    }
    if (st == LOOM_OK) st = loom_attention_ex(q, k, v, &ao, &att);
    if (st == LOOM_OK) st = loom_reshape(att, 2, flat, &att2);
    if (st == LOOM_OK) st = block_linear(a, LOOM_LORA_O, att2, NULL, out); /* g-reduced inside */
    RELEASE(hn, h, q, k, v, att, att2);
    return st;
}

static loom_status mlp_part(const struct llama_block_args *a, loom_tensor *x, loom_tensor **out) {
    const loom_llama *m = a->m;
    const loom_llama_config *c = &m->cfg;
    const loom_llama_layer *y = &m->layers[a->layer];
    loom_tensor *hn = NULL, *h = NULL, *g = NULL, *u = NULL, *s = NULL;
    loom_status st = loom_rmsnorm_ex(x, y->mlp_norm->tensor, c->norm_eps, norm_offset(c), &hn);
    if (st == LOOM_OK) st = tp_copy(m->tp_comm, hn, &h);
    if (st == LOOM_OK) st = block_linear(a, LOOM_LORA_GATE, h, hn, &g);
    if (st == LOOM_OK) st = block_linear(a, LOOM_LORA_UP, h, hn, &u);
    if (st == LOOM_OK) st = c->act == LOOM_ACT_GELU_TANH ? loom_geglu(g, u, &s) : loom_swiglu(g, u, &s);
    if (st == LOOM_OK) st = block_linear(a, LOOM_LORA_DOWN, s, NULL, out); /* g-reduced inside */
    RELEASE(hn, h, g, u, s);
    return st;
}

/* *x normalized by norm's weight (Gemma 2's norms of a block's outputs); *x is replaced. */
static loom_status post_norm(const loom_llama *m, const loom_param *norm, loom_tensor **x) {
    loom_tensor *y = NULL;
    loom_status st = loom_rmsnorm_ex(*x, norm->tensor, m->cfg.norm_eps, norm_offset(&m->cfg), &y);
    loom_tensor_release(*x);
    *x = y;
    return st;
}

/* One transformer block: x + attn(norm(x)), then + mlp(norm(.)). x (B*T, C). */
static loom_status block_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const struct llama_block_args *a = user;
    loom_tensor *att = NULL, *x2 = NULL, *mlp = NULL;
    const loom_llama_layer *y = &a->m->layers[a->layer];
    float rm = a->m->cfg.residual_multiplier; /* Granite's */
    loom_status st = attention_part(a, in[0], &att);
    if (st == LOOM_OK && y->attn_post_norm) st = post_norm(a->m, y->attn_post_norm, &att); /* Gemma 2's */
    if (st == LOOM_OK) st = scale_by(&att, rm);
    if (st == LOOM_OK) st = loom_add(in[0], att, &x2);
    if (st == LOOM_OK) st = mlp_part(a, x2, &mlp);
    if (st == LOOM_OK && y->mlp_post_norm) st = post_norm(a->m, y->mlp_post_norm, &mlp);
    if (st == LOOM_OK) st = scale_by(&mlp, rm);
    if (st == LOOM_OK) st = loom_add(x2, mlp, &out[0]);
    RELEASE(att, x2, mlp);
    return st;
}

loom_status loom_llama_forward(loom_llama *m, const int32_t *tokens, const int32_t *targets, int B, int T,
                               loom_tensor **loss, loom_tensor **logits_out) {
    const loom_llama_config *c = &m->cfg;
    if (loss) *loss = NULL;
    if (logits_out) *logits_out = NULL;
    if (B <= 0 || T <= 0 || T > c->max_seq)
        return loom_error(LOOM_ERR_INVALID, "llama forward: batch %d x sequence %d (sequence must be 1..%d)", B, T,
                          c->max_seq);
    if (m->recompute.blocks < 0)
        return loom_error(LOOM_ERR_INVALID, "llama forward: recompute.blocks is %d (0: every block, or 1..%d)",
                          m->recompute.blocks, c->n_layers);
    int N = B * T;
    /* Whether this forward trains is decided here, outside every region (a
     * reentrant region runs its first forward without gradients), and kept
     * in the arguments its replays read. */
    struct llama_arg_set *args = arg_set_for(m, B, T, loom_grad_enabled());
    if (!args) return loom_error(LOOM_ERR_NOMEM, "llama forward: out of memory");
    loom_tensor *x = NULL, *h = NULL, *logits = NULL;
    LOOM_TRY(loom_embedding(m->embed->tensor, tokens, N, &x));
    loom_status st = LOOM_OK;
    if (c->scale_embeddings) st = scale_by(&x, loom_llama_embed_scale(c, x->dtype)); /* Gemma's */
    if (st == LOOM_OK) st = scale_by(&x, c->embedding_multiplier);                   /* Granite's */
    int recomputed = m->recompute.blocks > 0 ? m->recompute.blocks : c->n_layers;
    for (int l = 0; l < c->n_layers && st == LOOM_OK; l++) {
        loom_tensor *next = NULL;
        loom_recompute_mode mode = l < recomputed ? m->recompute.mode : LOOM_RECOMPUTE_NONE;
        /* block_region passes its intermediates only through ops. */
        st = loom_checkpoint_flags(mode, LOOM_REGION_OPS_ONLY, block_region, &args->layer[l], &x, 1, &next, 1);
        loom_tensor_release(x);
        x = next;
    }
    if (st == LOOM_OK) st = loom_rmsnorm_ex(x, m->final_norm->tensor, c->norm_eps, norm_offset(c), &h);
    if (st == LOOM_OK) st = loom_fused_linear(h, m->lm_head->tensor, NULL, &logits);
    if (st == LOOM_OK && c->final_softcap > 0.0f) st = replace_by(&logits, loom_softcap, c->final_softcap); /* Gemma 2 */
    if (st == LOOM_OK && c->logits_scaling != 0.0f && c->logits_scaling != 1.0f) /* Granite's, divided as HF does */
        st = replace_by(&logits, loom_divide, c->logits_scaling);
    if (st == LOOM_OK && loss && targets) st = loom_cross_entropy(logits, targets, N, -1, loss);
    if (st == LOOM_OK && logits_out) *logits_out = loom_tensor_retain(logits);
    RELEASE(x, h, logits);
    return st;
}
