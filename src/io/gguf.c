/*
 * gguf.c — a model as one GGUF file (version 3) for llama.cpp's "llama"
 * architecture: the hyperparameters as llama.* keys, loom's byte-level BPE
 * as a "gpt2" vocabulary, and the weights under llama.cpp's tensor names.
 *
 * Layout: ggml lists a tensor's dimensions fastest first, so a Hugging Face
 * (out, in) matrix keeps its bytes and is described as [in, out]. llama.cpp
 * rotates adjacent pairs (x[2i], x[2i+1]) where Hugging Face rotates halves
 * (x[i], x[i + HS/2]), so each head's rows of q_proj and k_proj are
 * interleaved: the file's row 2i of a head is its row i, row 2i+1 its row
 * i + HS/2 (what llama.cpp's own converter does to a Hugging Face model).
 * Norm weights stay fp32 whatever the type, as that converter keeps them.
 * Q8_0 follows ggml's reference quantizer: per block of 32, d = amax / 127,
 * q = round(x * (1 / d)) half away from zero, d stored as fp16.
 *
 * Vocabulary: token i is its bytes, each byte written as the code point
 * GPT-2 assigns it (printable Latin-1 bytes as themselves, the others as
 * 256 + n in byte order), merges as "left right" of those strings, and
 * "<|endoftext|>" a control token that is also BOS and EOS (loom starts a
 * prompt with it, as training put it before every document). Ids past the
 * tokenizer's, when the model's vocabulary is larger, are unused tokens.
 *
 * Must never: leave a partial file (it is written through loom_atomic_file).
 */
#include "loom/checkpoint.h"
#include "io/io_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define GGUF_ALIGN 32

enum { /* metadata value types */
    GGUF_U32 = 4, GGUF_I32 = 5, GGUF_F32 = 6, GGUF_BOOL = 7, GGUF_STRING = 8, GGUF_ARRAY = 9
};
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_Q8_0 = 8, GGML_BF16 = 30 }; /* tensor types */
enum { FILE_ALL_F32 = 0, FILE_MOSTLY_F16 = 1, FILE_MOSTLY_Q8_0 = 7, FILE_MOSTLY_BF16 = 32 }; /* general.file_type */
#define Q8_BLOCK 32
#define Q8_BLOCK_BYTES 34 /* fp16 d, then 32 int8 */
enum { TOKEN_NORMAL = 1, TOKEN_CONTROL = 3, TOKEN_UNUSED = 5 };

/* A growing byte buffer for the header; the first failed growth sticks. */
typedef struct gbuf {
    unsigned char *p;
    size_t n, cap;
    uint64_t n_keys; /* metadata pairs put */
    int oom;
} gbuf;

static void put(gbuf *b, const void *src, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_u32(gbuf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(gbuf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(gbuf *b, const char *s, size_t n) { put_u64(b, n); put(b, s, n); }
static void put_key(gbuf *b, const char *key, uint32_t type) {
    put_str(b, key, strlen(key));
    put_u32(b, type);
    b->n_keys++;
}

static void kv_u32(gbuf *b, const char *key, uint32_t v) { put_key(b, key, GGUF_U32); put_u32(b, v); }
static void kv_f32(gbuf *b, const char *key, float v) { put_key(b, key, GGUF_F32); put(b, &v, 4); }
static void kv_bool(gbuf *b, const char *key, int v) { unsigned char c = v != 0; put_key(b, key, GGUF_BOOL); put(b, &c, 1); }
static void kv_str(gbuf *b, const char *key, const char *s) { put_key(b, key, GGUF_STRING); put_str(b, s, strlen(s)); }
static void kv_array(gbuf *b, const char *key, uint32_t type, uint64_t n) {
    put_key(b, key, GGUF_ARRAY);
    put_u32(b, type);
    put_u64(b, n);
}

/* --------------------------------------------------------- vocabulary */

/* Token id's string as the vocabulary spells it: its bytes in GPT-2's
 * alphabet, "<|endoftext|>" for the end-of-text token, "<|unused_N|>" for
 * ids past the tokenizer's. Appended to b. */
static void put_spelling(gbuf *b, const bpe_byte_chars *bc, const loom_tokenizer *tok, int32_t id) {
    if (id >= loom_tokenizer_vocab_size(tok)) {
        char pad[32];
        int n = snprintf(pad, sizeof pad, "<|unused_%d|>", (int)id);
        put(b, pad, (size_t)n);
        return;
    }
    if (id == loom_tokenizer_eot(tok)) {
        put(b, LOOM_TOKENIZER_EOT, strlen(LOOM_TOKENIZER_EOT));
        return;
    }
    const char *bytes;
    size_t n;
    loom_tokenizer_token_bytes(tok, id, &bytes, &n);
    for (size_t i = 0; i < n; i++) put(b, bc->s[(unsigned char)bytes[i]], bc->len[(unsigned char)bytes[i]]);
}

/* Put token id's spelling as a GGUF string (length first). */
static void put_token(gbuf *b, gbuf *scratch, const bpe_byte_chars *bc, const loom_tokenizer *tok, int32_t id) {
    scratch->n = 0;
    put_spelling(scratch, bc, tok, id);
    if (!scratch->oom) put_str(b, (const char *)scratch->p, scratch->n);
}

/* llama.cpp maps each token's string to its id and stops on a string two
 * ids share, which a hand-made merge list can give (two merges spelling the
 * same bytes) or text that held "<|endoftext|>" itself. */
static loom_status check_unique_spellings(const loom_tokenizer *tok, int vocab_size) {
    bpe_byte_chars bc;
    bpe_byte_chars_init(&bc);
    io_bytesmap seen = {0};
    gbuf s = {0};
    int32_t *first = malloc((size_t)vocab_size * sizeof *first);
    loom_status st = first ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "GGUF export: out of memory");
    for (int32_t id = 0; id < vocab_size && st == LOOM_OK; id++) {
        s.n = 0;
        put_spelling(&s, &bc, tok, id);
        int inserted = 0;
        int64_t e = s.oom ? -1 : io_bytesmap_insert(&seen, s.p, s.n, &inserted);
        if (e < 0) st = loom_error(LOOM_ERR_NOMEM, "GGUF export: out of memory");
        else if (!inserted)
            st = loom_error(LOOM_ERR_INVALID, "GGUF export: tokens %d and %d have the same bytes (%.*s), which "
                            "llama.cpp's vocabulary cannot hold; retrain the tokenizer", (int)first[e], (int)id,
                            (int)(s.n < 40 ? s.n : 40), (const char *)s.p);
        else first[e] = id;
    }
    free(first);
    free(s.p);
    io_bytesmap_free(&seen);
    return st;
}

static void put_vocabulary(gbuf *b, const loom_tokenizer *tok, int vocab_size) {
    bpe_byte_chars bc;
    bpe_byte_chars_init(&bc);
    gbuf scratch = {0};
    int n_tok = loom_tokenizer_vocab_size(tok), eot = loom_tokenizer_eot(tok);
    kv_str(b, "tokenizer.ggml.model", "gpt2");
    kv_str(b, "tokenizer.ggml.pre", "gpt-2");
    kv_array(b, "tokenizer.ggml.tokens", GGUF_STRING, (uint64_t)vocab_size);
    for (int id = 0; id < vocab_size; id++) put_token(b, &scratch, &bc, tok, id);
    kv_array(b, "tokenizer.ggml.token_type", GGUF_I32, (uint64_t)vocab_size);
    for (int id = 0; id < vocab_size; id++)
        put_u32(b, id >= n_tok ? TOKEN_UNUSED : id == eot ? TOKEN_CONTROL : TOKEN_NORMAL);
    int n_merges = loom_tokenizer_num_merges(tok);
    kv_array(b, "tokenizer.ggml.merges", GGUF_STRING, (uint64_t)n_merges);
    for (int r = 0; r < n_merges; r++) {
        int32_t x, y;
        loom_tokenizer_merge(tok, r, &x, &y);
        scratch.n = 0;
        put_spelling(&scratch, &bc, tok, x);
        put(&scratch, " ", 1);
        put_spelling(&scratch, &bc, tok, y);
        if (!scratch.oom) put_str(b, (const char *)scratch.p, scratch.n);
    }
    b->oom |= scratch.oom;
    free(scratch.p);
    kv_u32(b, "tokenizer.ggml.bos_token_id", (uint32_t)eot);
    kv_u32(b, "tokenizer.ggml.eos_token_id", (uint32_t)eot);
    kv_bool(b, "tokenizer.ggml.add_bos_token", 1);
    kv_bool(b, "tokenizer.ggml.add_eos_token", 0);
}

/* ------------------------------------------------------------- tensors */

typedef struct gguf_tensor {
    char name[64];
    int param;        /* index in m->params */
    int heads;        /* > 0: interleave the rotary halves of this many heads' rows */
    loom_gguf_type type;
    int64_t rows, cols;
    uint64_t offset;  /* from the start of the data section */
} gguf_tensor;

static int param_index(const loom_llama *m, const loom_param *p) {
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i] == p) return i;
    return -1;
}

static uint32_t ggml_type(loom_gguf_type t) {
    return t == LOOM_GGUF_F32 ? GGML_F32 : t == LOOM_GGUF_F16 ? GGML_F16 : t == LOOM_GGUF_BF16 ? GGML_BF16 : GGML_Q8_0;
}

static loom_dtype float_dtype(loom_gguf_type t) {
    return t == LOOM_GGUF_F32 ? LOOM_F32 : t == LOOM_GGUF_F16 ? LOOM_F16 : LOOM_BF16;
}

static uint64_t tensor_bytes(const gguf_tensor *t) {
    uint64_t n = (uint64_t)(t->rows * t->cols);
    switch (t->type) {
    case LOOM_GGUF_F32: return 4 * n;
    case LOOM_GGUF_Q8_0: return n / Q8_BLOCK * Q8_BLOCK_BYTES;
    default: return 2 * n;
    }
}

/* Rows of cols values (a multiple of 32) as Q8_0 blocks. */
static void quantize_q8_0(const float *x, unsigned char *out, size_t n) {
    for (size_t b = 0; b < n / Q8_BLOCK; b++, x += Q8_BLOCK, out += Q8_BLOCK_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = loom_f32_to_f16(d);
        memcpy(out, &h, 2);
        for (int i = 0; i < Q8_BLOCK; i++) out[2 + i] = (unsigned char)(int8_t)roundf(x[i] * id);
    }
}

/* Every tensor llama.cpp reads, in llama.cpp's order; output.weight only
 * when the embeddings are not tied (llama.cpp falls back to token_embd). */
static int list_tensors(const loom_llama *m, loom_gguf_type type, gguf_tensor *t) {
    int n = 0;
    const loom_llama_config *c = &m->cfg;
#define ADD(p, heads_, ...) do { \
        snprintf(t[n].name, sizeof t[n].name, __VA_ARGS__); \
        t[n].param = param_index(m, (p)); \
        t[n].heads = (heads_); \
        n++; \
    } while (0)
    ADD(m->embed, 0, "token_embd.weight");
    for (int l = 0; l < c->n_layers; l++) {
        const loom_llama_layer *y = &m->layers[l];
        ADD(y->attn_norm, 0, "blk.%d.attn_norm.weight", l);
        ADD(y->wq, c->n_heads, "blk.%d.attn_q.weight", l);
        ADD(y->wk, c->n_kv_heads, "blk.%d.attn_k.weight", l);
        ADD(y->wv, 0, "blk.%d.attn_v.weight", l);
        ADD(y->wo, 0, "blk.%d.attn_output.weight", l);
        ADD(y->mlp_norm, 0, "blk.%d.ffn_norm.weight", l);
        ADD(y->w_gate, 0, "blk.%d.ffn_gate.weight", l);
        ADD(y->w_up, 0, "blk.%d.ffn_up.weight", l);
        ADD(y->w_down, 0, "blk.%d.ffn_down.weight", l);
    }
    ADD(m->final_norm, 0, "output_norm.weight");
    if (!c->tie_embeddings) ADD(m->lm_head, 0, "output.weight");
#undef ADD
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(m, t[i].param, fs);
        t[i].rows = fs[0];
        t[i].cols = fs[1];
        t[i].type = t[i].cols == 1 ? LOOM_GGUF_F32 : type; /* vectors (the norms) stay fp32 */
        if (t[i].type == LOOM_GGUF_Q8_0 && t[i].cols % Q8_BLOCK) t[i].type = LOOM_GGUF_F16;
        t[i].offset = off;
        off += (tensor_bytes(&t[i]) + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
    }
    return n;
}

/* Rows of each head from halves [h0 | h1] to pairs (h0[i], h1[i]). */
static void interleave_heads(const float *src, float *dst, int heads, int64_t rows, int64_t cols) {
    int64_t hs = rows / heads, half = hs / 2;
    for (int h = 0; h < heads; h++)
        for (int64_t i = 0; i < half; i++)
            for (int j = 0; j < 2; j++)
                memcpy(dst + (h * hs + 2 * i + j) * cols, src + (h * hs + j * half + i) * cols,
                       (size_t)cols * sizeof *dst);
}

/* The metadata pairs. */
static void put_metadata(gbuf *b, const loom_llama *m, loom_gguf_type type, const loom_tokenizer *tok) {
    const loom_llama_config *c = &m->cfg;
    kv_str(b, "general.architecture", "llama");
    kv_str(b, "general.name", "loom");
    static const uint32_t file_type[] = {FILE_ALL_F32, FILE_MOSTLY_F16, FILE_MOSTLY_BF16, FILE_MOSTLY_Q8_0};
    kv_u32(b, "general.file_type", file_type[type]); /* the matrices' type, as written */
    kv_u32(b, "general.alignment", GGUF_ALIGN);
    /* llama.cpp's "llama" architecture has no sliding window (Mistral's): the context stops at the window, up to
     * which full attention is the same */
    int ctx = c->sliding_window > 0 && c->sliding_window < c->max_seq ? c->sliding_window : c->max_seq;
    kv_u32(b, "llama.context_length", (uint32_t)ctx);
    kv_u32(b, "llama.embedding_length", (uint32_t)c->dim);
    kv_u32(b, "llama.block_count", (uint32_t)c->n_layers);
    kv_u32(b, "llama.feed_forward_length", (uint32_t)c->ffn_dim);
    kv_u32(b, "llama.attention.head_count", (uint32_t)c->n_heads);
    kv_u32(b, "llama.attention.head_count_kv", (uint32_t)c->n_kv_heads);
    kv_u32(b, "llama.rope.dimension_count", (uint32_t)(c->dim / c->n_heads));
    kv_f32(b, "llama.rope.freq_base", c->rope_theta);
    kv_f32(b, "llama.attention.layer_norm_rms_epsilon", c->norm_eps);
    kv_u32(b, "llama.vocab_size", (uint32_t)c->vocab_size);
    put_vocabulary(b, tok, c->vocab_size);
}

/* Everything before the tensor data: magic, version, counts, metadata, the
 * tensor descriptions, and the padding up to the data section. */
static void put_header(gbuf *b, const gbuf *meta, const gguf_tensor *t, int n_tensors) {
    put(b, "GGUF", 4);
    put_u32(b, 3);
    put_u64(b, (uint64_t)n_tensors);
    put_u64(b, meta->n_keys);
    put(b, meta->p, meta->n);
    for (int i = 0; i < n_tensors; i++) {
        put_str(b, t[i].name, strlen(t[i].name));
        int ndim = t[i].cols == 1 ? 1 : 2;
        put_u32(b, (uint32_t)ndim);
        if (ndim == 1) {
            put_u64(b, (uint64_t)t[i].rows);
        } else {
            put_u64(b, (uint64_t)t[i].cols);
            put_u64(b, (uint64_t)t[i].rows);
        }
        put_u32(b, ggml_type(t[i].type));
        put_u64(b, t[i].offset);
    }
    static const unsigned char zeros[GGUF_ALIGN];
    put(b, zeros, (GGUF_ALIGN - b->n % GGUF_ALIGN) % GGUF_ALIGN);
}

loom_status loom_gguf_type_parse(const char *name, loom_gguf_type *out) {
    loom_dtype dt;
    if (name && strcasecmp(name, "q8_0") == 0) *out = LOOM_GGUF_Q8_0;
    else if (name && loom_dtype_parse(name, &dt) == LOOM_OK)
        *out = dt == LOOM_F32 ? LOOM_GGUF_F32 : dt == LOOM_F16 ? LOOM_GGUF_F16 : LOOM_GGUF_BF16;
    else return loom_error(LOOM_ERR_INVALID, "unknown GGUF type '%s' (fp32, fp16, bf16 or q8_0)", name ? name : "");
    return LOOM_OK;
}

const char *loom_gguf_type_name(loom_gguf_type type) {
    static const char *const names[] = {"fp32", "fp16", "bf16", "q8_0"}; /* by loom_gguf_type */
    return (unsigned)type <= LOOM_GGUF_Q8_0 ? names[type] : "?";
}

/* The directory of path, created if missing. */
static loom_status make_parent_dir(const char *path) {
    char dir[4200];
    if (snprintf(dir, sizeof dir, "%s", path) >= (int)sizeof dir)
        return loom_error(LOOM_ERR_INVALID, "path too long: %s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return LOOM_OK;
    *slash = '\0';
    return loom_mkdir_p(dir);
}

loom_status loom_llama_save_gguf(loom_llama *m, loom_gguf_type type, const loom_tokenizer *tok, const char *path) {
    if (!m || !path) return loom_error(LOOM_ERR_INVALID, "loom_llama_save_gguf: NULL model or path");
    if ((unsigned)type > LOOM_GGUF_Q8_0)
        return loom_error(LOOM_ERR_INVALID, "GGUF export: type %d is not fp32, fp16, bf16 or q8_0", (int)type);
    if (m->tp_size > 1)
        return loom_error(LOOM_ERR_UNSUPPORTED, "GGUF export of a tensor-parallel model is not supported: save the "
                          "model directory, then export it with loom export --format gguf");
    if (!tok)
        return loom_error(LOOM_ERR_INVALID, "GGUF export needs the model's tokenizer: llama.cpp cannot run a model "
                          "without its vocabulary");
    const loom_llama_config *c = &m->cfg;
    int granite = loom_llama_has_multipliers(c);
    if (c->rope_type != LOOM_ROPE_DEFAULT || c->qkv_bias || c->head_dim || c->qk_norm || c->norm_unit_offset ||
        c->act != LOOM_ACT_SILU || granite || c->fused_proj || c->nope_interval || c->post_norms)
        return loom_error(LOOM_ERR_UNSUPPORTED, "GGUF export of a model with %s is not supported: export a "
                          "Hugging Face directory (loom export --format hf) and convert that with llama.cpp's "
                          "convert_hf_to_gguf.py", c->post_norms ? "Gemma 2's or 3's architecture"
                          : c->norm_unit_offset ? "Gemma's architecture"
                          : granite ? "Granite's multipliers" : c->fused_proj ? "Phi-3's fused projections"
                          : c->nope_interval ? "SmolLM3's NoPE blocks"
                          : c->qkv_bias ? "attention biases (Qwen 2's, attention_bias)"
                          : c->qk_norm ? "q/k norms (Qwen 3's)" : c->head_dim ? "its own head_dim"
                          : c->act != LOOM_ACT_SILU ? "a GELU MLP" : "rope_scaling");
    if (tok->hf)
        return loom_error(LOOM_ERR_UNSUPPORTED, "GGUF export with a Hugging Face tokenizer is not supported: export "
                          "a Hugging Face directory (loom export --format hf), which keeps the tokenizer.json as "
                          "it is, and convert that with llama.cpp's convert_hf_to_gguf.py");
    if (loom_tokenizer_eot(tok) < 0)
        return loom_error(LOOM_ERR_INVALID, "GGUF export: the tokenizer has no %s token, which llama.cpp needs as "
                          "BOS and EOS; use a tokenizer loom trained (it always has one)", LOOM_TOKENIZER_EOT);
    if (loom_tokenizer_vocab_size(tok) > m->cfg.vocab_size)
        return loom_error(LOOM_ERR_INVALID, "GGUF export: the tokenizer has %d tokens but the model only %d; "
                          "give the tokenizer the model was trained with", loom_tokenizer_vocab_size(tok),
                          m->cfg.vocab_size);
    gguf_tensor *t = calloc(9 * (size_t)m->cfg.n_layers + 3, sizeof *t); /* no biases: refused above */
    if (!t) return loom_error(LOOM_ERR_NOMEM, "GGUF export: out of memory");
    int n = list_tensors(m, type, t);
    /* Q8_0 asked for, but every matrix fell back to fp16: say fp16. */
    loom_gguf_type written = type == LOOM_GGUF_Q8_0 ? LOOM_GGUF_F16 : type;
    for (int i = 0; i < n; i++)
        if (t[i].type == LOOM_GGUF_Q8_0) written = LOOM_GGUF_Q8_0;
    loom_status st = check_unique_spellings(tok, m->cfg.vocab_size);
    if (st != LOOM_OK) {
        free(t);
        return st;
    }
    gbuf meta = {0}, hdr = {0};
    put_metadata(&meta, m, written, tok);
    if (!meta.oom) put_header(&hdr, &meta, t, n);
    free(meta.p);
    st = meta.oom || hdr.oom ? loom_error(LOOM_ERR_NOMEM, "GGUF export: out of memory for the header") : LOOM_OK;
    loom_atomic_file *f = NULL;
    if (st == LOOM_OK) st = make_parent_dir(path);
    if (st == LOOM_OK) st = loom_atomic_file_open(path, &f);
    if (st == LOOM_OK) st = loom_atomic_file_write(f, hdr.p, hdr.n);
    free(hdr.p);
    float *full = NULL, *perm = NULL;
    void *out = NULL;
    static const unsigned char zeros[GGUF_ALIGN];
    for (int i = 0; i < n && st == LOOM_OK; i++) {
        size_t count = (size_t)(t[i].rows * t[i].cols), bytes = (size_t)tensor_bytes(&t[i]);
        full = malloc(count * sizeof *full);
        perm = t[i].heads ? malloc(count * sizeof *perm) : NULL;
        out = malloc(bytes);
        if (!full || !out || (t[i].heads && !perm)) {
            st = loom_error(LOOM_ERR_NOMEM, "GGUF export: out of memory for %s", t[i].name);
            break;
        }
        st = loom_llama_param_merged(m, t[i].param, full); /* LoRA adapters merged in */
        if (st == LOOM_OK) st = io_check_finite(full, count, path, m->params[t[i].param]->name);
        const float *src = full;
        if (st == LOOM_OK && t[i].heads) {
            interleave_heads(full, perm, t[i].heads, t[i].rows, t[i].cols);
            src = perm;
        }
        if (st == LOOM_OK && t[i].type == LOOM_GGUF_Q8_0) quantize_q8_0(src, out, count);
        else if (st == LOOM_OK) loom_convert(out, float_dtype(t[i].type), src, LOOM_F32, count);
        if (st == LOOM_OK) st = loom_atomic_file_write(f, out, bytes);
        if (st == LOOM_OK) st = loom_atomic_file_write(f, zeros, (GGUF_ALIGN - bytes % GGUF_ALIGN) % GGUF_ALIGN);
        free(full);
        free(perm);
        free(out);
        full = perm = NULL;
        out = NULL;
    }
    free(full);
    free(perm);
    free(out);
    free(t);
    if (f && st == LOOM_OK) return loom_atomic_file_commit(f);
    if (f) loom_atomic_file_abort(f);
    return st;
}
