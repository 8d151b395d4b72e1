/*
 * test_lora.c — LoRA adapters on the LLaMA model: the target list, the
 * refusals, a model that starts exactly at its base, frozen weights that
 * neither get a gradient nor move, the adapters' gradients against finite
 * differences, bit-identical gradients under every recompute mode, the
 * merged weights, and generation through the adapters.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

#define N_TOK 24 /* B 2 x T 12 */

static loom_llama_config config(void) {
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = 32; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2; c.ffn_dim = 48;
    c.vocab_size = 53; c.max_seq = 16; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    return c;
}

static int tie_next;  /* the next model ties its embeddings */
static int bias_next; /* the next model has biases on q, k, v and o (LLaMA's attention_bias), drawn */

static loom_llama *new_model(loom_precision prec) {
    loom_llama_config c = config();
    c.tie_embeddings = tie_next;
    c.qkv_bias = c.o_bias = bias_next;
    loom_llama *m;
    assert_int_equal(loom_llama_new(&c, prec, &m), LOOM_OK);
    loom_llama_init_weights(m, 31);
    for (int i = 0; bias_next && i < m->n_params; i++) { /* init's are zero */
        loom_param *q = m->params[i];
        if (!strstr(q->name, ".bias")) continue;
        tu_fill_uniform(loom_param_master(q), (size_t)loom_param_numel(q), -0.5f, 0.5f, 200 + (uint64_t)i);
        loom_param_sync_from_master(q);
    }
    /* Weights larger than init's, so that every linear moves the loss well
     * beyond fp32's rounding (the finite differences need it). */
    for (int i = 0; i < m->n_params; i++) {
        loom_param *q = m->params[i];
        float *w = loom_param_master(q);
        for (int64_t k = 0; k < loom_param_numel(q); k++) w[k] *= q->tensor->ndim == 2 ? 8.0f : 1.0f;
        loom_param_sync_from_master(q);
    }
    return m;
}

static int dora_next; /* the next adapters are DoRA's */

/* Adapters of rank 3, alpha 5 (a scale of 5/3) on `targets`, with B drawn
 * too (b_scale 0: left at zero, as loom_llama_add_lora makes it), and with
 * dora_next DoRA's magnitudes, each then moved by a factor in [0.5, 1.5)
 * (b_scale not 0: so that m / n is not 1). */
static void add_adapters_alpha(loom_llama *m, unsigned targets, float b_scale, float alpha) {
    loom_lora_config lc = {.rank = 3, .alpha = alpha, .targets = targets, .dora = dora_next};
    assert_int_equal(loom_llama_add_lora(m, &lc, 7), LOOM_OK);
    if (b_scale == 0.0f) return;
    for (int i = m->n_base; i < m->n_params; i++) {
        loom_param *p = m->params[i];
        int mag = strstr(p->name, "lora_magnitude_vector") != NULL;
        if (!strstr(p->name, "lora_B") && !mag) continue;
        size_t n = (size_t)loom_param_numel(p);
        float *v = malloc(n * sizeof *v), *u = malloc(n * sizeof *u);
        tu_fill_uniform(v, n, -b_scale, b_scale, 100 + (uint64_t)i);
        if (mag) {
            loom_param_get_f32(p, u);
            tu_fill_uniform(v, n, 0.5f, 1.5f, 100 + (uint64_t)i);
            for (size_t k = 0; k < n; k++) v[k] *= u[k];
        }
        assert_int_equal(loom_param_set_f32(p, v, (int64_t)n), LOOM_OK);
        free(v);
        free(u);
    }
}

static void add_adapters(loom_llama *m, unsigned targets, float b_scale) {
    add_adapters_alpha(m, targets, b_scale, 5.0f);
}

static void tokens(int32_t *tok, int32_t *tgt, int V) {
    float u[N_TOK];
    tu_fill_uniform(u, N_TOK, 0, 1, 5);
    for (int i = 0; i < N_TOK; i++) tok[i] = (int32_t)(u[i] * (float)V) % V;
    for (int i = 0; i < N_TOK; i++) tgt[i] = tok[(i + 1) % N_TOK];
}

static float loss_of(loom_llama *m, int grad, float **logits) {
    int32_t tok[N_TOK], tgt[N_TOK];
    tokens(tok, tgt, m->cfg.vocab_size);
    loom_rng_init(loom_rng_default(), 42); /* LoRA's dropout draws the same masks every time */
    loom_tensor *loss = NULL, *lg = NULL;
    if (!grad) loom_no_grad_enter();
    assert_int_equal(loom_llama_forward(m, tok, tgt, 2, N_TOK / 2, &loss, logits ? &lg : NULL), LOOM_OK);
    if (!grad) loom_no_grad_exit();
    float l = loom_tensor_get(loss, 0);
    if (grad) assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    loom_tensor_release(loss);
    if (logits) {
        *logits = malloc((size_t)loom_tensor_numel(lg) * sizeof **logits);
        loom_tensor_read_f32(lg, *logits);
        loom_tensor_release(lg);
    }
    return l;
}

static double eval_loss(loom_llama *m) { return loss_of(m, 0, NULL); }

/* The loss of a training forward (dropout on, the same masks each time:
 * the RNG starts alike), its graph dropped without a backward. */
static double train_loss(loom_llama *m) {
    int32_t tok[N_TOK], tgt[N_TOK];
    tokens(tok, tgt, m->cfg.vocab_size);
    loom_rng_init(loom_rng_default(), 42);
    loom_tensor *loss = NULL;
    assert_int_equal(loom_llama_forward(m, tok, tgt, 2, N_TOK / 2, &loss, NULL), LOOM_OK);
    double l = loom_tensor_get(loss, 0);
    loom_tensor_release(loss);
    loom_tape_clear();
    return l;
}

/* The relative error of p's largest gradient entry (*g_top) against the
 * central difference of loss(m) there (step 1e-2 on the fp32 master). */
static double fd_error(loom_llama *m, loom_param *p, double (*loss)(loom_llama *), float *g_top) {
    size_t n = (size_t)loom_param_numel(p), top = 0;
    float *g = malloc(n * sizeof *g), *w = loom_param_master(p);
    loom_param_read_grad(p, g);
    for (size_t k = 1; k < n; k++)
        if (fabsf(g[k]) > fabsf(g[top])) top = k;
    float keep = w[top], h = 1e-2f;
    double l[2];
    for (int side = 0; side < 2; side++) {
        w[top] = keep + (side ? -h : h);
        loom_param_sync_from_master(p);
        l[side] = loss(m);
    }
    w[top] = keep;
    loom_param_sync_from_master(p);
    double fd = (l[0] - l[1]) / (2.0 * h), err = fabs(fd - g[top]) / fabs(fd);
    if (err > 5e-3) fprintf(stderr, "%s[%zu]: backward %g, finite difference %g\n", p->name, top, g[top], fd);
    *g_top = g[top];
    free(g);
    return err;
}

static void test_targets(void **state) {
    (void)state;
    unsigned t;
    char buf[64];
    assert_int_equal(loom_lora_targets_parse("q,v", &t), LOOM_OK);
    assert_int_equal(t, (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_V));
    loom_lora_targets_format(t, buf, sizeof buf);
    assert_string_equal(buf, "q,v");
    assert_int_equal(loom_lora_targets_parse("all", &t), LOOM_OK);
    assert_int_equal(t, LOOM_LORA_ALL);
    loom_lora_targets_format(t, buf, sizeof buf);
    assert_string_equal(buf, "q,k,v,o,gate,up,down");
    assert_int_equal(loom_lora_targets_parse("down_proj,gate", &t), LOOM_OK);
    assert_int_equal(t, (1u << LOOM_LORA_DOWN) | (1u << LOOM_LORA_GATE));
    const char *bad[] = {"", "x", "q,", ",q", "q,,v", "qv", "Q"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(loom_lora_targets_parse(bad[i], &t), LOOM_ERR_INVALID);
        assert_non_null(strstr(loom_last_error(), "LoRA target"));
    }
    assert_string_equal(loom_lora_target_name(LOOM_LORA_UP), "up_proj");
}

static void test_refusals(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec);
    int n = m->n_params;
    const loom_lora_config bad[] = {
        {.rank = 0, .alpha = 1.0f, .targets = LOOM_LORA_ALL},
        {.rank = 33, .alpha = 1.0f, .targets = LOOM_LORA_ALL},
        {.rank = 2, .alpha = 0.0f, .targets = LOOM_LORA_ALL},
        {.rank = 2, .alpha = NAN, .targets = LOOM_LORA_ALL},
        {.rank = 2, .alpha = INFINITY, .targets = LOOM_LORA_ALL},
        {.rank = 2, .alpha = 1.0f, .targets = 0},
        {.rank = 2, .alpha = 1.0f, .targets = 1u << LOOM_LORA_N},
        {.rank = 2, .alpha = 1.0f, .targets = LOOM_LORA_ALL, .dropout = 1.0f},
        {.rank = 2, .alpha = 1.0f, .targets = LOOM_LORA_ALL, .dropout = -0.1f},
        {.rank = 2, .alpha = 1.0f, .targets = LOOM_LORA_ALL, .dropout = NAN},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(loom_llama_add_lora(m, &bad[i], 1), LOOM_ERR_INVALID);
        assert_int_equal(m->n_params, n); /* nothing added, nothing frozen */
        assert_int_equal(m->lora.rank, 0);
        for (int k = 0; k < n; k++) assert_true(m->params[k]->trainable && m->params[k]->grad);
    }
    loom_lora_config ok = {.rank = 2, .alpha = 4.0f, .targets = 1u << LOOM_LORA_V};
    assert_int_equal(loom_llama_add_lora(m, &ok, 1), LOOM_OK);
    assert_int_equal(m->n_params, n + 2 * m->cfg.n_layers);
    assert_int_equal(loom_llama_add_lora(m, &ok, 1), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "already"));
    loom_llama_free(m);
}

/* Frozen bf16 weights give up their fp32 master (4 of their 6 bytes) and
 * keep their values as bf16; fp16 ones keep the master. */
static void test_frozen_masters(void **state) {
    (void)state;
    loom_dtype dts[] = {LOOM_BF16, LOOM_F16};
    for (int d = 0; d < 2; d++) {
        loom_precision prec = {dts[d], 1};
        loom_llama *m = new_model(prec);
        int64_t frozen = loom_llama_n_weights(m);
        loom_mem_stats before, after;
        loom_mem_get_stats(&before);
        loom_lora_config lc = {.rank = 2, .alpha = 2.0f, .targets = 1u << LOOM_LORA_Q};
        assert_int_equal(loom_llama_add_lora(m, &lc, 3), LOOM_OK);
        loom_mem_get_stats(&after);
        int64_t adapters = loom_llama_n_weights(m) - frozen;
        /* adapters: compute copy + master + main_grad; frozen: minus the grads (and the bf16 masters) */
        int64_t params_delta = (int64_t)after.current[LOOM_MEM_PARAMS] - (int64_t)before.current[LOOM_MEM_PARAMS];
        int64_t want = adapters * (2 + 4) - (dts[d] == LOOM_BF16 ? frozen * 4 : 0);
        assert_int_equal(params_delta, want);
        for (int i = 0; i < m->n_base; i++) {
            loom_param *p = m->params[i];
            assert_int_equal(loom_param_has_master(p), dts[d] == LOOM_F16);
            size_t n = (size_t)loom_param_numel(p);
            float *v = malloc(n * sizeof *v), *w = malloc(n * sizeof *w);
            loom_param_get_f32(p, v);
            loom_convert(w, LOOM_F32, loom_tensor_data(p->tensor), p->tensor->dtype, n);
            if (dts[d] == LOOM_BF16) assert_memory_equal(v, w, n * sizeof *v); /* the compute copy, widened */
            /* set_f32 reaches the compute copy either way */
            for (size_t k = 0; k < n; k++) v[k] = 0.5f;
            assert_int_equal(loom_param_set_f32(p, v, (int64_t)n), LOOM_OK);
            loom_convert(w, LOOM_F32, loom_tensor_data(p->tensor), p->tensor->dtype, n);
            assert_true(w[0] == 0.5f && w[n - 1] == 0.5f);
            free(v);
            free(w);
        }
        loom_llama_free(m);
    }
}

/* loom_llama_new_lora: the model's own weights never take a gradient or
 * (bf16) a master, and with the same weights it computes what a model
 * given its adapters by loom_llama_add_lora computes, bit for bit. */
static void test_new_lora(void **state) {
    (void)state;
    loom_precision prec = {LOOM_BF16, 1};
    loom_llama *a = new_model(prec);
    add_adapters(a, LOOM_LORA_ALL, 0.0f);
    loom_llama_config c = config();
    loom_lora_config lc = {.rank = 3, .alpha = 5.0f, .targets = LOOM_LORA_ALL};
    loom_mem_stats before, after;
    loom_mem_get_stats(&before);
    loom_llama *b;
    assert_int_equal(loom_llama_new_lora(&c, prec, &lc, 7, &b), LOOM_OK);
    loom_mem_get_stats(&after);
    int64_t own = 0, adapters = 0;
    for (int i = 0; i < b->n_params; i++) *(i < b->n_base ? &own : &adapters) += loom_param_numel(b->params[i]);
    assert_int_equal((int64_t)(after.current[LOOM_MEM_PARAMS] - before.current[LOOM_MEM_PARAMS]),
                     own * 2 + adapters * (2 + 4));
    assert_int_equal((int64_t)(after.current[LOOM_MEM_GRADS] - before.current[LOOM_MEM_GRADS]), adapters * 4);
    assert_int_equal(b->n_params, a->n_params);
    assert_true(b->lora.rank == 3 && b->lora.alpha == 5.0f && b->lora.targets == LOOM_LORA_ALL);
    for (int i = 0; i < b->n_params; i++) {
        assert_string_equal(a->params[i]->name, b->params[i]->name);
        assert_int_equal(b->params[i]->trainable, i >= b->n_base);
        size_t n = (size_t)loom_param_numel(a->params[i]);
        float *v = malloc(n * sizeof *v);
        loom_param_get_f32(a->params[i], v);
        if (i < b->n_base) assert_int_equal(loom_param_set_f32(b->params[i], v, (int64_t)n), LOOM_OK);
        else assert_memory_equal(v, loom_param_master(b->params[i]), n * sizeof *v); /* the same A, the same B */
        free(v);
    }
    float *x, *y;
    float la = loss_of(a, 0, &x), lb = loss_of(b, 0, &y);
    assert_true(la == lb);
    assert_true(tu_bits_equal(x, y, (size_t)N_TOK * (size_t)c.vocab_size * sizeof *x, "logits"));
    free(x);
    free(y);
    loom_llama_free(b);
    loom_llama_free(a);
    loom_lora_config bad = {.rank = 0, .alpha = 1.0f, .targets = LOOM_LORA_ALL};
    assert_int_equal(loom_llama_new_lora(&c, prec, &bad, 7, &b), LOOM_ERR_INVALID);
    assert_null(b);
}

/* B starts at zero: the adapted model computes the base model's logits
 * and loss bit for bit, in fp32, bf16 and fp16, and with tied embeddings. */
static void test_starts_at_base(void **state) {
    (void)state;
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16, LOOM_BF16};
    for (int d = 0; d < 4; d++) {
        loom_precision prec = {dts[d], 1};
        tie_next = d == 3;
        loom_llama *base = new_model(prec), *m = new_model(prec);
        tie_next = 0;
        add_adapters(m, LOOM_LORA_ALL, 0.0f);
        float *a, *b;
        float la = loss_of(base, 0, &a), lb = loss_of(m, 0, &b);
        assert_true(la == lb);
        size_t n = (size_t)N_TOK * (size_t)m->cfg.vocab_size;
        assert_true(tu_bits_equal(a, b, n * sizeof *a, "logits"));
        free(a);
        free(b);
        loom_llama_free(base);
        loom_llama_free(m);
    }
}

/* Frozen weights: no gradient buffer, no moments, untouched by a step;
 * the audit passes; the adapters' gradients agree with central differences
 * of the loss (fp32, on each adapter's largest entries). */
static void test_frozen_and_finite_differences(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec);
    add_adapters(m, (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_O) | (1u << LOOM_LORA_UP) | (1u << LOOM_LORA_DOWN),
                 0.3f);
    for (int i = 0; i < m->n_params; i++) {
        assert_int_equal(m->params[i]->trainable, i >= m->n_base);
        assert_int_equal(m->params[i]->grad == NULL, i < m->n_base);
    }
    assert_null(m->layers[0].lora_a[LOOM_LORA_K]);
    assert_non_null(m->layers[1].lora_b[LOOM_LORA_DOWN]);
    loom_llama_zero_grad(m);
    loss_of(m, 1, NULL);
    assert_int_equal(loom_grad_audit(m->params, m->n_params, NULL, 0), LOOM_OK);
    float worst = 0.0f;
    for (int i = m->n_base; i < m->n_params; i++) {
        float g_top;
        double err = fd_error(m, m->params[i], eval_loss, &g_top);
        assert_true(fabsf(g_top) > 1e-4f); /* a gradient that means something */
        assert_true(err <= 5e-3);
        if (err > worst) worst = (float)err;
    }
    fprintf(stderr, "lora: worst relative error against finite differences %.3g\n", (double)worst);
    /* A step moves the adapters only. */
    float **before = calloc((size_t)m->n_params, sizeof *before);
    for (int i = 0; i < m->n_params; i++) {
        size_t n = (size_t)loom_param_numel(m->params[i]);
        before[i] = malloc(n * sizeof(float));
        memcpy(before[i], loom_param_master(m->params[i]), n * sizeof(float));
    }
    loom_adamw_config ac = loom_adamw_defaults();
    loom_adamw *opt;
    assert_int_equal(loom_adamw_new(&ac, m->params, m->n_params, &opt), LOOM_OK);
    for (int i = 0; i < m->n_params; i++) assert_int_equal(loom_adamw_m(opt, i) == NULL, i < m->n_base);
    assert_int_equal(loom_adamw_step(opt, 1e-2f, 1.0f), LOOM_OK);
    for (int i = 0; i < m->n_params; i++) {
        size_t bytes = (size_t)loom_param_numel(m->params[i]) * sizeof(float);
        int same = memcmp(before[i], loom_param_master(m->params[i]), bytes) == 0;
        assert_int_equal(same, i < m->n_base);
        free(before[i]);
    }
    free(before);
    /* Freezing is one-way: a frozen weight marked trainable again is refused. */
    m->params[0]->trainable = 1;
    assert_int_equal(loom_adamw_step(opt, 1e-2f, 1.0f), LOOM_ERR_STATE);
    assert_non_null(strstr(loom_last_error(), "one-way"));
    m->params[0]->trainable = 0;
    loom_adamw_free(opt);
    /* The distributed optimizer takes the trainable parameters only. */
    loom_dist_optim *dopt;
    assert_int_equal(loom_dist_optim_new(&ac, m->params, m->n_params, NULL, 0, 0, &dopt), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "frozen"));
    assert_int_equal(loom_dist_optim_new(&ac, m->params + m->n_base, m->n_params - m->n_base, NULL, 0, 0, &dopt),
                     LOOM_OK);
    loom_dist_optim_free(dopt);
    loom_llama_free(m);
}

/* Every recompute mode gives the adapters the no-recompute gradients, bit
 * for bit (bf16 compute, fp32 main_grad). */
static void recompute_bit_identical(float alpha, float dropout, float attention_dropout) {
    loom_recompute_mode modes[] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                   LOOM_RECOMPUTE_SELECTIVE};
    float ref_loss = 0.0f;
    float **ref = NULL;
    int n_ref = 0, base = 0;
    for (int k = 0; k < 4; k++) {
        loom_precision prec = {LOOM_BF16, 1};
        loom_llama *m = new_model(prec);
        add_adapters_alpha(m, LOOM_LORA_ALL, 0.2f, alpha);
        m->lora.dropout = dropout;
        m->cfg.attention_dropout = attention_dropout;
        m->recompute.mode = modes[k];
        loom_llama_zero_grad(m);
        float l = loss_of(m, 1, NULL);
        assert_int_equal(loom_grad_audit(m->params, m->n_params, NULL, 0), LOOM_OK);
        if (k == 0) {
            ref_loss = l;
            n_ref = m->n_params;
            base = m->n_base;
            ref = calloc((size_t)n_ref, sizeof *ref);
        } else {
            assert_true(l == ref_loss);
        }
        for (int i = base; i < n_ref; i++) {
            size_t bytes = (size_t)loom_param_numel(m->params[i]) * sizeof(float);
            if (k == 0) {
                ref[i] = malloc(bytes);
                memcpy(ref[i], m->params[i]->grad, bytes);
            } else {
                assert_true(tu_bits_equal(ref[i], m->params[i]->grad, bytes, m->params[i]->name));
            }
        }
        loom_llama_free(m);
    }
    for (int i = base; i < n_ref; i++) free(ref[i]);
    free(ref);
}

/* alpha 5 (a scale op after B) and alpha 3 = rank (a scale of 1: no op) */
static void test_recompute_bit_identical(void **state) {
    (void)state;
    recompute_bit_identical(5.0f, 0.0f, 0.0f);
    recompute_bit_identical(3.0f, 0.0f, 0.0f);
    recompute_bit_identical(5.0f, 0.25f, 0.0f); /* the replays draw the forward's dropout masks */
    /* and with the attention's dropout between the adapters': selective recompute keeps the attention, whose
     * draws a replay must step over (the RNG set to where the kept op left it) for the later dropouts' masks */
    recompute_bit_identical(5.0f, 0.25f, 0.3f);
}

/* LoRA's dropout: in training forwards only. A no-grad forward (evaluation)
 * computes what the model without dropout does, bit for bit; a training
 * forward differs, and its adapters' gradients agree with central
 * differences of training forwards that draw the same masks. */
static void test_dropout(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec), *plain = new_model(prec);
    add_adapters(m, (1u << LOOM_LORA_V) | (1u << LOOM_LORA_UP), 0.3f);
    add_adapters(plain, (1u << LOOM_LORA_V) | (1u << LOOM_LORA_UP), 0.3f);
    m->lora.dropout = 0.4f;
    float *x, *y;
    float le = loss_of(m, 0, &x), lp = loss_of(plain, 0, &y);
    assert_true(le == lp);
    assert_true(tu_bits_equal(x, y, (size_t)N_TOK * (size_t)m->cfg.vocab_size * sizeof *x, "eval logits"));
    free(x);
    free(y);
    loom_llama_zero_grad(m);
    float lt = loss_of(m, 1, NULL);
    assert_true(lt != lp);
    for (int i = m->n_base; i < m->n_params; i++) {
        float g_top;
        assert_true(fd_error(m, m->params[i], train_loss, &g_top) <= 5e-3);
    }
    int32_t tok[N_TOK], tgt[N_TOK];
    tokens(tok, tgt, m->cfg.vocab_size);
    loom_llama_free(plain);
    loom_llama_free(m);
    /* An evaluation between a training forward and its backward (the same
     * shape, no gradients, no dropout) changes nothing the replays see:
     * the adapters' gradients are the bits of the backward without it. */
    loom_recompute_mode modes[] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    for (int k = 0; k < 3; k++) {
        void *ref[64] = {0};
        for (int between = 0; between <= 1; between++) {
            loom_llama *r = new_model(prec);
            add_adapters(r, LOOM_LORA_ALL, 0.3f);
            r->lora.dropout = 0.3f;
            r->recompute.mode = modes[k];
            assert_true(r->n_params <= 64);
            loom_llama_zero_grad(r);
            loom_rng_init(loom_rng_default(), 42);
            loom_tensor *loss = NULL, *eval = NULL;
            assert_int_equal(loom_llama_forward(r, tok, tgt, 2, N_TOK / 2, &loss, NULL), LOOM_OK);
            if (between) {
                loom_no_grad_enter();
                assert_int_equal(loom_llama_forward(r, tok, tgt, 2, N_TOK / 2, &eval, NULL), LOOM_OK);
                loom_no_grad_exit();
                loom_tensor_release(eval);
            }
            assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
            loom_tensor_release(loss);
            for (int i = r->n_base; i < r->n_params; i++) {
                size_t bytes = (size_t)loom_param_numel(r->params[i]) * sizeof(float);
                if (!between) {
                    ref[i] = malloc(bytes);
                    memcpy(ref[i], r->params[i]->grad, bytes);
                } else {
                    assert_true(tu_bits_equal(ref[i], r->params[i]->grad, bytes, r->params[i]->name));
                    free(ref[i]);
                }
            }
            loom_llama_free(r);
        }
    }
}

/* rsLoRA scales the adapters by alpha / sqrt(rank): at rank 4, alpha 3 is
 * plain LoRA's alpha 6, bit for bit (a factor of 1.5 both ways), in the
 * forward and the merged weights; without the flag alpha 3 is another
 * model. */
static void test_rslora(void **state) {
    (void)state;
    loom_lora_config r8 = {.rank = 8, .alpha = 16.0f, .targets = LOOM_LORA_ALL, .rslora = 1};
    loom_lora_config p8 = {.rank = 8, .alpha = 16.0f, .targets = LOOM_LORA_ALL};
    assert_true(loom_lora_scale(&r8) == (float)(16.0 / sqrt(8.0)) && loom_lora_scale(&p8) == 2.0f);
    loom_precision prec = {LOOM_F32, 1};
    const loom_lora_config cfg[3] = {{.rank = 4, .alpha = 3.0f, .targets = LOOM_LORA_ALL, .rslora = 1},
                                     {.rank = 4, .alpha = 6.0f, .targets = LOOM_LORA_ALL},
                                     {.rank = 4, .alpha = 3.0f, .targets = LOOM_LORA_ALL}};
    float *logits[3], *merged[3];
    for (int k = 0; k < 3; k++) {
        loom_llama *m = new_model(prec);
        assert_int_equal(loom_llama_add_lora(m, &cfg[k], 7), LOOM_OK);
        for (int i = m->n_base; i < m->n_params; i++) { /* B (and A) the same in each */
            size_t n = (size_t)loom_param_numel(m->params[i]);
            tu_fill_uniform(loom_param_master(m->params[i]), n, -0.3f, 0.3f, 90 + (uint64_t)i);
            loom_param_sync_from_master(m->params[i]);
        }
        loss_of(m, 0, &logits[k]);
        int wq = 2; /* layer 0's q_proj, adapted */
        assert_true(strstr(m->params[wq]->name, "q_proj") != NULL);
        merged[k] = malloc((size_t)loom_param_numel(m->params[wq]) * sizeof(float));
        assert_int_equal(loom_llama_param_merged(m, wq, merged[k]), LOOM_OK);
        loom_llama_free(m);
    }
    size_t nl = (size_t)N_TOK * (size_t)config().vocab_size * sizeof(float);
    size_t nw = (size_t)config().dim * (size_t)config().dim * sizeof(float);
    assert_true(tu_bits_equal(logits[0], logits[1], nl, "rsLoRA logits"));
    assert_true(tu_bits_equal(merged[0], merged[1], nw, "rsLoRA merged weights"));
    assert_true(memcmp(logits[0], logits[2], nl) != 0 && memcmp(merged[0], merged[2], nw) != 0);
    for (int k = 0; k < 3; k++) {
        free(logits[k]);
        free(merged[k]);
    }
}

/* A copy of parameter p's fp32 values (malloc'd). */
static float *values_of(const loom_param *p) {
    float *v = malloc((size_t)loom_param_numel(p) * sizeof *v);
    loom_param_get_f32(p, v);
    return v;
}

/* DoRA (y = (m / n) (x W^T + s (x A^T) B^T), n the detached norms of the
 * rows of W + s B A):
 *  - with B zero it computes the base model, bit for bit, each m its n;
 *  - m's gradients agree with central differences (n does not depend on
 *    m), with and without dropout;
 *  - A's and B's are those of plain LoRA on W' = c W and B' = c B (c = m / n
 *    per row), B's times c: the detached norm's gradient, computed another
 *    way;
 *  - the merged weights give its logits, and so does the KV-cache path;
 *  - every recompute mode gives the gradients' bits. */
static void test_dora(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    dora_next = 1;
    float *x, *y;
    size_t nl = (size_t)N_TOK * (size_t)config().vocab_size;
    for (int bf16 = 0; bf16 <= 1; bf16++) { /* in bf16 too: the magnitudes are fp32, m / n exactly 1 */
        loom_precision pr = {bf16 ? LOOM_BF16 : LOOM_F32, 1};
        loom_llama *d0 = new_model(pr), *base = new_model(pr);
        add_adapters(d0, LOOM_LORA_ALL, 0.0f);
        assert_int_equal(d0->layers[0].lora_m[LOOM_LORA_Q]->tensor->dtype, LOOM_F32);
        loss_of(d0, 0, &x);
        loss_of(base, 0, &y);
        assert_true(tu_bits_equal(x, y, nl * sizeof *x, "DoRA at the start"));
        free(x);
        free(y);
        loom_llama_free(d0);
        loom_llama_free(base);
    }
    loom_llama *d, *plain = new_model(prec);

    d = new_model(prec);
    add_adapters(d, LOOM_LORA_ALL, 0.3f);
    assert_int_equal(d->n_params - d->n_base, 3 * LOOM_LORA_N * d->cfg.n_layers);
    loom_llama_zero_grad(d);
    float ld = loss_of(d, 1, NULL);
    for (int dropout = 0; dropout <= 1; dropout++) {
        d->lora.dropout = dropout ? 0.3f : 0.0f;
        if (dropout) {
            loom_llama_zero_grad(d);
            loss_of(d, 1, NULL);
        }
        for (int i = d->n_base; i < d->n_params; i++) {
            if (!strstr(d->params[i]->name, "lora_magnitude_vector")) continue;
            float g_top;
            assert_true(fd_error(d, d->params[i], train_loss, &g_top) <= 5e-3 && g_top != 0.0f);
        }
    }
    d->lora.dropout = 0.0f;
    loom_llama_zero_grad(d);
    assert_true(loss_of(d, 1, NULL) == ld);

    /* Plain LoRA on c W, c B: the same loss, A's gradients, B's over c. */
    dora_next = 0;
    loom_llama *p = new_model(prec);
    add_adapters(p, LOOM_LORA_ALL, 0.0f);
    for (int l = 0; l < d->cfg.n_layers; l++) /* the same seed draws the same A with DoRA or without */
        for (int t = 0; t < LOOM_LORA_N; t++)
            assert_true(tu_bits_equal(loom_param_master(d->layers[l].lora_a[t]), loom_param_master(p->layers[l].lora_a[t]),
                                      (size_t)loom_param_numel(p->layers[l].lora_a[t]) * sizeof(float), "A"));
    for (int l = 0; l < d->cfg.n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N; t++) {
            loom_llama_layer *yd = &d->layers[l], *yp = &p->layers[l];
            const loom_param *w = loom_llama_layer_weight(yd, (loom_lora_target)t);
            int out = (int)w->tensor->shape[0], in = (int)w->tensor->shape[1], r = d->lora.rank;
            float *n = malloc((size_t)out * sizeof *n), *mv = values_of(yd->lora_m[t]);
            float *wv = values_of(w), *bv = values_of(yd->lora_b[t]), *av = values_of(yd->lora_a[t]);
            assert_int_equal(loom_llama_dora_norms(d, l, (loom_lora_target)t, n), LOOM_OK);
            for (int o = 0; o < out; o++) {
                float c = mv[o] / n[o];
                for (int k = 0; k < in; k++) wv[(size_t)o * in + k] *= c;
                for (int k = 0; k < r; k++) bv[(size_t)o * r + k] *= c;
            }
            assert_int_equal(loom_param_set_f32(loom_llama_layer_weight(yp, (loom_lora_target)t), wv, (int64_t)out * in),
                             LOOM_OK);
            assert_int_equal(loom_param_set_f32(yp->lora_b[t], bv, (int64_t)out * r), LOOM_OK);
            assert_int_equal(loom_param_set_f32(yp->lora_a[t], av, (int64_t)r * in), LOOM_OK);
            free(n); free(mv); free(wv); free(bv); free(av);
        }
    loom_llama_zero_grad(p);
    float lp = loss_of(p, 1, NULL);
    assert_true(fabsf(lp - ld) <= 1e-5f * fabsf(ld));
    for (int l = 0; l < d->cfg.n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N; t++) {
            loom_llama_layer *yd = &d->layers[l], *yp = &p->layers[l];
            int out = (int)yd->lora_b[t]->tensor->shape[0], r = d->lora.rank;
            float *n = malloc((size_t)out * sizeof *n), *mv = values_of(yd->lora_m[t]);
            assert_int_equal(loom_llama_dora_norms(d, l, (loom_lora_target)t, n), LOOM_OK);
            float *want = malloc((size_t)out * r * sizeof *want);
            for (int o = 0; o < out; o++)
                for (int k = 0; k < r; k++) want[(size_t)o * r + k] = ((const float *)yp->lora_b[t]->grad)[(size_t)o * r + k] * mv[o] / n[o];
            TU_ASSERT_CLOSE((const float *)yd->lora_b[t]->grad, want, (size_t)out * r, 1e-6, 1e-4);
            TU_ASSERT_CLOSE((const float *)yd->lora_a[t]->grad, (const float *)yp->lora_a[t]->grad, (size_t)loom_param_numel(yd->lora_a[t]), 1e-6,
                            1e-4);
            free(n); free(mv); free(want);
        }
    loom_llama_free(p);

    /* The merged weights, and the KV-cache path, give the forward's logits. */
    loom_llama *merged = new_model(prec);
    for (int i = 0; i < d->n_base; i++) {
        float *w = malloc((size_t)loom_param_numel(d->params[i]) * sizeof *w);
        assert_int_equal(loom_llama_param_merged(d, i, w), LOOM_OK);
        assert_int_equal(loom_param_set_f32(merged->params[i], w, loom_param_numel(d->params[i])), LOOM_OK);
        free(w);
    }
    loss_of(d, 0, &x);
    loss_of(merged, 0, &y);
    TU_ASSERT_CLOSE(y, x, nl, 1e-5, 1e-4);
    int32_t tok[N_TOK], tgt[N_TOK];
    tokens(tok, tgt, d->cfg.vocab_size);
    float *next = malloc((size_t)d->cfg.vocab_size * sizeof *next);
    loom_tensor *lg = NULL;
    loom_no_grad_enter();
    assert_int_equal(loom_llama_forward(d, tok, NULL, 1, 9, NULL, &lg), LOOM_OK);
    loom_no_grad_exit();
    float *all = malloc((size_t)loom_tensor_numel(lg) * sizeof *all);
    loom_tensor_read_f32(lg, all);
    loom_tensor_release(lg);
    assert_int_equal(loom_llama_next_logits(d, tok, 9, next), LOOM_OK);
    TU_ASSERT_CLOSE(next, all + (size_t)8 * (size_t)d->cfg.vocab_size, (size_t)d->cfg.vocab_size, 1e-5, 1e-4);
    free(all); free(next); free(x); free(y);
    loom_llama_free(merged);
    loom_llama_free(plain);
    loom_llama_free(d);

    dora_next = 1;
    recompute_bit_identical(5.0f, 0.0f, 0.0f);
    recompute_bit_identical(5.0f, 0.25f, 0.0f);
    dora_next = 0;
}

/* A training forward's logits (dropout on, the RNG started alike), its
 * graph dropped. */
static float *train_logits(loom_llama *m, const int32_t *tok, const int32_t *tgt, int B, int T) {
    loom_rng_init(loom_rng_default(), 42);
    loom_tensor *loss = NULL, *lg = NULL;
    assert_int_equal(loom_llama_forward(m, tok, tgt, B, T, &loss, &lg), LOOM_OK);
    float *logits = malloc((size_t)loom_tensor_numel(lg) * sizeof *logits);
    loom_tensor_read_f32(lg, logits);
    loom_tensor_release(lg);
    loom_tensor_release(loss);
    loom_tape_clear();
    return logits;
}

/* Data-parallel replicas draw their rows of the global batch's dropout
 * masks: rank r of 2, given row r of a batch of 2 alone, computes the
 * logits the model computes for that row in the whole batch, at every
 * adapter (o and down included). Back at rank 0 of 1, the same row alone
 * draws other masks. */
static void test_dropout_data_parallel(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec);
    add_adapters(m, LOOM_LORA_ALL, 0.3f);
    m->lora.dropout = 0.4f;
    int T = N_TOK / 2, V = m->cfg.vocab_size;
    size_t row = (size_t)T * (size_t)V;
    int32_t tok[N_TOK], tgt[N_TOK];
    tokens(tok, tgt, V);
    float *whole = train_logits(m, tok, tgt, 2, T);
    double top = 0;
    for (size_t k = 0; k < 2 * row; k++) top = fmax(top, fabs(whole[k]));
    for (int r = 0; r < 2; r++) {
        assert_int_equal(loom_llama_set_data_parallel(m, r, 2), LOOM_OK);
        float *part = train_logits(m, tok + r * T, tgt + r * T, 1, T);
        double diff = 0;
        for (size_t k = 0; k < row; k++) diff = fmax(diff, fabs(part[k] - whole[r * row + k]));
        if (diff > 1e-5 * top) fprintf(stderr, "rank %d: logits differ by %g (largest %g)\n", r, diff, top);
        assert_true(diff <= 1e-5 * top);
        free(part);
    }
    assert_int_equal(loom_llama_set_data_parallel(m, 0, 1), LOOM_OK);
    float *alone = train_logits(m, tok + T, tgt + T, 1, T);
    double diff = 0;
    for (size_t k = 0; k < row; k++) diff = fmax(diff, fabs(alone[k] - whole[row + k]));
    assert_true(diff > 1e-3 * top); /* the dropout shows in the logits */
    assert_int_equal(loom_llama_set_data_parallel(m, 2, 2), LOOM_ERR_INVALID);
    assert_int_equal(loom_llama_set_data_parallel(m, 0, 0), LOOM_ERR_INVALID);
    assert_int_equal(m->dp_rank, 0);
    assert_int_equal(m->dp_size, 1);
    free(alone);
    free(whole);
    loom_llama_free(m);
}

/* The merged weights W + (alpha / rank) B A give the adapted model's
 * logits; a weight without an adapter merges to itself. */
static void test_merged_weights(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec), *plain = new_model(prec);
    add_adapters(m, (1u << LOOM_LORA_K) | (1u << LOOM_LORA_GATE) | (1u << LOOM_LORA_DOWN), 0.5f);
    for (int i = 0; i < m->n_base; i++) {
        size_t n = (size_t)loom_param_numel(m->params[i]);
        float *w = malloc(n * sizeof *w);
        assert_int_equal(loom_llama_param_merged(m, i, w), LOOM_OK);
        loom_param *a, *b;
        if (!loom_llama_lora_of(m, i, &a, &b)) assert_memory_equal(w, loom_param_master(m->params[i]), n * 4);
        assert_int_equal(loom_param_set_f32(plain->params[i], w, (int64_t)n), LOOM_OK);
        free(w);
    }
    float *x, *y, *z;
    loss_of(m, 0, &x);
    loss_of(plain, 0, &y);
    size_t n = (size_t)N_TOK * (size_t)m->cfg.vocab_size;
    TU_ASSERT_CLOSE(x, y, n, 1e-5, 1e-4);
    /* and they are not the base model's: the check could fail */
    loom_llama *base = new_model(prec);
    loss_of(base, 0, &z);
    assert_true(tu_close_ratio(x, z, n, 1e-5, 1e-4, NULL) > 100.0);
    free(x);
    free(y);
    free(z);
    loom_llama_free(base);
    loom_llama_free(plain);
    loom_llama_free(m);
}

/* The KV-cache path runs the adapters: its next-token logits equal the
 * training forward's last row. */
static void test_generation_uses_adapters(void **state);

/* With the attention's biases (q, k, v and o), which the adapters, DoRA's
 * scale, the merge and the replays leave as they are: LoRA and DoRA start at
 * the base model bit for bit, replays are bit-identical, the merged weights
 * give the adapters' logits, and so does the KV-cache path. */
static void test_with_biases(void **state) {
    bias_next = 1;
    for (dora_next = 0; dora_next <= 1; dora_next++) {
        test_starts_at_base(state);
        recompute_bit_identical(5.0f, 0.25f, 0.0f);
        test_merged_weights(state);
        test_generation_uses_adapters(state);
    }
    /* and the biases are there: the model differs from one without */
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec);
    bias_next = 0;
    dora_next = 0;
    loom_llama *plain = new_model(prec);
    assert_int_equal(plain->n_params + 8, m->n_params); /* 4 biases in each of 2 layers */
    assert_true(eval_loss(m) != eval_loss(plain));
    loom_llama_free(plain);
    loom_llama_free(m);
}

static void test_generation_uses_adapters(void **state) {
    (void)state;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m = new_model(prec);
    add_adapters(m, LOOM_LORA_ALL, 0.5f);
    int32_t tok[N_TOK], tgt[N_TOK];
    tokens(tok, tgt, m->cfg.vocab_size);
    int T = 9, V = m->cfg.vocab_size;
    loom_tensor *lg = NULL;
    loom_no_grad_enter();
    assert_int_equal(loom_llama_forward(m, tok, NULL, 1, T, NULL, &lg), LOOM_OK);
    loom_no_grad_exit();
    float *all = malloc((size_t)(T * V) * sizeof *all), *next = malloc((size_t)V * sizeof *next);
    loom_tensor_read_f32(lg, all);
    loom_tensor_release(lg);
    assert_int_equal(loom_llama_next_logits(m, tok, T, next), LOOM_OK);
    TU_ASSERT_CLOSE(next, all + (size_t)(T - 1) * (size_t)V, (size_t)V, 1e-5, 1e-4);
    free(all);
    /* Decoding token by token through the cache: each greedy pick is the
     * argmax of the full forward over the text so far. */
    loom_sampler greedy = {0.0f, 1.0f, 1, 0, 0, 0.0f, 0.0f};
    int32_t out[6];
    int n_out = 0;
    assert_int_equal(loom_llama_generate(m, tok, 4, 6, &greedy, -1, out, &n_out), LOOM_OK);
    assert_int_equal(n_out, 6);
    int32_t seq[16];
    memcpy(seq, tok, 4 * sizeof *seq);
    memcpy(seq + 4, out, 6 * sizeof *seq);
    for (int k = 0; k < 6; k++) {
        assert_int_equal(loom_llama_next_logits(m, seq, 4 + k, next), LOOM_OK);
        int best = 0;
        for (int v = 1; v < V; v++)
            if (next[v] > next[best]) best = v;
        assert_int_equal(out[k], best);
    }
    free(next);
    loom_llama_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_targets),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_frozen_masters),
        cmocka_unit_test(test_new_lora),
        cmocka_unit_test(test_starts_at_base),
        cmocka_unit_test(test_frozen_and_finite_differences),
        cmocka_unit_test(test_recompute_bit_identical),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_dropout_data_parallel),
        cmocka_unit_test(test_rslora),
        cmocka_unit_test(test_dora),
        cmocka_unit_test(test_merged_weights),
        cmocka_unit_test(test_generation_uses_adapters),
        cmocka_unit_test(test_with_biases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
