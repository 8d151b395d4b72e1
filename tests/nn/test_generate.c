/*
 * test_generate.c — KV-cache inference against the training forward: the
 * next-token logits from the cache path equal the last row of the full
 * forward's logits, one-pass prompt processing equals token-by-token, and
 * greedy generation picks the argmax of the full forward at every step
 * (with sliding windows too).
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

static int bias_next;     /* the next model has the attention's biases: 1 Qwen 2's (q, k, v), 2 LLaMA's (and o) */
static int head_dim_next; /* and heads of this size (0: dim / heads) */
static int qk_norm_next;  /* and Qwen 3's norms of each query and key head (drawn around 1) */
static int gemma_next;    /* and Gemma's norms (1 + weight, weights drawn around 0), scaled embeddings, GELU */
static int granite_next;  /* and Granite's multipliers */
static int gemma2_next;   /* and Gemma 2's (with gemma_next): norms of the outputs, softcaps, its scale; with
                          * qk_norm_next Gemma 3's (a window on every other block, a local RoPE base) */

static loom_llama *model_with_context(loom_dtype dt, int tie, int max_seq) {
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = 32; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2; c.ffn_dim = 48; c.vocab_size = 50;
    c.max_seq = max_seq; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f; c.tie_embeddings = tie;
    c.qkv_bias = bias_next > 0;
    c.o_bias = bias_next > 1;
    c.head_dim = head_dim_next;
    c.qk_norm = qk_norm_next;
    c.norm_unit_offset = c.scale_embeddings = gemma_next;
    c.act = gemma_next ? LOOM_ACT_GELU_TANH : LOOM_ACT_SILU;
    c.post_norms = gemma2_next;
    c.attn_softcap = gemma2_next ? 2.0f : 0.0f;
    c.final_softcap = gemma2_next ? 4.0f : 0.0f;
    c.query_pre_attn_scalar = gemma2_next ? 10.0f : 0.0f;
    if (gemma2_next && qk_norm_next) { /* Gemma 3's: a window, and a local RoPE base on its blocks */
        c.sliding_window = 4;
        c.window_global_interval = 2;
        c.rope_local_theta = 50.0f; /* far from the global 10000 */
    }
    if (granite_next) {
        c.embedding_multiplier = 12.0f;
        c.residual_multiplier = 0.22f;
        c.attention_multiplier = 0.5f;
        c.logits_scaling = 8.0f;
    }
    loom_llama *m;
    loom_precision p = {dt, 0};
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    loom_llama_init_weights(m, 99);
    /* Larger weights than init so logits are far from uniform; biases drawn (init's are zero). */
    for (int i = 0; i < m->n_params; i++) {
        loom_param *q = m->params[i];
        float *w = loom_param_master(q);
        if (strstr(q->name, ".bias")) tu_fill_uniform(w, (size_t)loom_param_numel(q), -1.0f, 1.0f, 300 + (uint64_t)i);
        if (strstr(q->name, "_norm.weight") && strstr(q->name, "self_attn"))
            tu_fill_uniform(w, (size_t)loom_param_numel(q), 0.5f, 1.5f, 400 + (uint64_t)i);
        else if (strstr(q->name, "norm.weight") && gemma_next) /* init's 0: 1 + w is 1 */
            tu_fill_uniform(w, (size_t)loom_param_numel(q), -0.5f, 0.5f, 500 + (uint64_t)i);
        for (int64_t k = 0; k < loom_param_numel(q); k++) w[k] *= q->tensor->ndim == 2 ? 20.0f : 1.0f;
        loom_param_sync_from_master(q);
    }
    return m;
}

static loom_llama *small_model(loom_dtype dt, int tie) { return model_with_context(dt, tie, 24); }

/* Logits of the full (training) forward at position n-1. */
static void full_logits(loom_llama *m, const int32_t *tok, int n, float *out) {
    loom_tensor *logits = NULL;
    loom_no_grad_enter();
    assert_int_equal(loom_llama_forward(m, tok, NULL, 1, n, NULL, &logits), LOOM_OK);
    loom_no_grad_exit();
    int V = m->cfg.vocab_size;
    float *all = malloc((size_t)(n * V) * sizeof *all);
    loom_tensor_read_f32(logits, all);
    memcpy(out, all + (size_t)(n - 1) * (size_t)V, (size_t)V * sizeof *out);
    free(all);
    loom_tensor_release(logits);
}

/* The cache path's next-token logits after tok[0 .. n) equal the full
 * forward's, for n = 1, 7, 13, 19. */
static void assert_cache_matches(loom_llama *m, const int32_t *tok) {
    float a[50], b[50];
    for (int n = 1; n <= 19; n += 6) {
        full_logits(m, tok, n, a);
        assert_int_equal(loom_llama_next_logits(m, tok, n, b), LOOM_OK);
        TU_ASSERT_CLOSE(b, a, 50, 1e-4, 1e-4);
    }
}

static void test_cache_matches_forward(void **state) {
    (void)state;
    for (int tie = 0; tie <= 12; tie++) {
        bias_next = tie > 2 && tie < 7 ? (tie >= 5 ? 2 : tie - 2) : 0; /* 3: Qwen 2's biases, 4-6: attention_bias */
        head_dim_next = tie >= 5 ? 12 : 0; /* 5 on: heads of 12 beside a dim of 32 (4 x 12 = 48) */
        qk_norm_next = tie == 6;           /* 6: Qwen 3's q/k norms */
        gemma_next = tie == 7 || tie == 11; /* 7: Gemma's model, tied; 11: Gemma 2's */
        gemma2_next = tie == 11;
        granite_next = tie == 8;           /* 8: Granite's multipliers */
        loom_llama *m = small_model(LOOM_F32, tie & 1);
        bias_next = head_dim_next = qk_norm_next = gemma_next = granite_next = gemma2_next = 0;
        if (tie == 10) m->cfg.nope_interval = 2; /* SmolLM3's: the second block without RoPE */
        if (tie == 12) { /* Phi-4-mini's rotary part: 6 of each head of 12 */
            m->cfg.fused_proj = 1;
            m->cfg.partial_rotary_factor = 0.5f;
        }
        if (tie == 9) { /* Phi-3's longrope: its short factors and attention factor, up to its original context */
            m->cfg.rope_type = LOOM_ROPE_LONGROPE;
            m->cfg.rope_n_ext = loom_llama_head_dim(&m->cfg) / 2;
            for (int i = 0; i < m->cfg.rope_n_ext; i++) m->cfg.rope_short[i] = m->cfg.rope_long[i] = 1.0f + 0.7f * (float)i;
            m->cfg.rope_attention_factor = 1.25f;
            m->cfg.rope_factor = 4.0f;
            m->cfg.rope_original_max_pos = 24;
        }
        if (tie == 2) { /* Llama 3.1's RoPE scaling: HS 8 has a kept, a blended and two divided frequencies */
            m->cfg.rope_type = LOOM_ROPE_LLAMA3;
            m->cfg.rope_factor = 8.0f;
            m->cfg.rope_low_freq_factor = 1.0f;
            m->cfg.rope_high_freq_factor = 4.0f;
            m->cfg.rope_original_max_pos = 64;
        }
        int32_t tok[20];
        for (int i = 0; i < 20; i++) tok[i] = (i * 7 + 3) % 50;
        assert_cache_matches(m, tok);
        loom_llama_free(m);
    }
}

/* longrope (Phi-3's) past its original context: a forward over more
 * positions than the original rotates every position with the long
 * factors (as Hugging Face's longrope update does), one within it with the
 * short; the training forward and the cache path's prefill alike, each the
 * bits of a model whose only factors are those. Greedy generation across
 * the original context picks what the full forward does at every step:
 * the short factors' picks within it (not all the long ones'), and past it
 * the long factors' (the step that passes it runs the cache again, as
 * Hugging Face's Phi-3 drops its cache there). */
static void test_longrope_long_factors(void **state) {
    (void)state;
    loom_llama *m = small_model(LOOM_F32, 0), *one = small_model(LOOM_F32, 0); /* the same weights */
    m->cfg.rope_type = LOOM_ROPE_LONGROPE;
    m->cfg.rope_n_ext = loom_llama_head_dim(&m->cfg) / 2;
    for (int i = 0; i < m->cfg.rope_n_ext; i++) {
        m->cfg.rope_short[i] = 1.0f + 0.7f * (float)i;
        m->cfg.rope_long[i] = 1.0f + 5.0f * (float)i;
    }
    m->cfg.rope_attention_factor = 1.25f;
    m->cfg.rope_factor = 3.0f;
    m->cfg.rope_original_max_pos = 8;
    assert_int_equal(loom_llama_config_validate(&m->cfg), LOOM_OK);
    int32_t tok[20], seq[24] = {5, 17, 2};
    for (int i = 0; i < 20; i++) tok[i] = (i * 7 + 3) % 50;
    float a[50], b[50];
    for (int k = 0; k < 2; k++) { /* the short model (n = 8), then the long one (n = 12) */
        int n = k ? 12 : 8;
        one->cfg = m->cfg;
        one->cfg.rope_original_max_pos = 24; /* never past it */
        if (k) memcpy(one->cfg.rope_short, m->cfg.rope_long, sizeof m->cfg.rope_long);
        full_logits(m, tok, n, a);
        full_logits(one, tok, n, b);
        assert_true(tu_bits_equal(a, b, sizeof a, "longrope forward"));
        assert_int_equal(loom_llama_next_logits(m, tok, n, a), LOOM_OK); /* one prefill call */
        TU_ASSERT_CLOSE(a, b, 50, 1e-4, 1e-4);
    }
    full_logits(m, tok, 12, a); /* and the long factors are not the short ones here */
    loom_llama_config long_cfg = one->cfg;
    memcpy(one->cfg.rope_short, m->cfg.rope_short, sizeof m->cfg.rope_short);
    full_logits(one, tok, 12, b);
    assert_false(tu_bits_equal(a, b, sizeof a, NULL));
    one->cfg = long_cfg; /* the long factors' model again */
    int32_t out[12];
    int n_out = 0;
    loom_sampler greedy = {0.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, seq, 3, 12, &greedy, -1, out, &n_out), LOOM_OK);
    assert_int_equal(n_out, 12);
    int differ = 0;
    for (int i = 0; i < 12; i++) { /* pick i is made at position 2 + i, from 3 + i tokens */
        full_logits(m, seq, 3 + i, a); /* the short factors up to 8 tokens, the long ones past them */
        full_logits(one, seq, 3 + i, b); /* the long ones throughout */
        int best = 0, best_long = 0;
        for (int v = 1; v < 50; v++) {
            if (a[v] > a[best]) best = v;
            if (b[v] > b[best_long]) best_long = v;
        }
        assert_int_equal(out[i], best);
        if (3 + i > 8) assert_int_equal(out[i], best_long);
        else differ += out[i] != best_long; /* within the original context, not the long factors' picks */
        seq[3 + i] = out[i];
    }
    assert_true(differ > 0);
    loom_llama_free(m);
    loom_llama_free(one);
}

/* Sliding windows (Mistral's on every block; Qwen's from its second block;
 * Gemma 2's on its first of two; Gemma 3's, whose windowed block rotates
 * with a local base, with q/k norms), each shorter than the text: the cache
 * path's prefill equals the full forward, greedy generation one token at a
 * time (queries past the cache's first keys) picks the full forward's
 * argmax at every step, and the window changes the logits (it bites). */
static void test_window_cache(void **state) {
    (void)state;
    for (int kind = 0; kind < 4; kind++) {
        bias_next = kind == 1; /* Qwen 2's biases */
        gemma_next = gemma2_next = kind >= 2;
        qk_norm_next = kind == 3; /* Gemma 3's */
        loom_llama *m = small_model(LOOM_F32, kind == 2);
        bias_next = gemma_next = gemma2_next = qk_norm_next = 0;
        m->cfg.sliding_window = kind == 0 ? 3 : kind == 1 ? 2 : 4;
        m->cfg.window_from = kind == 1;
        m->cfg.window_global_interval = kind >= 2 ? 2 : 0;
        assert_int_equal(loom_llama_config_validate(&m->cfg), LOOM_OK);
        int32_t tok[20], seq[24] = {5, 17, 2};
        for (int i = 0; i < 20; i++) tok[i] = (i * 7 + 3) % 50;
        assert_cache_matches(m, tok);
        float a[50], b[50];
        full_logits(m, tok, 19, a);
        loom_llama_config with = m->cfg;
        m->cfg.sliding_window = m->cfg.window_from = m->cfg.window_global_interval = 0;
        m->cfg.rope_local_theta = 0.0f;
        full_logits(m, tok, 19, b);
        assert_false(tu_bits_equal(a, b, sizeof a, NULL));
        m->cfg = with;
        int32_t out[16];
        int n_out = 0;
        loom_sampler greedy = {0.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
        assert_int_equal(loom_llama_generate(m, seq, 3, 12, &greedy, -1, out, &n_out), LOOM_OK);
        assert_int_equal(n_out, 12);
        for (int i = 0; i < n_out; i++) {
            full_logits(m, seq, 3 + i, a);
            int best = 0;
            for (int v = 1; v < 50; v++) if (a[v] > a[best]) best = v;
            assert_int_equal(out[i], best);
            seq[3 + i] = out[i];
        }
        loom_llama_free(m);
    }
}

/* Hugging Face's repetition penalty: each greedy pick is the argmax of the
 * full forward's logits with those of every id seen so far (prompt and
 * output) divided by the penalty when positive, multiplied when negative;
 * the picks differ from the unpenalized ones (the test reaches it); a
 * penalty that is not a positive number is refused. */
static void test_repetition_penalty(void **state) {
    (void)state;
    loom_llama *m = small_model(LOOM_F32, 0);
    int32_t seq[24] = {5, 17, 2};
    int n_prompt = 3, n_out = 0, n_plain = 0;
    int32_t out[16], plain[16];
    loom_sampler pen = {0.0f, 1.0f, 1, 0, 0, 1.5f, 0.0f}, none = {0.0f, 1.0f, 1, 0, 0, 1.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, seq, n_prompt, 12, &pen, -1, out, &n_out), LOOM_OK);
    assert_int_equal(loom_llama_generate(m, seq, n_prompt, 12, &none, -1, plain, &n_plain), LOOM_OK);
    assert_int_equal(n_out, 12);
    assert_true(memcmp(out, plain, sizeof out) != 0);
    float logits[50];
    unsigned char seen[50] = {0};
    for (int i = 0; i < n_prompt; i++) seen[seq[i]] = 1;
    for (int i = 0; i < n_out; i++) {
        full_logits(m, seq, n_prompt + i, logits);
        for (int v = 0; v < 50; v++)
            if (seen[v]) logits[v] = logits[v] < 0.0f ? logits[v] * 1.5f : logits[v] / 1.5f;
        int best = 0;
        for (int v = 1; v < 50; v++) if (logits[v] > logits[best]) best = v;
        assert_int_equal(out[i], best);
        seq[n_prompt + i] = out[i];
        seen[out[i]] = 1;
    }
    loom_sampler bad = {0.0f, 1.0f, 1, 0, 0, -1.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, seq, n_prompt, 4, &bad, -1, out, &n_out), LOOM_ERR_INVALID);
    bad.repetition_penalty = NAN;
    assert_int_equal(loom_llama_generate(m, seq, n_prompt, 4, &bad, -1, out, &n_out), LOOM_ERR_INVALID);
    loom_llama_free(m);
}

static void test_greedy_matches_argmax(void **state) {
    (void)state;
    loom_llama *m = small_model(LOOM_F32, 0);
    int32_t seq[24] = {5, 17, 2};
    int n_prompt = 3, n_out = 0;
    int32_t out[16];
    loom_sampler greedy = {0.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, seq, n_prompt, 12, &greedy, -1, out, &n_out), LOOM_OK);
    assert_int_equal(n_out, 12);
    float logits[50];
    for (int i = 0; i < n_out; i++) {
        full_logits(m, seq, n_prompt + i, logits);
        int best = 0;
        for (int v = 1; v < 50; v++) if (logits[v] > logits[best]) best = v;
        assert_int_equal(out[i], best);
        seq[n_prompt + i] = out[i];
    }
    /* Stops: the first generated id that is one of them ends the text, and
     * is its last id; the ids before it are the unstopped run's. */
    int32_t until[16], stops[2] = {49, out[4]};
    int first = 0;
    while (out[first] != stops[0] && out[first] != stops[1]) first++; /* at most 4 */
    int n_until = 0;
    assert_int_equal(loom_llama_generate_until(m, seq, n_prompt, 12, &greedy, stops, 2, until, &n_until), LOOM_OK);
    assert_int_equal(n_until, first + 1);
    assert_memory_equal(until, out, (size_t)n_until * sizeof *until);
    assert_int_equal(loom_llama_generate_until(m, seq, n_prompt, 12, &greedy, NULL, 0, until, &n_until), LOOM_OK);
    assert_int_equal(n_until, 12);
    assert_int_equal(loom_llama_generate_until(m, seq, n_prompt, 12, &greedy, NULL, -1, until, &n_until),
                     LOOM_ERR_INVALID);
    /* Sampling is reproducible from the seed and stays in the vocabulary. */
    loom_sampler hot = {1.0f, 0.9f, 42, 0, 0, 0.0f, 0.0f};
    int32_t s1[10], s2[10];
    int n1, n2;
    assert_int_equal(loom_llama_generate(m, seq, 3, 10, &hot, -1, s1, &n1), LOOM_OK);
    assert_int_equal(loom_llama_generate(m, seq, 3, 10, &hot, -1, s2, &n2), LOOM_OK);
    assert_int_equal(n1, n2);
    assert_memory_equal(s1, s2, sizeof s1);
    for (int i = 0; i < n1; i++) assert_true(s1[i] >= 0 && s1[i] < 50);
    /* A vocab limit (a tokenizer smaller than the model) keeps every id below
     * it, greedy and sampled; unlimited runs go past it, so this can fail. */
    int above = 0;
    for (int i = 0; i < n1; i++) above |= s1[i] >= 20;
    for (int i = 0; i < 12; i++) above |= out[i] >= 20;
    assert_true(above);
    loom_sampler hot20 = {1.0f, 0.9f, 42, 20, 0, 0.0f, 0.0f}, greedy20 = {0.0f, 1.0f, 1, 20, 0, 0.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, seq, 3, 10, &hot20, -1, s1, &n1), LOOM_OK);
    for (int i = 0; i < n1; i++) assert_true(s1[i] >= 0 && s1[i] < 20);
    assert_int_equal(loom_llama_generate(m, seq, 3, 10, &greedy20, -1, s1, &n1), LOOM_OK);
    for (int i = 0; i < n1; i++) assert_true(s1[i] >= 0 && s1[i] < 20);
    /* Generation stops at the context length. */
    assert_int_equal(loom_llama_generate(m, seq, 20, 10, &greedy, -1, out, &n_out), LOOM_OK);
    assert_int_equal(n_out, 5); /* 20 + 4 more fill the 24 context; the 5th is sampled from position 23 */
    /* Bad prompts are errors, not crashes. */
    int32_t bad[2] = {3, 50};
    assert_int_equal(loom_llama_generate(m, bad, 2, 1, &greedy, -1, out, &n_out), LOOM_ERR_INVALID);
    assert_int_equal(loom_llama_generate(m, bad, 0, 1, &greedy, -1, out, &n_out), LOOM_ERR_INVALID);
    /* So are samplers that are not numbers (a NaN temperature was greedy without a word). */
    loom_sampler nan_t = {NAN, 0.9f, 1, 0, 0, 0.0f, 0.0f}, neg_t = {-1.0f, 0.9f, 1, 0, 0, 0.0f, 0.0f};
    loom_sampler inf_t = {INFINITY, 0.9f, 1, 0, 0, 0.0f, 0.0f}, nan_p = {1.0f, NAN, 1, 0, 0, 0.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, seq, 3, 1, &nan_t, -1, out, &n_out), LOOM_ERR_INVALID);
    assert_int_equal(loom_llama_generate(m, seq, 3, 1, &neg_t, -1, out, &n_out), LOOM_ERR_INVALID);
    assert_int_equal(loom_llama_generate(m, seq, 3, 1, &inf_t, -1, out, &n_out), LOOM_ERR_INVALID);
    assert_int_equal(loom_llama_generate(m, seq, 3, 1, &nan_p, -1, out, &n_out), LOOM_ERR_INVALID);
    loom_llama_free(m);
}

/* The sampler draws from softmax(logits / T): with logits {0, 5, 4} the
 * frequencies over many draws match exp(l / T) / sum (a sampler that
 * rescaled against a wrong maximum would favour id 2 here). */
static void test_sampling_distribution(void **state) {
    (void)state;
    const float temps[2] = {1.0f, 0.5f};
    for (int k = 0; k < 2; k++) {
        float T = temps[k];
        double e[3] = {exp(0.0 / T), exp(5.0 / T), exp(4.0 / T)}, z = e[0] + e[1] + e[2];
        loom_sampler sp = {T, 1.0f, 99, 0, 0, 0.0f, 0.0f};
        int count[3] = {0, 0, 0}, n = 20000;
        for (int i = 0; i < n; i++) {
            float logits[3] = {0.0f, 5.0f, 4.0f};
            int32_t id = loom_sample(logits, 3, &sp, (uint64_t)i);
            assert_true(id >= 0 && id < 3);
            count[id]++;
        }
        for (int v = 0; v < 3; v++) {
            double p = e[v] / z, f = (double)count[v] / n, tol = 4.0 * sqrt(p * (1.0 - p) / n) + 1e-3;
            if (fabs(f - p) > tol) {
                fprintf(stderr, "T %g: id %d drawn %.4f of the time, expected %.4f\n", T, v, f, p);
                fail();
            }
        }
    }
    /* A draw of exactly 0 (counter 16902731 under seed 1: the top 24 bits
     * of its first word are 0) still never picks a token of probability 0
     * (exp(-1002) is 0 in float) as the first kept id. */
    uint32_t r[4];
    loom_philox4x32(1, 16902731, r);
    assert_true(loom_u32_to_unit(r[0]) == 0.0f);
    loom_sampler full = {1.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
    float zero_first[4] = {-1000.0f, 2.0f, 1.0f, 0.0f};
    assert_int_equal(loom_sample(zero_first, 4, &full, 16902731), 1);
    /* top-p 0.8 at T = 1: the nucleus is {1} (mass 0.73) plus {2}; id 0 is cut. */
    loom_sampler nucleus = {1.0f, 0.8f, 7, 0, 0, 0.0f, 0.0f};
    for (int i = 0; i < 2000; i++) {
        float logits[3] = {0.0f, 5.0f, 4.0f};
        assert_true(loom_sample(logits, 3, &nucleus, (uint64_t)i) != 0);
    }
    /* Ties at the cut: probabilities 0.574, 0.211, 0.211, 0.004. top-p 0.6
     * needs id 0 and one of the tied pair; both are kept, id 3 never is.
     * top-p 0.5 is met by id 0 alone. */
    loom_sampler tied = {1.0f, 0.6f, 3, 0, 0, 0.0f, 0.0f}, head = {1.0f, 0.5f, 3, 0, 0, 0.0f, 0.0f};
    int drawn[4] = {0};
    for (int i = 0; i < 4000; i++) {
        float logits[4] = {5.0f, 4.0f, 4.0f, 0.0f}, again[4] = {5.0f, 4.0f, 4.0f, 0.0f};
        drawn[loom_sample(logits, 4, &tied, (uint64_t)i)]++;
        assert_int_equal(loom_sample(again, 4, &head, (uint64_t)i), 0);
    }
    assert_int_equal(drawn[3], 0);
    assert_true(drawn[1] > 700 && drawn[2] > 700); /* about 850 each */
    /* top-k: logits {0, 5, 4, 3, 1}, k = 2 keeps ids 1 and 2 only, drawn in
     * the ratio e^5 : e^4 (0.731 : 0.269); k = 3 with the third tied (two
     * logits of 3) keeps both tied ids; k = 1 is the argmax; k >= V cuts
     * nothing. With top-p 0.7 after k = 3, the nucleus of {1, 2, 3}
     * (0.665, 0.245, 0.090) needs ids 1 and 2. */
    int got[5] = {0}, n = 20000;
    loom_sampler k2 = {1.0f, 1.0f, 5, 0, 2, 0.0f, 0.0f}, k3 = {1.0f, 1.0f, 5, 0, 3, 0.0f, 0.0f}, k1 = {1.0f, 1.0f, 5, 0, 1, 0.0f, 0.0f};
    loom_sampler kv = {1.0f, 1.0f, 5, 0, 5, 0.0f, 0.0f}, none = {1.0f, 1.0f, 5, 0, 0, 0.0f, 0.0f}, k3p = {1.0f, 0.7f, 5, 0, 3, 0.0f, 0.0f};
    for (int i = 0; i < n; i++) {
        float a[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f}, b[5] = {0.0f, 5.0f, 4.0f, 3.0f, 3.0f};
        float c[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f}, d[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f};
        float e2[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f}, f2[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f};
        got[loom_sample(a, 5, &k2, (uint64_t)i)]++;
        int32_t t3 = loom_sample(b, 5, &k3, (uint64_t)i);
        assert_true(t3 >= 1); /* ids 1, 2, 3 and the tied 4 */
        assert_int_equal(loom_sample(c, 5, &k1, (uint64_t)i), 1);
        assert_int_equal(loom_sample(d, 5, &kv, (uint64_t)i), loom_sample(e2, 5, &none, (uint64_t)i));
        int32_t tp = loom_sample(f2, 5, &k3p, (uint64_t)i);
        assert_true(tp == 1 || tp == 2);
    }
    assert_int_equal(got[0] + got[3] + got[4], 0);
    double p1 = exp(5.0) / (exp(5.0) + exp(4.0)), f1 = (double)got[1] / n;
    assert_true(fabs(f1 - p1) < 4.0 * sqrt(p1 * (1.0 - p1) / n) + 1e-3);
    /* min-p: with logits {0, 5, 4, 3, 1} the probabilities are e^-1, e^-2,
     * e^-4, e^-5 of the largest (at T = 1): min_p 0.2 keeps ids 1 and 2
     * (drawn e^5 : e^4), 0.1 ids 1, 2 and 3, 1 the largest alone; at T = 2
     * (e^-0.5, e^-1, e^-2, e^-2.5) 0.2 keeps 1, 2 and 3. After top-p 0.9
     * (ids 1 and 2 hold 0.895: the nucleus takes 3 too), min_p 0.1 keeps
     * {1, 2, 3}, as Hugging Face's order does; min-p first would leave
     * {1, 2, 3} whose nucleus at 0.9 is {1, 2}. */
    loom_sampler mp2 = {1.0f, 1.0f, 5, 0, 0, 0.0f, 0.2f}, mp1 = {1.0f, 1.0f, 5, 0, 0, 0.0f, 0.1f};
    loom_sampler mp_all = {1.0f, 1.0f, 5, 0, 0, 0.0f, 1.0f}, mp_t2 = {2.0f, 1.0f, 5, 0, 0, 0.0f, 0.2f};
    loom_sampler mp_p = {1.0f, 0.9f, 5, 0, 0, 0.0f, 0.1f};
    int got2[5] = {0}, got1[5] = {0}, got_t2[5] = {0}, got_p[5] = {0};
    for (int i = 0; i < n; i++) {
        float a[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f}, b[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f};
        float c[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f}, d[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f};
        float e[5] = {0.0f, 5.0f, 4.0f, 3.0f, 1.0f};
        got2[loom_sample(a, 5, &mp2, (uint64_t)i)]++;
        got1[loom_sample(b, 5, &mp1, (uint64_t)i)]++;
        got_t2[loom_sample(d, 5, &mp_t2, (uint64_t)i)]++;
        got_p[loom_sample(e, 5, &mp_p, (uint64_t)i)]++;
        assert_int_equal(loom_sample(c, 5, &mp_all, (uint64_t)i), 1);
    }
    assert_true(got2[0] + got2[3] + got2[4] == 0 && got2[1] > 0 && got2[2] > 0);
    assert_true(fabs((double)got2[1] / n - p1) < 4.0 * sqrt(p1 * (1.0 - p1) / n) + 1e-3);
    assert_true(got1[0] + got1[4] == 0 && got1[3] > 0);
    assert_true(got_t2[0] + got_t2[4] == 0 && got_t2[3] > 0);
    assert_true(got_p[0] + got_p[4] == 0 && got_p[3] > 0);
    loom_sampler bad_mp = {1.0f, 1.0f, 5, 0, 0, 0.0f, 1.5f};
    int32_t tok[3] = {1, 2, 3}, o[2];
    int n_o;
    loom_llama *m = small_model(LOOM_F32, 0);
    assert_int_equal(loom_llama_generate(m, tok, 3, 2, &bad_mp, -1, o, &n_o), LOOM_ERR_INVALID);
    bad_mp.min_p = NAN;
    assert_int_equal(loom_llama_generate(m, tok, 3, 2, &bad_mp, -1, o, &n_o), LOOM_ERR_INVALID);
    loom_llama_free(m);
    int tied4 = 0;
    for (int i = 0; i < 4000; i++) {
        float b[5] = {0.0f, 5.0f, 4.0f, 3.0f, 3.0f};
        tied4 += loom_sample(b, 5, &k3, (uint64_t)i) == 4;
    }
    assert_true(tied4 > 100); /* a tied id at the cut is kept: about 4000 * 0.083 = 330 */
}

/* Logits that are not finite (an overflow, broken weights) end generation
 * with an error instead of sampling from NaN. */
static void test_nonfinite_logits(void **state) {
    (void)state;
    loom_llama *m = small_model(LOOM_F32, 0);
    loom_param *norm = m->final_norm;
    float *w = loom_param_master(norm);
    for (int64_t i = 0; i < loom_param_numel(norm); i++) w[i] = INFINITY;
    loom_param_sync_from_master(norm);
    int32_t prompt[3] = {5, 17, 2}, out[4];
    int n_out = -1;
    loom_sampler greedy = {0.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
    assert_int_equal(loom_llama_generate(m, prompt, 3, 4, &greedy, -1, out, &n_out), LOOM_ERR_NUMERIC);
    assert_non_null(strstr(loom_last_error(), "logits for token 1"));
    assert_int_equal(n_out, 0);
    loom_llama_free(m);
}

static void test_bf16_cache(void **state) {
    (void)state;
    loom_llama *m = small_model(LOOM_BF16, 0);
    int32_t tok[12];
    for (int i = 0; i < 12; i++) tok[i] = (i * 11 + 1) % 50;
    float a[50], b[50];
    full_logits(m, tok, 12, a);
    assert_int_equal(loom_llama_next_logits(m, tok, 12, b), LOOM_OK);
    /* Both paths round activations to bf16 at the same points except the
     * final logits (fp32 here, bf16 in the training forward): one bf16 ulp
     * of the logit scale plus accumulated rounding. */
    double scale = 0;
    for (int i = 0; i < 50; i++) scale = fmax(scale, fabs(a[i]));
    TU_ASSERT_CLOSE(b, a, 50, 0.02 * scale, 0.0);
    loom_llama_free(m);
}

/* The KV cache holds the positions a call reaches, not the model's whole
 * context: 3 + 5 tokens from a model with a context of 65536 take a few KiB
 * (the full cache would be 2 layers x 2 x 65536 x 16 floats = 16 MiB), and
 * give the tokens the same model with a short context gives. */
static void test_cache_sized_to_the_call(void **state) {
    (void)state;
    loom_llama *longctx = model_with_context(LOOM_F32, 0, 65536), *shortctx = small_model(LOOM_F32, 0);
    int32_t prompt[3] = {5, 17, 2}, a[5], b[5];
    int na = 0, nb = 0;
    loom_sampler greedy = {0.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
    loom_mem_reset_peak();
    loom_mem_stats before, after;
    loom_mem_get_stats(&before);
    assert_int_equal(loom_llama_generate(longctx, prompt, 3, 5, &greedy, -1, a, &na), LOOM_OK);
    loom_mem_get_stats(&after);
    size_t used = after.peak[LOOM_MEM_ACTIVATIONS] - before.current[LOOM_MEM_ACTIVATIONS];
    if (used > 64 * 1024) fprintf(stderr, "generate took %zu bytes of activations for 8 positions\n", used);
    assert_true(used <= 64 * 1024);
    assert_int_equal(loom_llama_generate(shortctx, prompt, 3, 5, &greedy, -1, b, &nb), LOOM_OK);
    assert_int_equal(na, 5);
    assert_int_equal(nb, 5);
    assert_memory_equal(a, b, sizeof a);
    float la[50], lb[50];
    assert_int_equal(loom_llama_next_logits(longctx, prompt, 3, la), LOOM_OK);
    assert_int_equal(loom_llama_next_logits(shortctx, prompt, 3, lb), LOOM_OK);
    assert_memory_equal(la, lb, sizeof la);
    loom_llama_free(longctx);
    loom_llama_free(shortctx);
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_matches_forward),
        cmocka_unit_test(test_greedy_matches_argmax),
        cmocka_unit_test(test_window_cache),
        cmocka_unit_test(test_longrope_long_factors),
        cmocka_unit_test(test_repetition_penalty),
        cmocka_unit_test(test_sampling_distribution),
        cmocka_unit_test(test_bf16_cache),
        cmocka_unit_test(test_nonfinite_logits),
        cmocka_unit_test(test_cache_sized_to_the_call),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
