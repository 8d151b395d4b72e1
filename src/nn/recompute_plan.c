/*
 * recompute_plan.c — how many blocks to recompute for a memory budget.
 *
 * Owns: loom_llama_plan_recompute. It measures rather than models: probe
 * steps (forward and backward on token id 0, whose activations are the
 * size of any batch's) with no block recomputed, with every block, and at
 * the count that interpolating between the two picks, adding blocks while
 * the measured peak is over the budget. Peaks are LOOM_MEM_ACTIVATIONS
 * bytes, loom's own accounting (bench's peak_act_MiB).
 * Must never: leave a trace of the probes: gradients are zeroed, the
 * default RNG and the recompute settings restored, and the allocator's
 * cached blocks returned to the system (the no-recompute probe's would
 * otherwise stay in the process for the whole run).
 */
#include "loom/loom.h"
#include "nn/recompute_plan.h"

#include <math.h>
#include <stdlib.h>

/* One probe step under (mode, blocks); *peak gets its activation peak. */
static loom_status probe(loom_llama *m, loom_recompute_mode mode, int blocks, const int32_t *tok, int B, int T,
                         size_t *peak) {
    m->recompute.mode = mode;
    m->recompute.blocks = blocks;
    loom_mem_stats s;
    loom_mem_get_stats(&s);
    size_t base = s.current[LOOM_MEM_ACTIVATIONS];
    loom_mem_reset_peak();
    loom_tensor *loss = NULL;
    loom_status st = loom_llama_forward(m, tok, tok, B, T, &loss, NULL);
    if (st == LOOM_OK) st = loom_backward(loss, 1.0f);
    loom_tensor_release(loss);
    loom_mem_get_stats(&s);
    *peak = s.peak[LOOM_MEM_ACTIVATIONS] - base;
    loom_llama_zero_grad(m);
    return st;
}

loom_status recompute_plan_search(int L, size_t peak_none, size_t peak_all, size_t budget, plan_measure_fn measure,
                                  void *ctx, int *blocks, size_t *peak_out, int *probes) {
    /* Each block recomputed saves about (none - all) / L: the estimate. */
    double per = (double)(peak_none - (peak_all < peak_none ? peak_all : peak_none)) / L;
    int n = per > 0 ? (int)ceil((double)(peak_none - budget) / per) : L;
    n = n < 1 ? 1 : n > L ? L : n;
    /* From the estimate: down while one block fewer still fits, or up
     * until it fits (every block does): the fewest blocks, measured. */
    size_t peak = peak_all;
    loom_status st = LOOM_OK;
    if (n < L) {
        st = measure(ctx, n, &peak);
        (*probes)++;
    }
    if (st == LOOM_OK && peak <= budget) {
        while (st == LOOM_OK && n > 1) {
            size_t fewer = 0;
            st = measure(ctx, n - 1, &fewer);
            (*probes)++;
            if (st != LOOM_OK || fewer > budget) break;
            n--;
            peak = fewer;
        }
    } else {
        while (st == LOOM_OK && peak > budget) {
            if (++n == L) {
                peak = peak_all;
                break;
            }
            st = measure(ctx, n, &peak);
            (*probes)++;
        }
    }
    *blocks = n;
    *peak_out = peak;
    return st;
}

struct probe_ctx {
    loom_llama *m;
    loom_recompute_mode mode;
    const int32_t *tok;
    int B, T;
};

static loom_status probe_blocks(void *user, int blocks, size_t *peak) {
    struct probe_ctx *c = user;
    return probe(c->m, c->mode, blocks, c->tok, c->B, c->T, peak);
}

loom_status loom_llama_plan_recompute(loom_llama *m, loom_recompute_mode mode, int B, int T, size_t budget,
                                      loom_recompute_plan *plan) {
    int L = m->cfg.n_layers;
    if (mode == LOOM_RECOMPUTE_NONE)
        return loom_error(LOOM_ERR_INVALID, "recompute plan: give a recomputing mode (selective or full)");
    if (B <= 0 || T <= 0 || T > m->cfg.max_seq)
        return loom_error(LOOM_ERR_INVALID, "recompute plan: batch %d x sequence %d (sequence must be 1..%d)", B, T,
                          m->cfg.max_seq);
    int32_t *tok = calloc((size_t)B * T, sizeof *tok); /* (B, T) id 0 */
    if (!tok) return loom_error(LOOM_ERR_NOMEM, "recompute plan: out of memory");
    loom_llama_recompute saved = m->recompute;
    loom_rng rng = *loom_rng_default();
    loom_recompute_plan p = {.mode = mode, .budget = budget, .n_layers = L};
    loom_status st = probe(m, LOOM_RECOMPUTE_NONE, 0, tok, B, T, &p.peak_none);
    if (st == LOOM_OK) st = probe(m, mode, 0, tok, B, T, &p.peak_all);
    if (st == LOOM_OK && p.peak_none <= budget) { /* nothing to recompute */
        p.blocks = 0;
        p.peak = p.peak_none;
    } else if (st == LOOM_OK && p.peak_all > budget) {
        st = loom_error(LOOM_ERR_INVALID, "a memory budget of %.3g MiB for activations is below what recomputing "
                        "every block takes (%.2f MiB measured; %.2f MiB with none): raise it, or lower the batch or "
                        "sequence length", budget / 1048576.0, p.peak_all / 1048576.0, p.peak_none / 1048576.0);
    } else if (st == LOOM_OK) {
        struct probe_ctx ctx = {m, mode, tok, B, T};
        st = recompute_plan_search(L, p.peak_none, p.peak_all, budget, probe_blocks, &ctx, &p.blocks, &p.peak,
                                   &p.probes);
    }
    m->recompute = saved;
    *loom_rng_default() = rng;
    free(tok);
    loom_mem_trim(); /* the probes' blocks, the no-recompute one's above all, go back to the system */
    if (st == LOOM_OK) *plan = p;
    return st;
}
