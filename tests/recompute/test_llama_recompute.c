/*
 * test_llama_recompute.c — the precision x master-grad x recompute matrix on
 * a small LLaMA (and on one whose rows lie 2 KiB apart, where GEMMs and
 * attention copy them first), micro-batch accumulation, and a steady-state
 * step that makes no system allocation. (The memory bound of full recompute is in
 * test_recompute_memory.c.)
 *
 * Within one precision and master-grad setting, every recompute mode must
 * give bit-identical losses and gradients: the same kernels run on the same
 * values in the same order; only where activations come from differs.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

typedef struct run_result {
    float loss;
    int n;               /* parameters */
    size_t *bytes;       /* gradient bytes per parameter */
    void **grads;        /* raw gradient buffers (copies) */
    int all_written;
    loom_status audit;
} run_result;

static loom_llama_config small_config(int layers) {
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = 32; c.n_layers = layers; c.n_heads = 4; c.n_kv_heads = 2; c.ffn_dim = 48;
    c.vocab_size = 61; c.max_seq = 16; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    return c;
}

static void make_tokens(int32_t *tok, int32_t *tgt, int n, int V, uint64_t seed, int ignore_one) {
    float *u = malloc((size_t)n * sizeof *u);
    tu_fill_uniform(u, (size_t)n, 0, 1, seed);
    for (int i = 0; i < n; i++) tok[i] = (int32_t)(u[i] * V) % V;
    for (int i = 0; i < n; i++) tgt[i] = tok[(i + 1) % n];
    if (ignore_one) tgt[3] = -1; /* one ignored position */
    free(u);
}

/* eval_between: a no-grad forward of another shape (the same tokens as one
 * sequence of B*T) runs between each forward and its backward, as an
 * evaluation might. */
static run_result run_step_blocks(const loom_llama_config *cfg, loom_precision prec, loom_recompute_mode mode,
                                  int blocks, int B, int T, int micro, float seed_scale, int eval_between) {
    loom_llama *m;
    assert_int_equal(loom_llama_new(cfg, prec, &m), LOOM_OK);
    loom_llama_init_weights(m, 1234);
    for (int i = 0; i < m->n_params; i++) { /* biases drawn (init's are zero): a replay adding one twice shows */
        loom_param *p = m->params[i];
        if (!strstr(p->name, ".bias")) continue;
        size_t n = (size_t)loom_param_numel(p);
        float *v = malloc(n * sizeof *v);
        tu_fill_uniform(v, n, -0.5f, 0.5f, 500 + (uint64_t)i);
        assert_int_equal(loom_param_set_f32(p, v, (int64_t)n), LOOM_OK);
        free(v);
    }
    m->recompute.mode = mode;
    m->recompute.blocks = blocks;
    loom_llama_zero_grad(m);
    int N = B * T;
    int32_t *tok = malloc((size_t)N * sizeof *tok), *tgt = malloc((size_t)N * sizeof *tgt);
    make_tokens(tok, tgt, N, cfg->vocab_size, 77, micro == 1);
    run_result r = {0};
    if (micro == 0) micro = 1; /* 0: one batch with no ignored row */
    int Bm = B / micro;
    for (int k = 0; k < micro; k++) {
        loom_tensor *loss = NULL;
        loom_rng_init(loom_rng_default(), 42);
        assert_int_equal(loom_llama_forward(m, tok + k * Bm * T, tgt + k * Bm * T, Bm, T, &loss, NULL), LOOM_OK);
        r.loss += loom_tensor_get(loss, 0) / (float)micro;
        if (eval_between) {
            loom_tensor *eval = NULL;
            loom_no_grad_enter();
            assert_int_equal(loom_llama_forward(m, tok, tgt, 1, Bm * T, &eval, NULL), LOOM_OK);
            loom_no_grad_exit();
            loom_tensor_release(eval);
        }
        loom_status st = loom_backward(loss, seed_scale / (float)micro);
        if (st != LOOM_OK) fprintf(stderr, "backward: %s\n", loom_last_error());
        assert_int_equal(st, LOOM_OK);
        loom_tensor_release(loss);
    }
    r.n = m->n_params;
    r.bytes = calloc((size_t)r.n, sizeof *r.bytes);
    r.grads = calloc((size_t)r.n, sizeof *r.grads);
    r.all_written = 1;
    for (int i = 0; i < r.n; i++) {
        loom_param *p = m->params[i];
        r.bytes[i] = (size_t)loom_param_numel(p) * loom_dtype_size(p->grad_dtype);
        r.grads[i] = malloc(r.bytes[i]);
        memcpy(r.grads[i], p->grad, r.bytes[i]);
        r.all_written &= p->grad_written;
    }
    r.audit = loom_grad_audit(m->params, m->n_params, NULL, 0);
    free(tok);
    free(tgt);
    loom_llama_free(m);
    assert_int_equal(loom_tape_size(), 0);
    return r;
}

static run_result run_step(const loom_llama_config *cfg, loom_precision prec, loom_recompute_mode mode, int B, int T,
                           int micro, float seed_scale) {
    return run_step_blocks(cfg, prec, mode, 0, B, T, micro, seed_scale, 0);
}

static void free_result(run_result *r) {
    for (int i = 0; i < r->n; i++) free(r->grads[i]);
    free(r->grads);
    free(r->bytes);
}

/* Every recompute mode against none, bit for bit, in every precision; and
 * with the attention's biases (LLaMA's attention_bias: q, k, v and o),
 * heads of their own size and Qwen 3's q/k norms; as Gemma's model (norms
 * of 1 + weight, scaled embeddings, the tanh GELU's gate) and Gemma 2's
 * (norms of the blocks' outputs, softcapped scores and logits, its sliding
 * window on every other block); with Granite's multipliers and
 * attention dropout (each mode replays the forward's masks); and with
 * Mistral's window on every block (Qwen 3's layout has one from its second
 * block); and as Gemma 3's (Gemma 2's with q/k norms and a local RoPE base
 * on its windowed blocks). Windows of 2 and 3 keys in sequences of 8. */
static void test_matrix(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(2);
    const loom_dtype dts[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    const loom_recompute_mode modes[3] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    for (int db = 0; db < 21; db++) {
        int d = db % 3, gemma3 = db >= 18, gemma2 = (db >= 12 && db < 15) || gemma3;
        int gemma = (db >= 6 && db < 9) || gemma2;
        int granite = db >= 9 && db < 12, mistral = db >= 15 && db < 18, qwen3 = db >= 3 && db < 6;
        cfg.qkv_bias = cfg.o_bias = db >= 3 && !mistral && !gemma3;
        cfg.qk_norm = qwen3 || gemma3;
        cfg.embedding_multiplier = granite ? 12.0f : 0.0f;
        cfg.residual_multiplier = granite ? 0.22f : 0.0f;
        cfg.attention_multiplier = granite ? 0.0625f : 0.0f;
        cfg.logits_scaling = granite ? 8.0f : 0.0f;
        cfg.attention_dropout = granite ? 0.1f : 0.0f; /* Granite 3's */
        cfg.head_dim = db >= 3 && !mistral && !gemma3 ? 12 : 0;
        cfg.norm_unit_offset = cfg.scale_embeddings = gemma;
        cfg.act = gemma ? LOOM_ACT_GELU_TANH : LOOM_ACT_SILU;
        cfg.post_norms = gemma2; /* Gemma 2's: norms of the outputs, softcaps, its scale */
        cfg.attn_softcap = gemma2 ? 2.0f : 0.0f;
        cfg.final_softcap = gemma2 ? 3.0f : 0.0f;
        cfg.query_pre_attn_scalar = gemma2 ? 24.0f : 0.0f;
        cfg.sliding_window = gemma2 || mistral ? 3 : qwen3 ? 2 : 0;
        cfg.window_from = qwen3;
        cfg.window_global_interval = gemma2 ? 2 : 0;
        cfg.rope_local_theta = gemma3 ? 100.0f : 0.0f;
        assert_int_equal(loom_llama_config_validate(&cfg), LOOM_OK);
        for (int mg = 0; mg <= 1; mg++) {
            loom_precision prec = {dts[d], mg};
            float seed = dts[d] == LOOM_F16 ? 1024.0f : 1.0f; /* a loss scale for fp16 */
            run_result ref = run_step(&cfg, prec, LOOM_RECOMPUTE_NONE, 2, 8, 1, seed);
            assert_true(isfinite(ref.loss));
            assert_true(ref.all_written);
            assert_int_equal(ref.audit, LOOM_OK);
            for (int k = 0; k < 3; k++) {
                loom_recompute_reset_stats();
                run_result r = run_step(&cfg, prec, modes[k], 2, 8, 1, seed);
                /* The non-reentrant replay skips each block's dead tail (the
                 * down projection's GEMM, the residual add; with Gemma 2's
                 * norm of the MLP's output, which saves that GEMM's output,
                 * the add alone): the bitwise checks below cover it. */
                loom_recompute_stats rs;
                loom_recompute_get_stats(&rs);
                if (modes[k] == LOOM_RECOMPUTE_NONREENTRANT)
                    assert_true(rs.skipped_ops >= (cfg.post_norms ? 1 : 2) * cfg.n_layers);
                else assert_int_equal(rs.skipped_ops, 0);
                char what[128];
                snprintf(what, sizeof what, "%s master_grad=%d %s", loom_dtype_name(dts[d]), mg,
                         loom_recompute_mode_name(modes[k]));
                if (memcmp(&r.loss, &ref.loss, sizeof r.loss) != 0) {
                    fprintf(stderr, "%s: loss %.9g vs %.9g\n", what, r.loss, ref.loss);
                    fail();
                }
                for (int i = 0; i < r.n; i++) {
                    if (!tu_bits_equal(r.grads[i], ref.grads[i], r.bytes[i], what)) {
                        fprintf(stderr, "%s: parameter %d differs\n", what, i);
                        fail();
                    }
                }
                assert_true(r.all_written);
                assert_int_equal(r.audit, LOOM_OK);
                free_result(&r);
            }
            free_result(&ref);
        }
    }
}

/* The config's attention dropout acts in a training forward only: the
 * training loss moves with it (and with the RNG's seed), an evaluation
 * forward (no gradients) gives the bits of the model without it; one
 * outside [0, 1) is refused. */
static void test_attention_dropout(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(2), none = cfg;
    const float bad[3] = {1.0f, -0.1f, NAN}; /* outside [0, 1): refused by name */
    for (int k = 0; k < 3; k++) {
        cfg.attention_dropout = bad[k];
        assert_int_equal(loom_llama_config_validate(&cfg), LOOM_ERR_INVALID);
        assert_non_null(strstr(loom_last_error(), "attention_dropout"));
    }
    cfg.attention_dropout = 0.3f;
    loom_precision prec = {LOOM_BF16, 1};
    run_result with = run_step(&cfg, prec, LOOM_RECOMPUTE_NONE, 2, 8, 1, 1.0f);
    run_result without = run_step(&none, prec, LOOM_RECOMPUTE_NONE, 2, 8, 1, 1.0f);
    assert_true(isfinite(with.loss) && with.loss != without.loss);
    assert_true(with.all_written);
    free_result(&with);
    free_result(&without);
    float eval[2], train[2];
    int32_t tok[16], tgt[16];
    make_tokens(tok, tgt, 16, cfg.vocab_size, 78, 0);
    for (int k = 0; k < 2; k++) { /* with dropout, then without */
        loom_llama *m;
        assert_int_equal(loom_llama_new(k ? &none : &cfg, prec, &m), LOOM_OK);
        loom_llama_init_weights(m, 1234);
        loom_tensor *loss = NULL;
        loom_no_grad_enter();
        assert_int_equal(loom_llama_forward(m, tok, tgt, 2, 8, &loss, NULL), LOOM_OK);
        loom_no_grad_exit();
        eval[k] = loom_tensor_get(loss, 0);
        loom_tensor_release(loss);
        for (int seed = 0; seed < 2 && !k; seed++) { /* two seeds, two masks */
            loom_rng_init(loom_rng_default(), 7 + (uint64_t)seed);
            assert_int_equal(loom_llama_forward(m, tok, tgt, 2, 8, &loss, NULL), LOOM_OK);
            train[seed] = loom_tensor_get(loss, 0);
            loom_tensor_release(loss);
            loom_tape_clear();
        }
        loom_llama_free(m);
    }
    assert_memory_equal(&eval[0], &eval[1], sizeof eval[0]);
    assert_true(train[0] != train[1]);
}

/* The gradients' values in every precision and master-grad setting, against
 * the fp32 run on the same weights: the matrix above compares each setting
 * only with itself. Each parameter's gradient (unscaled by fp16's loss
 * scale, read in fp32 whatever its dtype) must be within a share of that
 * parameter's largest fp32 gradient: 4% for bf16, 1% for fp16 (their
 * forward rounds activations to 8 and 11 bits; measured 1.4% and 0.2%; a
 * gradient doubled or dropped on one path is off by 100%). */
static void test_precisions_against_fp32(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(2);
    run_result ref = run_step(&cfg, (loom_precision){LOOM_F32, 1}, LOOM_RECOMPUTE_NONE, 2, 8, 1, 1.0f);
    const loom_dtype dts[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int d = 0; d < 3; d++)
        for (int mg = 0; mg <= 1; mg++) {
            loom_precision prec = {dts[d], mg};
            float seed = dts[d] == LOOM_F16 ? 1024.0f : 1.0f;
            run_result r = run_step(&cfg, prec, LOOM_RECOMPUTE_NONE, 2, 8, 1, seed);
            assert_int_equal(r.n, ref.n);
            double share = dts[d] == LOOM_F32 ? 1e-6 : dts[d] == LOOM_BF16 ? 0.04 : 0.01;
            for (int i = 0; i < r.n; i++) {
                size_t n = ref.bytes[i] / sizeof(float);
                loom_dtype gdt = (loom_dtype)(r.bytes[i] / n == 4 ? LOOM_F32 : dts[d]);
                float *g = malloc(n * sizeof *g);
                loom_convert(g, LOOM_F32, r.grads[i], gdt, n);
                double scale = 0.0;
                for (size_t k = 0; k < n; k++) {
                    g[k] /= seed;
                    scale = fmax(scale, fabs(((const float *)ref.grads[i])[k]));
                }
                assert_true(scale > 0.0);
                char what[96];
                snprintf(what, sizeof what, "%s master_grad=%d parameter %d", loom_dtype_name(dts[d]), mg, i);
                assert_true(tu_close_ratio(g, ref.grads[i], n, share * scale, 0.0, what) <= 1.0);
                free(g);
            }
            free_result(&r);
        }
    free_result(&ref);
}

/* Rows 2 KiB apart (dim 512 in 8 heads of 64, a block of 64 queries): the
 * dW GEMMs copy their operands to padded strides and the fp32 attention
 * reads dense copies of its rows. Every recompute mode still matches the
 * run without recompute bit for bit, fp32 and bf16 (widened into padded
 * panels where the CPU lacks AVX-512 BF16), and the padded path did run. */
static void test_matrix_wide_rows(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(1);
    cfg.dim = 512; cfg.n_heads = 8; cfg.n_kv_heads = 8; cfg.ffn_dim = 64; cfg.max_seq = 64;
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    const loom_recompute_mode modes[3] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    for (int d = 0; d < 2; d++) {
        loom_precision prec = {dts[d], 1};
        loom_gemm_stats g0, g1;
        loom_gemm_get_stats(&g0);
        run_result ref = run_step(&cfg, prec, LOOM_RECOMPUTE_NONE, 1, 64, 1, 1.0f);
        loom_gemm_get_stats(&g1);
        /* oneDNN built in and used; bf16 pads only where it is widened
         * (CPUs without AVX-512 BF16: oneDNN takes it natively elsewhere). */
        if (g1.onednn_calls > g0.onednn_calls && (dts[d] == LOOM_F32 || g1.widened_calls > g0.widened_calls))
            assert_true(g1.padded_calls > g0.padded_calls);
        assert_true(isfinite(ref.loss));
        for (int k = 0; k < 3; k++) {
            run_result r = run_step(&cfg, prec, modes[k], 1, 64, 1, 1.0f);
            char what[128];
            snprintf(what, sizeof what, "wide rows %s %s", loom_dtype_name(dts[d]), loom_recompute_mode_name(modes[k]));
            if (memcmp(&r.loss, &ref.loss, sizeof r.loss) != 0) {
                fprintf(stderr, "%s: loss %.9g vs %.9g\n", what, r.loss, ref.loss);
                fail();
            }
            for (int i = 0; i < r.n; i++)
                if (!tu_bits_equal(r.grads[i], ref.grads[i], r.bytes[i], what)) fail();
            free_result(&r);
        }
        free_result(&ref);
    }
}

/* A forward of another shape between a forward and its backward (an
 * evaluation, say) leaves the replays of the first one alone: the gradients
 * stay bit-identical to the plain run's. */
static void test_other_shape_before_backward(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(2);
    loom_precision prec = {LOOM_F32, 1};
    const loom_recompute_mode modes[4] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                          LOOM_RECOMPUTE_SELECTIVE};
    run_result ref = run_step(&cfg, prec, LOOM_RECOMPUTE_NONE, 2, 8, 0, 1.0f);
    for (int k = 0; k < 4; k++) {
        run_result r = run_step_blocks(&cfg, prec, modes[k], 0, 2, 8, 0, 1.0f, 1);
        for (int i = 0; i < r.n; i++)
            if (!tu_bits_equal(r.grads[i], ref.grads[i], r.bytes[i], loom_recompute_mode_name(modes[k]))) fail();
        free_result(&r);
    }
    free_result(&ref);
}

/* Two micro-batches of B/2, each loss scaled by 1/2, accumulate to the
 * gradient of one batch of B (no ignored rows, so the batch mean is the mean
 * of the micro-batch means). Only the fp32 summation order differs: rows
 * are reduced in two halves then added. */
static void test_microbatch_accumulation(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(2);
    loom_precision prec = {LOOM_F32, 1};
    run_result one = run_step(&cfg, prec, LOOM_RECOMPUTE_NONE, 4, 8, 0, 1.0f);
    run_result two = run_step(&cfg, prec, LOOM_RECOMPUTE_NONREENTRANT, 4, 8, 2, 1.0f);
    assert_float_equal(one.loss, two.loss, 1e-5);
    for (int i = 0; i < one.n; i++) {
        int n = (int)(one.bytes[i] / sizeof(float));
        assert_true(tu_close_ratio(two.grads[i], one.grads[i], (size_t)n, 1e-6, 1e-3, "microbatch") <= 1.0);
    }
    free_result(&one);
    free_result(&two);
}

/* After a warm-up step, a training step (forward, backward, AdamW) is
 * served from the allocator's cache: no new system allocation, and the
 * activation bytes return to where they were. */
static void test_steady_state_no_malloc(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(2);
    loom_llama *m;
    loom_precision prec = {LOOM_BF16, 1};
    assert_int_equal(loom_llama_new(&cfg, prec, &m), LOOM_OK);
    loom_llama_init_weights(m, 5);
    m->recompute.mode = LOOM_RECOMPUTE_NONREENTRANT;
    loom_adamw_config ac = loom_adamw_defaults();
    loom_adamw *opt;
    assert_int_equal(loom_adamw_new(&ac, m->params, m->n_params, &opt), LOOM_OK);
    int32_t tok[32], tgt[32];
    make_tokens(tok, tgt, 32, cfg.vocab_size, 3, 0);
    loom_mem_stats before, after;
    for (int step = 0; step < 3; step++) {
        if (step == 2) loom_mem_get_stats(&before);
        loom_llama_zero_grad(m);
        loom_tensor *loss = NULL;
        assert_int_equal(loom_llama_forward(m, tok, tgt, 2, 16, &loss, NULL), LOOM_OK);
        assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
        loom_tensor_release(loss);
        assert_int_equal(loom_adamw_step(opt, 1e-3f, 1.0f), LOOM_OK);
    }
    loom_mem_get_stats(&after);
    assert_int_equal(after.n_malloc, before.n_malloc);
    assert_true(after.n_alloc > before.n_alloc);
    assert_int_equal(after.current[LOOM_MEM_ACTIVATIONS], before.current[LOOM_MEM_ACTIVATIONS]);
    loom_adamw_free(opt);
    loom_llama_free(m);
}

/* Recompute in the first 1 or 2 of 3 blocks only (recompute.blocks): the
 * same loss and gradients, bit for bit, as no recompute, in every mode, and
 * exactly that many blocks replayed; a negative count is refused. */
static void test_some_blocks(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(3);
    const loom_recompute_mode modes[3] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    const loom_precision precs[2] = {{LOOM_F32, 1}, {LOOM_BF16, 1}};
    for (int p = 0; p < 2; p++) {
        run_result ref = run_step(&cfg, precs[p], LOOM_RECOMPUTE_NONE, 2, 8, 1, 1.0f);
        for (int k = 0; k < 3; k++)
            for (int blocks = 1; blocks <= 3; blocks++) {
                loom_recompute_reset_stats();
                run_result r = run_step_blocks(&cfg, precs[p], modes[k], blocks, 2, 8, 1, 1.0f, 0);
                loom_recompute_stats rs;
                loom_recompute_get_stats(&rs);
                char what[128];
                snprintf(what, sizeof what, "%s %s blocks=%d", loom_dtype_name(precs[p].compute),
                         loom_recompute_mode_name(modes[k]), blocks);
                assert_int_equal(rs.regions, blocks);
                assert_int_equal(rs.replays, blocks);
                assert_memory_equal(&r.loss, &ref.loss, sizeof r.loss);
                for (int i = 0; i < r.n; i++)
                    if (!tu_bits_equal(r.grads[i], ref.grads[i], r.bytes[i], what)) fail();
                free_result(&r);
            }
        free_result(&ref);
    }
    loom_llama *m;
    assert_int_equal(loom_llama_new(&cfg, precs[0], &m), LOOM_OK);
    m->recompute.mode = LOOM_RECOMPUTE_NONREENTRANT;
    m->recompute.blocks = -1;
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    loom_tensor *loss = NULL;
    assert_int_equal(loom_llama_forward(m, tok, tok, 1, 8, &loss, NULL), LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "recompute.blocks is -1"));
    loom_llama_free(m);
}

/* The gradients of one fp32 step in which, between forward and backward,
 * layer `poke`'s attention norm weight is scaled by 1.5: a block that is
 * replayed recomputes its activations with the new weight, a block that kept
 * them does not. */
static run_result poked_step(const loom_llama_config *cfg, loom_recompute_mode mode, int blocks, int poke) {
    loom_llama *m;
    assert_int_equal(loom_llama_new(cfg, (loom_precision){LOOM_F32, 0}, &m), LOOM_OK);
    loom_llama_init_weights(m, 1234);
    m->recompute.mode = mode;
    m->recompute.blocks = blocks;
    loom_llama_zero_grad(m);
    int32_t tok[16], tgt[16];
    make_tokens(tok, tgt, 16, cfg->vocab_size, 77, 0);
    loom_tensor *loss = NULL;
    assert_int_equal(loom_llama_forward(m, tok, tgt, 2, 8, &loss, NULL), LOOM_OK);
    loom_tensor *w = m->layers[poke].attn_norm->tensor;
    float *v = loom_tensor_data(w);
    for (int64_t i = 0; i < loom_tensor_numel(w); i++) v[i] *= 1.5f;
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    loom_tensor_release(loss);
    run_result r = {0};
    r.n = m->n_params;
    r.bytes = calloc((size_t)r.n, sizeof *r.bytes);
    r.grads = calloc((size_t)r.n, sizeof *r.grads);
    for (int i = 0; i < r.n; i++) {
        r.bytes[i] = (size_t)loom_param_numel(m->params[i]) * sizeof(float);
        r.grads[i] = malloc(r.bytes[i]);
        memcpy(r.grads[i], m->params[i]->grad, r.bytes[i]);
    }
    loom_llama_free(m);
    return r;
}

static int same_grads(const run_result *a, const run_result *b) {
    for (int i = 0; i < a->n; i++)
        if (memcmp(a->grads[i], b->grads[i], a->bytes[i])) return 0;
    return 1;
}

/* recompute.blocks = N recomputes the first N blocks, not any other N: with
 * 1 of 3, a weight changed between forward and backward reaches the
 * gradients through block 0's replay (they differ from no recompute's) and
 * not through block 2 (they equal no recompute's), in every mode. */
static void test_which_blocks(void **state) {
    (void)state;
    loom_llama_config cfg = small_config(3);
    const loom_recompute_mode modes[3] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};
    for (int poke = 0; poke < 3; poke += 2) {
        run_result none = poked_step(&cfg, LOOM_RECOMPUTE_NONE, 0, poke);
        for (int k = 0; k < 3; k++) {
            run_result r = poked_step(&cfg, modes[k], 1, poke);
            if (same_grads(&r, &none) != (poke == 2))
                fail_msg("%s, 1 of 3 blocks, layer %d changed: gradients %s no recompute's",
                         loom_recompute_mode_name(modes[k]), poke, poke == 2 ? "differ from" : "equal");
            free_result(&r);
        }
        free_result(&none);
    }
}

int main(void) {
    loom_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matrix),
        cmocka_unit_test(test_precisions_against_fp32),
        cmocka_unit_test(test_attention_dropout),
        cmocka_unit_test(test_matrix_wide_rows),
        cmocka_unit_test(test_microbatch_accumulation),
        cmocka_unit_test(test_other_shape_before_backward),
        cmocka_unit_test(test_steady_state_no_malloc),
        cmocka_unit_test(test_some_blocks),
        cmocka_unit_test(test_which_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
