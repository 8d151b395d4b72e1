/*
 * loom/dist.h — communicators: an Open MPI backend and a single-process
 * backend behind one interface, plus the data-parallel / tensor-parallel
 * layout of a job.
 *
 * A build without MPI, or a process not started by mpirun, gets the
 * single-process backend: every collective is a copy or a no-op. Errors
 * from MPI come back as LOOM_ERR_DIST with MPI's message; a process that
 * cannot continue calls loom_dist_abort, which ends the whole job (never a
 * hang waiting for a dead rank).
 */
#ifndef LOOM_DIST_H
#define LOOM_DIST_H

#include "loom/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct loom_comm loom_comm;

/* Initialise (MPI_Init when launched by mpirun and built with MPI). Returns
 * the world communicator (owned by loom; freed by loom_dist_finalize). */
loom_status loom_dist_init(int *argc, char ***argv, loom_comm **world);
void loom_dist_finalize(void);
/* Print "loom: rank R: message" (just the message in a single process) and
 * end every process of the job with exit status `code`. */
void loom_dist_abort(const char *message, int code) __attribute__((noreturn));
/* Whether this process runs under MPI with more than one rank. */
int loom_dist_is_distributed(void);
/* Whether this loom was built with MPI (else every job is one process). */
int loom_dist_built_with_mpi(void);
/* The number of processes the launcher (mpirun, a PMI launcher) says the
 * job has, before MPI starts; 1 when started on its own. */
long loom_dist_launched_ranks(void);

int loom_comm_rank(const loom_comm *c);
int loom_comm_size(const loom_comm *c);
/* Ranks with the same color form one new communicator, ordered by key. */
loom_status loom_comm_split(loom_comm *c, int color, int key, loom_comm **out);
void loom_comm_free(loom_comm *c);

/* In-place sum over all ranks. */
loom_status loom_comm_allreduce_sum_f32(loom_comm *c, float *buf, size_t n);
loom_status loom_comm_allreduce_sum_f64(loom_comm *c, double *buf, size_t n);
/* In-place maximum (e.g. found-inf flags). */
loom_status loom_comm_allreduce_max_int(loom_comm *c, int *buf, size_t n);
/* recv (n floats) = sum over ranks of send[rank * n .. (rank + 1) * n). */
loom_status loom_comm_reduce_scatter_f32(loom_comm *c, const float *send, float *recv, size_t n);
/* recv (size * n floats) = every rank's send (n floats), in rank order. */
loom_status loom_comm_allgather_f32(loom_comm *c, const float *send, float *recv, size_t n);
/* On rank `root`, recv + displs[r] = rank r's send (counts[r] floats);
 * counts and displs are the same on every rank, recv is written on root
 * only (others may pass NULL). */
loom_status loom_comm_gatherv_f32(loom_comm *c, const float *send, float *recv, const int *counts,
                                  const int *displs, int root);
/* recv (rows, cols * size) = every rank's send (rows, cols), rank r's in
 * columns [r cols, (r + 1) cols) of each row: a tensor split by columns
 * made whole, with no staging copy. */
loom_status loom_comm_allgather_cols_f32(loom_comm *c, const float *send, float *recv, size_t rows, size_t cols);
/* Nonblocking collectives: start one, then test or wait on its request.
 * Every rank must start the same collectives in the same order; the buffers
 * stay untouched until the request completes. The single-process backend
 * completes them at once. A request is caller storage (no allocation). */
typedef struct loom_comm_request {
    _Alignas(8) unsigned char impl[16]; /* the backend's handle */
    int active;
} loom_comm_request;
/* In-place sum over all ranks; n must fit an int. */
loom_status loom_comm_iallreduce_sum_f32(loom_comm *c, float *buf, size_t n, loom_comm_request *req);
/* recv (counts[rank] floats) = the sum over ranks of this rank's part of
 * send, where send is split into consecutive parts of counts[0], counts[1],
 * ... floats (one per rank, in rank order). send == recv works in place:
 * the result then lands at the start of the buffer. */
loom_status loom_comm_ireduce_scatter_f32(loom_comm *c, const float *send, float *recv, const int *counts,
                                          loom_comm_request *req);
/* *done = 1 when the request has completed (then it is inactive). Drives
 * the backend's progress: call it now and then while computing. */
loom_status loom_comm_test(loom_comm_request *req, int *done);
/* Block until the request completes; an inactive request returns at once. */
loom_status loom_comm_wait(loom_comm_request *req);
loom_status loom_comm_broadcast(loom_comm *c, void *buf, size_t bytes, int root);
loom_status loom_comm_barrier(loom_comm *c);

/* The layout of a job of `world` ranks with tensor-parallel degree tp:
 * consecutive ranks form a tensor-parallel group; ranks with the same
 * position in their TP group form a data-parallel group. */
typedef struct loom_dist {
    loom_comm *world, *tp, *dp;
    int rank, world_size;
    int tp_rank, tp_size;
    int dp_rank, dp_size;
} loom_dist;

loom_status loom_dist_layout(loom_comm *world, int tp, loom_dist *out);
void loom_dist_layout_free(loom_dist *d);

#ifdef __cplusplus
}
#endif
#endif
