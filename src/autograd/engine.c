/*
 * engine.c — the tape and the backward engine.
 * Owns: nodes (creation order), gradient routing and accumulation, freeing
 * each node's saved tensors right after its backward, no-grad scopes.
 * Must never: assign a parameter's gradient (it accumulates), keep an
 * output tensor alive from a node (nodes hold metadata only), or walk a
 * freed node.
 */
#include "internal.h"
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>

/* ------------------------------------------------------------- grad mode */

static _Thread_local int no_grad_depth;

void loom_no_grad_enter(void) { no_grad_depth++; }
void loom_no_grad_exit(void) { if (no_grad_depth > 0) no_grad_depth--; }
int loom_grad_enabled(void) { return no_grad_depth == 0; }
int autograd_no_grad_depth(void) { return no_grad_depth; }

/* > 0 inside a reentrant replay: its forward already counted these uses. */
static _Thread_local int uses_counted;
void autograd_uses_counted_enter(void) { uses_counted++; }
void autograd_uses_counted_exit(void) { if (uses_counted > 0) uses_counted--; }
int autograd_uses_counted(void) { return uses_counted > 0; }
int autograd_grad_mode_enable(void) { int d = no_grad_depth; no_grad_depth = 0; return d; }
void autograd_grad_mode_restore(int saved) { no_grad_depth = saved; }

/* ------------------------------------------------------------------ tape */

typedef struct tape {
    loom_node **nodes;
    int n, cap;
} tape;

#define MAX_TAPES 32
static _Thread_local tape tapes[MAX_TAPES];
static _Thread_local int tape_depth; /* index of the current tape */
static _Thread_local long node_seq;

/* A backward is walking tape d: a backward (or tape clear) called from a
 * node's backward or the backward hook must not walk or free it too. */
static _Thread_local unsigned char walking[MAX_TAPES];

static tape *current_tape(void) { return &tapes[tape_depth]; }

void loom_tape_push(void) {
    LOOM_ASSERT(tape_depth + 1 < MAX_TAPES);
    tape_depth++;
    tapes[tape_depth].n = 0;
    walking[tape_depth] = 0;
}

loom_status autograd_tape_room(void) {
    if (tape_depth + 1 < MAX_TAPES) return LOOM_OK;
    return loom_error(LOOM_ERR_UNSUPPORTED, "recompute: reentrant regions nest more than %d deep", MAX_TAPES - 1);
}

void loom_tape_pop(void) {
    loom_tape_clear();
    LOOM_ASSERT(tape_depth > 0);
    tape_depth--;
}

int loom_tape_size(void) { return current_tape()->n; }

static void node_destroy(loom_object *o) {
    loom_node *n = (loom_node *)o;
    for (int i = 0; n->inputs && i < n->n_inputs; i++) {
        if (n->inputs[i].node) loom_object_release(&n->inputs[i].node->obj);
        loom_tensor_release(n->inputs[i].leaf);
    }
    for (int i = 0; n->grad_out && i < n->n_outputs; i++) loom_tensor_release(n->grad_out[i]);
    ctx_free(n->ctx);
    free(n->inputs);
    free(n->grad_out);
    free(n->out_shape);
    free(n->out_ndim);
    free(n->out_dtype);
    free(n);
}

/* Free what a node holds for backward; its metadata lives on while tensors
 * still reference it (so a second backward finds it released). */
static void node_release(loom_node *n) {
    if (n->released) return;
    n->released = 1;
    ctx_free(n->ctx);
    n->ctx = NULL;
    for (int i = 0; i < n->n_inputs; i++) {
        if (n->inputs[i].node) loom_object_release(&n->inputs[i].node->obj);
        n->inputs[i].node = NULL;
        loom_tensor_release(n->inputs[i].leaf);
        n->inputs[i].leaf = NULL;
    }
    for (int i = 0; i < n->n_outputs; i++) {
        loom_tensor_release(n->grad_out[i]);
        n->grad_out[i] = NULL;
    }
}

void loom_tape_clear(void) {
    if (walking[tape_depth]) return; /* the walking backward frees it when it ends */
    tape *tp = current_tape();
    for (int i = tp->n - 1; i >= 0; i--) {
        node_release(tp->nodes[i]);
        loom_object_release(&tp->nodes[i]->obj);
    }
    tp->n = 0;
}

int loom_tensor_requires_grad(const loom_tensor *t) {
    if (!t) return 0;
    if (t->param) return t->param->trainable;
    if (t->node) return !t->node->released;
    return t->requires_grad;
}

loom_status loom_tensor_set_requires_grad(loom_tensor *t, int on) {
    if (t->param || t->node)
        return loom_error(LOOM_ERR_INVALID,
                          "set_requires_grad: only leaves (not parameters, not op outputs) can be marked");
    t->requires_grad = on != 0;
    return LOOM_OK;
}

loom_status engine_record(const loom_function *fn, loom_fn_ctx *ctx, loom_tensor *const *inputs,
                          int n_inputs, loom_tensor **outputs, int n_outputs) {
    loom_node *n = calloc(1, sizeof *n);
    if (!n) return loom_error(LOOM_ERR_NOMEM, "%s: out of memory recording a node", fn->name);
    n->obj.refcount = 1; /* the tape's */
    n->obj.destroy = node_destroy;
    n->fn = fn;
    n->n_inputs = n_inputs;
    n->n_outputs = n_outputs;
    n->inputs = calloc((size_t)(n_inputs ? n_inputs : 1), sizeof *n->inputs);
    n->grad_out = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *n->grad_out);
    n->out_shape = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *n->out_shape);
    n->out_ndim = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *n->out_ndim);
    n->out_dtype = calloc((size_t)(n_outputs ? n_outputs : 1), sizeof *n->out_dtype);
    tape *tp = current_tape();
    if (tp->n == tp->cap) {
        int cap = tp->cap ? 2 * tp->cap : 256;
        loom_node **nn = realloc(tp->nodes, (size_t)cap * sizeof *nn);
        if (nn) { tp->nodes = nn; tp->cap = cap; }
    }
    if (!n->inputs || !n->grad_out || !n->out_shape || !n->out_ndim || !n->out_dtype || tp->n == tp->cap) {
        n->ctx = NULL;
        node_destroy(&n->obj);
        return loom_error(LOOM_ERR_NOMEM, "%s: out of memory recording a node", fn->name);
    }
    for (int i = 0; i < n_inputs; i++) {
        loom_tensor *t = inputs[i];
        edge *e = &n->inputs[i];
        if (!t) continue;
        e->ndim = t->ndim;
        memcpy(e->shape, t->shape, sizeof e->shape);
        if (t->param) {
            if (t->param->trainable) {
                if (!(fn->flags & LOOM_FN_PASS_THROUGH_PARAMS)) {
                    e->param = t->param;
                    if (!uses_counted) t->param->uses++;
                }
            }
        } else if (t->node && !t->node->released) {
            e->node = t->node;
            e->index = t->out_index;
            loom_object_retain(&t->node->obj);
        } else if (t->requires_grad) {
            e->leaf = loom_tensor_retain(t);
        }
    }
    for (int i = 0; i < n_outputs; i++) {
        loom_tensor *o = outputs[i];
        n->out_ndim[i] = o->ndim;
        memcpy(n->out_shape[i], o->shape, sizeof n->out_shape[i]);
        n->out_dtype[i] = o->dtype;
        LOOM_ASSERT(o->node == NULL && o->param == NULL);
        o->node = n;
        o->out_index = i;
        loom_object_retain(&n->obj);
    }
    n->ctx = ctx;
    n->seq = node_seq++;
    tp->nodes[tp->n++] = n;
    return LOOM_OK;
}

/* -------------------------------------------------------------- backward */

/* Add g into *slot; takes the reference to g. A slot holds a contiguous
 * gradient (ops read them as dense arrays, whatever a custom backward
 * returned), and accumulation never writes memory another slot can see. */
static loom_status add_into(loom_tensor **slot, loom_tensor *g) {
    loom_tensor *gc = loom_tensor_contiguous(g, LOOM_MEM_ACTIVATIONS); /* g itself (retained) when dense */
    loom_tensor_release(g);
    if (!gc) return loom_error(LOOM_ERR_NOMEM, "backward: out of memory for a gradient");
    if (!*slot) {
        *slot = gc;
        return LOOM_OK;
    }
    loom_tensor *a = *slot;
    if (!loom_tensor_writable_in_place(a)) { /* another slot or a view may see it */
        loom_tensor *c = loom_tensor_to(a, a->dtype, LOOM_MEM_ACTIVATIONS);
        if (!c) {
            loom_tensor_release(gc);
            return loom_error(LOOM_ERR_NOMEM, "backward: out of memory for a gradient");
        }
        loom_tensor_release(a);
        *slot = a = c;
    }
    accumulate(loom_tensor_data(a), a->dtype, loom_tensor_data(gc), gc->dtype, 1.0f,
               (size_t)loom_tensor_numel(a));
    loom_tensor_release(gc);
    return LOOM_OK;
}

static int shape_matches(const loom_tensor *g, int ndim, const int64_t *shape) {
    if (g->ndim != ndim) return 0;
    for (int i = 0; i < ndim; i++)
        if (g->shape[i] != shape[i]) return 0;
    return 1;
}

/* Route the gradient of input i of node n; takes the reference to g. */
static loom_status route_grad(loom_node *n, int i, loom_tensor *g) {
    edge *e = &n->inputs[i];
    if (!shape_matches(g, e->ndim, e->shape)) {
        char d[96];
        loom_tensor_describe(g, d, sizeof d);
        loom_tensor_release(g);
        return loom_error(LOOM_ERR_STATE, "%s: backward returned a gradient %s for input %d of %d dims",
                          n->fn->name, d, i, e->ndim);
    }
    loom_dtype want = e->node ? e->node->out_dtype[e->index] : e->leaf ? e->leaf->dtype : g->dtype;
    if (!e->param && g->dtype != want) {
        /* Gradients travel in the dtype of the tensor they belong to. */
        loom_tensor *c = loom_tensor_to(g, want, LOOM_MEM_ACTIVATIONS);
        loom_tensor_release(g);
        if (!c) return LOOM_ERR_NOMEM;
        g = c;
    }
    if (e->node) {
        if (e->node->released) {
            loom_tensor_release(g);
            return loom_error(LOOM_ERR_STATE, "%s: input %d comes from a graph already freed by an "
                              "earlier backward", n->fn->name, i);
        }
        return add_into(&e->node->grad_out[e->index], g);
    }
    if (e->param) {
        loom_status st = loom_param_accumulate(e->param, g);
        loom_tensor_release(g);
        return st;
    }
    if (e->leaf) return add_into(&e->leaf->grad, g);
    loom_tensor_release(g); /* the input needs no gradient */
    return LOOM_OK;
}

/* The node whose backward runs on this thread (nested: a reentrant region's
 * replay runs nodes inside its own backward). */
static _Thread_local loom_node *running_node;

/* Where the running node's input i collects its gradient: the producer's
 * output slot or a leaf's grad; NULL for a parameter, a released producer
 * or an input that takes none. */
static loom_tensor **input_grad_slot(int i) {
    loom_node *n = running_node;
    if (!n || i < 0 || i >= n->n_inputs) return NULL;
    edge *e = &n->inputs[i];
    return e->node && !e->node->released ? &e->node->grad_out[e->index]
           : !e->node && !e->param && e->leaf ? &e->leaf->grad : NULL;
}

loom_tensor *loom_ctx_take_grad_sum(loom_fn_ctx *ctx, int i, loom_dtype dtype) {
    if (!running_node || running_node->ctx != ctx) return NULL;
    loom_tensor **slot = input_grad_slot(i), *g = slot ? *slot : NULL;
    if (!g) return NULL;
    const edge *e = &running_node->inputs[i];
    if (g->dtype != dtype || !shape_matches(g, e->ndim, e->shape) || !loom_tensor_is_contiguous(g) ||
        !loom_tensor_writable_in_place(g))
        return NULL;
    *slot = NULL;
    return g;
}

loom_tensor *autograd_take_input_grad(int i) {
    loom_tensor **slot = input_grad_slot(i), *g = slot ? *slot : NULL;
    if (slot) *slot = NULL;
    return g;
}

static loom_status run_node_backward(loom_node *n) {
    loom_tensor *gin_local[8], **gin = n->n_inputs <= 8 ? gin_local : calloc((size_t)n->n_inputs, sizeof *gin);
    if (!gin) return loom_error(LOOM_ERR_NOMEM, "%s: out of memory in backward", n->fn->name);
    for (int i = 0; i < n->n_inputs; i++) gin[i] = NULL;
    loom_status st = LOOM_OK;
    for (int k = 0; k < n->n_outputs && st == LOOM_OK; k++) {
        if (!n->grad_out[k]) {
            n->grad_out[k] = loom_tensor_zeros(n->out_dtype[k], n->out_ndim[k], n->out_shape[k],
                                               LOOM_MEM_ACTIVATIONS);
            if (!n->grad_out[k]) st = LOOM_ERR_NOMEM;
        }
    }
    if (st == LOOM_OK) {
        /* Ops a backward calls are not recorded (a reentrant region
         * re-enables recording for its replay). */
        loom_no_grad_enter();
        profile_enter();
        loom_node *outer = running_node;
        running_node = n;
        st = n->fn->backward(n->ctx, n->grad_out, n->n_outputs, gin, n->n_inputs);
        running_node = outer;
        profile_leave(n->fn, 1);
        loom_no_grad_exit();
    }
    /* Saved tensors and output gradients are freed as soon as the node is done. */
    ctx_free_saved(n->ctx);
    for (int k = 0; k < n->n_outputs; k++) {
        loom_tensor_release(n->grad_out[k]);
        n->grad_out[k] = NULL;
    }
    for (int i = 0; i < n->n_inputs; i++) {
        if (!gin[i]) continue;
        if (st == LOOM_OK) st = route_grad(n, i, gin[i]);
        else loom_tensor_release(gin[i]);
        gin[i] = NULL;
    }
    if (gin != gin_local) free(gin);
    return st;
}

static _Thread_local loom_backward_hook node_hook;
static _Thread_local void *node_hook_user;

void loom_set_backward_hook(loom_backward_hook fn, void *user) {
    node_hook = fn;
    node_hook_user = user;
}

loom_status loom_backward_multi(loom_tensor *const *tensors, loom_tensor *const *grads, int n) {
    tape *tp = current_tape();
    if (walking[tape_depth])
        return loom_error(LOOM_ERR_STATE, "backward called inside a backward (from a node's backward or the "
                          "backward hook) on the tape being walked; a nested backward needs its own tape: "
                          "loom_tape_push() before the forward it backpropagates, loom_tape_pop() after");
    if (n < 0 || (n > 0 && (!tensors || !grads)))
        return loom_error(LOOM_ERR_INVALID, "backward: %d tensors with %s arrays", n, n < 0 ? "a negative count of" : "NULL");
    int any = 0;
    for (int i = 0; i < n; i++) {
        loom_tensor *t = tensors[i];
        if (!t || !grads[i]) continue;
        if (t->node && t->node->released)
            return loom_error(LOOM_ERR_STATE, "backward through a graph that was already freed: each "
                              "forward can be backpropagated once; run the forward again");
        if (!loom_tensor_requires_grad(t)) continue;
        if (!loom_tensor_same_shape(t, grads[i])) {
            char a[96], b[96];
            return loom_error(LOOM_ERR_INVALID, "backward: gradient %s does not match tensor %s",
                              loom_tensor_describe(grads[i], a, sizeof a), loom_tensor_describe(t, b, sizeof b));
        }
        any = 1;
    }
    if (!any)
        return loom_error(LOOM_ERR_STATE, "backward: none of the tensors requires a gradient (they were "
                          "computed from inputs and parameters that need none, or under no-grad)");
    loom_status st = LOOM_OK;
    for (int i = 0; i < n && st == LOOM_OK; i++) {
        loom_tensor *t = tensors[i];
        if (!t || !grads[i] || !loom_tensor_requires_grad(t)) continue;
        loom_tensor *g = loom_tensor_to(grads[i], t->dtype, LOOM_MEM_ACTIVATIONS);
        if (!g) { st = LOOM_ERR_NOMEM; break; }
        if (t->node) st = add_into(&t->node->grad_out[t->out_index], g);
        else if (t->param) { st = loom_param_accumulate(t->param, g); loom_tensor_release(g); }
        else st = add_into(&t->grad, g);
    }
    walking[tape_depth] = 1;
    for (int i = tp->n - 1; i >= 0 && st == LOOM_OK; i--) {
        loom_node *nd = tp->nodes[i];
        if (nd->released) continue;
        int has_grad = 0;
        for (int k = 0; k < nd->n_outputs; k++) has_grad |= nd->grad_out[k] != NULL;
        if (has_grad) st = run_node_backward(nd);
        node_release(nd);
        if (has_grad && st == LOOM_OK && node_hook) st = node_hook(node_hook_user);
    }
    walking[tape_depth] = 0;
    loom_tape_clear();
    return st;
}

loom_status loom_backward(loom_tensor *loss, float seed) {
    if (!loss) return loom_error(LOOM_ERR_INVALID, "backward: loss is NULL");
    if (loom_tensor_numel(loss) != 1)
        return loom_error(LOOM_ERR_INVALID, "backward: loss must have one element, it has %lld "
                          "(use loom_backward_multi for non-scalar outputs)", (long long)loom_tensor_numel(loss));
    int64_t shape[LOOM_MAX_DIMS] = {1, 1, 1, 1};
    loom_tensor *g = loom_tensor_new(LOOM_F32, loss->ndim, shape, LOOM_MEM_ACTIVATIONS);
    if (!g) { /* as every failed backward: the tape goes */
        loom_tape_clear();
        return loom_error(LOOM_ERR_NOMEM, "backward: out of memory for the seed gradient");
    }
    ((float *)loom_tensor_data(g))[0] = seed;
    loom_status st = loom_backward_multi(&loss, &g, 1);
    loom_tensor_release(g);
    return st;
}
