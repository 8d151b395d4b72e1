/*
 * loom/recompute.h — activation recomputation (checkpoint regions).
 *
 * A region is a C function of some tensor inputs producing some outputs;
 * non-tensor arguments travel through `user`, which must stay valid until
 * the backward pass that consumes the region has finished.
 *
 * Modes:
 *  - NONE: the region runs as ordinary code.
 *  - REENTRANT: the region runs without recording and saves only its inputs;
 *    backward replays it onto a nested tape and runs a nested backward. The
 *    gradient an input already has (from uses after the region) seeds the
 *    replay's leaf, so the sums run in the same order as without recompute.
 *    A replay whose outputs need no gradient (frozen weights on inputs that
 *    need none) adds nothing. A tensor passed as two inputs is one leaf in
 *    the replay, and an output that is an input (or an earlier output) is
 *    handed back as that very tensor, as in the other modes.
 *  - NONREENTRANT: the region records as usual, but each activation saved
 *    inside it (except the region's inputs) becomes a placeholder; the first
 *    time backward needs one, the region is replayed once and the
 *    placeholders are filled in order, each freed after use.
 *  - SELECTIVE: NONREENTRANT with a policy that keeps the outputs of
 *    expensive ops (flag LOOM_FN_EXPENSIVE: GEMMs and the flash attention,
 *    whose recompute costs O(T^2) flops but whose saves are O(T)) and
 *    recomputes the rest (norms, RoPE, SwiGLU/GeGLU, element-wise ops).
 *
 * In every mode parameters and NULL slots are never packed, copied or
 * recomputed: a saved parameter comes back as the very same parameter. The
 * region's RNG offset is recorded and restored on replay, so dropout is
 * identical. A replay that saves a different number, shape or dtype of
 * tensors, or runs different ops, fails with LOOM_ERR_STATE (determinism
 * check). Regions nest (up to 64 levels, 31 of them reentrant: deeper is
 * LOOM_ERR_UNSUPPORTED). Gradients are bit-for-bit identical across modes.
 * Out of memory anywhere in a region, forward or replay, is
 * LOOM_ERR_NOMEM from the call that ran into it.
 */
#ifndef LOOM_RECOMPUTE_H
#define LOOM_RECOMPUTE_H

#include "loom/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum loom_recompute_mode {
    LOOM_RECOMPUTE_NONE = 0,
    LOOM_RECOMPUTE_REENTRANT = 1,
    LOOM_RECOMPUTE_NONREENTRANT = 2,
    LOOM_RECOMPUTE_SELECTIVE = 3
} loom_recompute_mode;

const char *loom_recompute_mode_name(loom_recompute_mode m);
/* "none", "reentrant", "nonreentrant" (or "non-reentrant"), "selective". */
loom_status loom_recompute_mode_parse(const char *s, loom_recompute_mode *out);

/* The region: fill outputs[0..n_outputs) with new references (entries may
 * be NULL for outputs that do not exist). Must be deterministic given its
 * inputs, `user` and the RNG offset. */
typedef loom_status (*loom_region_fn)(void *user, loom_tensor *const *inputs, int n_inputs,
                                      loom_tensor **outputs, int n_outputs);

/* Which ops' outputs a selective region keeps (1) instead of recomputing (0). */
typedef struct loom_recompute_policy {
    int (*keep)(void *user, const loom_function *fn);
    void *user;
} loom_recompute_policy;

/* Keeps ops flagged LOOM_FN_EXPENSIVE. */
extern const loom_recompute_policy loom_recompute_policy_default;

/* Run `fn` as a checkpoint region in `mode`. Inputs may include NULL and
 * parameters' tensors. On error no output is returned. */
loom_status loom_checkpoint(loom_recompute_mode mode, loom_region_fn fn, void *user,
                            loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                            int n_outputs);
/* Flags of loom_checkpoint_flags. */
enum {
    /* The caller vouches that the region's intermediate tensors pass only
     * through loom functions: host code neither reads them nor copies them
     * (loom_tensor_to, loom_tensor_contiguous...). A NONREENTRANT replay may
     * then skip ops whose outputs nothing it needs reads (each LLaMA block's
     * down projection and last residual add), with the same gradients. Views
     * of an op's output count as the output; a region that runs an op under
     * an explicit no-grad scope skips nothing. Other modes ignore it. */
    LOOM_REGION_OPS_ONLY = 1u << 0,
};

/* loom_checkpoint with flags (LOOM_REGION_OPS_ONLY); unknown flags are
 * LOOM_ERR_INVALID. loom_checkpoint is this with flags 0. */
loom_status loom_checkpoint_flags(loom_recompute_mode mode, unsigned flags, loom_region_fn fn, void *user,
                                  loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                                  int n_outputs);
/* Non-reentrant region with an explicit selective policy (NULL policy:
 * recompute everything). */
loom_status loom_checkpoint_policy(const loom_recompute_policy *policy, loom_region_fn fn, void *user,
                                   loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                                   int n_outputs);

/* Counters for tests and reports (thread-local, since the last reset). */
typedef struct loom_recompute_stats {
    long regions;        /* regions entered in a recomputing mode */
    long replays;        /* region replays run by backward (every recomputing mode) */
    long placeholders;   /* activations dropped for recompute */
    long kept_outputs;   /* selective: op outputs kept */
    long skipped_ops;    /* replayed ops not run: nothing live needed their outputs */
    double replay_seconds; /* wall time of the replays' forwards: what recomputing cost, measured
                            * inside the step (a reentrant region's nested backward not included) */
} loom_recompute_stats;
void loom_recompute_get_stats(loom_recompute_stats *out);
void loom_recompute_reset_stats(void);

#ifdef __cplusplus
}
#endif
#endif
