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
/* A replay's forward starts (stats.replays) and returns the clock to hand
 * to recompute_replay_end, which adds the time since to stats.replay_seconds. */
double recompute_replay_begin(void);
void recompute_replay_end(double started);

#endif
