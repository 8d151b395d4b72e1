/*
 * loom/autograd.h — parameters, the function interface shared by built-in
 * ops and user code, the tape and the backward engine.
 *
 * The tape records nodes in creation order; loom_backward walks it in
 * reverse, accumulates the gradients of tensors used more than once, calls
 * each node's backward and frees the node's saved tensors right after. A
 * backward consumes the tape: the graph it walked is freed, and walking it
 * again is an error (LOOM_ERR_STATE), never a crash.
 *
 * Thread model: the tape, the no-grad depth and the recompute state are
 * thread-local. Kernels inside ops use OpenMP; the autograd bookkeeping runs
 * on the calling thread.
 */
#ifndef LOOM_AUTOGRAD_H
#define LOOM_AUTOGRAD_H

#include "loom/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ parameters */

/* A trainable tensor. The parameter owns:
 *  - its compute copy `tensor` (dtype f32, bf16 or f16; tensor->param == p),
 *  - an fp32 master copy when the compute dtype is not f32 (else the compute
 *    copy is the master),
 *  - its gradient: with master_grad on, `main_grad` in fp32; with it off, a
 *    gradient in the compute dtype. Gradients are only ever accumulated.
 * Counters: `uses` counts recorded forward uses, `contributions` counts
 * gradient accumulations; the gradient audit compares them. */
struct loom_param {
    char name[160];
    loom_tensor *tensor;  /* compute copy (owned) */
    float *master;        /* fp32 master (owned) or NULL when tensor is f32 */
    void *grad;           /* main_grad (f32) or gradient in grad_dtype (owned); NULL once frozen */
    loom_dtype grad_dtype;
    int master_grad;      /* 1: grad is the fp32 main_grad */
    int trainable;        /* 0: frozen, receives no gradient (loom_param_freeze; one-way: grad is NULL) */
    int no_weight_decay;  /* norms and biases: AdamW skips decay */
    int uses;             /* forward uses recorded since the last zero_grad */
    int contributions;    /* gradient accumulations since the last zero_grad */
    int grad_written;     /* any contribution since the last zero_grad */
    /* tensor parallel: which dimension is split across ranks (-1: none) */
    int tp_split_dim;
    int grad_borrowed;    /* grad lives in a buffer someone else owns */
    int master_sharded;   /* ZeRO-1 holds the master; `master` is NULL */
    int master_borrowed;  /* `master` lives in a buffer someone else owns (ZeRO-1's, lent whole) */
};

/* Create a parameter of the given shape, zero-initialised, with compute dtype
 * dt. With master_grad = 1 the gradient is an fp32 main_grad; with 0 it has
 * dtype dt. Free with loom_param_free. */
loom_status loom_param_new(const char *name, loom_dtype dt, int ndim, const int64_t *shape,
                           int master_grad, loom_param **out);
/* A parameter created frozen (as loom_param_freeze leaves one), so that its
 * gradient and, for bf16, its fp32 master never take memory: zero values. */
loom_status loom_param_new_frozen(const char *name, loom_dtype dt, int ndim, const int64_t *shape,
                                  loom_param **out);
void loom_param_free(loom_param *p);
static inline int64_t loom_param_numel(const loom_param *p) { return loom_tensor_numel(p->tensor); }
/* The fp32 master values (borrowed): `master`, or the compute copy when the
 * compute dtype is f32. Not for a frozen bf16 parameter, which has none
 * (loom_param_freeze): read any parameter's values with loom_param_get_f32. */
float *loom_param_master(loom_param *p);
/* Whether p holds fp32 values loom_param_master can hand out. */
int loom_param_has_master(const loom_param *p);
/* Whether p's values are its compute copy alone (a frozen bf16 parameter):
 * no master, and none held elsewhere (ZeRO-1). */
int loom_param_compute_only(const loom_param *p);
/* p's values as numel floats into dst: the master, or a frozen bf16
 * parameter's compute copy widened (exactly). */
void loom_param_get_f32(const loom_param *p, float *dst);
/* ZeRO-1: free the fp32 master (its owner keeps a shard of it elsewhere);
 * until loom_param_attach_master, loom_param_master must not be called.
 * No-op when the compute dtype is f32 (the compute copy is the master). */
void loom_param_drop_master(loom_param *p);
/* Give a dropped master back, from numel floats. */
loom_status loom_param_attach_master(loom_param *p, const float *full);
/* Give a dropped master back as buf itself (numel floats, borrowed, kept
 * alive and left alone by the caller until loom_param_drop_master): no
 * copy, no allocation. */
void loom_param_lend_master(loom_param *p, float *buf);
/* Let the gradient live at buf (numel elements of grad_dtype, borrowed, kept
 * alive by the caller): the current gradient is copied there. buf = NULL
 * moves it back into memory the parameter owns. Data parallelism uses it to
 * lay every main_grad out in one buffer that is communicated in place. */
loom_status loom_param_set_grad_buffer(loom_param *p, void *buf);
/* Set master and compute copy from n floats (n must equal numel); a frozen
 * bf16 parameter, without a master, rounds them into its compute copy. */
loom_status loom_param_set_f32(loom_param *p, const float *src, int64_t n);
/* Refresh the compute copy from the master (after an optimizer step). */
void loom_param_sync_from_master(loom_param *p);
/* Zero the gradient and the audit counters. */
void loom_param_zero_grad(loom_param *p);
/* The buffer gradients accumulate into, for a function that writes its
 * gradient directly (e.g. a GEMM with beta = 1 into main_grad). Counts one
 * contribution. The buffer is borrowed; *dt is f32 for main_grad. */
void *loom_param_grad_target(loom_param *p, loom_dtype *dt);
/* Accumulate a gradient tensor g (any dtype, p's shape) into p. Counts one
 * contribution. */
loom_status loom_param_accumulate(loom_param *p, const loom_tensor *g);
/* Copy p's gradient out as n floats (zeros for a frozen parameter). */
void loom_param_read_grad(const loom_param *p, float *dst);
/* Freeze p, for good: it receives no gradient from now on (ops skip its
 * gradient, AdamW and the audit pass it by, and loom_dist_optim_new
 * refuses it: give optimizers the trainable parameters; freeze before any
 * optimizer is made) and its gradient buffer is freed
 * (grad becomes NULL). Its values stay. A bf16 parameter's fp32 master is
 * freed too: frozen, it is its bf16 compute copy, as a bf16 model is held
 * for inference (2 bytes a weight instead of 6); fp16 keeps the master,
 * whose values fp16's range may not hold. For a
 * parameter whose gradient lives in a buffer someone else owns (data
 * parallelism's flat buffer), LOOM_ERR_STATE: freeze before that is made. */
loom_status loom_param_freeze(loom_param *p);

/* ----------------------------------------------------- function interface */

typedef struct loom_fn_ctx loom_fn_ctx;

/* Flags of a function. */
enum {
    /* The selective recompute policy of loom_recompute_policy_default keeps
     * this op's saved tensors (expensive ops like GEMMs). */
    LOOM_FN_EXPENSIVE = 1u << 0,
    /* Parameters among the inputs are not counted as uses (the op does not
     * itself produce their gradient; e.g. a reentrant checkpoint region). */
    LOOM_FN_PASS_THROUGH_PARAMS = 1u << 1,
};

/* One differentiable operation. Built-in ops are loom_functions too.
 *
 * forward: read `inputs` (entries may be NULL for absent optional inputs),
 *   create every output (new references, stored into outputs[0..n_outputs)),
 *   call loom_ctx_save for what backward needs. Non-tensor arguments come
 *   from loom_ctx_args. Return LOOM_OK or an error.
 * backward: given grad_outputs (one per output, never NULL: an output that
 *   received no gradient gets zeros), store into grad_inputs[i] a new
 *   reference to the gradient of input i, or leave it NULL (no gradient, or
 *   the function accumulated into a parameter itself through
 *   loom_param_grad_target). A gradient's shape must equal the input's.
 * n_inputs / n_outputs: the counts the function expects (-1: any).
 */
typedef struct loom_function {
    const char *name;
    int n_inputs;
    int n_outputs;
    unsigned flags;
    loom_status (*forward)(loom_fn_ctx *ctx, loom_tensor *const *inputs, int n_inputs,
                           loom_tensor **outputs, int n_outputs);
    loom_status (*backward)(loom_fn_ctx *ctx, loom_tensor *const *grad_outputs, int n_outputs,
                            loom_tensor **grad_inputs, int n_inputs);
} loom_function;

/* Run fn on inputs, producing n_outputs new tensor references in outputs.
 * `args` (args_size bytes, may be NULL) are copied into the ctx and are
 * readable in forward and backward. The call is recorded on the tape when
 * gradients are enabled and any input needs a gradient (or fn has
 * LOOM_FN_PASS_THROUGH_PARAMS). On error no output is returned. */
loom_status loom_function_apply(const loom_function *fn, loom_tensor *const *inputs, int n_inputs,
                                loom_tensor **outputs, int n_outputs, const void *args,
                                size_t args_size);

/* Save tensors for backward. Any mix of activations, parameters' tensors
 * and NULL, in any order; may be called more than once (slots append).
 * A parameter is saved by reference: loom_ctx_saved gives back the very
 * same loom_tensor (and its loom_param) in every recompute mode. Inside a
 * recomputed region, activations may be dropped and recomputed later. */
loom_status loom_ctx_save(loom_fn_ctx *ctx, loom_tensor *const *tensors, int n);
/* The i-th saved slot (borrowed): *out is NULL for a NULL slot. Errors:
 * index out of range, or the saved tensors were already freed (a second
 * backward), or a recompute replay failed its determinism check. */
loom_status loom_ctx_saved(loom_fn_ctx *ctx, int i, loom_tensor **out);
int loom_ctx_n_saved(const loom_fn_ctx *ctx);
/* The args blob given to loom_function_apply (borrowed; NULL if none). */
const void *loom_ctx_args(const loom_fn_ctx *ctx);
/* Small per-call state that forward may write and backward read (zeroed,
 * at most 256 bytes, kept with the ctx). */
void *loom_ctx_state(loom_fn_ctx *ctx, size_t bytes);
/* Whether input i needs a gradient (an op may skip computing it). */
int loom_ctx_needs_input_grad(const loom_fn_ctx *ctx, int i);
/* Whether this forward call is a recompute replay (its outputs will be
 * discarded; only what it saves matters). */
int loom_ctx_is_replay(const loom_fn_ctx *ctx);

/* In a backward: the gradient input i has received so far from its other
 * uses, handed over so that this backward sums its own contribution into it
 * (a GEMM with beta = 1, say) instead of returning the contribution for the
 * engine to add in a pass of its own. It is given only when it is a dense
 * tensor of the input's shape and of `dtype` that nothing else can see;
 * the backward must then return it in grad_inputs[i] with its contribution
 * added. NULL when the input has no gradient yet or it is not such a
 * tensor: return the contribution alone, as usual. Recompute modes see the
 * same sums in the same order, so their gradients stay bit-identical. If the
 * backward then fails, the gradient it took is gone with it (see
 * loom_backward_multi). */
loom_tensor *loom_ctx_take_grad_sum(loom_fn_ctx *ctx, int i, loom_dtype dtype);

/* ------------------------------------------------------------- backward */

/* Backpropagate from a scalar loss with initial gradient `seed` (1, or the
 * loss scale for fp16). Walks and then frees the current tape. */
loom_status loom_backward(loom_tensor *loss, float seed);
/* Backpropagate from several tensors with the given gradients (each
 * grads[i] has tensors[i]'s shape; NULL entries are skipped).
 * Both refuse bad arguments (a gradient of the wrong shape, a non-scalar
 * loss, nothing that requires a gradient, a graph already freed) before
 * anything runs: the tape is left as it was, so the call can be made again
 * with the right arguments. Every other outcome, failures included, frees
 * the tape. Called from a node's backward or the backward hook on the tape
 * being walked, both are LOOM_ERR_STATE (a nested backward pushes a tape of
 * its own first, as a reentrant region does). A backward that fails midway
 * leaves the gradients it was summing, leaves' t->grad included, partly
 * summed or cleared: discard them (zero the parameters' gradients, release
 * the leaves' grad) before the next step. */
loom_status loom_backward_multi(loom_tensor *const *tensors, loom_tensor *const *grads, int n);

/* A function called on the calling thread after every node's backward
 * (including those of a reentrant replay), once the node's gradients have
 * reached their destinations: a parameter whose `contributions` now equal
 * its recorded `uses` has its gradient complete for this backward. The data
 * parallel optimizer uses it to start gradient all-reduces while backward
 * goes on. An error it returns stops the backward. NULL removes it. */
typedef loom_status (*loom_backward_hook)(void *user);
void loom_set_backward_hook(loom_backward_hook fn, void *user);

/* Whether t needs a gradient: it has a live producer node, is a trainable
 * parameter's tensor, or is a leaf marked with loom_tensor_set_requires_grad. */
int loom_tensor_requires_grad(const loom_tensor *t);
/* Mark a leaf (no producer, not a parameter) to collect its gradient in
 * t->grad during backward. */
loom_status loom_tensor_set_requires_grad(loom_tensor *t, int on);

/* No-grad scopes nest; ops inside record nothing. */
void loom_no_grad_enter(void);
void loom_no_grad_exit(void);
int loom_grad_enabled(void);

/* Tapes nest (a reentrant recompute replays onto its own tape). */
void loom_tape_push(void);
void loom_tape_pop(void);
/* Nodes recorded on the current tape and not yet freed. */
int loom_tape_size(void);
/* Free the current tape's nodes without backward (e.g. after an evaluation
 * forward that recorded a graph). Inside a backward walking the current
 * tape it does nothing: that backward frees the tape when it ends. */
void loom_tape_clear(void);

/* -------------------------------------------------------------- profiling */

/* Self time of one function's forward (backward = 0) or backward calls. */
typedef struct loom_profile_entry {
    const char *name;  /* the function's name (borrowed) */
    int backward;
    double seconds;    /* wall time inside it, minus nested functions */
    long calls;
} loom_profile_entry;

/* Per-function timing on the calling thread: off by default (and nearly
 * free when off). Enabling restarts the nesting; reset clears the table. */
void loom_profile_enable(int on);
void loom_profile_reset(void);
/* Copies up to max entries in first-seen order; returns how many exist. */
int loom_profile_get(loom_profile_entry *out, int max);

/* --------------------------------------------------------- gradient audit */

/* After backward: checks that every trainable parameter received exactly as
 * many gradient contributions as it had recorded uses, and that none was
 * left unwritten. Returns LOOM_OK, or LOOM_ERR_STATE with a message naming
 * every offending parameter (also written to `report` when not NULL). */
loom_status loom_grad_audit(loom_param *const *params, int n, char *report, size_t report_size);

#ifdef __cplusplus
}
#endif
#endif
