/*
 * threads.c — the one OpenMP pool's size. loom never creates threads of its
 * own; every parallel loop is an OpenMP loop on this pool.
 */
#include "loom/core.h"

#include <omp.h>
#include <stdlib.h>

static int default_threads(void) {
    const char *e = getenv("OMP_NUM_THREADS");
    if (e && atoi(e) > 0) return atoi(e);
    return omp_get_num_procs();
}

void loom_set_threads(int n) {
    n = n > 0 ? n : default_threads();
    omp_set_num_threads(n < LOOM_MAX_THREADS ? n : LOOM_MAX_THREADS);
}

int loom_get_threads(void) { return omp_get_max_threads(); }
