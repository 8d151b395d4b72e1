/*
 * recompute_plan.h — the search behind loom_llama_plan_recompute, apart from
 * the model so that its tests can give it any curve of peaks. Not public API.
 */
#ifndef LOOM_NN_RECOMPUTE_PLAN_H
#define LOOM_NN_RECOMPUTE_PLAN_H

#include <stddef.h>

#include "loom/core.h"

/* Measure the activation peak with the first `blocks` blocks recomputed. */
typedef loom_status (*plan_measure_fn)(void *ctx, int blocks, size_t *peak);

/* The fewest blocks n in 1..L whose measured peak fits budget, for
 * peak_none (no block) > budget >= peak_all (all L blocks, not measured
 * again), assuming peaks do not grow as blocks are added. It measures the
 * count that interpolating between the two picks, then steps down while one
 * block fewer fits, or up until it fits. *blocks and *peak get the answer;
 * *probes is incremented per measurement. Errors: what measure returns. */
loom_status recompute_plan_search(int L, size_t peak_none, size_t peak_all, size_t budget, plan_measure_fn measure,
                                  void *ctx, int *blocks, size_t *peak, int *probes);

#endif
