/*
 * checkpoint.c — loom_checkpoint: mode dispatch and the reentrant region.
 *
 * The reentrant region is a loom_function like any op: its forward runs the
 * region without recording and saves the inputs; its backward replays the
 * region onto a nested tape (same RNG offset) and runs a nested backward.
 * Parameters passed as inputs are handed to the replay as themselves, so
 * their gradients reach the real main_grad, never a copy.
 */
#include "recompute/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <strings.h>



static int keep_expensive(void *user, const loom_function *fn) {
    (void)user;
    return (fn->flags & LOOM_FN_EXPENSIVE) != 0;
}

const loom_recompute_policy loom_recompute_policy_default = {keep_expensive, NULL};

const char *loom_recompute_mode_name(loom_recompute_mode m) {
    switch (m) {
    case LOOM_RECOMPUTE_NONE: return "none";
    case LOOM_RECOMPUTE_REENTRANT: return "reentrant";
    case LOOM_RECOMPUTE_NONREENTRANT: return "nonreentrant";
    case LOOM_RECOMPUTE_SELECTIVE: return "selective";
    }
    return "?";
}

loom_status loom_recompute_mode_parse(const char *s, loom_recompute_mode *out) {
    if (!strcasecmp(s, "none")) *out = LOOM_RECOMPUTE_NONE;
    else if (!strcasecmp(s, "reentrant")) *out = LOOM_RECOMPUTE_REENTRANT;
    else if (!strcasecmp(s, "nonreentrant") || !strcasecmp(s, "non-reentrant")) *out = LOOM_RECOMPUTE_NONREENTRANT;
    else if (!strcasecmp(s, "selective")) *out = LOOM_RECOMPUTE_SELECTIVE;
    else return loom_error(LOOM_ERR_INVALID, "unknown recompute mode '%s': use none, reentrant, nonreentrant or selective", s);
    return LOOM_OK;
}

/* ------------------------------------------------------ reentrant region */

/* What forward found in an output slot, recorded for loom_checkpoint. */
enum { OUT_NEW = -1, OUT_NULL = -2 }; /* >= 0: the input (< n_inputs) or earlier output it is */

typedef struct reentrant_args {
    loom_region_fn fn;
    void *user;
    /* Where forward marks each output as new, NULL or an existing tensor
     * (the caller's array in loom_checkpoint; read there only, never in
     * backward). */
    int *out_kind;
} reentrant_args;

/* OUT_NEW, or the input j (j) or earlier output k (n_in + k) that out[i]
 * is: the region returned an existing tensor, as no recomputation hands
 * it back. */
static int alias_of(loom_tensor *const *in, int n_in, loom_tensor *const *out, int i) {
    for (int j = 0; j < n_in; j++)
        if (in[j] && out[i] == in[j]) return j;
    for (int k = 0; k < i; k++)
        if (out[i] == out[k]) return n_in + k;
    return OUT_NEW;
}

typedef struct reentrant_state {
    loom_rng rng_start;
} reentrant_state;

static loom_status reentrant_forward(loom_fn_ctx *ctx, loom_tensor *const *inputs, int n_inputs,
                                     loom_tensor **outputs, int n_outputs) {
    const reentrant_args *a = loom_ctx_args(ctx);
    reentrant_state *s = loom_ctx_state(ctx, sizeof *s);
    s->rng_start = *loom_rng_default();
    loom_no_grad_enter();
    /* Recorded, and not inside an enclosing region's replay (whose first
     * forward counted these uses already): count the region's parameter
     * uses now, so they are all known before the backward; the replay
     * records them without counting again. */
    int counting = !ctx->replay && !ctx->discard && !autograd_uses_counted();
    int saved = counting ? autograd_count_uses_begin() : 0;
    loom_status st = a->fn(a->user, inputs, n_inputs, outputs, n_outputs);
    if (counting) autograd_count_uses_end(saved);
    loom_no_grad_exit();
    if (st != LOOM_OK) return st;
    /* An output the region left NULL becomes an empty stand-in (a node's
     * outputs are tensors); loom_checkpoint hands NULL back in its place,
     * and the replay's NULL there takes no gradient. One that is an input
     * or an earlier output: loom_checkpoint hands that tensor back itself,
     * so its gradient gathers there, in the order of the run without
     * recomputation, and the node's slot for it takes none. */
    for (int i = 0; i < n_outputs; i++) {
        a->out_kind[i] = outputs[i] ? alias_of(inputs, n_inputs, outputs, i) : OUT_NULL;
        if (!outputs[i] && !(outputs[i] = loom_tensor_new(LOOM_F32, 1, (const int64_t[]){0}, LOOM_MEM_ACTIVATIONS)))
            return LOOM_ERR_NOMEM;
    }
    return loom_ctx_save(ctx, inputs, n_inputs);
}

static loom_status reentrant_backward(loom_fn_ctx *ctx, loom_tensor *const *grad_outputs, int n_outputs,
                                      loom_tensor **grad_inputs, int n_inputs) {
    const reentrant_args *a = loom_ctx_args(ctx);
    const reentrant_state *s = loom_ctx_state(ctx, sizeof *s);
    loom_tensor *in_local[16], *out_local[16];
    loom_tensor **in = n_inputs <= 16 ? in_local : calloc((size_t)n_inputs, sizeof *in);
    loom_tensor **out = n_outputs <= 16 ? out_local : calloc((size_t)n_outputs, sizeof *out);
    loom_status st = (in && out) ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
    for (int i = 0; i < n_inputs; i++) if (in) in[i] = NULL;
    for (int i = 0; i < n_outputs; i++) if (out) out[i] = NULL;
    /* Fresh leaves for activations; parameters stay themselves; an
     * activation passed twice is one leaf, as it is one tensor without
     * recomputation (its gradient goes back once, from the first slot). */
    loom_tensor *saved_local[16];
    loom_tensor **saved = n_inputs <= 16 ? saved_local : calloc((size_t)n_inputs, sizeof *saved);
    if (!saved && st == LOOM_OK) st = loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
    for (int i = 0; i < n_inputs && st == LOOM_OK; i++) {
        loom_tensor *t;
        st = loom_ctx_saved(ctx, i, &t);
        saved[i] = t;
        if (st != LOOM_OK || !t) continue;
        if (t->param) {
            in[i] = loom_tensor_retain(t);
            continue;
        }
        int first = 0;
        while (first < i && saved[first] != t) first++;
        if (first < i) {
            in[i] = loom_tensor_retain(in[first]);
            continue;
        }
        in[i] = loom_tensor_detach(t);
        if (!in[i]) {
            st = LOOM_ERR_NOMEM;
        } else if ((in[i]->requires_grad = loom_ctx_needs_input_grad(ctx, i))) {
            /* The gradient the input has from uses after the region seeds
             * the replay's leaf: the uses inside then add to it one by one,
             * in the order and with the roundings of the run without
             * recomputation, and the sum goes back as the input's gradient. */
            in[i]->grad = autograd_take_input_grad(i);
        }
    }
    if (st == LOOM_OK) st = autograd_tape_room();
    if (st == LOOM_OK) {
        double started = recompute_replay_begin();
        loom_tape_push();
        autograd_uses_counted_enter(); /* the forward counted them */
        int grad_mode = autograd_grad_mode_enable();
        loom_rng *rng = loom_rng_default(), saved_rng = *rng;
        *rng = s->rng_start;
        st = a->fn(a->user, in, n_inputs, out, n_outputs);
        *rng = saved_rng;
        recompute_replay_end(started);
        if (st == LOOM_OK) {
            /* Outputs that need no gradient (frozen parameters, inputs that
             * need none) take none: then the region has nothing to add.
             * Neither do outputs that are an input or an earlier output:
             * loom_checkpoint handed those tensors back themselves. */
            int any = 0;
            for (int k = 0; k < n_outputs; k++) {
                if (out[k] && alias_of(in, n_inputs, out, k) != OUT_NEW) {
                    loom_tensor_release(out[k]);
                    out[k] = NULL;
                }
                any |= out[k] && loom_tensor_requires_grad(out[k]);
            }
            if (any) st = loom_backward_multi(out, grad_outputs, n_outputs);
        }
        autograd_grad_mode_restore(grad_mode);
        autograd_uses_counted_exit();
        loom_tape_pop();
    }
    for (int i = 0; i < n_inputs; i++) {
        if (!in || !in[i]) continue;
        int dup = 0;
        for (int j = 0; j < i && !dup; j++) dup = in[j] == in[i];
        if (st == LOOM_OK && !dup && !in[i]->param && in[i]->grad) grad_inputs[i] = loom_tensor_retain(in[i]->grad);
        loom_tensor_release(in[i]);
    }
    if (saved != saved_local) free(saved);
    for (int k = 0; k < n_outputs; k++) if (out) loom_tensor_release(out[k]);
    if (in != in_local) free(in);
    if (out != out_local) free(out);
    return st;
}

static const loom_function reentrant_fn = {
    "checkpoint_reentrant", -1, -1, LOOM_FN_PASS_THROUGH_PARAMS, reentrant_forward, reentrant_backward,
};

/* ------------------------------------------------------------------ entry */

loom_status loom_checkpoint(loom_recompute_mode mode, loom_region_fn fn, void *user,
                            loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                            int n_outputs) {
    return loom_checkpoint_flags(mode, 0, fn, user, inputs, n_inputs, outputs, n_outputs);
}

loom_status loom_checkpoint_flags(loom_recompute_mode mode, unsigned flags, loom_region_fn fn, void *user,
                                  loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                                  int n_outputs) {
    if (!fn) return loom_error(LOOM_ERR_INVALID, "checkpoint: region function is NULL");
    if (flags & ~(unsigned)LOOM_REGION_OPS_ONLY)
        return loom_error(LOOM_ERR_INVALID, "checkpoint: unknown flags 0x%x", flags & ~(unsigned)LOOM_REGION_OPS_ONLY);
    switch (mode) {
    case LOOM_RECOMPUTE_NONE:
        for (int i = 0; i < n_outputs; i++) outputs[i] = NULL;
        return fn(user, inputs, n_inputs, outputs, n_outputs);
    case LOOM_RECOMPUTE_NONREENTRANT:
        return recompute_region_run(NULL, flags, fn, user, inputs, n_inputs, outputs, n_outputs);
    case LOOM_RECOMPUTE_SELECTIVE:
        return loom_checkpoint_policy(&loom_recompute_policy_default, fn, user, inputs, n_inputs, outputs,
                                      n_outputs);
    case LOOM_RECOMPUTE_REENTRANT: {
        if (!loom_grad_enabled()) {
            for (int i = 0; i < n_outputs; i++) outputs[i] = NULL;
            return fn(user, inputs, n_inputs, outputs, n_outputs);
        }
        int kind_local[16];
        int *out_kind = n_outputs <= 16 ? kind_local : calloc((size_t)n_outputs, sizeof *out_kind);
        if (!out_kind) return loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
        recompute_count_region();
        reentrant_args a = {fn, user, out_kind};
        loom_status st = loom_function_apply(&reentrant_fn, inputs, n_inputs, outputs, n_outputs, &a, sizeof a);
        for (int i = 0; i < n_outputs && st == LOOM_OK; i++) {
            if (out_kind[i] == OUT_NEW) continue;
            loom_tensor_release(outputs[i]); /* the stand-in, or apply's new view of an existing tensor */
            outputs[i] = out_kind[i] == OUT_NULL ? NULL
                         : loom_tensor_retain(out_kind[i] < n_inputs ? inputs[out_kind[i]]
                                                                    : outputs[out_kind[i] - n_inputs]);
        }
        if (out_kind != kind_local) free(out_kind);
        return st;
    }
    }
    return loom_error(LOOM_ERR_INVALID, "checkpoint: unknown mode %d", (int)mode);
}
