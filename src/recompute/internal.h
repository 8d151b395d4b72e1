/* internal.h — private to the recompute layer. */
#ifndef LOOM_RECOMPUTE_INTERNAL_H
#define LOOM_RECOMPUTE_INTERNAL_H

#include "autograd/internal.h"
#include "loom/recompute.h"

/* Whether the calling code runs inside a non-reentrant region (its first
 * forward or its replay). */
int recompute_in_region(void);
void recompute_count_region(void);
/* A reentrant region's backward replayed it (stats.replays). */
void recompute_count_replay(void);

#endif
