/*
 * function.c — the function interface: ctx, saved slots, and
 * loom_function_apply, which runs forward and records a node.
 * Must never: hand a parameter or a NULL slot to a pack hook, or record a
 * call whose forward failed.
 */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>

/* Defined in engine.c */
loom_status engine_record(const loom_function *fn, loom_fn_ctx *ctx, loom_tensor *const *inputs,
                          int n_inputs, loom_tensor **outputs, int n_outputs);

/* ----------------------------------------------------------------- hooks */

#define MAX_HOOKS 64
static _Thread_local saved_hooks *hook_stack[MAX_HOOKS];
static _Thread_local int hook_depth;

void autograd_hooks_push(saved_hooks *h) {
    LOOM_ASSERT(hook_depth < MAX_HOOKS);
    hook_stack[hook_depth++] = h;
}

loom_status autograd_hooks_room(void) {
    if (hook_depth < MAX_HOOKS) return LOOM_OK;
    return loom_error(LOOM_ERR_UNSUPPORTED, "recompute: regions nest more than %d deep", MAX_HOOKS);
}

void autograd_hooks_pop(void) {
    LOOM_ASSERT(hook_depth > 0);
    hook_depth--;
}

saved_hooks *autograd_hooks_top(void) { return hook_depth ? hook_stack[hook_depth - 1] : NULL; }

/* ------------------------------------------------------------------- ctx */

loom_fn_ctx *ctx_new(const loom_function *fn, int n_inputs, const void *args, size_t args_size) {
    loom_fn_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return NULL;
    ctx->fn = fn;
    ctx->n_inputs = n_inputs;
    ctx->needs_grad = calloc((size_t)(n_inputs > 0 ? n_inputs : 1), 1);
    if (args && args_size) {
        ctx->args = malloc(args_size);
        if (ctx->args) memcpy(ctx->args, args, args_size);
        ctx->args_size = args_size;
    }
    if (!ctx->needs_grad || (args_size && args && !ctx->args)) {
        ctx_free(ctx);
        return NULL;
    }
    return ctx;
}

void ctx_free_saved(loom_fn_ctx *ctx) {
    for (int i = 0; i < ctx->n_slots; i++) {
        saved_slot *s = &ctx->slots[i];
        if (s->kind == SLOT_PACKED) s->hooks->drop(s->handle);
        else loom_tensor_release(s->t);
        s->t = NULL;
        s->handle = NULL;
    }
    ctx->freed = 1;
}

void ctx_free(loom_fn_ctx *ctx) {
    if (!ctx) return;
    if (!ctx->freed) ctx_free_saved(ctx);
    free(ctx->slots);
    free(ctx->args);
    free(ctx->needs_grad);
    free(ctx);
}

static loom_status add_slot(loom_fn_ctx *ctx, saved_slot s) {
    if (ctx->n_slots == ctx->cap_slots) {
        int cap = ctx->cap_slots ? 2 * ctx->cap_slots : 4;
        saved_slot *n = realloc(ctx->slots, (size_t)cap * sizeof *n);
        if (!n) return loom_error(LOOM_ERR_NOMEM, "save: out of memory");
        ctx->slots = n;
        ctx->cap_slots = cap;
    }
    ctx->slots[ctx->n_slots++] = s;
    return LOOM_OK;
}

loom_status loom_ctx_save(loom_fn_ctx *ctx, loom_tensor *const *tensors, int n) {
    if (!ctx) return loom_error(LOOM_ERR_INVALID, "save: ctx is NULL");
    if (n < 0 || (n > 0 && !tensors))
        return loom_error(LOOM_ERR_INVALID, "%s: save of %d tensors from %s", ctx->fn ? ctx->fn->name : "?", n,
                          n < 0 ? "a negative count" : "a NULL array");
    if (ctx->discard) return LOOM_OK;
    for (int i = 0; i < n; i++) {
        loom_tensor *t = tensors[i];
        saved_slot s = {SLOT_NULL, NULL, NULL, NULL};
        if (t && t->param) {
            /* A parameter is saved by reference, never packed. */
            s.kind = SLOT_PARAM;
            s.t = loom_tensor_retain(t);
        } else if (t) {
            s.kind = SLOT_TENSOR;
            void *h = (ctx->hooks && !ctx->keep_saved) ? ctx->hooks->pack(ctx->hooks->self, ctx, t) : NULL;
            if (h) {
                s.kind = SLOT_PACKED;
                s.handle = h;
                s.hooks = ctx->hooks;
            } else if (ctx->replay) {
                continue; /* a replay's saves live in the region, not here */
            } else {
                s.t = loom_tensor_retain(t);
            }
        } else if (ctx->replay) {
            continue;
        }
        loom_status st = add_slot(ctx, s);
        if (st != LOOM_OK) { /* the slot never made it into ctx: release what it held */
            if (s.kind == SLOT_PACKED) s.hooks->drop(s.handle);
            loom_tensor_release(s.t);
            return st;
        }
    }
    return LOOM_OK;
}

loom_status loom_ctx_saved(loom_fn_ctx *ctx, int i, loom_tensor **out) {
    if (!out) return loom_error(LOOM_ERR_INVALID, "saved: out is NULL");
    *out = NULL;
    const char *name = ctx && ctx->fn ? ctx->fn->name : "?";
    if (!ctx) return loom_error(LOOM_ERR_INVALID, "saved: ctx is NULL");
    if (ctx->freed)
        return loom_error(LOOM_ERR_STATE,
                          "%s: saved tensors were already freed (backward through a graph that was "
                          "already backpropagated; run forward again)", name);
    if (i < 0 || i >= ctx->n_slots)
        return loom_error(LOOM_ERR_INVALID, "%s: saved slot %d requested, only %d saved", name, i,
                          ctx->n_slots);
    saved_slot *s = &ctx->slots[i];
    if (s->kind == SLOT_PACKED) return s->hooks->unpack(s->handle, out);
    *out = s->t;
    return LOOM_OK;
}

int loom_ctx_n_saved(const loom_fn_ctx *ctx) { return ctx->n_slots; }

const void *loom_ctx_args(const loom_fn_ctx *ctx) { return ctx->args; }

void *loom_ctx_state(loom_fn_ctx *ctx, size_t bytes) {
    return bytes <= CTX_STATE_BYTES ? ctx->state : NULL;
}

int loom_ctx_needs_input_grad(const loom_fn_ctx *ctx, int i) {
    return i >= 0 && i < ctx->n_inputs && ctx->needs_grad[i];
}

int loom_ctx_is_replay(const loom_fn_ctx *ctx) { return ctx->replay; }

/* ----------------------------------------------------------------- apply */

static void release_outputs(loom_tensor **outputs, int n) {
    for (int i = 0; i < n; i++) {
        loom_tensor_release(outputs[i]);
        outputs[i] = NULL;
    }
}

/* Depth of forwards running on this thread (ops called inside an op's forward). */
static _Thread_local int forward_depth;

/* autograd_count_uses_begin: the no-grad and forward depths (+ 1, so 0 is
 * off) at which a reentrant region's code calls its ops. */
static _Thread_local int count_no_grad, count_forward;

int autograd_count_uses_begin(void) {
    int saved = count_no_grad << 16 | count_forward;
    count_no_grad = autograd_no_grad_depth() + 1;
    count_forward = forward_depth + 1;
    return saved;
}

void autograd_count_uses_end(int saved) {
    count_no_grad = saved >> 16;
    count_forward = saved & 0xffff;
}

/* An unrecorded call: count its trainable parameter inputs as
 * engine_record would, when a reentrant region's code made it. */
static void count_param_uses(const loom_function *fn, loom_tensor *const *inputs, int n_inputs) {
    if (!count_no_grad || count_no_grad != autograd_no_grad_depth() + 1 || count_forward != forward_depth + 1 ||
        (fn->flags & LOOM_FN_PASS_THROUGH_PARAMS))
        return;
    for (int i = 0; i < n_inputs; i++)
        if (inputs[i] && inputs[i]->param && inputs[i]->param->trainable) inputs[i]->param->uses++;
}

static loom_status run_forward(const loom_function *fn, loom_fn_ctx *ctx, loom_tensor *const *inputs,
                               int n_inputs, loom_tensor **outputs, int n_outputs) {
    /* Ops called inside a forward are part of this op, not recorded. */
    loom_no_grad_enter();
    profile_enter();
    forward_depth++;
    loom_status st = fn->forward(ctx, inputs, n_inputs, outputs, n_outputs);
    forward_depth--;
    profile_leave(fn, 0);
    loom_no_grad_exit();
    if (st != LOOM_OK) {
        release_outputs(outputs, n_outputs);
        return st;
    }
    for (int i = 0; i < n_outputs; i++) {
        loom_tensor *o = outputs[i];
        if (!o) {
            release_outputs(outputs, n_outputs);
            return loom_error(LOOM_ERR_STATE, "%s: forward returned LOOM_OK but left output %d NULL",
                              fn->name, i);
        }
        int existing = o->node || o->param || o->requires_grad;
        for (int j = 0; j < n_inputs && !existing; j++) existing = o == inputs[j];
        for (int j = 0; j < i && !existing; j++) existing = o == outputs[j];
        if (existing) {
            /* forward returned an existing tensor (an input, or one output
             * twice): the output is a new view of it, so the input keeps its
             * own history and every output gets its own node slot. */
            outputs[i] = loom_tensor_detach(o);
            loom_tensor_release(o);
            if (!outputs[i]) {
                release_outputs(outputs, n_outputs);
                return LOOM_ERR_NOMEM;
            }
        }
    }
    return LOOM_OK;
}

loom_status loom_function_apply(const loom_function *fn, loom_tensor *const *inputs, int n_inputs,
                                loom_tensor **outputs, int n_outputs, const void *args,
                                size_t args_size) {
    if (!fn || !fn->forward || !fn->backward)
        return loom_error(LOOM_ERR_INVALID, "apply: function %s has no forward or backward",
                          fn && fn->name ? fn->name : "(null)");
    if (n_inputs < 0 || n_outputs < 0 || (n_inputs > 0 && !inputs) || (n_outputs > 0 && !outputs))
        return loom_error(LOOM_ERR_INVALID, "%s: called with %d inputs and %d outputs%s", fn->name, n_inputs,
                          n_outputs, n_inputs < 0 || n_outputs < 0 ? " (a negative count)" : " and a NULL array");
    if ((fn->n_inputs >= 0 && n_inputs != fn->n_inputs) || (fn->n_outputs >= 0 && n_outputs != fn->n_outputs))
        return loom_error(LOOM_ERR_INVALID, "%s: takes %d inputs and %d outputs, called with %d and %d",
                          fn->name, fn->n_inputs, fn->n_outputs, n_inputs, n_outputs);
    for (int i = 0; i < n_outputs; i++) outputs[i] = NULL;

    loom_fn_ctx *ctx = ctx_new(fn, n_inputs, args, args_size);
    if (!ctx) return loom_error(LOOM_ERR_NOMEM, "%s: out of memory for its ctx", fn->name);
    int any = 0;
    for (int i = 0; i < n_inputs; i++) {
        const loom_tensor *t = inputs[i];
        ctx->needs_grad[i] = t && loom_tensor_requires_grad(t);
        any |= ctx->needs_grad[i] || (t && t->param && (fn->flags & LOOM_FN_PASS_THROUGH_PARAMS));
    }
    saved_hooks *hooks = autograd_hooks_top();
    int grad_on = loom_grad_enabled();
    int replaying = grad_on && hooks && hooks->replaying;
    int recorded = grad_on && !replaying && (any || (fn->flags & LOOM_FN_PASS_THROUGH_PARAMS));

    if (!grad_on || (!recorded && !replaying && !hooks)) {
        if (!grad_on && hooks && hooks->untracked_op && forward_depth == 0) hooks->untracked_op(hooks->self);
        if (!grad_on) count_param_uses(fn, inputs, n_inputs);
        ctx->discard = 1;
        loom_status st = run_forward(fn, ctx, inputs, n_inputs, outputs, n_outputs);
        ctx_free(ctx);
        return st;
    }
    ctx->hooks = hooks;
    ctx->replay = replaying;
    ctx->discard = !recorded && !replaying;
    int before = hooks ? hooks->before_forward(hooks->self, ctx, recorded, inputs, outputs, n_outputs) : 0;
    if (before != 0) {
        /* 1: the hook supplied the outputs (a kept op in a selective
         * replay); -1: it could not record the call. */
        ctx_free(ctx);
        return before > 0 ? LOOM_OK : LOOM_ERR_NOMEM;
    }
    loom_status st = run_forward(fn, ctx, inputs, n_inputs, outputs, n_outputs);
    if (st != LOOM_OK) {
        ctx_free(ctx);
        return st;
    }
    if (hooks && hooks->after_forward(hooks->self, ctx, recorded, outputs, n_outputs) != 0) {
        release_outputs(outputs, n_outputs);
        ctx_free(ctx);
        return LOOM_ERR_NOMEM;
    }
    if (!recorded) {
        ctx_free(ctx);
        return LOOM_OK;
    }
    st = engine_record(fn, ctx, inputs, n_inputs, outputs, n_outputs);
    if (st != LOOM_OK) {
        release_outputs(outputs, n_outputs);
        ctx_free(ctx);
    }
    return st;
}
