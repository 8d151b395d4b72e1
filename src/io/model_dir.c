/*
 * model_dir.c — model directories in the Hugging Face layout: config.json
 * and model.safetensors with Hugging Face LLaMA names (loom's parameter
 * names are those names, but for Phi-3's fused tensors and Gemma 3's
 * multimodal files, whose text model is their language_model: file_slot_of).
 * Must never: leave a half-written file (every write is atomic) or a
 * directory whose files come from two saves (all are written before any
 * replaces its old one), or load a tensor whose shape differs from the
 * config.
 */
#include "loom/checkpoint.h"
#include "io/io_internal.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <jansson.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

loom_status loom_mkdir_p(const char *dir) {
    char buf[4096];
    if (!dir || !*dir) return loom_error(LOOM_ERR_INVALID, "cannot create a directory with an empty name");
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return loom_error(LOOM_ERR_INVALID, "path too long: %s", dir);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return loom_error(LOOM_ERR_IO, "cannot create directory %s: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return loom_error(LOOM_ERR_IO, "cannot create directory %s: %s", buf, strerror(errno));
    struct stat s;
    if (stat(buf, &s) != 0 || !S_ISDIR(s.st_mode))
        return loom_error(LOOM_ERR_IO, "%s exists and is not a directory", buf);
    return LOOM_OK;
}

/* ----------------------------------------------------------- config.json */

/* A JSON file (`what` names it in errors) parsed into *root (the caller
 * decrefs it). A regular file only: a FIFO would block. */
static loom_status read_json(const char *path, const char *what, json_t **root) {
    void *text;
    size_t len;
    LOOM_TRY(io_read_file(path, what, &text, &len));
    json_error_t err;
    *root = json_loadb(text, len, 0, &err);
    free(text);
    if (!*root) return loom_error(LOOM_ERR_FORMAT, "%s: invalid JSON at line %d: %s", path, err.line, err.text);
    return LOOM_OK;
}

/* An optional field that is null is absent (Hugging Face writes
 * "num_key_value_heads": null for "as many as the attention heads"). */
static loom_status get_int(json_t *root, const char *path, const char *key, int required, int *out) {
    json_t *v = json_object_get(root, key);
    if (!v || (!required && json_is_null(v))) {
        if (required) return loom_error(LOOM_ERR_FORMAT, "%s: missing field \"%s\"", path, key);
        return LOOM_OK;
    }
    if (!json_is_integer(v) || json_integer_value(v) <= 0 || json_integer_value(v) > (1 << 30))
        return loom_error(LOOM_ERR_FORMAT, "%s: field \"%s\" must be a positive integer", path, key);
    *out = (int)json_integer_value(v);
    return LOOM_OK;
}

static loom_status get_float(json_t *root, const char *path, const char *key, float *out) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return LOOM_OK; /* every float field is optional */
    if (!json_is_number(v) || !(json_number_value(v) > 0) || !(json_number_value(v) <= FLT_MAX))
        return loom_error(LOOM_ERR_FORMAT, "%s: field \"%s\" must be a positive number no larger than %g", path,
                          key, (double)FLT_MAX);
    *out = (float)json_number_value(v);
    return LOOM_OK;
}

/* Whether the config's model_type is `name`. */
static int model_type_is(json_t *root, const char *name) {
    json_t *mt = json_object_get(root, "model_type");
    return json_is_string(mt) && !strcmp(json_string_value(mt), name);
}

/* The config classes loom reads, by model_type, with the defaults each
 * gives the fields a file leaves out. */
typedef struct family {
    const char *type;
    float theta, eps;   /* rope_theta, rms_norm_eps */
    int kv_heads;       /* num_key_value_heads when absent (0: the heads; null is the heads for all) */
    int max_seq, tie;   /* max_position_embeddings, tie_word_embeddings */
    int head_dim;       /* 0: hidden_size / heads */
    int windows;        /* its class reads sliding_window (1), and layer_types too (2); 0: neither */
    int window;         /* sliding_window when absent (0: none) */
    int window_if_used; /* the window applies only with use_sliding_window, from block max_window_layers on */
    int window_from;    /* max_window_layers when absent */
    int window_global;  /* every N-th block keeps full attention (Gemma 2's 2; 0: none) */
    int dim, layers, heads, ffn, vocab; /* the shape when absent (0: required, as its class's default is a
                                           model other than the one meant) */
} family;

static const family families[] = {
    /* type       theta  eps    kv  max    tie hd  reads window used from global  dim layers heads ffn vocab */
    {"llama",     1e4f,  1e-6f, 0,  2048,  0,  0,   0,  0,     0,   0,   0, 0, 0, 0, 0, 0},
    {"mistral",   1e4f,  1e-6f, 0,  2048,  0,  0,   1,  4096,  0,   0,   0, 0, 0, 0, 0, 0}, /* MistralConfig's window */
    {"qwen2",     1e4f,  1e-6f, 32, 32768, 0,  0,   2,  4096,  1,   28,  0, 0, 0, 0, 0, 0},
    {"qwen3",     1e4f,  1e-6f, 32, 32768, 0,  128, 2,  4096,  1,   28,  0, 0, 0, 0, 0, 0},
    {"gemma",     1e4f,  1e-6f, 16, 8192,  1,  256, 0,  0,     0,   0,   0, 0, 0, 0, 0, 0},
    {"gemma2",    1e4f,  1e-6f, 4,  8192,  1,  256, 2,  4096,  0,   0,   2, 0, 0, 0, 0, 0}, /* 4 kv heads with its 256 scalar */
    {"granite",   1e4f,  1e-6f, 0,  2048,  0,  0,   0,  0,     0,   0,   0, 0, 0, 0, 0, 0},
    {"phi3",      1e4f,  1e-5f, 0,  4096,  0,  0,   1,  0,     0,   0,   0, 0, 0, 0, 0, 0},
    {"smollm3",   2e6f,  1e-6f, 4,  32768, 1,  0,   2,  0,     1,   0,   0, 0, 0, 0, 0, 0},
    /* sliding_window_pattern 6; Gemma3TextConfig's shape, which the text_config of Gemma 3's multimodal files
     * (4B, 12B, 27B) leaves partly to it */
    {"gemma3_text", 1e6f, 1e-6f, 4, 131072, 1, 256, 2,  4096,  0,   0,   6, 2304, 26, 8, 9216, 262208},
};

/* The family of root's model_type: LLaMA's when it has none, NULL for a
 * model_type loom does not read. */
static const family *family_of(json_t *root) {
    json_t *mt = json_object_get(root, "model_type");
    if (!mt) return &families[0];
    for (size_t k = 0; json_is_string(mt) && k < sizeof families / sizeof families[0]; k++)
        if (!strcmp(json_string_value(mt), families[k].type)) return &families[k];
    return NULL;
}

/* Qwen 2's model (model_type "qwen2") is LLaMA's with biases on q, k and
 * v; Qwen 3's ("qwen3") with a norm of each query and key head instead
 * (and LLaMA's attention_bias). Both have a sliding window only where
 * use_sliding_window says so, and defaults of their own. */
static int is_qwen2(json_t *root) { return model_type_is(root, "qwen2"); }
static int is_qwen3(json_t *root) { return model_type_is(root, "qwen3"); }
/* Gemma's ("gemma"): norms scaling by 1 + weight, embeddings by sqrt(dim),
 * the tanh GELU's gate, heads of 256 and tied embeddings by default. */
static int is_gemma(json_t *root) { return model_type_is(root, "gemma"); }
/* Gemma 2's ("gemma2"): Gemma's, with norms of each block's outputs, softcapped scores and logits, the scores
 * scaled by query_pre_attn_scalar^-0.5, a sliding window (4096) on every other block; Gemma2Config's defaults. */
static int is_gemma2(json_t *root) { return model_type_is(root, "gemma2"); }
/* Gemma 3's text model ("gemma3_text"): Gemma 2's with q/k norms (of 1 + weight), no softcaps by default, a
 * window on every block but every sliding_window_pattern-th (6), whose blocks rotate with their own base
 * (rope_local_base_freq, 10000); Gemma3TextConfig's defaults. */
static int is_gemma3(json_t *root) { return model_type_is(root, "gemma3_text"); }

/* A number field of Gemma 2's or 3's, into *out: the file's (null or 0: none; refused when negative), else def. */
static loom_status gemma2_number(json_t *root, const char *path, const char *key, float def, float *out) {
    json_t *v = json_object_get(root, key);
    *out = def;
    if (!v) return LOOM_OK;
    double x = json_is_null(v) ? 0.0 : json_is_number(v) ? json_number_value(v) : -1.0;
    if (!(x >= 0.0) || !isfinite((float)x))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s must be a positive number or null", path, key);
    *out = (float)x;
    return LOOM_OK;
}

/* Gemma 2's fields (Gemma2Config's softcaps 50 and 30 by default) or Gemma 3's (none by default, its local
 * RoPE base). */
static loom_status read_gemma2(json_t *root, const char *path, loom_llama_config *c) {
    int g3 = is_gemma3(root);
    c->post_norms = 1;
    LOOM_TRY(gemma2_number(root, path, "attn_logit_softcapping", g3 ? 0.0f : 50.0f, &c->attn_softcap));
    LOOM_TRY(gemma2_number(root, path, "final_logit_softcapping", g3 ? 0.0f : 30.0f, &c->final_softcap));
    LOOM_TRY(gemma2_number(root, path, "query_pre_attn_scalar", 256.0f, &c->query_pre_attn_scalar));
    if (!(c->query_pre_attn_scalar > 0.0f))
        return loom_error(LOOM_ERR_FORMAT, "%s: query_pre_attn_scalar must be a positive number", path);
    if (g3) {
        LOOM_TRY(gemma2_number(root, path, "rope_local_base_freq", 10000.0f, &c->rope_local_theta));
        if (!(c->rope_local_theta > 0.0f))
            return loom_error(LOOM_ERR_FORMAT, "%s: rope_local_base_freq must be a positive number", path);
    }
    return LOOM_OK;
}
/* Granite's ("granite"): LLaMA's with four multipliers (GraniteConfig's 1 by
 * default, the attention's too: its scale is attention_multiplier, not
 * 1/sqrt(head size)). */
static int is_granite(json_t *root) { return model_type_is(root, "granite"); }
/* Phi-3's ("phi3", Phi-4's too): LLaMA's model in files whose q, k, v and
 * gate, up are fused (fused_proj); no attention biases whatever the file
 * says; rms_norm_eps 1e-5 and 4096 positions by default. */
static int is_phi3(json_t *root) { return model_type_is(root, "phi3"); }
/* SmolLM3's ("smollm3"): LLaMA's with NoPE blocks (nope_interval); 4 kv
 * heads, 32768 positions, rope_theta 2e6 and tied embeddings by default; a
 * sliding window only with use_sliding_window, as Qwen's. */
static int is_smollm3(json_t *root) { return model_type_is(root, "smollm3"); }

/* An entry of no_rope_layers: 1 (RoPE) or 0 (none), as an integer or a boolean; -1 otherwise. */
static int nope_entry(json_t *e) {
    if (json_is_boolean(e)) return json_is_true(e);
    return json_is_integer(e) && (json_integer_value(e) == 0 || json_integer_value(e) == 1) ? (int)json_integer_value(e)
                                                                                          : -1;
}

/* SmolLM3's NoPE blocks: no_rope_layers (1: RoPE, 0: none; at least a
 * block's worth) where given, else every no_rope_layer_interval-th block
 * (4 by default), as SmolLM3Config makes the list. loom holds the pattern
 * as that interval: a list that is not every N-th block is refused. */
static loom_status read_nope(json_t *root, const char *path, loom_llama_config *c) {
    json_t *list = json_object_get(root, "no_rope_layers"), *iv = json_object_get(root, "no_rope_layer_interval");
    int L = c->n_layers, n = 0;
    if (list && !json_is_null(list)) {
        if (!json_is_array(list) || (int)json_array_size(list) < L)
            return loom_error(LOOM_ERR_FORMAT, "%s: no_rope_layers must be a list of 0 and 1 with one entry a block "
                              "(%d)", path, L);
        for (int l = 0; l < L && !n; l++) /* the first NoPE block gives the interval */
            if (nope_entry(json_array_get(list, (size_t)l)) == 0) n = l + 1;
        for (int l = 0; l < L; l++) {
            int want = n == 0 || (l + 1) % n != 0;
            if (nope_entry(json_array_get(list, (size_t)l)) != want)
                return loom_error(LOOM_ERR_UNSUPPORTED, "%s: no_rope_layers must be 0 or 1 a block, 0 at every N-th "
                                  "block (SmolLM3's pattern); block %d breaks it", path, l);
        }
    } else {
        n = 4; /* SmolLM3Config's */
        if (iv && !json_is_null(iv)) {
            if (!json_is_integer(iv) || json_integer_value(iv) <= 0 || json_integer_value(iv) > (1 << 20))
                return loom_error(LOOM_ERR_FORMAT, "%s: no_rope_layer_interval must be a positive integer", path);
            n = (int)json_integer_value(iv);
        }
    }
    c->nope_interval = n > L ? 0 : n; /* beyond the last block: none */
    return LOOM_OK;
}

/* Phi-3's partial_rotary_factor v (from the top of the file or, in
 * transformers v5, rope_parameters: both must agree), a number in (0, 1]
 * (null: not said), into c (0: not said, the whole head). */
static loom_status read_partial(json_t *v, const char *path, const char *what, loom_llama_config *c) {
    if (!v || json_is_null(v)) return LOOM_OK;
    double f = json_is_number(v) ? json_number_value(v) : -1.0;
    if (!(f > 0.0 && f <= 1.0))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s partial_rotary_factor must be a number in (0, 1]", path, what);
    float p = (float)f;
    if (c->partial_rotary_factor != 0.0f && c->partial_rotary_factor != p)
        return loom_error(LOOM_ERR_FORMAT, "%s: the two partial_rotary_factor fields disagree", path);
    c->partial_rotary_factor = p;
    return LOOM_OK;
}

/* Phi-3's rotary part of each head (Phi-4-mini's partial_rotary_factor),
 * and what its config can ask that loom does not compute: dropout on the
 * residual branches or the embeddings (0 in the released models). */
static loom_status read_phi3(json_t *root, const char *path, loom_llama_config *c) {
    LOOM_TRY(read_partial(json_object_get(root, "partial_rotary_factor"), path, "its", c));
    json_t *v;
    static const char *const drop[2] = {"resid_pdrop", "embd_pdrop"};
    for (int i = 0; i < 2; i++) {
        v = json_object_get(root, drop[i]);
        if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 0.0))
            return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s other than 0 is not supported by loom (set it to 0 to "
                              "fine-tune without that dropout)", path, drop[i]);
    }
    return LOOM_OK;
}

/* Granite's multipliers, each a positive number (1 when the file leaves it out). */
static loom_status read_multipliers(json_t *root, const char *path, loom_llama_config *c) {
    static const char *const key[4] = {"embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                       "logits_scaling"};
    float *dst[4] = {&c->embedding_multiplier, &c->residual_multiplier, &c->attention_multiplier, &c->logits_scaling};
    for (int i = 0; i < 4; i++) {
        json_t *v = json_object_get(root, key[i]);
        double x = v && !json_is_null(v) ? (json_is_number(v) ? json_number_value(v) : -1.0) : 1.0;
        if (!(x > 0.0) || !isfinite((float)x) || !((float)x > 0.0f))
            return loom_error(LOOM_ERR_FORMAT, "%s: %s must be a positive number", path, key[i]);
        *dst[i] = (float)x;
    }
    return LOOM_OK;
}

/* The activation a hidden_act / hidden_activation string `v` names (field
 * `key`): "silu", or the tanh GELU as PyTorch ("gelu_pytorch_tanh") or the
 * formula ("gelu_new") names it; others are refused by name. */
static loom_status parse_act(json_t *v, const char *path, const char *key, loom_activation *act) {
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    if (s && !strcmp(s, "silu")) *act = LOOM_ACT_SILU;
    else if (s && (!strcmp(s, "gelu_pytorch_tanh") || !strcmp(s, "gelu_new"))) *act = LOOM_ACT_GELU_TANH;
    else
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s \"%s\" is not supported by loom (\"silu\" and the tanh GELU, "
                          "\"gelu_pytorch_tanh\" or \"gelu_new\", are)", path, key, s ? s : "?");
    return LOOM_OK;
}

/* The MLP's activation. Gemma's is hidden_activation, where given; else
 * the tanh GELU that Gemma was trained with, which its first configs call
 * hidden_act "gelu" (as Hugging Face's Gemma read them until transformers
 * 4.48, which computes them with the exact GELU). Others: hidden_act. */
static loom_status read_act(json_t *root, const char *path, loom_llama_config *c) {
    json_t *v = json_object_get(root, "hidden_activation"), *a = json_object_get(root, "hidden_act");
    if (is_gemma2(root) || is_gemma3(root)) { /* Gemma2Config's (Gemma3TextConfig's) hidden_activation, alone */
        c->act = LOOM_ACT_GELU_TANH;
        return v && !json_is_null(v) ? parse_act(v, path, "hidden_activation", &c->act) : LOOM_OK;
    }
    if (is_gemma(root)) {
        if (v && !json_is_null(v)) return parse_act(v, path, "hidden_activation", &c->act);
        if (!a || (json_is_string(a) && !strcmp(json_string_value(a), "gelu"))) {
            c->act = LOOM_ACT_GELU_TANH;
            return LOOM_OK;
        }
    }
    return a ? parse_act(a, path, "hidden_act", &c->act) : LOOM_OK;
}

/* The fields that shape the model beyond its sizes: the attention's biases
 * (Qwen 2's on q, k and v; LLaMA's attention_bias on all four), the heads'
 * own size, Qwen 3's q/k norms, attention_dropout; and what loom does not
 * implement, refused rather than computed as something else. */
static loom_status read_architecture(json_t *root, const char *path, loom_llama_config *c) {
    json_t *v = json_object_get(root, "mlp_bias");
    if (v && json_is_true(v))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: mlp_bias = true is not supported by loom's LLaMA", path);
    v = json_object_get(root, "use_bidirectional_attention");
    if (v && json_is_true(v)) /* EmbeddingGemma's gemma3_text files */
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: use_bidirectional_attention = true (an embedding model, as "
                          "EmbeddingGemma) is not a causal language model; loom trains causal ones", path);
    v = json_object_get(root, "attention_bias");
    c->qk_norm = is_qwen3(root) || is_gemma3(root);
    if (is_qwen2(root)) {
        c->qkv_bias = 1; /* Qwen 2's attention has them whatever the file says; o has none */
    } else if (v && !json_is_null(v) && !model_type_is(root, "mistral") && !is_phi3(root)) {
        /* LLaMA's (Mistral's and Phi-3's models have none, whatever the file says) */
        if (!json_is_boolean(v)) return loom_error(LOOM_ERR_FORMAT, "%s: attention_bias must be true or false", path);
        c->qkv_bias = c->o_bias = json_is_true(v);
    }
    const family *f = family_of(root);
    v = json_object_get(root, "head_dim"); /* its own (0: dim / n_heads, however the file says it) */
    json_int_t hd = f ? f->head_dim : 0;   /* Qwen3Config's 128, Gemma's 256 */
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) <= 0 || json_integer_value(v) > (1 << 20))
            return loom_error(LOOM_ERR_FORMAT, "%s: head_dim must be a positive integer or null", path);
        hd = json_integer_value(v);
    }
    if (hd && (c->dim % c->n_heads || hd != c->dim / c->n_heads)) c->head_dim = (int)hd;
    /* Other model types are other architectures under similar names. */
    v = json_object_get(root, "model_type");
    if (!f)
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: model_type \"%s\" is not a LLaMA model (loom reads \"llama\", "
                          "\"mistral\", \"qwen2\", \"qwen3\", \"gemma\", \"gemma2\", \"gemma3_text\", \"granite\", "
                          "\"phi3\" and \"smollm3\", and the text model of Gemma 3's multimodal \"gemma3\")", path,
                          json_is_string(v) ? json_string_value(v) : "?");
    if (is_smollm3(root)) LOOM_TRY(read_nope(root, path, c));
    c->fused_proj = is_phi3(root);
    if (is_phi3(root)) LOOM_TRY(read_phi3(root, path, c));
    v = json_object_get(root, "partial_rotary_factor");
    if (!is_phi3(root) && v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 1.0))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: partial_rotary_factor other than 1 is read for Phi-3 models "
                          "only, whose class turns part of each head", path);
    c->norm_unit_offset = c->scale_embeddings = is_gemma(root) || is_gemma2(root) || is_gemma3(root);
    if (is_gemma2(root) || is_gemma3(root)) LOOM_TRY(read_gemma2(root, path, c));
    if (is_granite(root)) LOOM_TRY(read_multipliers(root, path, c));
    v = json_object_get(root, "attention_dropout"); /* a training forward applies it (loom_llama_forward) */
    if (v && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) >= 0.0 && json_number_value(v) < 1.0))
            return loom_error(LOOM_ERR_FORMAT, "%s: attention_dropout must be a number in [0, 1)", path);
        c->attention_dropout = (float)json_number_value(v);
    }
    return read_act(root, path, c);
}

/* The blocks of a layer_types list (Hugging Face's since 4.53:
 * "sliding_attention" or "full_attention" a block) as loom holds them: the
 * window from the first sliding block on, but every N-th block
 * (c->window_global_interval) full. A list of another pattern is refused. */
static loom_status read_layer_types(json_t *list, const char *path, loom_llama_config *c) {
    int L = c->n_layers, from = -1, global = 0;
    if (!json_is_array(list) || (int)json_array_size(list) < L)
        return loom_error(LOOM_ERR_FORMAT, "%s: layer_types must be a list with one entry a block (%d)", path, L);
    for (int pass = 0; pass < 2; pass++) /* the pattern from the first blocks, then every block against it */
        for (int l = 0; l < L; l++) {
            const char *t = json_string_value(json_array_get(list, (size_t)l));
            if (!t || (strcmp(t, "sliding_attention") && strcmp(t, "full_attention")))
                return loom_error(LOOM_ERR_FORMAT, "%s: layer_types[%d] must be \"sliding_attention\" or "
                                  "\"full_attention\"", path, l);
            int sliding = !strcmp(t, "sliding_attention");
            if (pass == 0 && sliding && from < 0) from = l;
            if (pass == 0 && !sliding && from >= 0 && !global) global = l + 1; /* the first full one after */
            if (pass == 1 && sliding != (from >= 0 && l >= from && (!global || (l + 1) % global != 0)))
                return loom_error(LOOM_ERR_UNSUPPORTED, "%s: layer_types must slide from one block on with full "
                                  "attention every N-th block or none (Qwen's, Gemma 2's and 3's patterns); "
                                  "block %d breaks it", path, l);
        }
    if (from < 0) { /* no block slides */
        c->sliding_window = c->window_from = c->window_global_interval = 0;
        return LOOM_OK;
    }
    c->window_from = from;
    c->window_global_interval = global;
    return LOOM_OK;
}

/* The sliding window (Mistral's: 4096 when a "mistral" config does not
 * say) and the blocks it applies to, as each config class has them: every
 * block (Mistral's, Phi-3's), every other from the first (Gemma 2's),
 * every block but every sliding_window_pattern-th (Gemma 3's), or, only
 * with use_sliding_window, every block from max_window_layers on (Qwen 2's
 * and Qwen 3's); a layer_types list says it for the classes that read one
 * (not Mistral's or Phi-3's). LLaMA's, Gemma's and Granite's classes have
 * no window, and a sliding_window in their files means nothing. SmolLM3's
 * window, on its NoPE blocks, is refused. A window as long as the context
 * or longer changes nothing, and is kept as the file says it. */
static loom_status apply_window(json_t *root, const char *path, loom_llama_config *c) {
    json_t *v = json_object_get(root, "sliding_window");
    json_t *use = json_object_get(root, "use_sliding_window");
    if (use && !json_is_null(use) && !json_is_boolean(use))
        return loom_error(LOOM_ERR_FORMAT, "%s: use_sliding_window must be true or false", path);
    const family *f = family_of(root); /* read_architecture refused model types it is not */
    if (!f->windows || (f->window_if_used && !json_is_true(use))) return LOOM_OK; /* LlamaConfig has none */
    json_int_t window = v ? 0 : f->window; /* the config class's when absent; null: none */
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) <= 0)
            return loom_error(LOOM_ERR_FORMAT, "%s: sliding_window must be a positive integer or null", path);
        window = json_integer_value(v);
    }
    if (!window) return LOOM_OK;
    if (is_smollm3(root))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: SmolLM3's sliding window (on its NoPE blocks) is not computed "
                          "by loom; set use_sliding_window to false", path);
    c->sliding_window = window > (1 << 30) ? 1 << 30 : (int)window; /* past any context: the same */
    c->window_global_interval = f->window_global;
    c->window_from = f->window_from;
    json_t *mwl = f->window_if_used ? json_object_get(root, "max_window_layers") : NULL;
    if (mwl && !json_is_null(mwl)) {
        if (!json_is_integer(mwl) || json_integer_value(mwl) < 0)
            return loom_error(LOOM_ERR_FORMAT, "%s: max_window_layers must be a non-negative integer", path);
        c->window_from = json_integer_value(mwl) > c->n_layers ? c->n_layers : (int)json_integer_value(mwl);
    }
    json_t *pat = is_gemma3(root) ? json_object_get(root, "sliding_window_pattern") : NULL;
    if (pat && !json_is_null(pat)) { /* Gemma 3's older files: every pattern-th block full */
        if (!json_is_integer(pat) || json_integer_value(pat) <= 0)
            return loom_error(LOOM_ERR_FORMAT, "%s: sliding_window_pattern must be a positive integer", path);
        c->window_global_interval = json_integer_value(pat) > (1 << 30) ? 1 << 30 : (int)json_integer_value(pat);
        if (c->window_global_interval == 1) c->window_from = c->n_layers; /* every block full */
    }
    json_t *types = f->windows > 1 ? json_object_get(root, "layer_types") : NULL; /* Mistral's, Phi-3's: none */
    if (types && !json_is_null(types)) LOOM_TRY(read_layer_types(types, path, c));
    if (c->window_from >= c->n_layers) /* no block has it */
        c->sliding_window = c->window_from = c->window_global_interval = 0;
    return LOOM_OK;
}

/* n factors from the JSON array `key` of rs into f; the count in *n (0
 * when absent: an error for the caller). */
static loom_status read_factors(json_t *rs, const char *key, const char *path, const char *what, float *f, int *n) {
    json_t *a = json_object_get(rs, key);
    *n = 0;
    if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > LOOM_ROPE_EXT_MAX)
        return loom_error(LOOM_ERR_FORMAT, "%s: %s longrope needs \"%s\", a list of 1 to %d numbers", path, what, key,
                          LOOM_ROPE_EXT_MAX);
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *v = json_array_get(a, i);
        float x = json_is_number(v) ? (float)json_number_value(v) : NAN;
        if (!(x > 0.0f) || !isfinite(x))
            return loom_error(LOOM_ERR_FORMAT, "%s: %s \"%s\" holds %s at %zu; factors are positive numbers", path,
                              what, key, json_is_number(v) ? "a value that is not" : "something that is not a number", i);
        f[i] = x;
    }
    *n = (int)json_array_size(a);
    return LOOM_OK;
}

/* Phi-3's longrope, as Hugging Face computes it: frequencies divided by
 * its short_factor for a forward whose positions stay within the original
 * context (original_max_position_embeddings, at the top of the file as
 * Phi-3's have it, or in rs), by its long_factor for one past it
 * (loom_llama_layer_rope_at); cosines and sines times attention_factor
 * (given, else sqrt(1 + ln(s) / ln(original)) with s =
 * max_position_embeddings / original, 1 when s <= 1). */
static loom_status parse_longrope(json_t *root, json_t *rs, const char *path, const char *what,
                                  loom_llama_config *c) {
    int ns, nl, hs = loom_llama_rotary_dim(c); /* Phi3Config counts the rotary part's frequencies */
    if (!model_type_is(root, "llama") && !is_phi3(root) && json_object_get(root, "model_type"))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s longrope is read for Phi-3 and LLaMA models only", path, what);
    if (is_phi3(root) && c->head_dim) /* Phi3Config counts the factors by hidden_size / heads */
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: longrope on a Phi-3 model with a head_dim of its own", path);
    LOOM_TRY(read_factors(rs, "short_factor", path, what, c->rope_short, &ns));
    LOOM_TRY(read_factors(rs, "long_factor", path, what, c->rope_long, &nl));
    if (ns != nl || ns != hs / 2)
        return loom_error(LOOM_ERR_FORMAT, "%s: %s longrope has %d short and %d long factors; a rotary part of %d "
                          "needs %d of each", path, what, ns, nl, hs, hs / 2);
    /* Phi-3's original context is the top-level field (Phi3Config's 4096 when absent; Hugging Face reads no
     * other); others may give it in rs */
    json_t *top = json_object_get(root, "original_max_position_embeddings");
    json_t *inner = json_object_get(rs, "original_max_position_embeddings"), *orig = top ? top : inner;
    json_int_t original = is_phi3(root) && !top ? 4096 : json_is_integer(orig) ? json_integer_value(orig) : 0;
    if (original <= 0 || original > (1 << 30))
        return loom_error(LOOM_ERR_FORMAT, "%s: longrope needs original_max_position_embeddings, a positive integer "
                          "(the context the short factors are for)", path);
    if (is_phi3(root) && inner && !json_is_null(inner) &&
        !(json_is_integer(inner) && json_integer_value(inner) == original))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s's original_max_position_embeddings is not the file's (%lld), "
                          "which Phi-3 reads", path, what, (long long)original);
    /* the context it extends to over the original: the file's contexts (Phi-3's; others' when rs gives no
     * factor), else rs's factor */
    double factor = (double)c->max_seq / (double)original;
    json_t *fv = json_object_get(rs, "factor");
    if (!is_phi3(root) && !top && fv && !json_is_null(fv)) factor = json_is_number(fv) ? json_number_value(fv) : -1.0;
    if (!(factor > 0.0) || factor > 1e6)
        return loom_error(LOOM_ERR_FORMAT, "%s: %s longrope's factor must be a positive number", path, what);
    json_t *av = json_object_get(rs, "attention_factor");
    double af = factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log((double)original));
    if (av && !json_is_null(av)) af = json_is_number(av) ? json_number_value(av) : -1.0;
    if (!(af > 0.0) || !isfinite((float)af))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s longrope's attention_factor must be a positive number", path, what);
    c->rope_type = LOOM_ROPE_LONGROPE;
    c->rope_n_ext = ns;
    c->rope_original_max_pos = (int)original;
    c->rope_factor = factor < 1.0 ? 1.0f : (float)factor;
    c->rope_attention_factor = (float)af;
    return LOOM_OK;
}

/* An optional positive number `key` of rs into *out (def when absent,
 * null or, as Hugging Face's `or` takes it, 0). */
static loom_status yarn_number(json_t *rs, const char *path, const char *what, const char *key, double def,
                               double *out) {
    json_t *v = json_object_get(rs, key);
    *out = !v || json_is_null(v) || (json_is_number(v) && json_number_value(v) == 0.0) ? def
           : json_is_number(v) ? json_number_value(v) : -1.0;
    if (!(*out > 0.0) || !isfinite((float)*out))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s yarn's %s must be a positive number", path, what, key);
    return LOOM_OK;
}

/* YaRN's parameters as Hugging Face's _compute_yarn_parameters reads them
 * (transformers 4.56 and later, v5: an explicit factor wins; 4.50-4.55 put
 * the contexts' ratio in its place whenever the original context is
 * given): factor (else the context over the original one), the original
 * context (else max_position_embeddings), attention_factor (else
 * 0.1 ln(factor) + 1, or the ratio of mscale's and mscale_all_dim's when
 * both are given), beta_fast and beta_slow (32 and 1), truncate (true; null
 * is false). The context is the file's: YaRN's frequencies do not depend on
 * the length. */
static loom_status parse_yarn(json_t *rs, const char *path, const char *what, loom_llama_config *c) {
    double original, factor, af, beta_fast, beta_slow, ms, msa;
    LOOM_TRY(yarn_number(rs, path, what, "original_max_position_embeddings", c->max_seq, &original));
    if (original != floor(original) || original > (1 << 30))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s yarn's original_max_position_embeddings must be a whole number",
                          path, what);
    LOOM_TRY(yarn_number(rs, path, what, "factor", c->max_seq / original, &factor));
    LOOM_TRY(yarn_number(rs, path, what, "beta_fast", 32.0, &beta_fast));
    LOOM_TRY(yarn_number(rs, path, what, "beta_slow", 1.0, &beta_slow));
    LOOM_TRY(yarn_number(rs, path, what, "mscale", 1.0, &ms));
    LOOM_TRY(yarn_number(rs, path, what, "mscale_all_dim", 1.0, &msa));
    /* Hugging Face's `if mscale and mscale_all_dim`: both given and not 0 */
    int both = json_number_value(json_object_get(rs, "mscale")) != 0.0 &&
               json_number_value(json_object_get(rs, "mscale_all_dim")) != 0.0;
    double m1 = factor <= 1.0 ? 1.0 : 0.1 * (both ? ms : 1.0) * log(factor) + 1.0;
    double m2 = factor <= 1.0 || !both ? 1.0 : 0.1 * msa * log(factor) + 1.0;
    LOOM_TRY(yarn_number(rs, path, what, "attention_factor", m1 / m2, &af));
    json_t *tr = json_object_get(rs, "truncate");
    if (tr && !json_is_null(tr) && !json_is_boolean(tr))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s yarn's truncate must be true or false", path, what);
    c->rope_type = LOOM_ROPE_YARN;
    c->rope_factor = (float)factor;
    c->rope_original_max_pos = (int)original;
    c->rope_attention_factor = (float)af;
    c->rope_beta_fast = (float)beta_fast;
    c->rope_beta_slow = (float)beta_slow;
    c->rope_truncate = !tr || json_is_true(tr); /* null: Hugging Face's .get("truncate", True) is None, false */
    loom_rope_freqs r = loom_llama_rope(c);
    if (loom_rope_check(&r) != LOOM_OK) return loom_error(LOOM_ERR_FORMAT, "%s: %s: %s", path, what, loom_last_error());
    return LOOM_OK;
}

/* The scaling in object rs (`what` names it in messages): "type" (which
 * Hugging Face takes first) or "rope_type" "default", "linear" (factor),
 * "llama3" (factor, low_freq_factor, high_freq_factor,
 * original_max_position_embeddings), "longrope" / "su" (parse_longrope) or
 * "yarn" (parse_yarn);
 * the others change the math in ways loom does not implement and are
 * refused by name. */
static loom_status parse_rope_scaling(json_t *root, json_t *rs, const char *path, const char *what,
                                      loom_llama_config *c) {
    json_t *t1 = json_object_get(rs, "type"), *t2 = json_object_get(rs, "rope_type"), *t = t1 ? t1 : t2;
    if (!json_is_string(t))
        return loom_error(LOOM_ERR_FORMAT, "%s: %s must be null or an object with a \"rope_type\"", path, what);
    const char *type = json_string_value(t);
    /* "su" is longrope's old name: transformers v5 writes rope_type "longrope" beside the old type "su" */
    int su_pair = t1 && t2 && json_is_string(t1) && json_is_string(t2) && !strcmp(json_string_value(t1), "su") &&
                  !strcmp(json_string_value(t2), "longrope");
    if (t1 && t2 && !json_equal(t1, t2) && !su_pair)
        return loom_error(LOOM_ERR_FORMAT, "%s: %s has \"type\" and \"rope_type\" that disagree", path, what);
    json_t *prf = json_object_get(rs, "partial_rotary_factor"); /* where transformers v5 keeps it */
    if (is_phi3(root)) LOOM_TRY(read_partial(prf, path, what, c));
    else if (prf && !json_is_null(prf) && !(json_is_number(prf) && json_number_value(prf) == 1.0))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s's partial_rotary_factor other than 1 (RoPE on part of each "
                          "head) is read for Phi-3 models only, whose class turns part of each head", path, what);
    if (!strcmp(type, "default")) return LOOM_OK;
    if (!strcmp(type, "longrope") || !strcmp(type, "su")) return parse_longrope(root, rs, path, what, c);
    if (!strcmp(type, "yarn") && !is_phi3(root)) return parse_yarn(rs, path, what, c);
    if (!strcmp(type, "dynamic") && !is_phi3(root)) { /* the default frequencies up to the file's context */
        json_t *o = json_object_get(rs, "original_max_position_embeddings");
        if (o && !json_is_null(o) && !(json_is_integer(o) && json_integer_value(o) == c->max_seq))
            return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s \"dynamic\" with an original context other than "
                              "max_position_embeddings is not supported by loom (transformers versions differ on it)",
                              path, what);
        if (!json_is_number(json_object_get(rs, "factor")))
            return loom_error(LOOM_ERR_FORMAT, "%s: %s \"dynamic\" needs \"factor\" (a number)", path, what);
        c->rope_type = LOOM_ROPE_DYNAMIC;
        LOOM_TRY(get_float(rs, path, "factor", &c->rope_factor));
        loom_rope_freqs r = loom_llama_rope(c);
        if (loom_rope_check(&r) != LOOM_OK)
            return loom_error(LOOM_ERR_FORMAT, "%s: %s: %s", path, what, loom_last_error());
        return LOOM_OK;
    }
    if (is_phi3(root)) /* Phi3Config takes no other */
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s \"%s\" on a Phi-3 model (Phi-3's take longrope or none)",
                          path, what, type);
    if (strcmp(type, "linear") && strcmp(type, "llama3"))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s \"%s\" is not supported by loom (default, linear, llama3, "
                          "longrope, yarn and dynamic are)", path, what, type);
    c->rope_type = strcmp(type, "linear") ? LOOM_ROPE_LLAMA3 : LOOM_ROPE_LINEAR;
    static const char *const need[] = {"factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings"};
    for (int i = 0; i < (c->rope_type == LOOM_ROPE_LLAMA3 ? 4 : 1); i++)
        if (!json_is_number(json_object_get(rs, need[i])))
            return loom_error(LOOM_ERR_FORMAT, "%s: %s \"%s\" needs \"%s\" (a number)", path, what, type, need[i]);
    LOOM_TRY(get_float(rs, path, "factor", &c->rope_factor));
    if (c->rope_type == LOOM_ROPE_LLAMA3) {
        LOOM_TRY(get_float(rs, path, "low_freq_factor", &c->rope_low_freq_factor));
        LOOM_TRY(get_float(rs, path, "high_freq_factor", &c->rope_high_freq_factor));
        LOOM_TRY(get_int(rs, path, "original_max_position_embeddings", 1, &c->rope_original_max_pos));
    }
    loom_rope_freqs r = loom_llama_rope(c);
    if (loom_rope_check(&r) != LOOM_OK) return loom_error(LOOM_ERR_FORMAT, "%s: %s: %s", path, what, loom_last_error());
    return LOOM_OK;
}

/* Gemma 3's rope_parameters in transformers v5, one per layer type: the
 * sliding blocks' (the default RoPE of its rope_theta: the local base,
 * which must agree with rope_local_base_freq where the file has that too)
 * into c; *rp becomes the full-attention blocks' entry, read as any model's
 * (NULL: Gemma3TextConfig's). Another model's per-type entries are refused. */
static loom_status gemma3_rope_parameters(json_t *root, const char *path, json_t **rp, loom_llama_config *c) {
    json_t *full = json_object_get(*rp, "full_attention"), *sl = json_object_get(*rp, "sliding_attention");
    if (!full && !sl) return LOOM_OK;
    if (!is_gemma3(root))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: rope_parameters per layer type are read for Gemma 3 only", path);
    if ((full && !json_is_object(full)) || (sl && !json_is_object(sl)))
        return loom_error(LOOM_ERR_FORMAT, "%s: rope_parameters' full_attention and sliding_attention must be objects",
                          path);
    if (sl) {
        json_t *t = json_object_get(sl, "rope_type"), *th = json_object_get(sl, "rope_theta");
        if (t && !json_is_null(t) && !(json_is_string(t) && !strcmp(json_string_value(t), "default")))
            return loom_error(LOOM_ERR_UNSUPPORTED, "%s: Gemma 3's sliding blocks take the default RoPE, not a scaling",
                              path);
        if (th && !json_is_null(th)) {
            if (!json_is_number(th) || !(json_number_value(th) > 0.0))
                return loom_error(LOOM_ERR_FORMAT, "%s: rope_parameters' sliding_attention rope_theta must be a "
                                  "positive number", path);
            json_t *top = json_object_get(root, "rope_local_base_freq");
            if (top && !json_is_null(top) && (float)json_number_value(top) != (float)json_number_value(th))
                return loom_error(LOOM_ERR_FORMAT, "%s: rope_parameters' sliding_attention rope_theta and "
                                  "rope_local_base_freq disagree", path);
            c->rope_local_theta = (float)json_number_value(th);
        }
    }
    *rp = full;
    return LOOM_OK;
}

/* The RoPE: rope_theta and rope_scaling (transformers before v5), or
 * rope_parameters (v5: theta and the scaling in one object; Gemma 3's one
 * per layer type); a file with both must say the same in both. */
static loom_status get_rope(json_t *root, const char *path, loom_llama_config *c) {
    json_t *rs = json_object_get(root, "rope_scaling"), *rp = json_object_get(root, "rope_parameters");
    if (json_is_object(rp)) LOOM_TRY(gemma3_rope_parameters(root, path, &rp, c));
    LOOM_TRY(get_float(root, path, "rope_theta", &c->rope_theta));
    if (rs && !json_is_null(rs)) {
        if (!json_is_object(rs))
            return loom_error(LOOM_ERR_FORMAT, "%s: rope_scaling must be null or an object with a \"rope_type\"", path);
        LOOM_TRY(parse_rope_scaling(root, rs, path, "rope_scaling", c));
    }
    if (!rp || json_is_null(rp)) return LOOM_OK;
    if (!json_is_object(rp)) return loom_error(LOOM_ERR_FORMAT, "%s: rope_parameters must be an object", path);
    loom_llama_config v5 = *c;
    v5.rope_type = LOOM_ROPE_DEFAULT;
    v5.rope_factor = v5.rope_low_freq_factor = v5.rope_high_freq_factor = v5.rope_attention_factor = 0.0f;
    v5.rope_beta_fast = v5.rope_beta_slow = 0.0f;
    v5.rope_original_max_pos = v5.rope_n_ext = v5.rope_truncate = 0;
    LOOM_TRY(get_float(rp, path, "rope_theta", &v5.rope_theta));
    LOOM_TRY(parse_rope_scaling(root, rp, path, "rope_parameters", &v5));
    c->partial_rotary_factor = v5.partial_rotary_factor; /* read_partial held both to agree */
    int said = json_object_get(root, "rope_theta") || (rs && !json_is_null(rs));
    if (said && !loom_llama_config_same_rope(&v5, c))
        return loom_error(LOOM_ERR_FORMAT, "%s: rope_parameters and rope_theta/rope_scaling disagree", path);
    *c = v5;
    return LOOM_OK;
}

/* Gemma 3's multimodal file (model_type "gemma3", Gemma3ForConditionalGeneration: the 4B, 12B and 27B): *root
 * becomes its text model's config, text_config as a "gemma3_text" file (Gemma3TextConfig's defaults where it
 * is silent, all of them without one). What transformers versions read differently in such a file is
 * refused: a tie_word_embeddings other than true outside text_config alone, a final logit softcap. The
 * vision tower and its projector are not read. Other files are left as they are. */
static loom_status text_config_of(const char *path, json_t **root) {
    if (!model_type_is(*root, "gemma3")) return LOOM_OK;
    json_t *tc = json_object_get(*root, "text_config"), *tie = json_object_get(*root, "tie_word_embeddings");
    if (tc && !json_is_null(tc) && !json_is_object(tc))
        return loom_error(LOOM_ERR_FORMAT, "%s: text_config must be an object (Gemma 3's text model)", path);
    json_t *mt = json_is_object(tc) ? json_object_get(tc, "model_type") : NULL;
    if (mt && !json_is_null(mt) && !(json_is_string(mt) && !strcmp(json_string_value(mt), "gemma3_text")))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: text_config's model_type must be \"gemma3_text\" (Gemma 3's "
                          "text model), not %s", path, json_is_string(mt) ? json_string_value(mt) : "this");
    json_t *text = json_is_object(tc) ? json_deep_copy(tc) : json_object();
    json_t *tt = text ? json_object_get(text, "tie_word_embeddings") : NULL, *cap;
    loom_status st = LOOM_OK;
    if (tie && tt && !json_equal(tie, tt))
        st = loom_error(LOOM_ERR_FORMAT, "%s: tie_word_embeddings differs from its text_config's", path);
    else if (tie && !tt && !json_is_true(tie)) /* transformers 4.x ties by text_config's (true), v5 by the file's */
        st = loom_error(LOOM_ERR_UNSUPPORTED, "%s: tie_word_embeddings other than true outside text_config, with none "
                        "inside it: transformers versions differ on which they read; say it in text_config", path);
    else if (text && (cap = json_object_get(text, "final_logit_softcapping")) && !json_is_null(cap) &&
             !(json_is_number(cap) && json_number_value(cap) == 0.0))
        st = loom_error(LOOM_ERR_UNSUPPORTED, "%s: a final_logit_softcapping in a multimodal Gemma 3 file: "
                        "transformers 4.52 and later do not apply it to Gemma3ForConditionalGeneration's logits, "
                        "earlier versions do", path);
    if (st != LOOM_OK) {
        json_decref(text);
        return st;
    }
    if (!text || json_object_set_new(text, "model_type", json_string("gemma3_text")) ||
        (tie && !tt && json_object_set(text, "tie_word_embeddings", tie))) {
        json_decref(text);
        return loom_error(LOOM_ERR_NOMEM, "%s: out of memory", path);
    }
    json_decref(*root);
    *root = text;
    return LOOM_OK;
}

loom_status loom_llama_config_load(const char *path, loom_llama_config *c) {
    json_t *root;
    LOOM_TRY(read_json(path, "config", &root));
    loom_status st = LOOM_OK;
    if (!json_is_object(root)) st = loom_error(LOOM_ERR_FORMAT, "%s: expected a JSON object", path);
    if (st == LOOM_OK) st = text_config_of(path, &root);
    memset(c, 0, sizeof *c);
    /* Absent fields take the Hugging Face config class's defaults (not
     * loom's presets'): the same directory must give the same model in both.
     * A model_type loom does not read takes LlamaConfig's until
     * read_architecture refuses it. */
    const family *f = family_of(root) ? family_of(root) : &families[0];
    c->rope_theta = f->theta;
    c->norm_eps = f->eps;
    c->dim = f->dim, c->n_layers = f->layers, c->n_heads = f->heads, c->ffn_dim = f->ffn, c->vocab_size = f->vocab;
    if (st == LOOM_OK) st = get_int(root, path, "hidden_size", !f->dim, &c->dim);
    if (st == LOOM_OK) st = get_int(root, path, "num_hidden_layers", !f->layers, &c->n_layers);
    if (st == LOOM_OK) st = get_int(root, path, "num_attention_heads", !f->heads, &c->n_heads);
    c->n_kv_heads = !json_object_get(root, "num_key_value_heads") && f->kv_heads ? f->kv_heads : c->n_heads;
    if (st == LOOM_OK) st = get_int(root, path, "num_key_value_heads", 0, &c->n_kv_heads);
    if (st == LOOM_OK) st = get_int(root, path, "intermediate_size", !f->ffn, &c->ffn_dim);
    if (st == LOOM_OK) st = get_int(root, path, "vocab_size", !f->vocab, &c->vocab_size);
    c->max_seq = f->max_seq;
    if (st == LOOM_OK) st = get_int(root, path, "max_position_embeddings", 0, &c->max_seq);
    if (st == LOOM_OK) st = get_float(root, path, "rms_norm_eps", &c->norm_eps);
    json_t *tie = st == LOOM_OK ? json_object_get(root, "tie_word_embeddings") : NULL;
    c->tie_embeddings = f->tie;
    if (tie) {
        if (!json_is_boolean(tie)) st = loom_error(LOOM_ERR_FORMAT, "%s: tie_word_embeddings must be true or false", path);
        else c->tie_embeddings = json_is_true(tie);
    }
    if (st == LOOM_OK) st = read_architecture(root, path, c);
    if (st == LOOM_OK) st = get_rope(root, path, c);
    /* Phi-3's longrope turns to its long factors past the original context (loom_llama_layer_rope_at, as
     * Hugging Face's Phi-3 with Phi3Config's original_max_position_embeddings); a LLaMA file's stops at its
     * original context, where transformers versions differ on which context they compare with */
    if (st == LOOM_OK && c->rope_type == LOOM_ROPE_LONGROPE && !is_phi3(root) && c->max_seq > c->rope_original_max_pos)
        c->max_seq = c->rope_original_max_pos;
    if (st == LOOM_OK) st = apply_window(root, path, c);
    json_decref(root);
    if (st == LOOM_OK && loom_llama_config_validate(c) != LOOM_OK)
        st = loom_error(LOOM_ERR_FORMAT, "%s: %s", path, loom_last_error());
    return st;
}

/* A config's number as Hugging Face's files say it (loom_float_decimal). */
static double dec(float x) { return loom_float_decimal(x); }

/* Phi-3's longrope as its files have it: rope_scaling with the short and
 * long factors (and the attention factor when it is not the one Hugging
 * Face computes from the contexts), the original context at the top of the
 * file and the one it extends to as max_position_embeddings (loom's context
 * when it extends to none: a factor of 1). 0 when JSON cannot be built. */
static int save_longrope(json_t *root, const loom_llama_config *c) {
    json_t *rs = json_pack("{s:s}", "type", "longrope"), *sf = json_array(), *lf = json_array();
    int ok = rs && sf && lf;
    for (int i = 0; ok && i < c->rope_n_ext; i++)
        ok = !json_array_append_new(sf, json_real(dec(c->rope_short[i]))) &&
             !json_array_append_new(lf, json_real(dec(c->rope_long[i])));
    if (!ok) {
        json_decref(rs);
        json_decref(sf);
        json_decref(lf);
        return 0;
    }
    int set_s = !json_object_set_new(rs, "short_factor", sf), set_l = !json_object_set_new(rs, "long_factor", lf);
    ok = set_s && set_l; /* each taken by rs, even on failure */
    long max_pos = lrint((double)c->rope_factor * c->rope_original_max_pos);
    double factor = (double)max_pos / c->rope_original_max_pos;
    float af = (float)(factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log((double)c->rope_original_max_pos)));
    if (ok && af != c->rope_attention_factor)
        ok = !json_object_set_new(rs, "attention_factor", json_real(dec(c->rope_attention_factor)));
    if (!ok) {
        json_decref(rs);
        return 0;
    }
    return !json_object_set_new(root, "rope_scaling", rs) &&
           !json_object_set_new(root, "max_position_embeddings",
                                json_integer(c->rope_factor > 1.0f ? max_pos : c->max_seq)) &&
           !json_object_set_new(root, "original_max_position_embeddings", json_integer(c->rope_original_max_pos));
}

/* layer_types: each block's "sliding_attention" (with a window) or
 * "full_attention", as transformers 4.53 and later read them. 0 when JSON
 * cannot be built. */
static int save_layer_types(json_t *root, const loom_llama_config *c) {
    json_t *types = json_array();
    int built = types != NULL;
    for (int l = 0; built && l < c->n_layers; l++)
        built = !json_array_append_new(types, json_string(loom_llama_layer_window(c, l) ? "sliding_attention"
                                                                                         : "full_attention"));
    if (!built) json_decref(types);
    return built && !json_object_set_new(root, "layer_types", types); /* taken by root, even on failure */
}

/* Gemma 3's own fields: its local RoPE base, and its blocks with a window
 * as the older files say them (sliding_window_pattern) and the newer
 * (layer_types). 0 when JSON cannot be built. */
static int save_gemma3(json_t *root, const loom_llama_config *c) {
    return save_layer_types(root, c) &&
           !json_object_set_new(root, "sliding_window_pattern", json_integer(c->window_global_interval)) &&
           !json_object_set_new(root, "rope_local_base_freq", json_real(dec(c->rope_local_theta)));
}

loom_status loom_llama_config_save(const loom_llama_config *c, loom_dtype dt, const char *path) {
    /* The Hugging Face class that reads it: Gemma 3's (norms of the outputs and q/k norms), Gemma 2's (norms
     * of the outputs; post: either), Gemma's (norms of 1 + weight),
     * Granite's (multipliers), Phi-3's (fused files), SmolLM3's (NoPE blocks), Qwen 3's (q/k norms), Qwen 2's
     * (biases on q, k, v alone), Mistral's (LLaMA's with a sliding window), LLaMA's;
     * loom_llama_config_validate keeps them apart and has each one's windows as its class does */
    int post = c->post_norms, gemma3 = post && c->qk_norm, gemma = !post && c->norm_unit_offset;
    int granite = !gemma && !post && loom_llama_has_multipliers(c), phi3 = c->fused_proj;
    int smollm3 = c->nope_interval > 0;
    int qwen3 = !gemma && !post && !granite && c->qk_norm;
    int qwen2 = !gemma && !post && !granite && !qwen3 && c->qkv_bias && !c->o_bias;
    const char *act = c->act == LOOM_ACT_GELU_TANH ? "gelu_pytorch_tanh" : "silu";
    static const struct { const char *cls, *type; } layouts[] = {
        {"LlamaForCausalLM", "llama"},     {"Qwen2ForCausalLM", "qwen2"},     {"Qwen3ForCausalLM", "qwen3"},
        {"SmolLM3ForCausalLM", "smollm3"}, {"Phi3ForCausalLM", "phi3"},       {"GraniteForCausalLM", "granite"},
        {"GemmaForCausalLM", "gemma"},     {"Gemma2ForCausalLM", "gemma2"},   {"MistralForCausalLM", "mistral"},
        {"Gemma3ForCausalLM", "gemma3_text"},
    };
    int layout = gemma3 ? 9 : post ? 7 : gemma ? 6 : granite ? 5 : phi3 ? 4 : smollm3 ? 3 : qwen3 ? 2 : qwen2 ? 1 : 0;
    if (layout == 0 && c->sliding_window > 0) layout = 8;
    json_t *window = c->sliding_window > 0 ? json_integer(c->sliding_window) : json_null();
    json_t *root = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:b, s:s, s:s, s:f}",
                             "architectures", layouts[layout].cls, "model_type", layouts[layout].type,
                             "hidden_size", c->dim,
                             "num_hidden_layers", c->n_layers, "num_attention_heads", c->n_heads,
                             "num_key_value_heads", c->n_kv_heads, "intermediate_size", c->ffn_dim,
                             "vocab_size", c->vocab_size, "max_position_embeddings", c->max_seq,
                             "rope_theta", dec(c->rope_theta), "rms_norm_eps", dec(c->norm_eps),
                             "tie_word_embeddings", c->tie_embeddings, "hidden_act", act, "torch_dtype",
                             dt == LOOM_F32 ? "float32" : dt == LOOM_BF16 ? "bfloat16" : "float16",
                             "initializer_range", 0.02);
    int ok = root != NULL;
    /* Phi3Config's default pad id, 32000, is an embedding row Hugging Face's model refuses below that vocabulary */
    if (ok && phi3 && c->vocab_size <= 32000) ok = !json_object_set_new(root, "pad_token_id", json_null());
    if (ok && phi3 && c->partial_rotary_factor > 0.0f && c->partial_rotary_factor < 1.0f) /* Phi-4-mini's */
        ok = !json_object_set_new(root, "partial_rotary_factor", json_real(dec(c->partial_rotary_factor)));
    if (ok && !qwen2 && !phi3 && layout != 8) /* Qwen 2's class has biases on q, k and v, Phi-3's and Mistral's none */
        ok = !json_object_set_new(root, "attention_bias", json_boolean(c->o_bias));
    /* the window as each class reads it (null: none; Mistral's and Gemma's classes have 4096 when absent) */
    if (ok && (qwen2 || qwen3 || smollm3)) {
        ok = !json_object_set_new(root, "use_sliding_window", json_boolean(c->sliding_window > 0));
        if (ok && c->sliding_window > 0)
            ok = !json_object_set_new(root, "max_window_layers", json_integer(c->window_from));
    }
    if (ok && post && !gemma3 && c->sliding_window <= 0) { /* Gemma 2 without one: Hugging Face's model needs a
        * number, so a window as long as the context and every block full (which newer versions read) */
        json_decref(window);
        window = json_integer(c->max_seq);
        ok = save_layer_types(root, c); /* without a window, every block full */
    }
    if (ok && (layout == 8 || phi3 || post || c->sliding_window > 0)) {
        ok = !json_object_set_new(root, "sliding_window", window);
        window = NULL; /* taken by root, even on failure */
    }
    json_decref(window);
    if (ok && smollm3) { /* the list SmolLM3Config makes of the interval, and the interval */
        json_t *list = json_array();
        int built = list != NULL;
        for (int l = 0; built && l < c->n_layers; l++)
            built = !json_array_append_new(list, json_integer(loom_llama_layer_has_rope(c, l)));
        if (!built) json_decref(list);
        ok = built && !json_object_set_new(root, "no_rope_layers", list) && /* taken by root, even on failure */
             !json_object_set_new(root, "no_rope_layer_interval", json_integer(c->nope_interval));
    }
    if (ok && c->rope_type == LOOM_ROPE_LONGROPE) ok = save_longrope(root, c);
    else if (ok && c->rope_type != LOOM_ROPE_DEFAULT) { /* as Hugging Face's own files write each */
        json_t *rs = c->rope_type == LOOM_ROPE_LINEAR || c->rope_type == LOOM_ROPE_DYNAMIC
                         ? json_pack("{s:s, s:f}", "type", c->rope_type == LOOM_ROPE_LINEAR ? "linear" : "dynamic",
                                     "factor", dec(c->rope_factor))
                     : c->rope_type == LOOM_ROPE_YARN /* the attention factor too: it may come from mscales */
                         ? json_pack("{s:s, s:f, s:i, s:f, s:f, s:f, s:b}", "rope_type", "yarn", "factor",
                                     dec(c->rope_factor), "original_max_position_embeddings", c->rope_original_max_pos,
                                     "attention_factor", dec(c->rope_attention_factor), "beta_fast",
                                     dec(c->rope_beta_fast), "beta_slow", dec(c->rope_beta_slow), "truncate",
                                     c->rope_truncate)
                         : json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor",
                                     dec(c->rope_factor), "low_freq_factor", dec(c->rope_low_freq_factor),
                                     "high_freq_factor", dec(c->rope_high_freq_factor),
                                     "original_max_position_embeddings", c->rope_original_max_pos);
        ok = !json_object_set_new(root, "rope_scaling", rs); /* fails (and frees nothing) when rs is NULL */
    }
    if (ok && c->attention_dropout > 0.0f)
        ok = !json_object_set_new(root, "attention_dropout", json_real(dec(c->attention_dropout)));
    /* Qwen 3's default head_dim is 128, Gemma's 256, not dim / heads: they always say their own */
    if (ok && (c->head_dim || qwen3 || gemma || post))
        ok = !json_object_set_new(root, "head_dim", json_integer(loom_llama_head_dim(c)));
    /* the field Gemma's class reads before hidden_act (read_act) */
    if (ok && (gemma || post)) ok = !json_object_set_new(root, "hidden_activation", json_string(act));
    if (ok && gemma3) ok = save_gemma3(root, c);
    if (ok && post) { /* Gemma 2's and 3's fields (0: null, none) */
        float qpas = c->query_pre_attn_scalar > 0.0f ? c->query_pre_attn_scalar : (float)loom_llama_head_dim(c);
        json_t *ac = c->attn_softcap > 0.0f ? json_real(dec(c->attn_softcap)) : json_null();
        json_t *fc = c->final_softcap > 0.0f ? json_real(dec(c->final_softcap)) : json_null();
        ok = !json_object_set_new(root, "attn_logit_softcapping", ac) &&
             !json_object_set_new(root, "final_logit_softcapping", fc) &&
             !json_object_set_new(root, "query_pre_attn_scalar", qpas == floorf(qpas) && qpas < 1e9f /* an int, */
                                      ? json_integer((json_int_t)qpas)                        /* as its files */
                                      : json_real(dec(qpas)));
    }
    if (ok && granite) { /* all four, as Granite's files have them (0: none, which is 1; the scale's default) */
        const float m[4] = {c->embedding_multiplier, c->residual_multiplier, loom_llama_attn_scale(c),
                            c->logits_scaling};
        static const char *const key[4] = {"embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                           "logits_scaling"};
        for (int i = 0; ok && i < 4; i++)
            ok = !json_object_set_new(root, key[i], json_real(m[i] != 0.0f ? dec(m[i]) : 1.0));
    }
    if (!ok) {
        json_decref(root);
        root = NULL;
    }
    if (!root) return loom_error(LOOM_ERR_NOMEM, "config: cannot build JSON");
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(9));
    json_decref(root);
    if (!text) return loom_error(LOOM_ERR_NOMEM, "config: cannot format JSON");
    loom_status st = loom_file_write_atomic(path, text, strlen(text));
    free(text);
    return st;
}

/* ------------------------------------------------------------- weights */

/* A weight computed as the file is written, one at a time: merged with its
 * adapter, converted to dt, and with tensor parallelism gathered over the
 * TP group (a collective: every TP rank fills its weights in the same
 * order). */
typedef struct lazy_weight {
    loom_llama *m;
    int i;
    loom_dtype dt;
    int fill, done; /* written through fill_weight; filled already */
    int parts;      /* > 1: the first of that many parameters one fused tensor holds (fill_fused) */
} lazy_weight;

/* Where parameter i lies in the files. Phi-3's (fused_proj) hold q, k and
 * v as one self_attn.qkv_proj.weight, their rows in that order, and gate
 * and up as one mlp.gate_up_proj.weight (the model's parameters are in
 * that order, consecutive: loom_llama_config_validate allows no biases
 * beside them). Others: their own name, whole. */
typedef struct file_slot {
    char name[256];
    int64_t rows, row0; /* the file tensor's rows; the first of i's */
    int parts, part;    /* parameters in the tensor (1: i alone), and which is i */
} file_slot;

/* How a file names the text model's tensors: as Hugging Face's text models
 * (loom's names), or as Gemma 3's multimodal files, whose text model is
 * their language_model: "language_model.model.…" and
 * "language_model.lm_head.weight" as the published files have them,
 * "model.language_model.…" and "lm_head.weight" as transformers 4.52 and
 * later name the loaded model's (and some files carry). */
typedef enum { LAYOUT_TEXT, LAYOUT_MM_OLD, LAYOUT_MM_NEW, LAYOUTS } weights_layout;

/* A text model's tensor name as layout l spells it. */
static void layout_name(weights_layout l, const char *name, char *out, size_t n) {
    if (l == LAYOUT_MM_OLD) snprintf(out, n, "language_model.%s", name);
    else if (l == LAYOUT_MM_NEW && !strncmp(name, "model.", 6)) snprintf(out, n, "model.language_model.%s", name + 6);
    else snprintf(out, n, "%s", name);
}

/* The layout whose embedding table `has` finds in a file (ctx its
 * argument); the text models' when none is found, for the errors to name. */
static weights_layout layout_of(int (*has)(const void *ctx, const char *name), const void *ctx) {
    for (int l = 0; l < LAYOUTS; l++) {
        char name[64];
        layout_name((weights_layout)l, "model.embed_tokens.weight", name, sizeof name);
        if (has(ctx, name)) return (weights_layout)l;
    }
    return LAYOUT_TEXT;
}

/* Parameter i's slot under the text models' names. */
static void text_slot_of(const loom_llama *m, int i, file_slot *f) {
    static const struct { const char *part, *fused; int index, parts; } map[] = {
        {"self_attn.q_proj.weight", "self_attn.qkv_proj.weight", 0, 3},
        {"self_attn.k_proj.weight", "self_attn.qkv_proj.weight", 1, 3},
        {"self_attn.v_proj.weight", "self_attn.qkv_proj.weight", 2, 3},
        {"mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0, 2},
        {"mlp.up_proj.weight", "mlp.gate_up_proj.weight", 1, 2},
    };
    const char *name = m->params[i]->name;
    int64_t fs[2];
    loom_llama_param_full_shape(m, i, fs);
    snprintf(f->name, sizeof f->name, "%s", name);
    f->rows = fs[0];
    f->row0 = 0;
    f->parts = 1;
    f->part = 0;
    size_t n = strlen(name);
    for (size_t k = 0; m->cfg.fused_proj && i < m->n_base && k < sizeof map / sizeof map[0]; k++) {
        size_t s = strlen(map[k].part);
        if (n <= s || strcmp(name + n - s, map[k].part)) continue;
        snprintf(f->name, sizeof f->name, "%.*s%s", (int)(n - s), name, map[k].fused);
        f->rows = 0;
        for (int j = 0; j < map[k].parts; j++) {
            loom_llama_param_full_shape(m, i - map[k].index + j, fs);
            if (j < map[k].index) f->row0 += fs[0];
            f->rows += fs[0];
        }
        f->parts = map[k].parts;
        f->part = map[k].index;
        return;
    }
}

/* Parameter i's slot in a file of layout l. */
static void file_slot_of(const loom_llama *m, int i, weights_layout l, file_slot *f) {
    text_slot_of(m, i, f);
    char text[sizeof f->name];
    memcpy(text, f->name, sizeof text);
    layout_name(l, text, f->name, sizeof f->name);
}

static loom_status fill_weight(void *user, void *dst, size_t n_bytes) {
    lazy_weight *l = user;
    l->done = 1;
    size_t n = n_bytes / loom_dtype_size(l->dt);
    if (l->dt == LOOM_F32) return loom_llama_param_merged(l->m, l->i, dst);
    float *full = malloc(n * sizeof(float) + 1);
    if (!full) return loom_error(LOOM_ERR_NOMEM, "save weights: out of memory");
    loom_status st = loom_llama_param_merged(l->m, l->i, full);
    if (st == LOOM_OK) loom_convert(dst, l->dt, full, LOOM_F32, n);
    free(full);
    return st;
}

/* A fused tensor (Phi-3's): its parameters' rows one after the other, each
 * as fill_weight makes it. All of them are filled even after one fails:
 * with tensor parallelism each fill is a collective. */
static loom_status fill_fused(void *user, void *dst, size_t n_bytes) {
    lazy_weight *l = user; /* the first of l->parts consecutive entries */
    unsigned char *out = dst;
    size_t left = n_bytes;
    loom_status st = LOOM_OK;
    for (int k = 0; k < l->parts; k++) {
        int64_t fs[2];
        loom_llama_param_full_shape(l->m, l[k].i, fs);
        size_t b = (size_t)(fs[0] * fs[1]) * loom_dtype_size(l->dt);
        LOOM_ASSERT(b <= left); /* the tensor was sized as its parts' rows (file_slot_of) */
        loom_status g = fill_weight(&l[k], out, b);
        if (st == LOOM_OK) st = g;
        out += b;
        left -= b;
    }
    return st;
}

/* With tensor parallelism, the gathers of every weight not written (all
 * of them on a rank that writes no file, the rest after a failed write)
 * are joined all the same: the other ranks of the group are in them. */
static loom_status join_weight_gathers(loom_llama *m, lazy_weight *lazy, void *spare) {
    loom_status st = LOOM_OK;
    for (int i = 0; m->tp_size > 1 && i < m->n_base; i++) {
        if (!lazy[i].fill || lazy[i].done) continue;
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        loom_status g = fill_weight(&lazy[i], spare, (size_t)(fs[0] * fs[1]) * loom_dtype_size(lazy[i].dt));
        if (st == LOOM_OK) st = g;
    }
    return st;
}

size_t io_widest_param(const loom_llama *m, int n) {
    size_t most = 1;
    for (int i = 0; i < n; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        if ((size_t)(fs[0] * fs[1]) > most) most = (size_t)(fs[0] * fs[1]);
    }
    return most;
}

loom_status loom_llama_save_weights(loom_llama *m, loom_dtype dt, const char *path) {
    loom_safetensors_writer *w = NULL;
    lazy_weight *lazy = calloc((size_t)m->n_params + 1, sizeof *lazy);
    /* Before any gather (pages only touched when used): a whole weight
     * whose gathers are joined without writing it. */
    void *spare = m->tp_size > 1 ? malloc(io_widest_param(m, m->n_base) * sizeof(float)) : NULL;
    if (!lazy || (m->tp_size > 1 && !spare)) {
        free(lazy);
        free(spare);
        return loom_error(LOOM_ERR_NOMEM, "save weights: out of memory");
    }
    loom_status st = path ? loom_safetensors_writer_init(&w) : LOOM_OK;
    /* The model's own weights, LoRA adapters merged in (the adapters
     * themselves are not Hugging Face tensors: a checkpoint keeps them).
     * Every weight is listed in lazy even when adding one to w fails: its
     * gathers are still to be joined. */
    for (int i = 0; i < m->n_base; i++) {
        loom_param *p = m->params[i], *a, *b;
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        int adapted = loom_llama_lora_of(m, i, &a, &b), add = w && st == LOOM_OK;
        file_slot f;
        file_slot_of(m, i, LAYOUT_TEXT, &f);
        if (f.parts > 1) { /* Phi-3's: the first part writes the fused tensor, the others are in it */
            lazy[i] = (lazy_weight){m, i, dt, 1, 0, f.part ? 0 : f.parts};
            int64_t shape[2] = {f.rows, fs[1]};
            if (add && !f.part)
                st = loom_safetensors_writer_add_fill(w, f.name, loom_safetensors_dtype_of(dt), shape, 2, fill_fused,
                                                      &lazy[i]);
            continue;
        }
        if (m->tp_size == 1 && !adapted && loom_param_compute_only(p) && (dt == LOOM_F32 || dt == LOOM_BF16)) {
            /* a frozen bf16 weight: its exact bf16 values, borrowed (a wider copy would hold no more) */
            if (add) st = loom_safetensors_writer_add(w, p->name, LOOM_SAFETENSORS_BF16, fs, p->tensor->ndim,
                                                      loom_tensor_data(p->tensor));
            continue;
        }
        if (m->tp_size == 1 && dt == LOOM_F32 && !adapted) {
            /* the fp32 masters as they are: borrowed until the write */
            if (add) st = loom_safetensors_writer_add(w, p->name, LOOM_SAFETENSORS_F32, fs, p->tensor->ndim,
                                                      loom_param_master(p));
            continue;
        }
        lazy[i] = (lazy_weight){m, i, dt, 1, 0, 0};
        if (add) st = loom_safetensors_writer_add_fill(w, p->name, loom_safetensors_dtype_of(dt), fs, p->tensor->ndim,
                                                       fill_weight, &lazy[i]);
    }
    if (st == LOOM_OK && w) st = loom_safetensors_writer_set_metadata(w, "format", "pt");
    if (st == LOOM_OK && w) st = loom_safetensors_writer_write(w, path);
    loom_status g = join_weight_gathers(m, lazy, spare);
    if (st == LOOM_OK) st = g;
    free(lazy);
    free(spare);
    loom_safetensors_writer_free(w);
    return st;
}

/* Parameter i from the open file sf (named path in messages), of layout l:
 * its tensor, or its rows of a fused one (file_slot_of). */
static loom_status load_param(loom_llama *m, int i, const loom_safetensors *sf, const char *path, weights_layout l) {
    loom_param *p = m->params[i];
    file_slot f;
    file_slot_of(m, i, l, &f);
    if (!loom_safetensors_has(sf, f.name))
        return loom_error(LOOM_ERR_FORMAT, "%s: tensor %s is missing (is this a LLaMA checkpoint of the same "
                          "configuration?)", path, f.name);
    int64_t fs[2];
    loom_llama_param_full_shape(m, i, fs);
    float *full = malloc((size_t)(fs[0] * fs[1]) * sizeof(float) + 1);
    if (!full) return loom_error(LOOM_ERR_NOMEM, "load weights: out of memory");
    loom_status st = f.parts > 1 ? loom_safetensors_read_rows(sf, f.name, LOOM_F32, f.rows, fs[1], f.row0, fs[0], full)
                                 : loom_safetensors_read(sf, f.name, LOOM_F32, fs, p->tensor->ndim, full);
    if (st != LOOM_OK) st = loom_error(st, "%s (the config and the weights disagree)", loom_last_error());
    char what[320]; /* a fused tensor's part: its rows, where the element index counts from */
    if (f.parts > 1) snprintf(what, sizeof what, "%s (rows %lld..%lld, counted from the first)", f.name,
                              (long long)f.row0, (long long)(f.row0 + fs[0]));
    else snprintf(what, sizeof what, "%s", f.name);
    if (st == LOOM_OK) st = io_check_finite(full, (size_t)(fs[0] * fs[1]), path, what);
    if (st == LOOM_OK) loom_llama_param_scatter(m, i, full);
    free(full);
    return st;
}

static int file_has(const void *sf, const char *name) { return loom_safetensors_has(sf, name); }
static int map_has(const void *map, const char *name) { return json_object_get(map, name) != NULL; }

loom_status loom_llama_load_weights(loom_llama *m, const char *path) {
    loom_safetensors *sf;
    LOOM_TRY(loom_safetensors_open(path, &sf));
    loom_status st = LOOM_OK;
    weights_layout l = layout_of(file_has, sf);
    for (int i = 0; i < m->n_base && st == LOOM_OK; i++) st = load_param(m, i, sf, path, l);
    loom_safetensors_close(sf);
    if (st == LOOM_OK) st = loom_llama_dora_reset(m); /* DoRA's magnitudes follow the weights */
    return st;
}

static loom_status join(char *buf, size_t n, const char *dir, const char *file) {
    if (snprintf(buf, n, "%s/%s", dir, file) >= (int)n) return loom_error(LOOM_ERR_INVALID, "path too long: %s", dir);
    return LOOM_OK;
}

/* Hugging Face's layout for weights split over several files:
 * model.safetensors.index.json maps each tensor to its file,
 * {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors", ...}},
 * the files beside it. Each file is opened once, when a tensor first needs it. */
static loom_status load_sharded(loom_llama *m, const char *dir, const char *index) {
    json_t *root;
    LOOM_TRY(read_json(index, "weight index", &root));
    json_t *map = json_object_get(root, "weight_map");
    loom_status st = json_is_object(map) ? LOOM_OK
                                         : loom_error(LOOM_ERR_FORMAT, "%s: no \"weight_map\" object", index);
    const char **names = calloc((size_t)m->n_params, sizeof *names); /* the files opened, at most one a tensor */
    loom_safetensors **files = calloc((size_t)m->n_params, sizeof *files);
    if (st == LOOM_OK && (!names || !files)) st = loom_error(LOOM_ERR_NOMEM, "load weights: out of memory");
    int n_files = 0;
    char path[4200];
    weights_layout l = st == LOOM_OK ? layout_of(map_has, map) : LAYOUT_TEXT;
    for (int i = 0; i < m->n_base && st == LOOM_OK; i++) {
        file_slot f;
        file_slot_of(m, i, l, &f);
        const char *name = f.name;
        json_t *v = json_object_get(map, name);
        const char *file = json_is_string(v) ? json_string_value(v) : NULL;
        if (!v) {
            st = loom_error(LOOM_ERR_FORMAT, "%s: tensor %s is missing from its weight_map (is this a LLaMA "
                            "checkpoint of the same configuration?)", index, name);
            break;
        }
        if (!file || !*file || strchr(file, '/')) {
            st = loom_error(LOOM_ERR_FORMAT, "%s: the weight_map entry of %s must name a file beside it", index, name);
            break;
        }
        int k = 0;
        while (k < n_files && strcmp(names[k], file)) k++;
        st = join(path, sizeof path, dir, file);
        if (st == LOOM_OK && k == n_files) {
            st = loom_safetensors_open(path, &files[k]);
            if (st == LOOM_OK) names[n_files++] = file;
        }
        if (st == LOOM_OK) st = load_param(m, i, files[k], path, l);
    }
    for (int k = 0; k < n_files; k++) loom_safetensors_close(files[k]);
    free(files);
    free(names);
    json_decref(root);
    if (st == LOOM_OK) st = loom_llama_dora_reset(m); /* DoRA's magnitudes follow the weights */
    return st;
}

/* dir's weight files (single and index hold WEIGHT_PATH bytes): its
 * model.safetensors, else (*sharded) the index of its shards; *found is 0
 * when dir has neither. */
#define WEIGHT_PATH 4096
static loom_status weight_files(const char *dir, char *single, char *index, int *sharded, int *found) {
    struct stat sb;
    LOOM_TRY(join(single, WEIGHT_PATH, dir, "model.safetensors"));
    LOOM_TRY(join(index, WEIGHT_PATH, dir, "model.safetensors.index.json"));
    int has_single = stat(single, &sb) == 0, has_index = stat(index, &sb) == 0;
    *sharded = !has_single && has_index;
    *found = has_single || has_index;
    return LOOM_OK;
}

/* The layout of dir's weights, read as loom_model_dir_load_weights reads
 * them, into *l; the text models' when dir has none (a name, such as a Hub
 * id, not a directory). */
static loom_status dir_layout(const char *dir, weights_layout *l) {
    char single[WEIGHT_PATH], index[WEIGHT_PATH];
    int sharded, found;
    *l = LAYOUT_TEXT;
    if (weight_files(dir, single, index, &sharded, &found) != LOOM_OK) { /* too long a path: a name */
        loom_clear_error();
        return LOOM_OK;
    }
    if (!found) return LOOM_OK;
    if (sharded) {
        json_t *root;
        LOOM_TRY(read_json(index, "weight index", &root));
        json_t *map = json_object_get(root, "weight_map");
        loom_status st = json_is_object(map) ? LOOM_OK
                                             : loom_error(LOOM_ERR_FORMAT, "%s: no \"weight_map\" object", index);
        if (st == LOOM_OK) *l = layout_of(map_has, map);
        json_decref(root);
        return st;
    }
    loom_safetensors *sf;
    LOOM_TRY(loom_safetensors_open(single, &sf));
    *l = layout_of(file_has, sf);
    loom_safetensors_close(sf);
    return LOOM_OK;
}

loom_status loom_model_dir_load_weights(loom_llama *m, const char *dir) {
    char single[WEIGHT_PATH], index[WEIGHT_PATH];
    int sharded, found;
    LOOM_TRY(weight_files(dir, single, index, &sharded, &found));
    if (sharded) return load_sharded(m, dir, index);
    return loom_llama_load_weights(m, single); /* names the file when it is missing */
}

loom_status io_check_finite(const float *v, size_t n, const char *path, const char *name) {
    for (size_t k = 0; k < n; k++)
        if (!isfinite(v[k]))
            return loom_error(LOOM_ERR_FORMAT, "%s: tensor %s holds %g at element %zu; the file is damaged or "
                              "comes from a run that diverged", path, name, (double)v[k], k);
    return LOOM_OK;
}

/* The files of a model directory. Each new one is written (atomically) as
 * "<file>.new" beside the old one; only when all are complete are they
 * renamed into place, so a failure (a full disk, a bad tokenizer path)
 * leaves the old files as they were. The renames run under a marker file:
 * a crash between two of them leaves new weights beside an old config, and
 * the marker makes readers refuse that directory instead of loading it. */
enum { DIR_CONFIG, DIR_WEIGHTS, DIR_TOKENIZER, DIR_GENERATION, DIR_FILES };
static const char *const dir_files[DIR_FILES] = {"config.json", "model.safetensors", "tokenizer.json",
                                                 LOOM_GENERATION_CONFIG};

loom_status loom_model_dir_save(loom_llama *m, loom_dtype dt, const char *tokenizer_path, const char *dir) {
    char path[DIR_FILES][4096] = {{0}}, staged[DIR_FILES][4104] = {{0}};
    if (m->tp_rank != 0 || !dir) return loom_llama_save_weights(m, dt, NULL); /* the gathers only */
    loom_status st = loom_mkdir_p(dir);
    const char *staged_names[DIR_FILES];
    for (int i = 0; i < DIR_FILES && st == LOOM_OK; i++) {
        st = join(path[i], sizeof path[i], dir, dir_files[i]);
        if (st == LOOM_OK && snprintf(staged[i], sizeof staged[i], "%s.new", path[i]) >= (int)sizeof staged[i])
            st = loom_error(LOOM_ERR_INVALID, "path too long: %s", dir);
        staged_names[i] = strrchr(staged[i], '/') + 1; /* "<file>.new" */
    }
    if (st == LOOM_OK) io_remove_dead_temporaries(dir, staged_names, DIR_FILES); /* a killed save's */
    /* The weights first, and always: with tensor parallelism the other
     * ranks are in the gathers, which rank 0 must join even when it will
     * not write. */
    loom_status w = loom_llama_save_weights(m, dt, st == LOOM_OK ? staged[DIR_WEIGHTS] : NULL);
    if (st == LOOM_OK) st = w;
    if (st == LOOM_OK) st = loom_llama_config_save(&m->cfg, dt, staged[DIR_CONFIG]);
    if (st == LOOM_OK && tokenizer_path) st = loom_file_copy_atomic(tokenizer_path, staged[DIR_TOKENIZER]);
    if (st == LOOM_OK && m->generation_config)
        st = loom_file_write_atomic(staged[DIR_GENERATION], m->generation_config, m->generation_config_len);
    char marker[4200];
    if (st == LOOM_OK) st = join(marker, sizeof marker, dir, LOOM_MODEL_INCOMPLETE);
    static const char note[] = "loom was replacing the files of this model directory and stopped before it had "
                               "replaced them all; save the model again\n";
    if (st == LOOM_OK) st = loom_file_write_atomic(marker, note, sizeof note - 1);
    for (int i = 0; i < DIR_FILES && st == LOOM_OK; i++) {
        if ((i == DIR_TOKENIZER && !tokenizer_path) || (i == DIR_GENERATION && !m->generation_config)) {
            /* No tokenizer (generation config) for this model: one left in
             * dir by an earlier model would not match it. */
            if (unlink(path[i]) != 0 && errno != ENOENT)
                st = loom_error(LOOM_ERR_IO, "cannot remove the stale %s: %s", path[i], strerror(errno));
        } else if (rename(staged[i], path[i]) != 0) {
            st = loom_error(LOOM_ERR_IO, "cannot rename %s to %s: %s", staged[i], path[i], strerror(errno));
        }
    }
    if (st != LOOM_OK) {
        for (int i = 0; i < DIR_FILES; i++) unlink(staged[i]); /* what was not renamed yet */
        return st;
    }
    /* The renames durable first, then the marker's removal. */
    int e = io_fsync_parent(path[DIR_CONFIG]);
    if (e == 0 && unlink(marker) != 0) e = errno;
    if (e == 0) e = io_fsync_parent(marker);
    if (e != 0) return loom_error(LOOM_ERR_IO, "wrote %s but could not sync it: %s", dir, strerror(e));
    return LOOM_OK;
}

/* PEFT's tensor names: the model's under this prefix. */
#define PEFT_PREFIX "base_model.model."

/* The adapter files, from each adapter's whole fp32 values (whole[k] for
 * parameter n_base + k). */
/* The LoRA targets Phi-3's files fuse (qkv_proj, gate_up_proj). */
static const unsigned fused_targets =
    1u << LOOM_LORA_Q | 1u << LOOM_LORA_K | 1u << LOOM_LORA_V | 1u << LOOM_LORA_GATE | 1u << LOOM_LORA_UP;

int loom_lora_peft_unwritable(const loom_llama *m) { return m->cfg.fused_proj && (m->lora.targets & fused_targets); }

/* The adapters' names follow the layout of the base's weights: for Gemma
 * 3's multimodal files, its language model's modules, and target_modules is
 * a pattern of those under both of transformers' names for them (the
 * loaded model's, which PEFT matches, changed in 4.52), not the vision
 * tower's linears of the same names. */
static loom_status write_peft(loom_llama *m, const char *dir, const char *base_model, float *const *whole) {
    char path[4200];
    weights_layout l = LAYOUT_TEXT;
    loom_status read = base_model ? dir_layout(base_model, &l) : LOOM_OK;
    if (read != LOOM_OK)
        return loom_error(read, "save adapter: the weights of the base model %s, whose tensor names the adapters' "
                          "follow, cannot be read (%s)", base_model, loom_last_error());
    LOOM_TRY(loom_mkdir_p(dir));
    loom_safetensors_writer *w;
    LOOM_TRY(loom_safetensors_writer_init(&w));
    loom_status st = LOOM_OK;
    char name[320], text[256];
    for (int i = m->n_base; i < m->n_params && st == LOOM_OK; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        layout_name(l, m->params[i]->name, text, sizeof text);
        snprintf(name, sizeof name, PEFT_PREFIX "%s", text);
        st = loom_safetensors_writer_add(w, name, LOOM_SAFETENSORS_F32, fs, m->params[i]->tensor->ndim,
                                         whole[i - m->n_base]); /* DoRA's magnitudes are vectors */
    }
    if (st == LOOM_OK) st = loom_safetensors_writer_set_metadata(w, "format", "pt");
    if (st == LOOM_OK) st = join(path, sizeof path, dir, "adapter_model.safetensors");
    if (st == LOOM_OK) st = loom_safetensors_writer_write(w, path);
    loom_safetensors_writer_free(w);
    LOOM_TRY(st);
    /* A path that is not UTF-8 cannot be a JSON string: null then. */
    json_t *base = base_model ? json_string(base_model) : NULL;
    if (!base) base = json_null();
    json_t *targets;
    if (l == LAYOUT_TEXT) { /* the modules' names */
        targets = json_array();
        for (int t = 0; t < LOOM_LORA_N && targets; t++)
            if (m->lora.targets & (1u << t) && json_array_append_new(targets, json_string(loom_lora_target_name(t)))) {
                json_decref(targets);
                targets = NULL;
            }
    } else { /* (language_model\.model|model\.language_model)\.layers\.[0-9]+\.(self_attn|mlp)\.(q_proj|...) */
        char pattern[256], names[128] = "";
        for (int t = 0, n = 0; t < LOOM_LORA_N; t++)
            if (m->lora.targets & (1u << t))
                n += snprintf(names + n, sizeof names - (size_t)n, "%s%s", n ? "|" : "", loom_lora_target_name(t));
        snprintf(pattern, sizeof pattern, "(language_model\\.model|model\\.language_model)\\.layers\\.[0-9]+\\."
                 "(self_attn|mlp)\\.(%s)", names);
        targets = json_string(pattern);
    }
    json_t *root = !targets ? NULL
                            : json_pack("{s:s, s:s, s:i, s:f, s:f, s:o, s:s, s:b, s:b, s:b, s:b, s:o}", "peft_type", "LORA",
                                        "task_type", "CAUSAL_LM", "r", m->lora.rank, "lora_alpha",
                                        (double)m->lora.alpha, "lora_dropout", (double)m->lora.dropout,
                                        "target_modules", targets, "bias", "none", "fan_in_fan_out", 0,
                                        "inference_mode", 1, "use_rslora", m->lora.rslora != 0, "use_dora", m->lora.dora != 0,
                                        "base_model_name_or_path", base);
    if (!root) return loom_error(LOOM_ERR_NOMEM, "save adapter: cannot build adapter_config.json");
    char *json = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(9));
    json_decref(root);
    if (!json) return loom_error(LOOM_ERR_NOMEM, "save adapter: cannot format adapter_config.json");
    st = join(path, sizeof path, dir, "adapter_config.json");
    if (st == LOOM_OK) st = loom_file_write_atomic(path, json, strlen(json));
    free(json);
    return st;
}

loom_status loom_lora_save_peft(loom_llama *m, const char *dir, const char *base_model) {
    if (!m->lora.rank) return loom_error(LOOM_ERR_INVALID, "save adapter: the model has no LoRA adapters");
    if (loom_lora_peft_unwritable(m))
        return loom_error(LOOM_ERR_UNSUPPORTED, "save adapter: PEFT adapts Phi-3's fused qkv_proj and gate_up_proj as "
                          "one module each, and loom does not write its adapters of their parts in that form: save "
                          "the model with the adapters merged (loom_model_dir_save), or adapt o_proj and down_proj "
                          "alone");
    /* Every adapter whole first (gathered over the TP group, whose every
     * rank calls this; they are small), then TP rank 0 writes. */
    int n = m->n_params - m->n_base;
    float **whole = calloc((size_t)n, sizeof *whole);
    loom_status st = whole ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "save adapter: out of memory");
    for (int k = 0; k < n && st == LOOM_OK; k++) { /* all of them before the first gather */
        int64_t fs[2];
        loom_llama_param_full_shape(m, m->n_base + k, fs);
        whole[k] = malloc((size_t)(fs[0] * fs[1]) * sizeof(float));
        if (!whole[k]) st = loom_error(LOOM_ERR_NOMEM, "save adapter: out of memory");
    }
    st = loom_llama_tp_agree(m, st); /* every rank gathers, or none */
    int joined = st == LOOM_OK;
    for (int k = 0; k < n && st == LOOM_OK; k++) st = loom_llama_param_gather(m, m->n_base + k, 0, whole[k]);
    if (st == LOOM_OK && m->tp_rank == 0) st = write_peft(m, dir, base_model, whole);
    for (int k = 0; whole && k < n; k++) free(whole[k]);
    free(whole);
    if (joined && m->tp_size > 1) { /* the writer's outcome, and its message, on every rank */
        struct { int status; char msg[768]; } out = {st, ""};
        if (m->tp_rank == 0 && st != LOOM_OK) snprintf(out.msg, sizeof out.msg, "%s", loom_last_error());
        loom_status b = loom_comm_broadcast(m->tp_comm, &out, sizeof out, 0);
        if (st == LOOM_OK && b != LOOM_OK) st = b;
        else if (st == LOOM_OK && out.status != LOOM_OK)
            st = loom_error((loom_status)out.status, "save adapter: tensor-parallel rank 0 did not write %s: %s", dir,
                            out.msg);
    }
    return st;
}

/* PEFT's target_modules selects modules by their full names: a list entry
 * names the modules it equals or ends (after a '.'), a string is a Python
 * regular expression that must match a whole name. loom adapts a linear
 * in every layer or in none, so a selection is checked against the names
 * of the model's layers (n_layers; 0, a model not known yet: layers
 * 0 .. PEFT_LAYERS - 1, more than any LLaMA has): each linear must be
 * chosen in all of them or in none. */
#define PEFT_LAYERS 128

/* The module name of linear t in layer l, as Hugging Face's LlamaForCausalLM
 * names it (PEFT's keys). */
static void peft_module_name(int l, int t, char *buf, size_t n) {
    snprintf(buf, n, "model.layers.%d.%s.%s", l, t <= LOOM_LORA_O ? "self_attn" : "mlp",
             loom_lora_target_name((loom_lora_target)t));
}

typedef int (*peft_match_fn)(const void *how, const char *name);

/* The linears `match` selects, into *targets; refused unless each is
 * selected in every layer or in none, and unless something is. */
static loom_status peft_select(peft_match_fn match, const void *how, const char *what, const char *path,
                               int n_layers, unsigned *targets) {
    int layers = n_layers > 0 ? n_layers : PEFT_LAYERS;
    char name[96];
    unsigned chosen = 0;
    for (int t = 0; t < LOOM_LORA_N; t++) {
        int in = 0;
        for (int l = 0; l < layers; l++) { /* its name in a text model, or in Gemma 3's multimodal ones */
            peft_module_name(l, t, name, sizeof name);
            int hit = 0;
            for (int k = 0; k < LAYOUTS && !hit; k++) {
                char named[128];
                layout_name((weights_layout)k, name, named, sizeof named);
                hit = match(how, named) != 0;
            }
            in += hit;
        }
        if (in && in < layers) {
            peft_module_name(0, t, name, sizeof name);
            return loom_error(LOOM_ERR_UNSUPPORTED, "%s: target_modules %s selects %s in some layers only; loom "
                              "adapts a linear in every layer or in none", path, what,
                              loom_lora_target_name((loom_lora_target)t));
        }
        if (in) chosen |= 1u << t;
    }
    if (!chosen)
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: target_modules %s selects none of q_proj, k_proj, v_proj, "
                          "o_proj, gate_proj, up_proj, down_proj (the linears loom adapts)", path, what);
    *targets |= chosen;
    return LOOM_OK;
}

/* A list entry: the name itself, or the end of a name after a '.'. */
static int name_ends_with(const void *how, const char *name) {
    const char *key = how;
    size_t n = strlen(name), k = strlen(key);
    return !strcmp(name, key) || (n > k && name[n - k - 1] == '.' && !strcmp(name + n - k, key));
}

static loom_status peft_name_targets(const char *entry, const char *path, int n_layers, unsigned *targets) {
    if (strstr(entry, "qkv_proj") || strstr(entry, "gate_up_proj"))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: target_modules entry \"%.120s\" adapts Phi-3's fused module as "
                          "one; loom adapts q, k, v (gate, up) apart and cannot load it", path, entry);
    char what[160];
    snprintf(what, sizeof what, "entry \"%.120s\"", entry);
    return peft_select(name_ends_with, entry, what, path, n_layers, targets);
}

/* A whole-name match of a POSIX extended regular expression. */
static int regex_matches(const void *how, const char *name) {
    regmatch_t at;
    return regexec(how, name, 1, &at, 0) == 0 && at.rm_so == 0 && name[at.rm_eo] == '\0';
}

/* Groups nested deeper than this are refused. */
#define PATTERN_DEPTH 8

/* What in pattern Python's regular expressions and POSIX extended ones
 * (glibc's regcomp) would read differently, or what could make regcomp's
 * compiled form explode; NULL: nothing. Inside [...] only a backslash
 * (Python's escape, POSIX's literal) and POSIX's [:class:], [.x.] and
 * [=x=] differ; outside, only escapes of punctuation are the same, and
 * glibc writes X+ as X X*, so a group holding a repeat is not repeated
 * with + (each level would double the compiled size). */
static const char *pattern_unread(const char *q, char *buf, size_t n) {
    int depth = 0, run = 0, holds[PATTERN_DEPTH + 1] = {0}; /* holds[d]: a repeat inside group d */
    for (; *q; q++) {
        if (*q == '[') { /* a bracket expression: one atom */
            q += q[1] == '^' ? 2 : 1;
            if (*q == ']') q++;
            for (; *q && *q != ']'; q++) {
                if (*q == '\\') return "a backslash inside [...], an escape in Python and itself in POSIX";
                if (*q == '[' && (q[1] == ':' || q[1] == '.' || q[1] == '='))
                    return "a POSIX [:class:], [.x.] or [=x=], which Python does not have";
            }
            if (!*q) return NULL; /* unterminated: regcomp refuses it */
            run = 0;
        } else if (*q == '\\') {
            if (!q[1]) return NULL;
            if (!strchr(".[](){}*+?|^$\\/-", q[1])) {
                snprintf(buf, n, "\\%c, an escape other than of punctuation (Python's \\d, \\w, \\b; glibc's "
                         "\\<, \\>)", q[1]);
                return buf;
            }
            q++;
            run = 0;
        } else if (*q == '(') {
            if (q[1] == '?') return "a (?...) group";
            if (++depth > PATTERN_DEPTH) return "groups nested more than 8 deep";
            holds[depth] = 0;
            run = 0;
        } else if (*q == ')') {
            if (depth > 0) {
                int inner = holds[depth--];
                if (inner && q[1] == '+') return "a group holding a repeat, repeated with +";
                holds[depth] |= inner;
            }
            run = 0;
        } else if (*q == '{') {
            return "a counted repeat {m,n}";
        } else if (strchr("*+?", *q)) { /* a second ? makes Python's repeat lazy: the same whole matches */
            if (++run > 2 || (run == 2 && *q != '?')) return "a repeat of a repeat";
            holds[depth] = 1;
        } else {
            run = 0;
        }
    }
    return NULL;
}

/* A pattern: Python's re.fullmatch, for the syntax Python's regular
 * expressions share with POSIX extended ones (pattern_unread refuses the
 * rest by name rather than read it another way). */
static loom_status peft_pattern_targets(const char *pattern, const char *path, int n_layers, unsigned *targets) {
    char what[160];
    snprintf(what, sizeof what, "pattern \"%.120s\"", pattern);
    if (strlen(pattern) > 512)
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: target_modules %s is longer than the 512 characters loom reads",
                          path, what);
    char buf[128];
    const char *unread = pattern_unread(pattern, buf, sizeof buf);
    if (unread)
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: target_modules %s uses %s, which loom's patterns do not read",
                          path, what, unread);
    regex_t re;
    int rc = regcomp(&re, pattern, REG_EXTENDED);
    if (rc != 0) {
        char why[128];
        regerror(rc, &re, why, sizeof why);
        return loom_error(rc == REG_ESPACE ? LOOM_ERR_NOMEM : LOOM_ERR_UNSUPPORTED, "%s: target_modules %s is not "
                          "a regular expression loom reads (%s)", path, what, why);
    }
    loom_status st = peft_select(regex_matches, &re, what, path, n_layers, targets);
    regfree(&re);
    return st;
}

/* adapter_config.json's LoRA setting; what loom does not compute (biases,
 * other modules, some layers only) is refused by name. */
static loom_status peft_config(json_t *root, const char *path, int n_layers, loom_lora_config *c) {
    memset(c, 0, sizeof *c);
    json_t *type = json_object_get(root, "peft_type");
    if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "LORA")))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: peft_type is not \"LORA\"; loom applies LoRA adapters only",
                          path);
    LOOM_TRY(get_int(root, path, "r", 1, &c->rank));
    c->alpha = 8.0f; /* PEFT's LoraConfig default */
    LOOM_TRY(get_float(root, path, "lora_alpha", &c->alpha));
    json_t *d = json_object_get(root, "lora_dropout");
    if (d && !json_is_null(d)) {
        double v = json_is_number(d) ? json_number_value(d) : -1.0;
        c->dropout = (float)v; /* checked as the float it becomes */
        if (!(c->dropout >= 0.0f && c->dropout < 1.0f))
            return loom_error(LOOM_ERR_FORMAT, "%s: lora_dropout must be in [0, 1)", path);
    }
    json_t *rs = json_object_get(root, "use_rslora");
    if (rs && !json_is_boolean(rs) && !json_is_null(rs))
        return loom_error(LOOM_ERR_FORMAT, "%s: use_rslora must be true or false", path);
    c->rslora = json_is_true(rs);
    json_t *dora = json_object_get(root, "use_dora");
    if (dora && !json_is_boolean(dora) && !json_is_null(dora))
        return loom_error(LOOM_ERR_FORMAT, "%s: use_dora must be true or false", path);
    c->dora = json_is_true(dora);
    static const char *const flags[] = {"fan_in_fan_out", "lora_bias"};
    for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++)
        if (json_is_true(json_object_get(root, flags[k])))
            return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s is true, which loom does not compute", path, flags[k]);
    json_t *bias = json_object_get(root, "bias");
    if (bias && !json_is_null(bias) && !(json_is_string(bias) && !strcmp(json_string_value(bias), "none")))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: bias is not \"none\"; loom's adapters have no biases", path);
    static const char *const unset[] = {"modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern",
                                        "exclude_modules", "layer_replication"};
    for (size_t k = 0; k < sizeof unset / sizeof unset[0]; k++) {
        json_t *v = json_object_get(root, unset[k]);
        if (v && !json_is_null(v) && !(json_is_array(v) && !json_array_size(v)) &&
            !(json_is_object(v) && !json_object_size(v)))
            return loom_error(LOOM_ERR_UNSUPPORTED, "%s: %s is set; loom applies one rank and alpha to whole "
                              "linears of every layer", path, unset[k]);
    }
    json_t *t = json_object_get(root, "target_modules");
    if (json_is_string(t) && !strcmp(json_string_value(t), "all-linear")) {
        c->targets = LOOM_LORA_ALL;
        return LOOM_OK;
    }
    if (json_is_string(t)) return peft_pattern_targets(json_string_value(t), path, n_layers, &c->targets);
    if (!json_is_array(t) || !json_array_size(t))
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: target_modules must be a list of module names, a pattern, or "
                          "\"all-linear\"", path);
    size_t i;
    json_t *v;
    json_array_foreach(t, i, v) {
        if (!json_is_string(v))
            return loom_error(LOOM_ERR_FORMAT, "%s: target_modules entry %zu is not a string", path, i);
        LOOM_TRY(peft_name_targets(json_string_value(v), path, n_layers, &c->targets));
    }
    return LOOM_OK;
}

loom_status loom_lora_peft_config(const char *dir, loom_lora_config *c) {
    return loom_lora_peft_config_layers(dir, 0, c);
}

loom_status loom_lora_peft_config_layers(const char *dir, int n_layers, loom_lora_config *c) {
    char path[4200];
    LOOM_TRY(join(path, sizeof path, dir, "adapter_config.json"));
    json_t *root;
    LOOM_TRY(read_json(path, "adapter config", &root));
    loom_status st = json_is_object(root) ? peft_config(root, path, n_layers, c)
                                          : loom_error(LOOM_ERR_FORMAT, "%s: expected a JSON object", path);
    json_decref(root);
    return st;
}

/* Whether a Gemma 3 multimodal model's module name is its vision tower's or
 * projector's (either of transformers' names). */
static int vision_side(const char *name) {
    static const char *const parts[] = {"vision_tower.", "multi_modal_projector."};
    for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++)
        if (!strncmp(name, parts[k], strlen(parts[k])) ||
            (!strncmp(name, "model.", 6) && !strncmp(name + 6, parts[k], strlen(parts[k]))))
            return 1;
    return 0;
}

loom_status loom_lora_load_peft(loom_llama *m, const char *dir) {
    loom_lora_config c;
    LOOM_TRY(loom_lora_peft_config_layers(dir, m->cfg.n_layers, &c));
    if (m->cfg.fused_proj && (c.targets & fused_targets)) /* PEFT adapts Phi-3's qkv_proj, gate_up_proj whole */
        return loom_error(LOOM_ERR_UNSUPPORTED, "%s: the adapter adapts q, k, v, gate or up apart, which a Phi-3 "
                          "model fuses (qkv_proj, gate_up_proj); loom loads adapters of o_proj and down_proj alone "
                          "into it", dir);
    if (m->lora.rank) { /* adapters made already: they must be this setting's */
        if (m->lora.rank != c.rank || m->lora.alpha != c.alpha || m->lora.targets != c.targets ||
            !m->lora.rslora != !c.rslora || !m->lora.dora != !c.dora) /* not dropout */
            return loom_error(LOOM_ERR_INVALID, "%s: the adapter's setting (r %d, lora_alpha %g%s%s) is not the "
                              "model's (rank %d, alpha %g%s%s), or its target_modules differ", dir, c.rank,
                              (double)c.alpha, c.rslora ? ", use_rslora" : "", c.dora ? ", use_dora" : "",
                              m->lora.rank, (double)m->lora.alpha, m->lora.rslora ? ", rslora" : "",
                              m->lora.dora ? ", dora" : "");
    } else {
        LOOM_TRY(loom_llama_add_lora(m, &c, 0));
    }
    char path[4200];
    LOOM_TRY(join(path, sizeof path, dir, "adapter_model.safetensors"));
    loom_safetensors *sf;
    LOOM_TRY(loom_safetensors_open(path, &sf));
    loom_status st = LOOM_OK;
    char name[320], text[256];
    weights_layout l = LAYOUT_TEXT; /* the layout in which the file has the first adapter */
    for (int k = 0; k < LAYOUTS && m->n_params > m->n_base; k++) {
        layout_name((weights_layout)k, m->params[m->n_base]->name, text, sizeof text);
        snprintf(name, sizeof name, PEFT_PREFIX "%s", text);
        if (loom_safetensors_has(sf, name)) {
            l = (weights_layout)k;
            break;
        }
    }
    for (int i = m->n_base; i < m->n_params && st == LOOM_OK; i++) {
        loom_param *p = m->params[i];
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        layout_name(l, p->name, text, sizeof text);
        snprintf(name, sizeof name, PEFT_PREFIX "%s", text);
        float *v = malloc((size_t)(fs[0] * fs[1]) * sizeof(float) + 1);
        if (!v) st = loom_error(LOOM_ERR_NOMEM, "load adapter: out of memory");
        else if (!loom_safetensors_has(sf, name))
            st = loom_error(LOOM_ERR_FORMAT, "%s: tensor %s is missing (adapter_config.json names its module)", path,
                            name);
        else if ((st = loom_safetensors_read(sf, name, LOOM_F32, fs, p->tensor->ndim, v)) == LOOM_ERR_INVALID)
            st = loom_error(LOOM_ERR_FORMAT, "%s (adapter_config.json and the tensors disagree)", loom_last_error());
        if (st == LOOM_OK) st = io_check_finite(v, (size_t)(fs[0] * fs[1]), path, name);
        if (st == LOOM_OK) loom_llama_param_scatter(m, i, v); /* this rank's part of it */
        free(v);
    }
    /* Every tensor of the file is one loom applies: none left out silently. */
    size_t expected = (size_t)(m->n_params - m->n_base);
    for (size_t k = 0; st == LOOM_OK && k < loom_safetensors_count(sf); k++) {
        loom_safetensors_tensor t;
        st = loom_safetensors_at(sf, k, &t);
        if (st == LOOM_OK && l != LAYOUT_TEXT && !strncmp(t.name, PEFT_PREFIX, strlen(PEFT_PREFIX)) &&
            vision_side(t.name + strlen(PEFT_PREFIX)))
            continue; /* PEFT adapts the vision tower's q_proj ... too: no part of a text model */
        int known = 0; /* one of the model's adapters, named in the file's layout */
        for (int i = m->n_base; st == LOOM_OK && i < m->n_params && !known; i++) {
            layout_name(l, m->params[i]->name, text, sizeof text);
            snprintf(name, sizeof name, PEFT_PREFIX "%s", text);
            known = !strcmp(t.name, name);
        }
        if (st == LOOM_OK && !known)
            st = loom_error(LOOM_ERR_UNSUPPORTED, "%s: tensor %s is not one of the adapters adapter_config.json "
                            "describes (%zu of them)", path, t.name, expected);
    }
    loom_safetensors_close(sf);
    return st;
}

/* generation_config.json's eos_token_id (one id or a list) from its JSON. */
static loom_status eos_ids_of(json_t *root, const char *path, int32_t *ids, int cap, int *n) {
    *n = 0;
    if (!json_is_object(root)) return loom_error(LOOM_ERR_FORMAT, "%s: expected a JSON object", path);
    json_t *eos = json_object_get(root, "eos_token_id");
    size_t count = json_is_array(eos) ? json_array_size(eos) : eos && !json_is_null(eos) ? 1 : 0;
    if (count > (size_t)(cap > 0 ? cap : 0))
        return loom_error(LOOM_ERR_FORMAT, "%s: eos_token_id lists %zu ids, more than %d", path, count, cap);
    for (size_t i = 0; i < count; i++) {
        json_t *v = json_is_array(eos) ? json_array_get(eos, i) : eos;
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            *n = 0;
            return loom_error(LOOM_ERR_FORMAT, "%s: eos_token_id must be a token id or a list of them (an integer "
                              "from 0)", path);
        }
        ids[(*n)++] = (int32_t)json_integer_value(v);
    }
    return LOOM_OK;
}

/* dir's generation_config.json: its path, its text (NULL when there is
 * none; malloc'd), its eos_token_id ids (*n of them, at most cap) and, with
 * root not NULL, its parsed JSON (NULL with the text; the caller's). */
static loom_status read_generation_config(const char *dir, char *path, size_t pcap, void **text, size_t *len,
                                          int32_t *ids, int cap, int *n, json_t **root_out) {
    *text = NULL;
    *len = 0;
    *n = 0;
    if (root_out) *root_out = NULL;
    LOOM_TRY(join(path, pcap, dir, LOOM_GENERATION_CONFIG));
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT) return LOOM_OK; /* optional */
    LOOM_TRY(io_read_file(path, "generation config", text, len));
    json_error_t err;
    json_t *root = json_loadb(*text, *len, 0, &err);
    loom_status st = root ? eos_ids_of(root, path, ids, cap, n)
                          : loom_error(LOOM_ERR_FORMAT, "%s: invalid JSON at line %d: %s", path, err.line, err.text);
    if (st == LOOM_OK && root_out) {
        *root_out = root;
        return LOOM_OK;
    }
    json_decref(root);
    if (st != LOOM_OK) {
        free(*text);
        *text = NULL;
    }
    return st;
}

loom_status loom_model_dir_eos_ids(const char *dir, int32_t *ids, int cap, int *n) {
    char path[4200];
    void *text;
    size_t len;
    loom_status st = read_generation_config(dir, path, sizeof path, &text, &len, ids, cap, n, NULL);
    free(text);
    return st;
}

loom_status loom_model_dir_sampler(const char *dir, unsigned given, loom_sampler *s, unsigned *from_file) {
    char path[4200];
    void *text;
    size_t len;
    int32_t ids[LOOM_EOS_IDS_MAX];
    int n;
    *from_file = 0;
    json_t *root;
    LOOM_TRY(read_generation_config(dir, path, sizeof path, &text, &len, ids, LOOM_EOS_IDS_MAX, &n, &root));
    free(text);
    if (!root) return LOOM_OK; /* none: *s as the caller has it */
    json_t *ds = json_object_get(root, "do_sample"), *t = json_object_get(root, "temperature");
    json_t *p = json_object_get(root, "top_p"), *k = json_object_get(root, "top_k");
    json_t *rp = json_object_get(root, "repetition_penalty"), *mp = json_object_get(root, "min_p");
    loom_status st = LOOM_OK;
    if (ds && !json_is_null(ds) && !json_is_boolean(ds))
        st = loom_error(LOOM_ERR_FORMAT, "%s: do_sample must be true or false", path);
    /* The temperature: the flag's, else greedy unless do_sample, else the file's (1 when it says none). */
    if (st == LOOM_OK && !(given & 1u)) {
        *from_file |= 1u;
        if (!json_is_true(ds)) {
            s->temperature = 0.0f;
            *from_file |= 8u;
        } else if (t && !json_is_null(t)) {
            if (!json_is_number(t) || !(json_number_value(t) >= 0.0 && json_number_value(t) <= 1e6))
                st = loom_error(LOOM_ERR_FORMAT, "%s: temperature must be a number from 0 (up to 1e6)", path);
            s->temperature = (float)json_number_value(t);
        } else {
            s->temperature = 1.0f;
        }
    }
    /* top_p and top_k when sampling: the flags', else the file's (1 and 50 when it says none). What is not
     * applied is not checked. */
    int sampling = s->temperature > 0.0f;
    if (st == LOOM_OK && sampling && !(given & 2u)) {
        float v = p && !json_is_null(p) && json_is_number(p) ? (float)json_number_value(p) : 1.0f;
        if ((p && !json_is_null(p) && !json_is_number(p)) || !(v > 0.0f && v <= 1.0f))
            st = loom_error(LOOM_ERR_FORMAT, "%s: top_p must be a number in (0, 1] (as an fp32)", path);
        s->top_p = v;
        *from_file |= 2u;
    }
    if (st == LOOM_OK && sampling && !(given & 4u)) {
        if (k && !json_is_null(k) && !(json_is_integer(k) && json_integer_value(k) >= 0 &&
                                       json_integer_value(k) <= INT32_MAX))
            st = loom_error(LOOM_ERR_FORMAT, "%s: top_k must be an integer from 0", path);
        s->top_k = json_is_integer(k) ? (int)json_integer_value(k) : 50;
        *from_file |= 4u;
    }
    /* min_p when sampling: the flag's, else the file's (none when it says none). */
    if (st == LOOM_OK && sampling && !(given & 32u) && mp && !json_is_null(mp)) {
        float v = json_is_number(mp) ? (float)json_number_value(mp) : NAN;
        if (!(v >= 0.0f && v <= 1.0f)) st = loom_error(LOOM_ERR_FORMAT, "%s: min_p must be a number in [0, 1]", path);
        s->min_p = v;
        *from_file |= 32u;
    }
    /* The repetition penalty, greedy or not (a logits processor in Hugging Face's generate). */
    if (st == LOOM_OK && !(given & 16u) && rp && !json_is_null(rp)) {
        float v = json_is_number(rp) ? (float)json_number_value(rp) : 0.0f;
        if (!(v > 0.0f) || !isfinite(v))
            st = loom_error(LOOM_ERR_FORMAT, "%s: repetition_penalty must be a positive number", path);
        s->repetition_penalty = v;
        *from_file |= 16u;
    }
    json_decref(root);
    return st;
}

loom_status loom_model_dir_load_generation_config(loom_llama *m, const char *dir) {
    char path[4200];
    void *text;
    size_t len;
    int32_t ids[LOOM_EOS_IDS_MAX];
    int n; /* checked as generate reads it */
    LOOM_TRY(read_generation_config(dir, path, sizeof path, &text, &len, ids, LOOM_EOS_IDS_MAX, &n, NULL));
    free(m->generation_config);
    m->generation_config = text;
    m->generation_config_len = len;
    return LOOM_OK;
}

loom_status loom_model_dir_check(const char *dir) {
    char marker[4200];
    struct stat sb;
    LOOM_TRY(join(marker, sizeof marker, dir, LOOM_MODEL_INCOMPLETE));
    if (stat(marker, &sb) == 0)
        return loom_error(LOOM_ERR_STATE, "%s: a save stopped while replacing its files (%s is there), so they may "
                          "be of two different saves; save the model again (a training run's last checkpoint, "
                          "RUN/ckpt-N, is a whole model too)", dir, LOOM_MODEL_INCOMPLETE);
    return LOOM_OK;
}

loom_status loom_model_dir_load(const char *dir, loom_precision prec, loom_llama **out) {
    char path[4096];
    loom_llama_config cfg;
    *out = NULL;
    LOOM_TRY(loom_model_dir_check(dir));
    LOOM_TRY(join(path, sizeof path, dir, "config.json"));
    LOOM_TRY(loom_llama_config_load(path, &cfg));
    loom_llama *m;
    LOOM_TRY(loom_llama_new(&cfg, prec, &m));
    loom_status st = loom_model_dir_load_weights(m, dir);
    if (st == LOOM_OK) st = loom_model_dir_load_generation_config(m, dir);
    if (st != LOOM_OK) { loom_llama_free(m); return st; }
    *out = m;
    return LOOM_OK;
}
