/*
 * test_recompute_memory.c — the memory bound of full recompute on an
 * 8-block LLaMA (dim 64, 4 heads, ffn 128, vocab 64, B = 2, T = 32, fp32).
 *
 * All figures are LOOM_MEM_ACTIVATIONS bytes from the allocator's own
 * accounting (bytes requested, not size classes), measured, not modelled:
 *  - one block's activations: what a block leaves saved after forward
 *    without recompute, (saved(8 layers) - saved(4 layers)) / 4;
 *  - head/tail: the rest of the forward's saved bytes (final norm, logits,
 *    loss), saved(8 layers) - 8 x one block;
 *  - stored block inputs: 8 x B*T*C*4 bytes, what a recomputing region keeps.
 * With every block recomputed (reentrant or non-reentrant), the peak over
 * forward + backward must stay within
 *     head/tail + stored inputs + one block's activations + slack,
 * because backward replays one block at a time and frees each replayed
 * activation after use. The slack is the backward's working set on top of
 * the replayed block:
 *  - non-reentrant: 2 x B*T*C*4 bytes, the gradient of the residual stream
 *    and the gradient passed between two ops (measured: about 1 x);
 *  - reentrant: 2 x B*T*C*4 more, the replay's output, held during the
 *    nested backward, and the copy of its incoming gradient that the nested
 *    backward makes (measured: about 3 x in all).
 * A regression that kept a second block's activations alive (about
 * 14 x B*T*C here), or kept each replayed activation until the whole block
 * is done instead of freeing it after use (+2 x), breaks the bound.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"
#include "nn/recompute_plan.h"

#define B 2
#define T 32
#define DIM 64
#define FFN 128
#define VOCAB 64

typedef struct mem_figures {
    size_t after_forward; /* activation bytes alive after forward (saved for backward + loss) */
    size_t peak;          /* activation peak over forward + backward */
    float loss;
} mem_figures;

static size_t act_current(void) {
    loom_mem_stats s;
    loom_mem_get_stats(&s);
    return s.current[LOOM_MEM_ACTIVATIONS];
}

static mem_figures measure_blocks(int layers, loom_recompute_mode mode, int blocks) {
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = DIM; c.n_layers = layers; c.n_heads = 4; c.n_kv_heads = 4; c.ffn_dim = FFN;
    c.vocab_size = VOCAB; c.max_seq = T; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    loom_precision prec = {LOOM_F32, 1};
    loom_llama *m;
    assert_int_equal(loom_llama_new(&c, prec, &m), LOOM_OK);
    loom_llama_init_weights(m, 5);
    m->recompute.mode = mode;
    m->recompute.blocks = blocks;
    loom_llama_zero_grad(m);
    int32_t tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) {
        tok[i] = (i * 7 + 3) % VOCAB;
        tgt[i] = (i * 7 + 10) % VOCAB;
    }
    mem_figures f;
    size_t base = act_current();
    loom_mem_reset_peak();
    loom_tensor *loss = NULL;
    assert_int_equal(loom_llama_forward(m, tok, tgt, B, T, &loss, NULL), LOOM_OK);
    f.after_forward = act_current() - base;
    f.loss = loom_tensor_get(loss, 0);
    assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
    loom_mem_stats s;
    loom_mem_get_stats(&s);
    f.peak = s.peak[LOOM_MEM_ACTIVATIONS] - base;
    loom_tensor_release(loss);
    assert_int_equal(loom_grad_audit(m->params, m->n_params, NULL, 0), LOOM_OK);
    loom_llama_free(m);
    assert_int_equal(act_current(), base); /* everything freed */
    return f;
}

static mem_figures measure(int layers, loom_recompute_mode mode) { return measure_blocks(layers, mode, 0); }

static void test_full_recompute_memory_bound(void **state) {
    (void)state;
    const size_t btc = (size_t)B * T * DIM * sizeof(float); /* one (B, T, C) fp32 tensor */
    mem_figures none4 = measure(4, LOOM_RECOMPUTE_NONE);
    mem_figures none8 = measure(8, LOOM_RECOMPUTE_NONE);
    mem_figures nonre = measure(8, LOOM_RECOMPUTE_NONREENTRANT);
    mem_figures reent = measure(8, LOOM_RECOMPUTE_REENTRANT);
    mem_figures selec = measure(8, LOOM_RECOMPUTE_SELECTIVE);

    assert_true(none8.after_forward > none4.after_forward);
    size_t per_block = (none8.after_forward - none4.after_forward) / 4;
    assert_true(none8.after_forward > 8 * per_block);
    size_t head_tail = none8.after_forward - 8 * per_block;
    size_t stored_inputs = 8 * btc;
    size_t slack_nonreentrant = 2 * btc, slack_reentrant = 4 * btc;
    size_t bound_nonreentrant = head_tail + stored_inputs + per_block + slack_nonreentrant;
    size_t bound_reentrant = head_tail + stored_inputs + per_block + slack_reentrant;

    printf("recompute memory, 8-block LLaMA dim %d ffn %d vocab %d, B=%d T=%d, fp32 (activation bytes)\n", DIM, FFN,
           VOCAB, B, T);
    printf("  B*T*C*4                        %9zu\n", btc);
    printf("  one block's activations        %9zu  (%.1f x B*T*C*4)\n", per_block, (double)per_block / (double)btc);
    printf("  head/tail                      %9zu\n", head_tail);
    printf("  stored block inputs (8)        %9zu\n", stored_inputs);
    printf("  %-14s after forward %9zu   peak %9zu\n", "none", none8.after_forward, none8.peak);
    printf("  %-14s after forward %9zu   peak %9zu   bound %9zu (slack 2 x B*T*C*4)\n", "nonreentrant",
           nonre.after_forward, nonre.peak, bound_nonreentrant);
    printf("  %-14s after forward %9zu   peak %9zu   bound %9zu (slack 4 x B*T*C*4)\n", "reentrant",
           reent.after_forward, reent.peak, bound_reentrant);
    printf("  %-14s after forward %9zu   peak %9zu   (between full recompute and none)\n", "selective",
           selec.after_forward, selec.peak);

    /* The same computation in every mode. */
    assert_memory_equal(&nonre.loss, &none8.loss, sizeof(float));
    assert_memory_equal(&reent.loss, &none8.loss, sizeof(float));
    assert_memory_equal(&selec.loss, &none8.loss, sizeof(float));

    /* Selective keeps GEMM outputs but recomputes norms, RoPE, attention and
     * SwiGLU (refilling the GEMMs' saved inputs): it must hold less than no
     * recompute and more than full recompute. */
    assert_true(selec.after_forward < none8.after_forward);
    assert_true(selec.peak < none8.peak);
    assert_true(selec.after_forward > nonre.after_forward);

    /* After forward a recomputing model holds only the block inputs and the
     * head/tail. */
    assert_true(nonre.after_forward <= head_tail + stored_inputs);
    assert_true(reent.after_forward <= head_tail + stored_inputs);
    /* The peak: one block replayed at a time. */
    assert_true(nonre.peak <= bound_nonreentrant);
    assert_true(reent.peak <= bound_reentrant);
    /* Well below storing everything: under a third of it here. */
    assert_true(3 * nonre.peak < none8.peak);
    assert_true(3 * reent.peak < none8.peak);
}

/* Recomputing 4 of the 8 blocks (recompute.blocks) keeps after forward the
 * activations of the other 4 and the inputs of those 4: halfway between
 * none and full, to within one (B, T, C) tensor; the same loss. */
static void test_half_the_blocks(void **state) {
    (void)state;
    const size_t btc = (size_t)B * T * DIM * sizeof(float);
    mem_figures none4 = measure(4, LOOM_RECOMPUTE_NONE);
    mem_figures none8 = measure(8, LOOM_RECOMPUTE_NONE);
    mem_figures half = measure_blocks(8, LOOM_RECOMPUTE_NONREENTRANT, 4);
    size_t per_block = (none8.after_forward - none4.after_forward) / 4;
    size_t head_tail = none8.after_forward - 8 * per_block;
    size_t want = head_tail + 4 * per_block + 4 * btc;
    printf("  4 of 8 blocks recomputed: after forward %zu, want %zu +- %zu; peak %zu (none %zu)\n",
           half.after_forward, want, btc, half.peak, none8.peak);
    assert_memory_equal(&half.loss, &none8.loss, sizeof(float));
    assert_true(half.after_forward + btc >= want && half.after_forward <= want + btc);
    assert_true(half.peak < none8.peak);
}

/* loom_llama_plan_recompute on the 8-block model: a budget the run without
 * recompute fits needs no block; one between picks the fewest blocks whose
 * measured peak fits (one block fewer does not, measured again here); one
 * below recomputing every block is refused, naming both peaks. The probes
 * leave no gradient, no cached block, the recompute settings and the RNG as
 * they were. */
static void test_plan_for_budget(void **state) {
    (void)state;
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = DIM; c.n_layers = 8; c.n_heads = 4; c.n_kv_heads = 4; c.ffn_dim = FFN;
    c.vocab_size = VOCAB; c.max_seq = T; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    loom_llama *m;
    assert_int_equal(loom_llama_new(&c, (loom_precision){LOOM_F32, 1}, &m), LOOM_OK);
    loom_llama_init_weights(m, 5);
    m->recompute.mode = LOOM_RECOMPUTE_SELECTIVE; /* not what the plan probes: must come back */
    m->recompute.blocks = 3;
    loom_rng_init(loom_rng_default(), 99);
    loom_rng before = *loom_rng_default();
    mem_figures none8 = measure(8, LOOM_RECOMPUTE_NONE), all8 = measure(8, LOOM_RECOMPUTE_NONREENTRANT);

    loom_recompute_plan p;
    assert_int_equal(loom_llama_plan_recompute(m, LOOM_RECOMPUTE_NONREENTRANT, B, T, none8.peak, &p), LOOM_OK);
    assert_int_equal(p.blocks, 0);
    assert_int_equal(p.peak_none, none8.peak);
    assert_int_equal(p.peak_all, all8.peak);

    size_t budget = (none8.peak + all8.peak) / 2;
    assert_int_equal(loom_llama_plan_recompute(m, LOOM_RECOMPUTE_NONREENTRANT, B, T, budget, &p), LOOM_OK);
    loom_mem_stats ms; /* the probes' blocks went back to the system, not to the cache */
    loom_mem_get_stats(&ms);
    assert_int_equal(ms.cached, 0);
    printf("  plan for %zu bytes: %d of 8 blocks, peak %zu (none %zu, all %zu, %d probes)\n", budget, p.blocks,
           p.peak, p.peak_none, p.peak_all, p.probes);
    assert_true(p.blocks > 0 && p.blocks < 8);
    assert_true(p.peak <= budget);
    assert_int_equal(measure_blocks(8, LOOM_RECOMPUTE_NONREENTRANT, p.blocks).peak, p.peak);
    if (p.blocks > 1) assert_true(measure_blocks(8, LOOM_RECOMPUTE_NONREENTRANT, p.blocks - 1).peak > budget);

    assert_int_equal(loom_llama_plan_recompute(m, LOOM_RECOMPUTE_NONREENTRANT, B, T, all8.peak - 1, &p),
                     LOOM_ERR_INVALID);
    assert_non_null(strstr(loom_last_error(), "below what recomputing every block takes"));
    assert_int_equal(loom_llama_plan_recompute(m, LOOM_RECOMPUTE_NONE, B, T, budget, &p), LOOM_ERR_INVALID);

    assert_int_equal(m->recompute.mode, LOOM_RECOMPUTE_SELECTIVE);
    assert_int_equal(m->recompute.blocks, 3);
    assert_memory_equal(loom_rng_default(), &before, sizeof before);
    for (int i = 0; i < m->n_params; i++) {
        const float *g = m->params[i]->grad;
        for (int64_t k = 0; k < loom_param_numel(m->params[i]); k++) assert_true(g[k] == 0.0f);
    }
    loom_llama_free(m);
}

/* A synthetic curve of peaks for recompute_plan_search: none at 0 blocks,
 * all at L, shaped in between by `shape` (1 linear, 2 convex, 3 concave, 4
 * a step at L); `fail_at` > 0 makes that measurement fail. */
typedef struct curve {
    int L, shape, calls, fail_at;
    size_t none, all;
} curve;

static size_t curve_peak(const curve *c, int n) {
    double f = (double)n / c->L, drop = (double)(c->none - c->all);
    switch (c->shape) {
    case 1: return c->none - (size_t)(drop * f);
    case 2: return c->none - (size_t)(drop * f * f);
    case 3: return c->none - (size_t)(drop * sqrt(f));
    default: return n < c->L ? c->none : c->all;
    }
}

static loom_status curve_measure(void *ctx, int n, size_t *peak) {
    curve *c = ctx;
    assert_true(n >= 1 && n < c->L); /* never 0 or L: the caller measured those */
    if (++c->calls == c->fail_at) return loom_error(LOOM_ERR_NOMEM, "probe %d failed", c->calls);
    *peak = curve_peak(c, n);
    return LOOM_OK;
}

/* The search behind the plan, on curves the models never give: where the
 * interpolated estimate is short (a convex curve: it steps up), over (a
 * concave one: it steps down), exact, or only every block fits (a step). For
 * every budget between the two ends it finds the fewest blocks that fit, as
 * trying every count does, measuring each count at most once; a failed
 * measurement is its error. */
static void test_plan_search_curves(void **state) {
    (void)state;
    int went_up = 0, went_down = 0;
    for (int shape = 1; shape <= 4; shape++) {
        for (int L = 1; L <= 12; L++) {
            for (int k = 0; k <= 40; k++) {
                curve c = {L, shape, 0, 0, 10000000, 1000000};
                size_t budget = c.all + (c.none - 1 - c.all) * (size_t)k / 40;
                int want = 1;
                while (want < L && curve_peak(&c, want) > budget) want++;
                int n = -1, probes = 0;
                size_t peak = 0;
                assert_int_equal(recompute_plan_search(L, c.none, c.all, budget, curve_measure, &c, &n, &peak,
                                                       &probes), LOOM_OK);
                if (n != want || peak != curve_peak(&c, want))
                    fail_msg("shape %d, L %d, budget %zu: %d blocks (peak %zu), want %d (peak %zu)", shape, L,
                             budget, n, peak, want, curve_peak(&c, want));
                assert_int_equal(probes, c.calls);
                assert_true(probes <= (L > 1 ? L - 1 : 0));
                /* Which way it went from the estimate. */
                double per = (double)(c.none - c.all) / L;
                int est = (int)ceil((double)(c.none - budget) / per);
                est = est < 1 ? 1 : est > L ? L : est;
                went_up += n > est;
                went_down += n < est;
            }
        }
    }
    assert_true(went_up > 0 && went_down > 0); /* both directions of the search ran */
    curve c = {8, 2, 0, 2, 10000000, 1000000};
    int n, probes = 0;
    size_t peak;
    assert_int_equal(recompute_plan_search(8, c.none, c.all, (c.none + c.all) / 2, curve_measure, &c, &n, &peak,
                                           &probes), LOOM_ERR_NOMEM);
    assert_int_equal(probes, 2);
}

int main(void) {
    /* One thread: the activation figures do not depend on it, and the test
     * stays fast on a busy machine and under the sanitizers. */
    loom_set_threads(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_recompute_memory_bound),
        cmocka_unit_test(test_half_the_blocks),
        cmocka_unit_test(test_plan_for_budget),
        cmocka_unit_test(test_plan_search_curves),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
