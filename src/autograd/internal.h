/*
 * internal.h — autograd's private structures: the ctx with its saved slots,
 * nodes, and the saved-tensor hooks through which the recompute layer
 * (above) drops and replays activations.
 *
 * The parameter rule lives here, below any hook: loom_ctx_save stores a
 * parameter's tensor and NULL directly; only activations ever reach a pack
 * hook. That is what keeps a saved parameter the very same object, with its
 * main_grad, in every recompute mode.
 */
#ifndef LOOM_AUTOGRAD_INTERNAL_H
#define LOOM_AUTOGRAD_INTERNAL_H

#include "loom/autograd.h"

typedef enum slot_kind {
    SLOT_NULL = 0,
    SLOT_PARAM,   /* t: the parameter's tensor (a reference) */
    SLOT_TENSOR,  /* t: an activation (a reference) */
    SLOT_PACKED,  /* handle: owned by `hooks` (e.g. a recompute placeholder) */
} slot_kind;

typedef struct saved_hooks saved_hooks;

typedef struct saved_slot {
    slot_kind kind;
    loom_tensor *t;
    void *handle;
    saved_hooks *hooks;
} saved_slot;

#define CTX_STATE_BYTES 256

struct loom_fn_ctx {
    const loom_function *fn;
    saved_slot *slots;
    int n_slots, cap_slots;
    void *args;
    size_t args_size;
    int n_inputs;
    unsigned char *needs_grad;  /* per input */
    int replay;                 /* forward of a recompute replay */
    int discard;                /* saves are dropped (not recorded) */
    int keep_saved;             /* selective policy: store activations as they are */
    int freed;                  /* saved slots already released */
    saved_hooks *hooks;         /* hooks in force during forward */
    _Alignas(16) unsigned char state[CTX_STATE_BYTES];
};

/* The recompute layer's hooks (a stack, thread-local). */
struct saved_hooks {
    void *self;
    /* Returns 1 when the call is a replay: the hooks take its saves through
     * pack and nothing is recorded. */
    int replaying;
    /* Before forward of every call made while grad is enabled. `recorded`
     * says whether the call will be recorded. May fill outputs itself and
     * return 1 to skip forward (a kept op in a selective replay). May set
     * ctx->keep_saved. Returns -1, with loom_error set, when it cannot
     * record the call (out of memory): the call fails with that error. */
    int (*before_forward)(void *self, loom_fn_ctx *ctx, int recorded, loom_tensor *const *inputs,
                          loom_tensor **outputs, int n_outputs);
    /* After forward produced outputs (not called when before_forward
     * skipped it). Returns -1, with loom_error set, when it cannot record
     * them: the call fails and its outputs are released. */
    int (*after_forward)(void *self, loom_fn_ctx *ctx, int recorded, loom_tensor **outputs, int n_outputs);
    /* An activation saved in ctx: return a handle (the slot becomes PACKED)
     * or NULL to store the tensor itself. */
    void *(*pack)(void *self, loom_fn_ctx *ctx, loom_tensor *t);
    loom_status (*unpack)(void *handle, loom_tensor **out); /* borrowed result */
    void (*drop)(void *handle);
    /* May be NULL. An op ran under an explicit no-grad scope in the code
     * these hooks watch (not inside another op's forward): no hook saw it,
     * so what it read and made is invisible to them. */
    void (*untracked_op)(void *self);
};

/* Enable recording regardless of no-grad scopes; returns what to restore. */
int autograd_grad_mode_enable(void);
void autograd_grad_mode_restore(int saved);

/* Parameter uses of a reentrant region, counted once and before backward.
 * Its forward runs without recording, so the engine sees its uses only when
 * the replay records them, in backward; the overlapped all-reduce would
 * then take a parameter also used after the region for complete once that
 * later use's gradient arrived. autograd_count_uses_begin (in the region's
 * forward, inside its no-grad scope) makes every op the region's code calls
 * directly (not inside another op's forward, not under a deeper no-grad
 * scope) count its trainable parameter inputs as recording would;
 * autograd_uses_counted_enter (around the replay and its backward) stops
 * the engine from counting them again. Each returns what its end restores. */
int autograd_count_uses_begin(void);
void autograd_count_uses_end(int saved);
void autograd_uses_counted_enter(void);
void autograd_uses_counted_exit(void);
int autograd_uses_counted(void); /* inside a replay whose uses are counted */
int autograd_no_grad_depth(void);

/* Inside a node's backward: take the gradient accumulated so far for its
 * input i (the producer's output slot, or a leaf's grad) out of its slot,
 * leaving the slot empty; NULL when there is none yet. A backward that
 * takes it must hand back the gradient with the take included (a
 * reentrant region seeds its replay leaf with it, so the sum runs in the
 * order of the run without recomputation). */
loom_tensor *autograd_take_input_grad(int i);

/* Profiling hooks around a function's forward or backward (profile.c). */
double autograd_seconds(void); /* CLOCK_MONOTONIC, for the profile and the recompute's replay time */
void profile_enter(void);
void profile_leave(const loom_function *fn, int backward);

void autograd_hooks_push(saved_hooks *h);
void autograd_hooks_pop(void);
saved_hooks *autograd_hooks_top(void);
/* LOOM_OK, or LOOM_ERR_UNSUPPORTED naming the limit, when regions nest so
 * deep that one more hook level (or one more tape) would not fit: check
 * before autograd_hooks_push (loom_tape_push), which abort past it. */
loom_status autograd_hooks_room(void);
loom_status autograd_tape_room(void);

/* An input edge of a node: where its gradient goes. */
typedef struct edge {
    loom_node *node;     /* producer (a reference) … */
    int index;           /* … and its output index */
    loom_param *param;   /* or a trainable parameter */
    loom_tensor *leaf;   /* or a leaf collecting t->grad (a reference) */
    int64_t shape[LOOM_MAX_DIMS];
    int ndim;
} edge;

struct loom_node {
    loom_object obj;          /* refcount: the tape + each output tensor */
    const loom_function *fn;
    loom_fn_ctx *ctx;
    int n_inputs, n_outputs;
    edge *inputs;
    loom_tensor **grad_out;   /* accumulated output gradients */
    int64_t (*out_shape)[LOOM_MAX_DIMS];
    int *out_ndim;
    loom_dtype *out_dtype;
    int released;             /* backward done or tape cleared */
    long seq;                 /* position on the tape */
};

loom_fn_ctx *ctx_new(const loom_function *fn, int n_inputs, const void *args, size_t args_size);
void ctx_free_saved(loom_fn_ctx *ctx);
void ctx_free(loom_fn_ctx *ctx);

#endif
