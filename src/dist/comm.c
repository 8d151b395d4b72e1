/*
 * comm.c — communicators over Open MPI, or a single process.
 * Owns: MPI initialisation and error handling (MPI_ERRORS_RETURN, every
 * return code checked, messages through loom_error), the TP/DP layout.
 * Must never: hang on an error it knows about (loom_dist_abort ends the job).
 */
#include "loom/dist.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if LOOM_HAVE_MPI
#include <mpi.h>
#endif

struct loom_comm {
    int rank, size;
    int owned; /* free the MPI communicator on loom_comm_free */
#if LOOM_HAVE_MPI
    MPI_Comm mpi;
#endif
};

static loom_comm world_comm = {0, 1, 0
#if LOOM_HAVE_MPI
                               , 0
#endif
};
static int mpi_active;

int loom_dist_is_distributed(void) { return mpi_active && world_comm.size > 1; }

int loom_dist_built_with_mpi(void) { return LOOM_HAVE_MPI; }

#if LOOM_HAVE_MPI
static loom_status mpi_check(int rc, const char *what) {
    if (rc == MPI_SUCCESS) return LOOM_OK;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return loom_error(LOOM_ERR_DIST, "%s failed on rank %d: %s", what, world_comm.rank, msg);
}

#endif

/* Started as one of several processes by mpirun or a PMI launcher. */
static int launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

long loom_dist_launched_ranks(void) {
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    long n = v ? strtol(v, NULL, 10) : 1;
    return n > 1 ? n : 1;
}

loom_status loom_dist_init(int *argc, char ***argv, loom_comm **world) {
    *world = &world_comm;
#if LOOM_HAVE_MPI
    if (!launched_by_mpirun() || mpi_active) return LOOM_OK;
    int provided;
    LOOM_TRY(mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init"));
    mpi_active = 1;
    if (provided < MPI_THREAD_FUNNELED) /* loom's OpenMP threads run beside MPI calls of the main thread */
        return loom_error(LOOM_ERR_DIST, "MPI_Init: this MPI library offers thread level %d; loom needs "
                          "MPI_THREAD_FUNNELED (%d): use an MPI built with thread support", provided,
                          MPI_THREAD_FUNNELED);
    world_comm.mpi = MPI_COMM_WORLD;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_comm.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_comm.size);
#else
    (void)argc; (void)argv;
    /* Each of the processes would train alone, on the same data and into
     * the same output directory. */
    if (launched_by_mpirun() && loom_dist_launched_ranks() > 1)
        return loom_error(LOOM_ERR_DIST, "started as one of %ld processes, but this loom was built without MPI; "
                          "install Open MPI (libopenmpi-dev) and rebuild, or run one process", loom_dist_launched_ranks());
#endif
    return LOOM_OK;
}

void loom_dist_finalize(void) {
#if LOOM_HAVE_MPI
    if (mpi_active) MPI_Finalize();
    mpi_active = 0;
#endif
}

void loom_dist_abort(const char *message, int code) {
    if (world_comm.size > 1) fprintf(stderr, "loom: rank %d: %s\n", world_comm.rank, message);
    else fprintf(stderr, "%s\n", message);
    fflush(stderr);
#if LOOM_HAVE_MPI
    if (mpi_active && world_comm.size > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    exit(code);
}

int loom_comm_rank(const loom_comm *c) { return c->rank; }
int loom_comm_size(const loom_comm *c) { return c->size; }

loom_status loom_comm_split(loom_comm *c, int color, int key, loom_comm **out) {
    loom_comm *n = calloc(1, sizeof *n);
    if (!n) return loom_error(LOOM_ERR_NOMEM, "comm_split: out of memory");
    n->rank = 0;
    n->size = 1;
#if LOOM_HAVE_MPI
    if (mpi_active) {
        loom_status st = mpi_check(MPI_Comm_split(c->mpi, color, key, &n->mpi), "MPI_Comm_split");
        if (st != LOOM_OK) { free(n); return st; }
        MPI_Comm_set_errhandler(n->mpi, MPI_ERRORS_RETURN);
        MPI_Comm_rank(n->mpi, &n->rank);
        MPI_Comm_size(n->mpi, &n->size);
        n->owned = 1;
    }
#else
    (void)c; (void)color; (void)key;
#endif
    *out = n;
    return LOOM_OK;
}

void loom_comm_free(loom_comm *c) {
    if (!c || c == &world_comm) return;
#if LOOM_HAVE_MPI
    if (c->owned && mpi_active) MPI_Comm_free(&c->mpi);
#endif
    free(c);
}

#if LOOM_HAVE_MPI
/* MPI counts are int: split large buffers. */
static loom_status allreduce(loom_comm *c, void *buf, size_t n, MPI_Datatype t, size_t esize, MPI_Op op) {
    for (size_t off = 0; off < n;) {
        int k = n - off > (size_t)INT_MAX ? INT_MAX : (int)(n - off);
        LOOM_TRY(mpi_check(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * esize, k, t, op, c->mpi), "MPI_Allreduce"));
        off += (size_t)k;
    }
    return LOOM_OK;
}
#endif

loom_status loom_comm_allreduce_sum_f32(loom_comm *c, float *buf, size_t n) {
#if LOOM_HAVE_MPI
    if (c->size > 1) return allreduce(c, buf, n, MPI_FLOAT, sizeof(float), MPI_SUM);
#endif
    (void)c; (void)buf; (void)n;
    return LOOM_OK;
}

loom_status loom_comm_allreduce_sum_f64(loom_comm *c, double *buf, size_t n) {
#if LOOM_HAVE_MPI
    if (c->size > 1) return allreduce(c, buf, n, MPI_DOUBLE, sizeof(double), MPI_SUM);
#endif
    (void)c; (void)buf; (void)n;
    return LOOM_OK;
}

loom_status loom_comm_allreduce_max_int(loom_comm *c, int *buf, size_t n) {
#if LOOM_HAVE_MPI
    if (c->size > 1) return allreduce(c, buf, n, MPI_INT, sizeof(int), MPI_MAX);
#endif
    (void)c; (void)buf; (void)n;
    return LOOM_OK;
}

loom_status loom_comm_reduce_scatter_f32(loom_comm *c, const float *send, float *recv, size_t n) {
#if LOOM_HAVE_MPI
    if (c->size > 1) {
        if (n > (size_t)INT_MAX) return loom_error(LOOM_ERR_DIST, "reduce_scatter: %zu elements per rank is too many", n);
        return mpi_check(MPI_Reduce_scatter_block(send, recv, (int)n, MPI_FLOAT, MPI_SUM, c->mpi),
                         "MPI_Reduce_scatter_block");
    }
#endif
    (void)c;
    if (recv != send) memmove(recv, send, n * sizeof *recv);
    return LOOM_OK;
}

loom_status loom_comm_allgather_f32(loom_comm *c, const float *send, float *recv, size_t n) {
#if LOOM_HAVE_MPI
    if (c->size > 1) {
        if (n > (size_t)INT_MAX) return loom_error(LOOM_ERR_DIST, "allgather: %zu elements per rank is too many", n);
        const void *s = send == recv + (size_t)c->rank * n ? MPI_IN_PLACE : send;
        return mpi_check(MPI_Allgather(s, (int)n, MPI_FLOAT, recv, (int)n, MPI_FLOAT, c->mpi), "MPI_Allgather");
    }
#endif
    (void)c;
    if (recv != send) memmove(recv, send, n * sizeof *recv);
    return LOOM_OK;
}

loom_status loom_comm_gatherv_f32(loom_comm *c, const float *send, float *recv, const int *counts,
                                  const int *displs, int root) {
#if LOOM_HAVE_MPI
    if (c->size > 1)
        return mpi_check(MPI_Gatherv(send, counts[c->rank], MPI_FLOAT, recv, counts, displs, MPI_FLOAT, root, c->mpi),
                         "MPI_Gatherv");
#endif
    (void)c; (void)root;
    if (recv && recv + displs[0] != send) memmove(recv + displs[0], send, (size_t)counts[0] * sizeof *recv);
    return LOOM_OK;
}

loom_status loom_comm_allgather_cols_f32(loom_comm *c, const float *send, float *recv, size_t rows, size_t cols) {
#if LOOM_HAVE_MPI
    if (c->size > 1) {
        size_t size = (size_t)c->size;
        if (rows > (size_t)INT_MAX || rows * cols > (size_t)INT_MAX || cols * size > (size_t)INT_MAX)
            return loom_error(LOOM_ERR_DIST, "allgather: %zu x %zu columns per rank is too many", rows, cols);
        /* Rank r's (rows, cols) block lands in columns [r cols, (r + 1) cols)
         * of every row: a strided type, its extent one block's width, so
         * that rank r's starts r blocks in. No staging copy. */
        MPI_Datatype strided, block;
        loom_status st = mpi_check(MPI_Type_vector((int)rows, (int)cols, (int)(cols * size), MPI_FLOAT, &strided),
                                   "MPI_Type_vector");
        if (st != LOOM_OK) return st;
        st = mpi_check(MPI_Type_create_resized(strided, 0, (MPI_Aint)(cols * sizeof(float)), &block),
                       "MPI_Type_create_resized");
        if (st == LOOM_OK) {
            st = mpi_check(MPI_Type_commit(&block), "MPI_Type_commit");
            if (st == LOOM_OK)
                st = mpi_check(MPI_Allgather(send, (int)(rows * cols), MPI_FLOAT, recv, 1, block, c->mpi),
                               "MPI_Allgather");
            MPI_Type_free(&block);
        }
        MPI_Type_free(&strided);
        return st;
    }
#endif
    (void)c; (void)rows;
    if (recv != send) memmove(recv, send, rows * cols * sizeof *recv);
    return LOOM_OK;
}

#if LOOM_HAVE_MPI
_Static_assert(sizeof(MPI_Request) <= sizeof(((loom_comm_request *)0)->impl), "MPI_Request does not fit");
static MPI_Request *mpi_request(loom_comm_request *req) { return (MPI_Request *)(void *)req->impl; }
#endif

loom_status loom_comm_iallreduce_sum_f32(loom_comm *c, float *buf, size_t n, loom_comm_request *req) {
    req->active = 0;
#if LOOM_HAVE_MPI
    if (c->size > 1) {
        if (n > (size_t)INT_MAX) return loom_error(LOOM_ERR_DIST, "iallreduce: %zu elements is too many", n);
        LOOM_TRY(mpi_check(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, c->mpi, mpi_request(req)),
                           "MPI_Iallreduce"));
        req->active = 1;
    }
#endif
    (void)c; (void)buf; (void)n;
    return LOOM_OK;
}

loom_status loom_comm_ireduce_scatter_f32(loom_comm *c, const float *send, float *recv, const int *counts,
                                          loom_comm_request *req) {
    req->active = 0;
#if LOOM_HAVE_MPI
    if (c->size > 1) {
        LOOM_TRY(mpi_check(MPI_Ireduce_scatter(send == recv ? MPI_IN_PLACE : send, recv, counts, MPI_FLOAT, MPI_SUM,
                                               c->mpi, mpi_request(req)), "MPI_Ireduce_scatter"));
        req->active = 1;
        return LOOM_OK;
    }
#endif
    (void)c;
    if (recv != send) memmove(recv, send, (size_t)counts[0] * sizeof *recv);
    return LOOM_OK;
}

loom_status loom_comm_test(loom_comm_request *req, int *done) {
    *done = 1;
    (void)req;
#if LOOM_HAVE_MPI
    if (req->active) {
        int flag = 0;
        LOOM_TRY(mpi_check(MPI_Test(mpi_request(req), &flag, MPI_STATUS_IGNORE), "MPI_Test"));
        *done = flag != 0;
        if (flag) req->active = 0;
    }
#endif
    return LOOM_OK;
}

loom_status loom_comm_wait(loom_comm_request *req) {
#if LOOM_HAVE_MPI
    if (req->active) {
        req->active = 0;
        return mpi_check(MPI_Wait(mpi_request(req), MPI_STATUS_IGNORE), "MPI_Wait");
    }
#endif
    (void)req;
    return LOOM_OK;
}

loom_status loom_comm_broadcast(loom_comm *c, void *buf, size_t bytes, int root) {
#if LOOM_HAVE_MPI
    if (c->size > 1) {
        for (size_t off = 0; off < bytes;) {
            int k = bytes - off > (size_t)INT_MAX ? INT_MAX : (int)(bytes - off);
            LOOM_TRY(mpi_check(MPI_Bcast((char *)buf + off, k, MPI_BYTE, root, c->mpi), "MPI_Bcast"));
            off += (size_t)k;
        }
    }
#endif
    (void)c; (void)buf; (void)bytes; (void)root;
    return LOOM_OK;
}

loom_status loom_comm_barrier(loom_comm *c) {
#if LOOM_HAVE_MPI
    if (c->size > 1) return mpi_check(MPI_Barrier(c->mpi), "MPI_Barrier");
#endif
    (void)c;
    return LOOM_OK;
}

loom_status loom_dist_layout(loom_comm *world, int tp, loom_dist *d) {
    memset(d, 0, sizeof *d);
    int n = loom_comm_size(world), r = loom_comm_rank(world);
    if (tp < 1 || n % tp)
        return loom_error(LOOM_ERR_INVALID, "--tp %d must divide the number of ranks (%d)%s", tp, n,
                          n == 1 ? ": start tensor parallelism with mpirun -np N (N a multiple of --tp)" : "");
    d->world = world;
    d->rank = r;
    d->world_size = n;
    d->tp_size = tp;
    d->dp_size = n / tp;
    LOOM_TRY(loom_comm_split(world, r / tp, r % tp, &d->tp));
    LOOM_TRY(loom_comm_split(world, r % tp, r / tp, &d->dp));
    d->tp_rank = loom_comm_rank(d->tp);
    d->dp_rank = loom_comm_rank(d->dp);
    return LOOM_OK;
}

void loom_dist_layout_free(loom_dist *d) {
    loom_comm_free(d->tp);
    loom_comm_free(d->dp);
    memset(d, 0, sizeof *d);
}
