/* internal.h — private to the recompute layer. */
#ifndef LOOM_RECOMPUTE_INTERNAL_H
#define LOOM_RECOMPUTE_INTERNAL_H

#include "autograd/internal.h"
#include "loom/recompute.h"

/* Whether the calling code runs inside a non-reentrant region (its first
 * forward or its replay). */
int recompute_in_region(void);
void recompute_count_region(void);
/* A non-reentrant region (selective with a policy); flags as loom_checkpoint_flags. */
loom_status recompute_region_run(const loom_recompute_policy *policy, unsigned flags, loom_region_fn fn,
                                 void *user, loom_tensor *const *inputs, int n_inputs, loom_tensor **outputs,
                                 int n_outputs);
/* A reentrant region's backward replayed it (stats.replays). */
void recompute_count_replay(void);

#endif
