/*
 * generate.c — KV-cache inference for the LLaMA model: no autograd, the
 * kernels called directly on raw buffers in the compute dtype.
 * The cache holds what the call can reach (prompt + new tokens, at most
 * max_seq positions), not max_seq: a short generation from a model with a
 * long context takes memory for its own tokens only.
 * Must never: write or read past the cache (the context is capped at its
 * capacity).
 */
#include "loom/loom.h"
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>

typedef struct kv_cache {
    void **k, **v; /* per layer: (cap, NKV, HS) in dt */
    int len, cap;
} kv_cache;

typedef struct scratch {
    void *x, *h, *q, *k, *v, *att, *o, *g, *u; /* (T, ...) rows in dt */
    void *lora;    /* (T, rank) in dt: x A^T of a LoRA adapter; NULL without adapters */
    float **dora;  /* per layer and linear: DoRA's m / n (out), fixed while generating; NULL without DoRA */
    float *rstd;  /* (T) */
    float *logits; /* (V) */
} scratch;

#define ELT(dt) loom_dtype_size(dt)

static void *row(void *base, int i, int width, loom_dtype dt) { return (char *)base + (size_t)i * (size_t)width * ELT(dt); }

/* Each of out's T rows (M wide) plus b (NULL: none). */
static void add_bias_rows(void *out, const void *b, int T, int M, loom_dtype dt) {
    if (b) rowadd(out, out, b, (size_t)T, (size_t)M, dt);
}

/* out (T, M) = x (T, K) W^T for linear t of layer y, plus s (x A^T) B^T
 * (s: loom_lora_scale) when it has a LoRA adapter, each column then times
 * DoRA's m / n when it is DoRA's; then its bias, if any, as training adds
 * it. */
static loom_status linear(const loom_llama *m, scratch *s, void *out, const void *x, const loom_llama_layer *y,
                          loom_lora_target t, int T, int K, int M) {
    loom_dtype dt = m->prec.compute;
    const loom_param *w = loom_llama_layer_weight(y, t), *a = y->lora_a[t], *b = y->lora_b[t];
    const loom_param *bias = loom_llama_layer_bias(y, t);
    const void *bv = bias ? loom_tensor_data(bias->tensor) : NULL;
    LOOM_TRY(gemm(0, 1, T, M, K, 1.0f, x, K, loom_tensor_data(w->tensor), K, dt, 0.0f, out, M, dt, NULL, LOOM_F32));
    if (!a) {
        add_bias_rows(out, bv, T, M, dt);
        return LOOM_OK;
    }
    int r = m->lora.rank;
    LOOM_TRY(gemm(0, 1, T, r, K, 1.0f, x, K, loom_tensor_data(a->tensor), K, dt, 0.0f, s->lora, r, dt, NULL, LOOM_F32));
    LOOM_TRY(gemm(0, 1, T, M, r, loom_lora_scale(&m->lora), s->lora, r, loom_tensor_data(b->tensor), r, dt, 1.0f, out,
                  M, dt, NULL, LOOM_F32));
    const float *f = s->dora ? s->dora[(y - m->layers) * LOOM_LORA_N + t] : NULL;
    if (f) colscale(out, out, f, (size_t)T, (size_t)M, dt); /* DoRA: (m / n) (x W^T + s x A^T B^T) */
    add_bias_rows(out, bv, T, M, dt);
    return LOOM_OK;
}

/* x (T, C) += a block's output o (T, C, overwritten): normalized first by
 * norm (Gemma 2's; NULL: none), times Granite's residual multiplier where
 * the model has one, as the training forward's block. */
static void add_output(void *x, void *o, const loom_param *norm, const loom_llama_config *cfg, int T,
                       loom_dtype dt) {
    size_t TC = (size_t)T * (size_t)cfg->dim;
    if (norm)
        rmsnorm_fwd(o, NULL, o, loom_tensor_data(norm->tensor), cfg->norm_unit_offset ? 1.0f : 0.0f, T, cfg->dim,
                    cfg->norm_eps, dt);
    if (cfg->residual_multiplier != 0.0f) scale_fwd(o, o, cfg->residual_multiplier, TC, dt);
    add_fwd(x, x, o, TC, dt);
}

/* Run T new tokens at positions cache->len .. through every layer; leaves
 * the last position's logits in s->logits. */
static loom_status forward_tokens(loom_llama *m, kv_cache *c, scratch *s, const int32_t *tokens, int T) {
    const loom_llama_config *cfg = &m->cfg;
    loom_dtype dt = m->prec.compute;
    int C = cfg->dim, NH = cfg->n_heads, NKV = cfg->n_kv_heads, HS = loom_llama_head_dim(cfg), Q = NH * HS;
    int KV = NKV * HS, F = cfg->ffn_dim;
    int pos0 = c->len;
    float wo = cfg->norm_unit_offset ? 1.0f : 0.0f; /* Gemma's norms scale by 1 + weight */
    embedding_fwd(s->x, tokens, loom_tensor_data(m->embed->tensor), T, C, dt);
    size_t TC = (size_t)T * (size_t)C;
    if (cfg->scale_embeddings) scale_fwd(s->x, s->x, loom_llama_embed_scale(cfg, dt), TC, dt); /* Gemma's */
    if (cfg->embedding_multiplier != 0.0f) scale_fwd(s->x, s->x, cfg->embedding_multiplier, TC, dt); /* Granite's */
    for (int l = 0; l < cfg->n_layers; l++) {
        const loom_llama_layer *y = &m->layers[l];
        float *rs = s->rstd;
        rmsnorm_fwd(s->h, rs, s->x, loom_tensor_data(y->attn_norm->tensor), wo, T, C, cfg->norm_eps, dt);
        LOOM_TRY(linear(m, s, s->q, s->h, y, LOOM_LORA_Q, T, C, Q));
        void *kdst = row(c->k[l], pos0, KV, dt), *vdst = row(c->v[l], pos0, KV, dt);
        LOOM_TRY(linear(m, s, kdst, s->h, y, LOOM_LORA_K, T, C, KV));
        LOOM_TRY(linear(m, s, vdst, s->h, y, LOOM_LORA_V, T, C, KV));
        if (y->q_norm) { /* Qwen 3: each head normalized before RoPE */
            rmsnorm_fwd(s->q, NULL, s->q, loom_tensor_data(y->q_norm->tensor), wo, T * NH, HS, cfg->norm_eps, dt);
            rmsnorm_fwd(kdst, NULL, kdst, loom_tensor_data(y->k_norm->tensor), wo, T * NKV, HS, cfg->norm_eps, dt);
        }
        if (loom_llama_layer_has_rope(cfg, l)) { /* not one of SmolLM3's NoPE blocks */
            /* Gemma 3's local one on its windowed blocks; longrope's long factors once this call's positions
             * pass the original context (generation runs the cache again then: loom_llama_generate_until) */
            loom_rope_freqs rope = loom_llama_layer_rope_at(cfg, l, pos0 + T);
            rope_fwd(s->q, s->q, 1, T, NH, HS, pos0, &rope, dt);
            rope_fwd(kdst, kdst, 1, T, NKV, HS, pos0, &rope, dt);
        }
        attn_opts ao = {.scale = loom_llama_attn_scale(cfg), .softcap = cfg->attn_softcap,
                        .window = loom_llama_layer_window(cfg, l)};
        attention_fwd_ex(s->att, NULL, s->q, c->k[l], c->v[l], 1, T, pos0 + T, NH, NKV, HS, pos0, &ao, dt);
        LOOM_TRY(linear(m, s, s->o, s->att, y, LOOM_LORA_O, T, Q, C));
        add_output(s->x, s->o, y->attn_post_norm, cfg, T, dt);
        rmsnorm_fwd(s->h, rs, s->x, loom_tensor_data(y->mlp_norm->tensor), wo, T, C, cfg->norm_eps, dt);
        LOOM_TRY(linear(m, s, s->g, s->h, y, LOOM_LORA_GATE, T, C, F));
        LOOM_TRY(linear(m, s, s->u, s->h, y, LOOM_LORA_UP, T, C, F));
        (cfg->act == LOOM_ACT_GELU_TANH ? geglu_fwd : swiglu_fwd)(s->g, s->g, s->u, (size_t)T * (size_t)F, dt);
        LOOM_TRY(linear(m, s, s->o, s->g, y, LOOM_LORA_DOWN, T, F, C));
        add_output(s->x, s->o, y->mlp_post_norm, cfg, T, dt);
    }
    c->len += T;
    /* Only the last position's logits are needed. */
    float rs1;
    void *last = row(s->x, T - 1, C, dt);
    rmsnorm_fwd(s->h, &rs1, last, loom_tensor_data(m->final_norm->tensor), wo, 1, C, cfg->norm_eps, dt);
    LOOM_TRY(gemm(0, 1, 1, cfg->vocab_size, C, 1.0f, s->h, C, loom_tensor_data(m->lm_head->tensor), C, dt, 0.0f,
                  s->logits, cfg->vocab_size, LOOM_F32, NULL, LOOM_F32));
    if (cfg->final_softcap > 0.0f) /* Gemma 2's */
        softcap_fwd(s->logits, s->logits, cfg->final_softcap, (size_t)cfg->vocab_size, LOOM_F32);
    if (cfg->logits_scaling != 0.0f) /* Granite's, divided as the training forward divides its logits */
        divide_fwd(s->logits, s->logits, cfg->logits_scaling, (size_t)cfg->vocab_size, LOOM_F32);
    return LOOM_OK;
}

static void state_free(loom_llama *m, kv_cache *c, scratch *s) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (c->k) loom_free(c->k[l]);
        if (c->v) loom_free(c->v[l]);
    }
    free(c->k);
    free(c->v);
    void *bufs[] = {s->x, s->h, s->q, s->k, s->v, s->att, s->o, s->g, s->u, s->lora, s->rstd, s->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) loom_free(bufs[i]);
    for (int i = 0; s->dora && i < m->cfg.n_layers * LOOM_LORA_N; i++) free(s->dora[i]);
    free(s->dora);
}

/* DoRA's factors m / n of every adapted linear, once: the adapters do not
 * change while generating. */
static loom_status dora_factors(loom_llama *m, scratch *s) {
    s->dora = calloc((size_t)m->cfg.n_layers * LOOM_LORA_N, sizeof *s->dora);
    if (!s->dora) return loom_error(LOOM_ERR_NOMEM, "generate: out of memory");
    for (int l = 0; l < m->cfg.n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N; t++) {
            const loom_param *mag = m->layers[l].lora_m[t];
            if (!mag) continue;
            size_t out = (size_t)loom_param_numel(mag);
            float *f = s->dora[l * LOOM_LORA_N + t] = malloc(out * sizeof *f + 1);
            float *n = malloc(out * sizeof *n + 1);
            loom_status st = f && n ? loom_llama_dora_norms(m, l, (loom_lora_target)t, n)
                                    : loom_error(LOOM_ERR_NOMEM, "generate: out of memory");
            if (st == LOOM_OK) {
                loom_convert(f, LOOM_F32, loom_tensor_data(mag->tensor), mag->tensor->dtype, out); /* as training */
                for (size_t o = 0; o < out; o++) f[o] /= n[o];
            }
            free(n);
            LOOM_TRY(st);
        }
    return LOOM_OK;
}

/* A cache for cap positions, scratch for T tokens at once. */
static loom_status state_init(loom_llama *m, int T, int cap, kv_cache *c, scratch *s) {
    const loom_llama_config *cfg = &m->cfg;
    loom_dtype dt = m->prec.compute;
    size_t C = (size_t)cfg->dim, HS = (size_t)loom_llama_head_dim(cfg), F = (size_t)cfg->ffn_dim;
    size_t Q = (size_t)cfg->n_heads * HS, KV = (size_t)cfg->n_kv_heads * HS;
    memset(c, 0, sizeof *c);
    memset(s, 0, sizeof *s);
    c->k = calloc((size_t)cfg->n_layers, sizeof *c->k);
    c->v = calloc((size_t)cfg->n_layers, sizeof *c->v);
    c->cap = cap;
    int ok = c->k && c->v;
    for (int l = 0; ok && l < cfg->n_layers; l++) {
        c->k[l] = loom_alloc((size_t)cap * KV * ELT(dt), LOOM_MEM_ACTIVATIONS);
        c->v[l] = loom_alloc((size_t)cap * KV * ELT(dt), LOOM_MEM_ACTIVATIONS);
        ok = c->k[l] && c->v[l];
    }
    size_t t = (size_t)T;
    void **bufs[] = {&s->x, &s->h, &s->o, &s->q, &s->att}; /* the last two (T, heads x head size) */
    for (size_t i = 0; ok && i < sizeof bufs / sizeof bufs[0]; i++)
        ok = (*bufs[i] = loom_alloc(t * (i < 3 ? C : Q) * ELT(dt), LOOM_MEM_WORKSPACE)) != NULL;
    if (ok) ok = (s->g = loom_alloc(t * F * ELT(dt), LOOM_MEM_WORKSPACE)) && (s->u = loom_alloc(t * F * ELT(dt), LOOM_MEM_WORKSPACE));
    if (ok) ok = (s->logits = loom_alloc((size_t)cfg->vocab_size * sizeof(float), LOOM_MEM_WORKSPACE)) != NULL;
    if (ok) ok = (s->rstd = loom_alloc(t * sizeof(float), LOOM_MEM_WORKSPACE)) != NULL;
    if (ok && m->lora.rank) ok = (s->lora = loom_alloc(t * (size_t)m->lora.rank * ELT(dt), LOOM_MEM_WORKSPACE)) != NULL;
    if (!ok) {
        state_free(m, c, s);
        return loom_error(LOOM_ERR_NOMEM, "generate: out of memory for the KV cache");
    }
    loom_status st = m->lora.dora ? dora_factors(m, s) : LOOM_OK;
    if (st != LOOM_OK) state_free(m, c, s);
    return st;
}

/* The k-th largest of p[0 .. V) (non-negative floats, at most 1), exactly:
 * the largest t with at least k values >= t, found by bisecting float bit
 * patterns, which order as the values do. No allocation, 31 passes. */
static float kth_largest(const float *p, int V, int k) {
    uint32_t lo = 0, hi = 0x3F800000u; /* 0.0f .. 1.0f; every value is >= 0.0f */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;
        float t;
        memcpy(&t, &mid, sizeof t);
        int c = 0;
        for (int i = 0; i < V; i++) c += p[i] >= t;
        if (c >= k) lo = mid;
        else hi = mid - 1;
    }
    float t;
    memcpy(&t, &lo, sizeof t);
    return t;
}

/* Sample from logits: greedy, or temperature + top-k + nucleus (top-p) +
 * min-p, in Hugging Face's order. */
int32_t loom_sample(float *logits, int V, const loom_sampler *sp, uint64_t counter) {
    if (sp->vocab_limit > 0 && sp->vocab_limit < V) V = sp->vocab_limit; /* ids past it cannot be decoded */
    int best = 0;
    for (int i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;
    if (sp->temperature <= 0.0f) return best;
    const float mx = logits[best]; /* read once: the loop overwrites logits[best] */
    double sum = 0.0;
    for (int i = 0; i < V; i++) {
        logits[i] = expf((logits[i] - mx) / sp->temperature);
        sum += logits[i];
    }
    uint32_t r[4];
    loom_philox4x32(sp->seed, counter, r);
    double u = loom_u32_to_unit(r[0]);
    float top_p = sp->top_p > 0.0f && sp->top_p < 1.0f ? sp->top_p : 1.0f;
    /* Nucleus: keep the most probable tokens up to mass top_p; draw within them.
     * Sorted selection by repeated max is fine for V of a few thousand at
     * generation speed only when top_p is small, so threshold instead. */
    double kept = sum;
    float cut = 0.0f;
    if (sp->top_k > 0 && sp->top_k < V) {
        cut = kth_largest(logits, V, sp->top_k);
        kept = 0.0;
        for (int i = 0; i < V; i++) if (logits[i] >= cut) kept += logits[i];
    }
    if (top_p < 1.0f) {
        /* Bisect a probability threshold whose kept mass is >= top_p of what
         * top-k kept. */
        float lo = cut, hi = 1.0f;
        for (int it = 0; it < 40; it++) {
            float mid = 0.5f * (lo + hi);
            double mass = 0.0;
            for (int i = 0; i < V; i++) if (logits[i] >= mid) mass += logits[i];
            if (mass / kept >= top_p) lo = mid; else hi = mid;
        }
        cut = lo;
        kept = 0.0;
        for (int i = 0; i < V; i++) if (logits[i] >= cut) kept += logits[i];
    }
    /* min-p: probabilities at least min_p times the largest. The values are
     * exp((logit - max) / T), the largest 1, so that is the value min_p. */
    if (sp->min_p > cut) {
        cut = sp->min_p;
        kept = 0.0;
        for (int i = 0; i < V; i++) if (logits[i] >= cut) kept += logits[i];
    }
    /* The first id whose running mass passes u * kept: strictly, so a draw
     * of u = 0 cannot land on a token whose probability underflowed to 0. */
    double target = u * kept, acc = 0.0;
    for (int i = 0; i < V; i++) {
        if (logits[i] < cut) continue;
        acc += logits[i];
        if (acc > target) return i;
    }
    return best;
}

static loom_status check_tokens(const loom_llama *m, const int32_t *t, int n) {
    if (m->tp_size > 1) /* the KV-cache path works on whole weights */
        return loom_error(LOOM_ERR_INVALID, "generate: the model is one of %d tensor-parallel shards; generate from "
                          "the saved model directory instead", m->tp_size);
    if (n <= 0) return loom_error(LOOM_ERR_INVALID, "generate: the prompt is empty");
    if (n > m->cfg.max_seq)
        return loom_error(LOOM_ERR_INVALID, "generate: the prompt has %d tokens, the model's context is %d", n,
                          m->cfg.max_seq);
    for (int i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= m->cfg.vocab_size)
            return loom_error(LOOM_ERR_INVALID, "generate: token %d at %d is outside the vocabulary", t[i], i);
    return LOOM_OK;
}

loom_status loom_llama_next_logits(loom_llama *m, const int32_t *tokens, int n, float *logits) {
    LOOM_TRY(check_tokens(m, tokens, n));
    kv_cache c;
    scratch s;
    LOOM_TRY(state_init(m, n, n, &c, &s));
    loom_status st = forward_tokens(m, &c, &s, tokens, n);
    if (st == LOOM_OK) memcpy(logits, s.logits, (size_t)m->cfg.vocab_size * sizeof(float));
    state_free(m, &c, &s);
    return st;
}

loom_status loom_llama_generate(loom_llama *m, const int32_t *prompt, int n_prompt, int n_new,
                                const loom_sampler *sampler, int stop_token, int32_t *out, int *n_out) {
    int32_t stop = stop_token;
    return loom_llama_generate_until(m, prompt, n_prompt, n_new, sampler, &stop, stop_token >= 0 ? 1 : 0, out, n_out);
}

loom_status loom_llama_generate_until(loom_llama *m, const int32_t *prompt, int n_prompt, int n_new,
                                      const loom_sampler *sampler, const int32_t *stops, int n_stops, int32_t *out,
                                      int *n_out) {
    *n_out = 0;
    if (n_stops < 0 || (n_stops && !stops))
        return loom_error(LOOM_ERR_INVALID, "generate: %d stop tokens and no array of them", n_stops);
    LOOM_TRY(check_tokens(m, prompt, n_prompt));
    if (!sampler || !(sampler->temperature >= 0.0f) || !isfinite(sampler->temperature) || isnan(sampler->top_p) ||
        !(sampler->min_p >= 0.0f && sampler->min_p <= 1.0f))
        return loom_error(LOOM_ERR_INVALID, "generate: the sampler's temperature must be a finite number >= 0 (0: "
                          "greedy), its top_p a number and its min_p in [0, 1], got %g, %g and %g",
                          sampler ? (double)sampler->temperature : 0.0, sampler ? (double)sampler->top_p : 0.0,
                          sampler ? (double)sampler->min_p : 0.0);
    float rp = sampler->repetition_penalty;
    if (!(rp >= 0.0f) || !isfinite(rp))
        return loom_error(LOOM_ERR_INVALID, "generate: the sampler's repetition_penalty must be a finite number > 0 "
                          "(0 or 1: none), got %g", (double)rp);
    /* The ids seen so far (the prompt's, then each output's), for the penalty. */
    unsigned char *seen = rp > 0.0f && rp != 1.0f ? calloc((size_t)m->cfg.vocab_size, 1) : NULL;
    if (rp > 0.0f && rp != 1.0f && !seen) return loom_error(LOOM_ERR_NOMEM, "generate: out of memory");
    for (int i = 0; seen && i < n_prompt; i++) seen[prompt[i]] = 1;
    kv_cache c;
    scratch s;
    /* The last new token is sampled, never run: n_prompt + n_new - 1
     * positions are the most the cache can take, and max_seq. */
    long long reach = (long long)n_prompt + (n_new > 1 ? n_new - 1 : 0);
    int cap = reach < m->cfg.max_seq ? (int)reach : m->cfg.max_seq;
    /* longrope: the step that first passes the original context runs every
     * token again, all with the long factors, into an emptied cache, as
     * Hugging Face's Phi-3 drops its cache there (prepare_inputs_for_generation);
     * the scratch then holds that many tokens, and `all` the tokens so far. */
    int orig = m->cfg.rope_original_max_pos;
    int restart = m->cfg.rope_type == LOOM_ROPE_LONGROPE && n_prompt <= orig && cap > orig;
    int32_t *all = restart ? malloc((size_t)cap * sizeof *all) : NULL;
    loom_status st = restart && !all ? loom_error(LOOM_ERR_NOMEM, "generate: out of memory") : LOOM_OK;
    if (st == LOOM_OK) st = state_init(m, restart ? orig + 1 : n_prompt, cap, &c, &s);
    if (st != LOOM_OK) {
        free(all);
        free(seen);
        return st;
    }
    if (all) memcpy(all, prompt, (size_t)n_prompt * sizeof *all);
    st = forward_tokens(m, &c, &s, prompt, n_prompt);
    for (int i = 0; i < n_new && st == LOOM_OK; i++) {
        for (int v = 0; v < m->cfg.vocab_size; v++)
            if (!isfinite(s.logits[v])) {
                st = loom_error(LOOM_ERR_NUMERIC, "generate: the logits for token %d hold %g (at id %d): the model "
                                "overflows in this precision (with fp16, try fp32 or bf16) or its weights are broken",
                                i + 1, (double)s.logits[v], v);
                break;
            }
        if (st != LOOM_OK) break;
        for (int v = 0; seen && v < m->cfg.vocab_size; v++) /* Hugging Face's RepetitionPenaltyLogitsProcessor */
            if (seen[v]) s.logits[v] = s.logits[v] < 0.0f ? s.logits[v] * rp : s.logits[v] / rp;
        int32_t next = loom_sample(s.logits, m->cfg.vocab_size, sampler, (uint64_t)i);
        if (seen) seen[next] = 1;
        out[(*n_out)++] = next;
        int stopped = 0;
        for (int k = 0; k < n_stops; k++) stopped |= next == stops[k];
        if (stopped || i + 1 == n_new || c.len >= c.cap) break;
        if (all) all[c.len] = next;
        if (all && c.len == orig) { /* the cache's keys rotated with the short factors: run them all again */
            c.len = 0;
            st = forward_tokens(m, &c, &s, all, orig + 1);
        } else {
            st = forward_tokens(m, &c, &s, &next, 1);
        }
    }
    state_free(m, &c, &s);
    free(all);
    free(seen);
    return st;
}
