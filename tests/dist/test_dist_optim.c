/*
 * test_dist_optim.c — the data-parallel optimizer's found-inf rule (and,
 * below, its overlap, its moments one tensor at a time, its lent masters,
 * and the column gather of split tensors). Run
 * alone it checks one process; tests/scripts/test_mpi.sh also runs it under
 * `mpirun -np 2`, where the gradients of the two ranks are summed.
 *
 * Each rank's fp16 gradient is 40000 (finite). Summed over 2 ranks that is
 * 80000: finite in the fp32 reduction buffer, +Inf once rounded back to
 * fp16 for the optimizer. The step must be reported (found_inf) and
 * skipped, never applied: an applied step would make the masters NaN. ZeRO-1
 * rounds its shard of the sum to fp16 too (it updates exactly as plain data
 * parallelism does), so it skips the same step.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "loom/loom.h"
#include "nn/tp.h"

#define N 64

static loom_dist dist;

static void run_case(int zero) {
    int64_t shape[1] = {N};
    loom_param *p = NULL;
    assert_int_equal(loom_param_new("w", LOOM_F16, 1, shape, 0, &p), LOOM_OK); /* master-grad off: fp16 grad */
    float w[N];
    for (int i = 0; i < N; i++) w[i] = 0.01f * (float)i;
    assert_int_equal(loom_param_set_f32(p, w, N), LOOM_OK);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, &p, 1, &dist, zero, 0, &o), LOOM_OK);
    loom_dtype gdt;
    void *g = loom_param_grad_target(p, &gdt);
    float local[N];
    for (int i = 0; i < N; i++) local[i] = 40000.0f;
    loom_convert(g, gdt, local, LOOM_F32, N);
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 1);
    sc.scale = 1.0f;
    loom_step_info info;
    assert_int_equal(loom_dist_optim_prepare(o, &sc, 0.0f, &info), LOOM_OK);
    int summed_overflows = dist.dp_size >= 2 && gdt == LOOM_F16;
    assert_int_equal(info.found_inf, summed_overflows);
    if (!info.found_inf) {
        assert_int_equal(loom_dist_optim_step(o, 1e-3f, info.grad_multiplier), LOOM_OK);
        assert_int_equal(loom_dist_optim_unshard_masters(o), LOOM_OK);
        const float *m = loom_param_master(p);
        for (int i = 0; i < N; i++) assert_true(isfinite(m[i]) && m[i] != w[i]);
    }
    /* The moments: lent without ZeRO (the very values get copies, moved by
     * a step taken; a write through them is what the optimizer holds),
     * none to lend with it. */
    loom_moments_io io = loom_dist_optim_moments_io(o, 0);
    float gm[N];
    assert_int_equal(io.get(io.user, 0, 0, gm), LOOM_OK);
    float *mv = io.view(io.user, 0, 0);
    assert_int_equal(mv != NULL, !(zero && dist.dp_size > 1));
    if (mv) {
        assert_memory_equal(mv, gm, sizeof gm);
        assert_true((gm[0] != 0.0f) == !info.found_inf);
        mv[0] = 12345.0f;
        assert_int_equal(io.get(io.user, 0, 0, gm), LOOM_OK);
        assert_true(gm[0] == 12345.0f);
    }
    loom_dist_optim_free(o);
    loom_param_free(p);
}

static void test_fp16_gradient_sum_overflow(void **state) {
    (void)state;
    run_case(0);
}

static void test_fp16_gradient_sum_zero(void **state) {
    (void)state;
    run_case(1);
}

/* A gradient that reaches a parameter after its bucket's reduction started
 * during the watched backward — here on rank 0 only — fails prepare on
 * every rank (not on rank 0 alone, leaving the others in a collective). */
static void test_late_gradient_stops_every_rank(void **state) {
    (void)state;
    if (dist.dp_size < 2) skip(); /* nothing is watched without data parallelism */
    int64_t shape[2] = {4, 4};
    loom_param *p = NULL;
    assert_int_equal(loom_param_new("w", LOOM_F32, 2, shape, 1, &p), LOOM_OK);
    float w[16];
    for (int i = 0; i < 16; i++) w[i] = 0.1f * (float)(i % 5);
    assert_int_equal(loom_param_set_f32(p, w, 16), LOOM_OK);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, &p, 1, &dist, 0, 0, &o), LOOM_OK);
    loom_param_zero_grad(p);
    loom_tensor *x = loom_tensor_from_f32(w, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS), *y = NULL, *l = NULL;
    assert_int_equal(loom_fused_linear(x, p->tensor, NULL, &y), LOOM_OK);
    assert_int_equal(loom_sum(y, &l), LOOM_OK);
    loom_dist_optim_watch_backward(o);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK); /* the bucket starts when w's gradient is complete */
    if (dist.dp_rank == 0) assert_int_equal(loom_param_accumulate(p, x), LOOM_OK); /* then one more arrives */
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    loom_step_info info;
    assert_int_equal(loom_dist_optim_prepare(o, &sc, 0.0f, &info), LOOM_ERR_STATE);
    assert_non_null(strstr(loom_last_error(), dist.dp_rank == 0 ? "had started (" : "on another rank"));
    loom_tensor_release(l);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_dist_optim_free(o);
    loom_param_free(p);
}

/* A parameter used inside a reentrant region and again after it: the use
 * after the region is backpropagated first, and the region's replay adds
 * the other. Its uses must be known before the backward, or its bucket
 * starts at the first contribution and the replay's is late. With the
 * overlap on, every mode prepares, and to the same gradient. */
static loom_param *shared_w;

static loom_status shared_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)user; (void)n_in; (void)n_out;
    loom_tensor *h = NULL;
    loom_status st = loom_fused_linear(in[0], shared_w->tensor, NULL, &h);
    if (st == LOOM_OK) st = loom_silu(h, &out[0]);
    loom_tensor_release(h);
    return st;
}

static void run_shared(loom_recompute_mode mode, float *grad) {
    int64_t shape[2] = {4, 4};
    assert_int_equal(loom_param_new("w", LOOM_F32, 2, shape, 1, &shared_w), LOOM_OK);
    float w[16];
    for (int i = 0; i < 16; i++) w[i] = 0.1f * (float)(i % 5) - 0.2f;
    assert_int_equal(loom_param_set_f32(shared_w, w, 16), LOOM_OK);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, &shared_w, 1, &dist, 0, 0, &o), LOOM_OK);
    loom_param_zero_grad(shared_w);
    for (int i = 0; i < 16; i++) w[i] = 0.05f * (float)(i + dist.dp_rank);
    loom_tensor *x = loom_tensor_from_f32(w, LOOM_F32, 2, shape, LOOM_MEM_ACTIVATIONS), *y = NULL, *z = NULL,
                *l = NULL;
    assert_int_equal(loom_checkpoint(mode, shared_region, NULL, &x, 1, &y, 1), LOOM_OK);
    assert_int_equal(loom_fused_linear(y, shared_w->tensor, NULL, &z), LOOM_OK); /* and after the region */
    assert_int_equal(loom_sum(z, &l), LOOM_OK);
    loom_dist_optim_watch_backward(o);
    assert_int_equal(loom_backward(l, 1.0f), LOOM_OK);
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    loom_step_info info;
    loom_status st = loom_dist_optim_prepare(o, &sc, 0.0f, &info);
    if (st != LOOM_OK) fprintf(stderr, "%s: %s\n", loom_recompute_mode_name(mode), loom_last_error());
    assert_int_equal(st, LOOM_OK);
    memcpy(grad, shared_w->grad, 16 * sizeof(float));
    loom_tensor_release(l);
    loom_tensor_release(z);
    loom_tensor_release(y);
    loom_tensor_release(x);
    loom_dist_optim_free(o);
    loom_param_free(shared_w);
}

static void test_parameter_inside_reentrant_and_after(void **state) {
    (void)state;
    float ref[16], got[16];
    run_shared(LOOM_RECOMPUTE_NONE, ref);
    const loom_recompute_mode modes[] = {LOOM_RECOMPUTE_REENTRANT, LOOM_RECOMPUTE_NONREENTRANT,
                                         LOOM_RECOMPUTE_SELECTIVE};
    for (int k = 0; k < 3; k++) {
        run_shared(modes[k], got);
        assert_memory_equal(got, ref, sizeof ref);
    }
}

/* The moments one tensor at a time (what checkpoints read and write):
 * with ZeRO, each gathered from the ranks that own its parts to DP rank 0,
 * equal bit for bit to plain data parallelism's whole moments after the
 * same steps; a set keeps each rank's part, which a get gives back whole.
 * Three parameters whose sizes make the shards of 2 ranks split the middle
 * one; the io's index is the model's, here one past the optimizer's. */
#define NP 3
static const int64_t io_sizes[NP] = {5, 37, 22};

/* NP bf16 parameters of io_sizes, with nonzero values; master_grad 1:
 * fp32 gradients (in the optimizer's flat buffer), 0: bf16 ones. */
static void make_params(loom_param **ps, int master_grad) {
    for (int i = 0; i < NP; i++) {
        char name[8];
        snprintf(name, sizeof name, "w%d", i);
        assert_int_equal(loom_param_new(name, LOOM_BF16, 1, &io_sizes[i], master_grad, &ps[i]), LOOM_OK);
        float w[64];
        for (int k = 0; k < io_sizes[i]; k++) w[k] = 0.01f * (float)(k - 7 * i);
        assert_int_equal(loom_param_set_f32(ps[i], w, io_sizes[i]), LOOM_OK);
    }
}

static void moments_after_steps(int zero, float *out) {
    loom_param *ps[NP];
    make_params(ps, 1);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, ps, NP, &dist, zero, 0, &o), LOOM_OK);
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    for (int step = 0; step < 2; step++) {
        for (int i = 0; i < NP; i++) {
            loom_dtype gdt;
            void *g = loom_param_grad_target(ps[i], &gdt);
            float local[64];
            for (int k = 0; k < io_sizes[i]; k++)
                local[k] = 0.1f * (float)(dist.dp_rank + 1) * (float)(k % 9 - 4) + 0.01f * (float)step;
            loom_convert(g, gdt, local, LOOM_F32, (size_t)io_sizes[i]);
        }
        loom_step_info info;
        assert_int_equal(loom_dist_optim_prepare(o, &sc, 1.0f, &info), LOOM_OK);
        assert_int_equal(loom_dist_optim_step(o, 1e-2f, info.grad_multiplier), LOOM_OK);
    }
    loom_moments_io io = loom_dist_optim_moments_io(o, 1);
    int lent = io.view(io.user, 1, 0) != NULL;
    assert_int_equal(lent, !(zero && dist.dp_size > 1));
    {
        float *at = out;
        for (int i = 0; i < NP; i++)
            for (int kind = 0; kind < 2; kind++, at += io_sizes[i])
                assert_int_equal(io.get(io.user, i + 1, kind, dist.dp_rank == 0 ? at : NULL), LOOM_OK);
    }
    if (zero) { /* set, then get back: each rank kept its part */
        float pattern[64], back[64];
        for (int i = 0; i < NP; i++)
            for (int kind = 0; kind < 2; kind++) {
                for (int k = 0; k < io_sizes[i]; k++) pattern[k] = (float)(1000 * i + 100 * kind + k);
                io.set(io.user, i + 1, kind, pattern);
            }
        if (dist.dp_rank != 0) {
            assert_int_equal(loom_dist_optim_serve_moments(o), LOOM_OK); /* what a checkpoint's non-writers do */
        } else {
            for (int i = 0; i < NP; i++)
                for (int kind = 0; kind < 2; kind++) {
                    for (int k = 0; k < io_sizes[i]; k++) pattern[k] = (float)(1000 * i + 100 * kind + k);
                    memset(back, 0, sizeof back);
                    assert_int_equal(io.get(io.user, i + 1, kind, back), LOOM_OK);
                    assert_memory_equal(back, pattern, (size_t)io_sizes[i] * sizeof(float));
                }
        }
    }
    assert_int_equal(loom_dist_optim_unshard_masters(o), LOOM_OK);
    loom_dist_optim_free(o);
    for (int i = 0; i < NP; i++) loom_param_free(ps[i]);
}

static void test_moments_one_tensor_at_a_time(void **state) {
    (void)state;
    float plain[128], zero[128];
    memset(plain, 0, sizeof plain);
    memset(zero, 0, sizeof zero);
    moments_after_steps(0, plain);
    moments_after_steps(1, zero);
    if (dist.dp_rank != 0) return;
    assert_memory_equal(zero, plain, sizeof plain);
    int moved = 0;
    for (int k = 0; k < 128; k++) moved += plain[k] != 0.0f;
    assert_true(moved > 100);
}

/* ZeRO-1's whole masters (unshard) live in the gradient buffer, lent to
 * the parameters: no memory of their own, gradients that read as zero and
 * a zero_grad that leaves them be, a step refused until they are taken
 * back (which leaves zero gradients), and their own copies, of the same
 * values, once the optimizer is freed. */
static void masters_lent(int master_grad) {
    loom_param *ps[NP];
    make_params(ps, master_grad);
    loom_adamw_config ac = loom_adamw_defaults();
    loom_dist_optim *o = NULL;
    assert_int_equal(loom_dist_optim_new(&ac, ps, NP, &dist, 1, 0, &o), LOOM_OK);
    int zero = dist.dp_size > 1;
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    loom_step_info info;
    assert_int_equal(loom_dist_optim_unshard_masters(o), LOOM_OK);
    float g[64], m[NP][64];
    for (int i = 0; i < NP; i++) {
        assert_int_equal(ps[i]->master_borrowed, zero);
        assert_int_equal(loom_param_master(ps[i]) == (float *)ps[i]->grad, zero && master_grad);
        /* while lent: the gradient reads as zero, and zero_grad leaves the master be */
        memcpy(m[i], loom_param_master(ps[i]), (size_t)io_sizes[i] * sizeof(float));
        loom_param_zero_grad(ps[i]);
        assert_memory_equal(loom_param_master(ps[i]), m[i], (size_t)io_sizes[i] * sizeof(float));
        loom_param_read_grad(ps[i], g);
        for (int k = 0; k < io_sizes[i]; k++) assert_true(g[k] == 0.0f);
        assert_true(m[i][1] != 0.0f);
    }
    assert_int_equal(loom_dist_optim_prepare(o, &sc, 0.0f, &info), zero ? LOOM_ERR_STATE : LOOM_OK);
    assert_int_equal(loom_dist_optim_reshard_masters(o), LOOM_OK);
    for (int i = 0; i < NP; i++) {
        loom_param_read_grad(ps[i], g);
        for (int k = 0; k < io_sizes[i]; k++) assert_true(g[k] == 0.0f);
    }
    assert_int_equal(loom_dist_optim_prepare(o, &sc, 0.0f, &info), LOOM_OK);
    assert_int_equal(loom_dist_optim_step(o, 1e-2f, info.grad_multiplier), LOOM_OK);
    assert_int_equal(loom_dist_optim_unshard_masters(o), LOOM_OK);
    for (int i = 0; i < NP; i++) memcpy(m[i], loom_param_master(ps[i]), (size_t)io_sizes[i] * sizeof(float));
    loom_dist_optim_free(o);
    for (int i = 0; i < NP; i++) {
        assert_false(ps[i]->master_borrowed);
        assert_memory_equal(loom_param_master(ps[i]), m[i], (size_t)io_sizes[i] * sizeof(float));
        loom_param_read_grad(ps[i], g);
        for (int k = 0; k < io_sizes[i]; k++) assert_true(g[k] == 0.0f);
        loom_param_free(ps[i]);
    }
}

static void test_masters_lent_from_gradient_buffer(void **state) {
    (void)state;
    masters_lent(1); /* fp32 gradients, in the buffer that holds the masters */
    masters_lent(0); /* bf16 gradients apart from it */
}

/* A tensor split by columns, made whole: rank r's (rows, cols) block lands
 * in columns [r cols, (r + 1) cols) of every row, straight from the
 * collective (a strided MPI type, no staging copy). */
static void test_allgather_cols(void **state) {
    (void)state;
    enum { ROWS = 3, COLS = 2 };
    int T = loom_comm_size(dist.world), me = loom_comm_rank(dist.world);
    float send[ROWS * COLS], recv[ROWS * COLS * 8];
    assert_true(T <= 8);
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) send[r * COLS + c] = (float)(100 * me + 10 * r + c);
    memset(recv, 0, sizeof recv);
    assert_int_equal(loom_comm_allgather_cols_f32(dist.world, send, recv, ROWS, COLS), LOOM_OK);
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < COLS; c++)
                assert_true(recv[r * COLS * T + t * COLS + c] == (float)(100 * t + 10 * r + c));
    for (int k = ROWS * COLS * T; k < ROWS * COLS * 8; k++) assert_true(recv[k] == 0.0f); /* nothing past it */
}

/* A bf16 weight reached through an fp32 cast and tp_copy (Qwen 3's q/k
 * norms under tensor parallelism: each rank's heads give part of its
 * gradient) gets the ranks' parts summed in fp32, bit for bit the fp32 sum
 * of the parts each rank accumulates when the weight is its own parameter
 * (tp_copy on the bf16 weight itself would round each part to bf16 first:
 * gradients travel in their tensor's dtype). */
static void test_norm_weight_through_tp_copy(void **state) {
    (void)state;
    enum { ROWS = 96, C = 16 };
    loom_comm *comm = dist.world;
    int rank = loom_comm_rank(comm);
    int64_t wshape[1] = {C}, xshape[2] = {ROWS, C};
    loom_param *w = NULL, *own = NULL;
    assert_int_equal(loom_param_new("w", LOOM_BF16, 1, wshape, 1, &w), LOOM_OK);
    assert_int_equal(loom_param_new("own", LOOM_BF16, 1, wshape, 1, &own), LOOM_OK);
    float v[C], x[ROWS * C], r[ROWS * C];
    for (int c = 0; c < C; c++) v[c] = 0.5f + 0.0625f * (float)c;
    for (int k = 0; k < ROWS * C; k++) {
        x[k] = sinf(0.37f * (float)k + (float)rank);
        r[k] = cosf(0.11f * (float)k * (float)(rank + 2));
    }
    assert_int_equal(loom_param_set_f32(w, v, C), LOOM_OK);
    assert_int_equal(loom_param_set_f32(own, v, C), LOOM_OK);
    loom_tensor *xt = loom_tensor_from_f32(x, LOOM_BF16, 2, xshape, LOOM_MEM_ACTIVATIONS);
    loom_tensor *rt = loom_tensor_from_f32(r, LOOM_F32, 2, xshape, LOOM_MEM_ACTIVATIONS);
    for (int through = 0; through <= 1; through++) {
        loom_tensor *wf = NULL, *wt = NULL, *xf = NULL, *y = NULL, *yr = NULL, *loss = NULL;
        assert_int_equal(loom_cast(through ? w->tensor : own->tensor, LOOM_F32, &wf), LOOM_OK);
        if (through) assert_int_equal(tp_copy(comm, wf, &wt), LOOM_OK);
        assert_int_equal(loom_cast(xt, LOOM_F32, &xf), LOOM_OK);
        assert_int_equal(loom_rmsnorm(xf, through ? wt : wf, 1e-5f, &y), LOOM_OK);
        assert_int_equal(loom_mul(y, rt, &yr), LOOM_OK);
        assert_int_equal(loom_sum(yr, &loss), LOOM_OK);
        assert_int_equal(loom_backward(loss, 1.0f), LOOM_OK);
        loom_tensor *ts[] = {wf, wt, xf, y, yr, loss};
        for (int k = 0; k < 6; k++) loom_tensor_release(ts[k]);
    }
    float sum[C];
    memcpy(sum, own->grad, sizeof sum);
    assert_int_equal(loom_comm_allreduce_sum_f32(comm, sum, C), LOOM_OK);
    assert_memory_equal(w->grad, sum, sizeof sum);
    loom_tensor_release(xt);
    loom_tensor_release(rt);
    loom_param_free(w);
    loom_param_free(own);
}

int main(int argc, char **argv) {
    loom_comm *world = NULL;
    if (loom_dist_init(&argc, &argv, &world) != LOOM_OK || loom_dist_layout(world, 1, &dist) != LOOM_OK) {
        fprintf(stderr, "test_dist_optim: %s\n", loom_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp16_gradient_sum_overflow),
        cmocka_unit_test(test_fp16_gradient_sum_zero),
        cmocka_unit_test(test_late_gradient_stops_every_rank),
        cmocka_unit_test(test_parameter_inside_reentrant_and_after),
        cmocka_unit_test(test_moments_one_tensor_at_a_time),
        cmocka_unit_test(test_masters_lent_from_gradient_buffer),
        cmocka_unit_test(test_allgather_cols),
        cmocka_unit_test(test_norm_weight_through_tp_copy),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    loom_dist_layout_free(&dist);
    loom_dist_finalize();
    return rc;
}
