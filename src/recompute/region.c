/*
 * region.c — non-reentrant and selective checkpoint regions.
 *
 * Owns: placeholders for activations saved inside a region, the region's
 * replay (once, on first need, with the region's RNG offset restored), the
 * selective policy's kept outputs, and the determinism check.
 * Must never: see a parameter or a NULL slot (autograd stores those itself
 * before any hook runs), or replay a region twice in one backward.
 */
#include "recompute/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static _Thread_local loom_recompute_stats stats;

void loom_recompute_get_stats(loom_recompute_stats *out) { *out = stats; }
void loom_recompute_reset_stats(void) { memset(&stats, 0, sizeof stats); }
void recompute_count_region(void) { stats.regions++; }
/* Replays nest in no path today (a region's forward never unpacks a
 * placeholder; a reentrant replay's nested backward runs after its forward
 * is timed), but a region that ran a backward itself would: only the
 * outermost replay adds its time, so none is counted twice. */
static _Thread_local int replay_depth;

double recompute_replay_begin(void) {
    stats.replays++;
    replay_depth++;
    return autograd_seconds();
}

void recompute_replay_end(double started) {
    if (--replay_depth == 0) stats.replay_seconds += autograd_seconds() - started;
}

typedef struct saved_meta {
    int ndim;
    int64_t shape[LOOM_MAX_DIMS];
    loom_dtype dtype;
    int dropped; /* saved tensors: the placeholder went before the replay */
} saved_meta;

static void meta_of(saved_meta *m, const loom_tensor *t) {
    m->ndim = t->ndim;
    memcpy(m->shape, t->shape, sizeof m->shape);
    m->dtype = t->dtype;
}

static int meta_matches(const saved_meta *m, const loom_tensor *t) {
    int same = m->ndim == t->ndim && m->dtype == t->dtype;
    for (int d = 0; same && d < m->ndim; d++) same = m->shape[d] == t->shape[d];
    return same;
}

typedef struct op_record {
    const loom_function *fn;
    int recorded;
    int n_inputs;
    unsigned char *needs_grad;
    loom_tensor **kept; /* its n_outs outputs, kept by the policy (NULL: recomputed) */
    /* A kept op is not re-run by the replay. The activations it saved that
     * were its own inputs are placeholders [ph_first, ph_first + ph_count),
     * refilled from the replay's inputs: ph_input[i] is which input. */
    int ph_first, ph_count;
    int *ph_input;
    /* Dead-op skipping (full recompute): an op the replay need not run,
     * because everything it saves is one of its inputs and nothing live
     * consumes its outputs, gets its placeholders refilled from its inputs
     * and NaN-filled outputs of the recorded shapes. */
    int *in_producer;     /* per input: the region op whose output shares its storage, or -1 */
    const loom_storage **out_storage; /* its outputs' storage in the forward (identity only) */
    saved_meta *out_meta;
    int n_outs;
    int own_saves;        /* saved something that is not one of its inputs */
    int rng_used;         /* drew random numbers (skipping would shift later draws) */
    loom_rng rng_after;   /* the default RNG when it returned in the first forward */
    int live, skip;
} op_record;

typedef struct region {
    int refcount;
    loom_region_fn fn;
    void *user;
    loom_tensor **inputs;
    int n_inputs, n_outputs;
    loom_rng rng_start;
    loom_recompute_policy policy;
    int has_policy;
    int ops_only;          /* the caller vouched that intermediates flow only through ops */
    int untracked;         /* an op ran under no-grad in the region's code: skip nothing */
    int failed;            /* out of memory recording it: every later op, and the region, fail */
    saved_meta *meta;
    loom_tensor **replayed;
    int n_saved, cap_saved;
    op_record *ops;
    int n_ops, cap_ops;
    int replayed_once;     /* 1 after a replay (successful or not) */
    int cur_kept;          /* first forward: index of the kept op running, or -1 */
    uint64_t cur_rng;      /* first forward: RNG offset when the current op began */
    loom_tensor *const *cur_inputs;
    loom_status replay_status;
    char replay_error[768];
    int replay_op, replay_save; /* cursors during replay */
    int mismatch;
    char mismatch_msg[384];
    saved_hooks fw_hooks, rp_hooks;
} region;

typedef struct placeholder {
    region *r;
    int index;
} placeholder;

static void region_release(region *r) {
    if (!r || --r->refcount > 0) return;
    for (int i = 0; i < r->n_inputs; i++) loom_tensor_release(r->inputs[i]);
    for (int i = 0; i < r->n_saved; i++) loom_tensor_release(r->replayed ? r->replayed[i] : NULL);
    for (int j = 0; j < r->n_ops; j++) {
        for (int k = 0; r->ops[j].kept && k < r->ops[j].n_outs; k++) loom_tensor_release(r->ops[j].kept[k]);
        free(r->ops[j].kept);
        free(r->ops[j].needs_grad);
        free(r->ops[j].ph_input);
        free(r->ops[j].in_producer);
        free(r->ops[j].out_storage);
        free(r->ops[j].out_meta);
    }
    free(r->inputs);
    free(r->meta);
    free(r->replayed);
    free(r->ops);
    free(r);
}

/* Stored as is (never recomputed): the region's inputs and kept outputs. */
static int is_stored(const region *r, const loom_tensor *t) {
    for (int i = 0; i < r->n_inputs; i++)
        if (r->inputs[i] == t) return 1;
    for (int j = 0; j < r->n_ops; j++)
        for (int k = 0; r->ops[j].kept && k < r->ops[j].n_outs; k++)
            if (r->ops[j].kept[k] == t) return 1;
    return 0;
}

/* ---------------------------------------------------------- first forward */

/* Out of memory while recording the region: the region fails (its call
 * returns LOOM_ERR_NOMEM), and every later op in it fails at once. */
static int out_of_memory(region *r, const char *what) {
    r->failed = 1;
    loom_error(LOOM_ERR_NOMEM, "recompute: out of memory recording %s", what);
    return -1;
}

static int fw_before(void *self, loom_fn_ctx *ctx, int recorded, loom_tensor *const *inputs, loom_tensor **outputs,
                     int n_outputs) {
    (void)outputs; (void)n_outputs;
    region *r = self;
    r->cur_kept = -1; /* a kept op whose forward failed left it set */
    if (r->failed) return out_of_memory(r, ctx->fn->name);
    if (r->n_ops == r->cap_ops) {
        int cap = r->cap_ops ? 2 * r->cap_ops : 16;
        op_record *n = realloc(r->ops, (size_t)cap * sizeof *n);
        if (!n) return out_of_memory(r, ctx->fn->name);
        r->ops = n;
        r->cap_ops = cap;
    }
    op_record *op = &r->ops[r->n_ops++];
    memset(op, 0, sizeof *op);
    op->fn = ctx->fn;
    op->recorded = recorded;
    op->n_inputs = ctx->n_inputs;
    op->needs_grad = malloc((size_t)(ctx->n_inputs > 0 ? ctx->n_inputs : 1));
    op->ph_input = malloc((size_t)(ctx->n_inputs > 0 ? ctx->n_inputs : 1) * 4 * sizeof *op->ph_input);
    op->in_producer = malloc((size_t)(ctx->n_inputs > 0 ? ctx->n_inputs : 1) * sizeof *op->in_producer);
    if (!op->needs_grad || !op->ph_input || !op->in_producer) return out_of_memory(r, ctx->fn->name);
    memcpy(op->needs_grad, ctx->needs_grad, (size_t)ctx->n_inputs);
    op->ph_first = r->n_saved;
    /* By storage, so that a view of an op's output counts as that output. */
    for (int i = 0; i < ctx->n_inputs; i++) {
        op->in_producer[i] = -1;
        for (int j = r->n_ops - 2; j >= 0 && op->in_producer[i] < 0 && inputs[i]; j--)
            for (int k = 0; k < r->ops[j].n_outs; k++)
                if (r->ops[j].out_storage[k] == inputs[i]->storage) op->in_producer[i] = j;
    }
    r->cur_inputs = inputs;
    r->cur_rng = loom_rng_default()->offset;
    /* A kept op is not re-run by the replay: what it saves is stored as is,
     * except its inputs, which the replay recomputes anyway (fw_pack). */
    if (recorded && r->has_policy && r->policy.keep(r->policy.user, ctx->fn))
        r->cur_kept = r->n_ops - 1; /* its outputs arrive in fw_after */
    return 0;
}

static int fw_after(void *self, loom_fn_ctx *ctx, int recorded, loom_tensor **outputs, int n_outputs) {
    region *r = self;
    op_record *op = &r->ops[r->n_ops - 1];
    (void)recorded;
    int kept = r->cur_kept == r->n_ops - 1;
    r->cur_kept = -1;
    if (r->failed) return out_of_memory(r, ctx->fn->name); /* one of its saves could not be packed */
    op->ph_count = r->n_saved - op->ph_first;
    op->rng_used = loom_rng_default()->offset != r->cur_rng;
    op->rng_after = *loom_rng_default();
    op->out_storage = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *op->out_storage);
    op->out_meta = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *op->out_meta);
    if (kept) op->kept = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *op->kept);
    if (!op->out_storage || !op->out_meta || (kept && !op->kept)) return out_of_memory(r, ctx->fn->name);
    for (int k = 0; k < n_outputs; k++) {
        op->out_storage[k] = outputs[k]->storage;
        meta_of(&op->out_meta[k], outputs[k]);
    }
    op->n_outs = n_outputs;
    if (!kept) return 0;
    for (int k = 0; k < n_outputs; k++) op->kept[k] = loom_tensor_retain(outputs[k]);
    stats.kept_outputs += n_outputs;
    return 0;
}

static void fw_untracked(void *self) { ((region *)self)->untracked = 1; }

static void *fw_pack(void *self, loom_fn_ctx *ctx, loom_tensor *t) {
    (void)ctx;
    region *r = self;
    if (is_stored(r, t)) return NULL;
    int refill = -1;
    op_record *op = &r->ops[r->n_ops - 1];
    for (int j = 0; j < op->n_inputs && refill < 0; j++)
        if (r->cur_inputs[j] == t) refill = j;
    int room = r->n_saved - op->ph_first < 4 * (op->n_inputs > 0 ? op->n_inputs : 1);
    if (r->cur_kept >= 0) {
        /* Anything else a kept op saves cannot be rebuilt: store it. */
        if (refill < 0 || !room) return NULL;
    }
    if (refill >= 0 && room) op->ph_input[r->n_saved - op->ph_first] = refill;
    else op->own_saves = 1;
    /* Out of memory: the tensor is stored as is for now, and the op and
     * the region fail (fw_after). */
    if (r->n_saved == r->cap_saved) {
        int cap = r->cap_saved ? 2 * r->cap_saved : 32;
        saved_meta *m = realloc(r->meta, (size_t)cap * sizeof *m);
        if (!m) return r->failed = 1, NULL;
        r->meta = m;
        r->cap_saved = cap;
    }
    placeholder *ph = malloc(sizeof *ph);
    if (!ph) return r->failed = 1, NULL;
    meta_of(&r->meta[r->n_saved], t);
    r->meta[r->n_saved].dropped = 0;
    ph->r = r;
    ph->index = r->n_saved++;
    r->refcount++;
    stats.placeholders++;
    return ph;
}

/* ----------------------------------------------------------------- replay */

static void mismatch(region *r, const char *msg) {
    if (!r->mismatch) snprintf(r->mismatch_msg, sizeof r->mismatch_msg, "%s", msg);
    r->mismatch = 1;
}

/* A skipped op's output is filled with NaN (all-ones bytes for other
 * dtypes), not left with whatever the allocator's cache held: if anything
 * did read it after all, the gradients say so loudly instead of being
 * silently computed from a stale copy of the value. */
static void poison(loom_tensor *t) {
    size_t n = (size_t)loom_tensor_numel(t);
    void *d = loom_tensor_data(t);
    if (t->dtype == LOOM_F32) {
        float nan = NAN;
        for (size_t i = 0; i < n; i++) ((float *)d)[i] = nan;
    } else if (t->dtype == LOOM_BF16 || t->dtype == LOOM_F16) {
        uint16_t nan = t->dtype == LOOM_BF16 ? 0x7fc0 : 0x7e00;
        for (size_t i = 0; i < n; i++) ((uint16_t *)d)[i] = nan;
    } else {
        memset(d, 0xff, n * loom_dtype_size(t->dtype));
    }
}

static int rp_before(void *self, loom_fn_ctx *ctx, int recorded, loom_tensor *const *inputs, loom_tensor **outputs,
                     int n_outputs) {
    (void)recorded;
    region *r = self;
    int j = r->replay_op++;
    char msg[256];
    if (j >= r->n_ops || r->ops[j].fn != ctx->fn || r->ops[j].n_inputs != ctx->n_inputs) {
        snprintf(msg, sizeof msg, "op %d of the replay is %s, the forward ran %s", j, ctx->fn->name,
                 j < r->n_ops ? r->ops[j].fn->name : "nothing there");
        mismatch(r, msg);
        ctx->discard = 1;
        return 0;
    }
    op_record *op = &r->ops[j];
    memcpy(ctx->needs_grad, op->needs_grad, (size_t)ctx->n_inputs);
    if (!op->recorded) ctx->discard = 1;
    if (!op->kept && !op->skip) return 0;
    if (op->n_outs != n_outputs) {
        mismatch(r, "a kept or skipped op returned a different number of outputs");
        return 0;
    }
    /* Fill the op's placeholders from this replay's inputs. */
    if (r->replay_save != op->ph_first) {
        mismatch(r, "a kept or skipped op's saved tensors are out of order in the replay");
        return 0;
    }
    for (int i = 0; i < op->ph_count; i++) {
        const loom_tensor *t = inputs[op->ph_input[i]];
        if (!t || !meta_matches(&r->meta[op->ph_first + i], t)) {
            mismatch(r, "a kept or skipped op's input differs in shape or dtype in the replay");
            return 0;
        }
    }
    if (op->skip) { /* outputs nothing live reads: allocated, not computed */
        for (int k = 0; k < n_outputs; k++) {
            const saved_meta *m = &op->out_meta[k];
            outputs[k] = loom_tensor_new(m->dtype, m->ndim, m->shape, LOOM_MEM_ACTIVATIONS);
            if (!outputs[k]) { /* out of memory: run the op after all */
                for (int i = 0; i < k; i++) { loom_tensor_release(outputs[i]); outputs[i] = NULL; }
                return 0;
            }
            poison(outputs[k]);
        }
        stats.skipped_ops++;
    } else {
        for (int k = 0; k < n_outputs; k++) outputs[k] = loom_tensor_retain(op->kept[k]);
    }
    for (int i = 0; i < op->ph_count; i++)
        r->replayed[op->ph_first + i] = loom_tensor_retain((loom_tensor *)inputs[op->ph_input[i]]);
    r->replay_save += op->ph_count;
    /* The op does not run, so it draws nothing: move the RNG to where it
     * left it in the forward, so later ops of the replay draw the numbers
     * they drew then (a kept dropout before a recomputed one). */
    if (op->rng_used) *loom_rng_default() = op->rng_after;
    return 1;
}

/* Which ops the replay of a full (non-selective) region may skip, when its
 * caller vouched that the region's intermediates flow only through ops
 * (LOOM_REGION_OPS_ONLY) and no op ran under no-grad in it: walking back
 * from the end, an op is live when it saved something other than its
 * inputs, drew random numbers, passes parameters through (a nested
 * reentrant region: it does more than produce outputs), or a live op reads
 * one of its outputs or a view of one; a skipped op still needs the inputs
 * it refills its placeholders from, so their producers are live too. The
 * region's own outputs are discarded by the replay. */
static void mark_skippable(region *r) {
    if (!r->ops_only || r->untracked) return;
    for (int j = r->n_ops - 1; j >= 0; j--) {
        op_record *op = &r->ops[j];
        op->live |= op->own_saves || op->rng_used || (op->fn->flags & LOOM_FN_PASS_THROUGH_PARAMS);
        op->skip = !op->live;
        for (int i = 0; i < op->n_inputs; i++) {
            int p = op->in_producer[i], needed = op->live;
            for (int q = 0; q < op->ph_count && !needed; q++) needed = op->ph_input[q] == i;
            if (p >= 0 && needed) r->ops[p].live = 1;
        }
    }
}

static int rp_after(void *self, loom_fn_ctx *ctx, int recorded, loom_tensor **outputs, int n_outputs) {
    (void)self; (void)ctx; (void)recorded; (void)outputs; (void)n_outputs;
    return 0;
}

static void *rp_pack(void *self, loom_fn_ctx *ctx, loom_tensor *t) {
    (void)ctx;
    region *r = self;
    if (is_stored(r, t)) return NULL;
    int k = r->replay_save++;
    char msg[256], a[96];
    if (k >= r->n_saved) {
        snprintf(msg, sizeof msg, "the replay saved more tensors than the forward's %d", r->n_saved);
        mismatch(r, msg);
        return NULL;
    }
    const saved_meta *m = &r->meta[k];
    if (!meta_matches(m, t)) {
        char b[96];
        loom_tensor fw = {.dtype = m->dtype, .ndim = m->ndim};
        memcpy(fw.shape, m->shape, sizeof fw.shape);
        snprintf(msg, sizeof msg, "saved tensor %d is %s in the replay but was %s in the forward", k,
                 loom_tensor_describe(t, a, sizeof a), loom_tensor_describe(&fw, b, sizeof b));
        mismatch(r, msg);
        return NULL;
    }
    /* What no placeholder will ask for is not kept. */
    if (!m->dropped) r->replayed[k] = loom_tensor_retain(t);
    return NULL;
}

static loom_status region_replay(region *r) {
    r->replayed_once = 1;
    r->replayed = calloc((size_t)(r->n_saved ? r->n_saved : 1), sizeof *r->replayed);
    loom_tensor **outs = calloc((size_t)(r->n_outputs ? r->n_outputs : 1), sizeof *outs);
    if (!r->replayed || !outs) {
        free(outs);
        return r->replay_status = loom_error(LOOM_ERR_NOMEM, "recompute: out of memory replaying a region");
    }
    loom_status room = autograd_hooks_room();
    if (room != LOOM_OK) {
        free(outs);
        snprintf(r->replay_error, sizeof r->replay_error, "%s", loom_last_error());
        return r->replay_status = room;
    }
    double started = recompute_replay_begin();
    r->replay_op = r->replay_save = 0;
    r->mismatch = 0;
    if (!r->has_policy) mark_skippable(r);
    loom_rng *rng = loom_rng_default(), saved_rng = *rng;
    *rng = r->rng_start;
    /* Backward runs under no-grad; the replay must see grad mode as the
     * forward did, so that the same calls save the same tensors. */
    int grad_mode = autograd_grad_mode_enable();
    autograd_hooks_push(&r->rp_hooks);
    loom_status st = r->fn(r->user, r->inputs, r->n_inputs, outs, r->n_outputs);
    autograd_hooks_pop();
    autograd_grad_mode_restore(grad_mode);
    *rng = saved_rng;
    recompute_replay_end(started);
    for (int i = 0; i < r->n_outputs; i++) loom_tensor_release(outs[i]);
    free(outs);
    if (st != LOOM_OK) {
        snprintf(r->replay_error, sizeof r->replay_error, "recompute: replaying a region failed: %s",
                 loom_last_error());
        return r->replay_status = st;
    }
    if (!r->mismatch && r->replay_op != r->n_ops) {
        snprintf(r->mismatch_msg, sizeof r->mismatch_msg, "the replay ran %d ops, the forward %d", r->replay_op,
                 r->n_ops);
        r->mismatch = 1;
    }
    if (!r->mismatch && r->replay_save != r->n_saved) {
        snprintf(r->mismatch_msg, sizeof r->mismatch_msg, "the replay saved %d tensors, the forward %d",
                 r->replay_save, r->n_saved);
        r->mismatch = 1;
    }
    if (r->mismatch) {
        snprintf(r->replay_error, sizeof r->replay_error,
                 "recompute: determinism check failed: %s. A recomputed region must run the same ops "
                 "with the same shapes and dtypes given the same inputs and RNG offset", r->mismatch_msg);
        return r->replay_status = LOOM_ERR_STATE;
    }
    return r->replay_status = LOOM_OK;
}

static loom_status ph_unpack(void *handle, loom_tensor **out) {
    placeholder *ph = handle;
    region *r = ph->r;
    *out = NULL;
    if (!r->replayed_once) region_replay(r);
    if (r->replay_status != LOOM_OK) return loom_error(r->replay_status, "%s", r->replay_error);
    *out = r->replayed[ph->index];
    LOOM_ASSERT(*out != NULL);
    return LOOM_OK;
}

static void ph_drop(void *handle) {
    placeholder *ph = handle;
    region *r = ph->r;
    if (r->replayed) {
        loom_tensor_release(r->replayed[ph->index]);
        r->replayed[ph->index] = NULL;
    } else {
        r->meta[ph->index].dropped = 1;
    }
    free(ph);
    region_release(r);
}

/* ------------------------------------------------------------------ entry */

int recompute_in_region(void) {
    saved_hooks *h = autograd_hooks_top();
    return h && (h->before_forward == fw_before || h->before_forward == rp_before);
}

loom_status recompute_region_run(const loom_recompute_policy *policy, unsigned flags, loom_region_fn fn,
                                 void *user, loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                                 int n_outputs) {
    for (int i = 0; i < n_outputs; i++) outputs[i] = NULL;
    /* Without grad nothing is saved; inside another region (first forward
     * or replay) the outer region already covers this one. */
    if (!loom_grad_enabled() || recompute_in_region()) return fn(user, inputs, n_inputs, outputs, n_outputs);
    LOOM_TRY(autograd_hooks_room());
    region *r = calloc(1, sizeof *r);
    if (r) r->inputs = calloc((size_t)(n_inputs ? n_inputs : 1), sizeof *r->inputs);
    if (!r || !r->inputs) {
        free(r);
        return loom_error(LOOM_ERR_NOMEM, "recompute: out of memory for a region");
    }
    stats.regions++;
    r->refcount = 1;
    r->cur_kept = -1;
    r->fn = fn;
    r->user = user;
    r->n_inputs = n_inputs;
    r->n_outputs = n_outputs;
    for (int i = 0; i < n_inputs; i++) r->inputs[i] = loom_tensor_retain(inputs[i]);
    r->rng_start = *loom_rng_default();
    if (policy) {
        r->policy = *policy;
        r->has_policy = 1;
    }
    r->ops_only = (flags & LOOM_REGION_OPS_ONLY) != 0;
    r->fw_hooks = (saved_hooks){r, 0, fw_before, fw_after, fw_pack, ph_unpack, ph_drop, fw_untracked};
    r->rp_hooks = (saved_hooks){r, 1, rp_before, rp_after, rp_pack, ph_unpack, ph_drop, NULL};
    autograd_hooks_push(&r->fw_hooks);
    loom_status st = fn(user, inputs, n_inputs, outputs, n_outputs);
    autograd_hooks_pop();
    if (st == LOOM_OK && r->failed) /* a region that dropped an op's error */
        st = loom_error(LOOM_ERR_NOMEM, "recompute: out of memory recording a region");
    if (st != LOOM_OK)
        for (int i = 0; i < n_outputs; i++) { loom_tensor_release(outputs[i]); outputs[i] = NULL; }
    region_release(r);
    return st;
}

loom_status loom_checkpoint_policy(const loom_recompute_policy *policy, loom_region_fn fn, void *user,
                                   loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                                   int n_outputs) {
    return recompute_region_run(policy, 0, fn, user, inputs, n_inputs, outputs, n_outputs);
}
