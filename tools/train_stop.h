/*
 * train_stop.h — how `loom train` takes SIGINT, SIGTERM, SIGUSR1 and
 * SIGUSR2: during training the first asks for a checkpoint after the
 * current step; a second one, or one during setup, stops at once.
 */
#ifndef LOOM_TRAIN_STOP_H
#define LOOM_TRAIN_STOP_H

#include "loom/loom.h"

/* Block the stop signals and start the thread that takes them. Call before
 * any other thread exists (OpenMP's, MPI's), so that every thread inherits
 * the mask. Until train_stop_arm, a stop signal has its default action (one
 * the process was started ignoring stays ignored). Errors: LOOM_ERR_STATE. */
loom_status train_stop_take(void);
/* Training runs: from now on the first stop signal is only recorded. */
void train_stop_arm(void);
/* The first stop signal received since train_stop_arm, or 0. */
int train_stop_requested(void);
/* "SIGINT", "SIGTERM", "SIGUSR1" or "SIGUSR2". */
const char *train_stop_name(int sig);

#endif
