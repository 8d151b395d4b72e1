/*
 * test_checkpoint_dist.c — checkpoints read and written through the
 * optimizer's loom_moments_io, one tensor at a time. Run alone it checks
 * one process; tests/scripts/test_mpi.sh also runs it under
 * `mpirun -np 2`, where it takes three layouts in turn: TP=2 (each tensor
 * gathered over the TP group as the file is written), and DP=2 with ZeRO-1
 * in bf16 and in fp32 (each moment gathered to DP rank 0; bf16's masters
 * sharded too).
 *
 *  - A save, then a load into a fresh model and optimizer, gives back every
 *    master and moment bit for bit.
 *  - A save that fails on the writing rank (the checkpoint exists; its
 *    directory cannot be made; the state file's write stops partway)
 *    returns the error there, and every other rank still finishes its
 *    part: no rank is left in a gather (a barrier after it meets, and a
 *    load after it gathers the same way). A rank short of memory for a
 *    gather tells the others first (loom_llama_tp_agree).
 *  - A PEFT adapter's write that fails on TP rank 0 fails on every rank.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loom/loom.h"

static loom_comm *world;
static char scratch[128]; /* the same directory on every rank (rank 0's name) */

typedef struct run {
    loom_dist dist;
    loom_llama *m;
    loom_dist_optim *o;
    loom_moments_io io;
} run;

static void run_open(run *r, int tp, int zero, loom_dtype dtype, uint64_t seed) {
    assert_int_equal(loom_dist_layout(world, tp, &r->dist), LOOM_OK);
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    /* A state of about 800 KiB: more than the file writer's buffer, so
     * that a write can fail before the last tensors are gathered. */
    c.dim = 32; c.n_layers = 1; c.n_heads = 2; c.n_kv_heads = 2; c.ffn_dim = 48; c.vocab_size = 1024;
    c.max_seq = 8; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    loom_precision p = {dtype, dtype != LOOM_F32};
    assert_int_equal(loom_llama_new_tp(&c, p, r->dist.tp, &r->m), LOOM_OK);
    loom_llama_init_weights(r->m, seed);
    loom_adamw_config ac = loom_adamw_defaults();
    assert_int_equal(loom_dist_optim_new(&ac, r->m->params, r->m->n_params, &r->dist, zero, 0, &r->o), LOOM_OK);
    r->io = loom_dist_optim_moments_io(r->o, 0);
}

static void run_close(run *r) {
    assert_int_equal(loom_dist_optim_unshard_masters(r->o), LOOM_OK);
    loom_dist_optim_free(r->o);
    loom_llama_free(r->m);
    loom_dist_layout_free(&r->dist);
}

/* Two steps on made-up gradients (the same on the ranks of a TP group,
 * another on each DP rank), so that masters and moments are all nonzero. */
static void train_two_steps(run *r) {
    loom_loss_scaler sc;
    loom_loss_scaler_init(&sc, 0);
    for (int step = 0; step < 2; step++) {
        for (int i = 0; i < r->m->n_params; i++) {
            loom_param *p = r->m->params[i];
            size_t n = (size_t)loom_param_numel(p);
            float *g = malloc(n * sizeof *g);
            for (size_t k = 0; k < n; k++)
                g[k] = 0.01f * (float)((int)((k * 7 + (size_t)i * 3) % 11) - 5) * (float)(r->dist.dp_rank + 1 + step);
            loom_dtype gdt;
            loom_convert(loom_param_grad_target(p, &gdt), gdt, g, LOOM_F32, n);
            free(g);
        }
        loom_step_info info;
        assert_int_equal(loom_dist_optim_prepare(r->o, &sc, 1.0f, &info), LOOM_OK);
        assert_int_equal(loom_dist_optim_step(r->o, 1e-2f, info.grad_multiplier), LOOM_OK);
    }
}

/* Save as `loom train` does: the ranks of DP group 0 write (TP rank 0 of
 * it the files), the others serve their moments' parts. */
static loom_status save(run *r, const char *dir) {
    loom_train_state st;
    memset(&st, 0, sizeof st);
    st.step = 2;
    st.loss_scale = 1.0f;
    assert_int_equal(loom_dist_optim_unshard_masters(r->o), LOOM_OK);
    loom_status s = r->dist.dp_rank == 0 ? loom_checkpoint_save_io(dir, r->m, &r->io, 2, &st, NULL)
                                         : loom_dist_optim_serve_moments(r->o);
    assert_int_equal(loom_dist_optim_reshard_masters(r->o), LOOM_OK);
    return s;
}

/* Every master and moment, full, on world rank 0 (collective): masters
 * gathered over TP, moments over DP then TP. */
static float *state_of(run *r, size_t *count) {
    loom_llama *m = r->m;
    size_t total = 0;
    for (int i = 0; i < m->n_params; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        total += 3 * (size_t)(fs[0] * fs[1]);
    }
    float *all = calloc(total, sizeof *all), *at = all;
    assert_int_equal(loom_dist_optim_unshard_masters(r->o), LOOM_OK);
    for (int i = 0; i < m->n_params; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        size_t n = (size_t)(fs[0] * fs[1]), local = (size_t)loom_param_numel(m->params[i]);
        assert_int_equal(loom_llama_param_gather(m, i, 0, at), LOOM_OK);
        at += n;
        for (int kind = 0; kind < 2; kind++, at += n) {
            float *part = malloc(local * sizeof *part);
            assert_int_equal(r->io.get(r->io.user, i, kind, part), LOOM_OK);
            assert_int_equal(loom_llama_tp_gather(m, i, part, at), LOOM_OK); /* meaningful on DP rank 0 */
            free(part);
        }
    }
    assert_int_equal(loom_dist_optim_reshard_masters(r->o), LOOM_OK);
    *count = total;
    return all;
}

static void check_layout(int tp, int zero, loom_dtype dtype, const char *tag) {
    run a, b;
    run_open(&a, tp, zero, dtype, 11);
    train_two_steps(&a);
    char dir[256], bad[256];
    snprintf(dir, sizeof dir, "%s/%s", scratch, tag);
    assert_int_equal(save(&a, dir), LOOM_OK);

    /* Fails on the writer only; every rank gets through. */
    int writer = a.dist.tp_rank == 0 && a.dist.dp_rank == 0;
    assert_int_equal(save(&a, dir), writer ? LOOM_ERR_IO : LOOM_OK);
    if (writer) assert_non_null(strstr(loom_last_error(), "already exists"));
    snprintf(bad, sizeof bad, "%s/file/%s", scratch, tag); /* below a regular file: no directory can be made */
    loom_status s = save(&a, bad);
    if (writer) assert_int_not_equal(s, LOOM_OK);
    else assert_int_equal(s, LOOM_OK);
    assert_int_equal(loom_comm_barrier(world), LOOM_OK);
    /* A write that stops partway through the state (a file size limit
     * standing in for a full disk, on the writer only): the tensors after
     * it are still gathered. */
    struct rlimit old, lim;
    if (writer) {
        char state[300];
        struct stat sb;
        snprintf(state, sizeof state, "%s/state.safetensors", dir);
        assert_int_equal(stat(state, &sb), 0);
        signal(SIGXFSZ, SIG_IGN);
        assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
        lim = old;
        lim.rlim_cur = (rlim_t)sb.st_size / 2; /* above the weights' file, a third of the state's */
        assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    }
    snprintf(bad, sizeof bad, "%s/%s-partial", scratch, tag);
    s = save(&a, bad);
    if (writer) {
        assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
        assert_int_equal(s, LOOM_ERR_IO);
        assert_non_null(strstr(loom_last_error(), "state.safetensors"));
    } else {
        assert_int_equal(s, LOOM_OK);
    }
    assert_int_equal(loom_comm_barrier(world), LOOM_OK);

    /* Back, bit for bit, into a model and optimizer that start elsewhere. */
    run_open(&b, tp, zero, dtype, 99);
    int adam_steps = 0;
    loom_train_state st;
    assert_int_equal(loom_dist_optim_unshard_masters(b.o), LOOM_OK);
    assert_int_equal(loom_checkpoint_load_io(dir, b.m, &b.io, &adam_steps, &st), LOOM_OK);
    assert_int_equal(loom_dist_optim_reshard_masters(b.o), LOOM_OK);
    assert_int_equal(adam_steps, 2);
    size_t na, nb;
    float *sa = state_of(&a, &na), *sb = state_of(&b, &nb);
    assert_int_equal(na, nb);
    if (loom_comm_rank(world) == 0) {
        assert_memory_equal(sa, sb, na * sizeof *sa);
        size_t moved = 0;
        for (size_t k = 0; k < na; k++) moved += sa[k] != 0.0f;
        assert_true(moved > na * 9 / 10);
    }
    free(sa);
    free(sb);
    /* A rank that cannot take part in a gather says so first: every rank
     * of the TP group learns it, and none gathers. */
    if (a.m->tp_size > 1) {
        loom_status mine = a.m->tp_rank == 1 ? loom_error(LOOM_ERR_NOMEM, "out of memory here") : LOOM_OK;
        assert_int_equal(loom_llama_tp_agree(a.m, mine), LOOM_ERR_NOMEM);
        if (a.m->tp_rank != 1) assert_non_null(strstr(loom_last_error(), "another tensor-parallel rank"));
        assert_int_equal(loom_llama_tp_agree(a.m, LOOM_OK), LOOM_OK);
    }
    run_close(&b);
    run_close(&a);
}

static void test_one_process_or_tensor_parallel(void **state) {
    (void)state;
    check_layout(loom_comm_size(world), 0, LOOM_F32, "tp");
}

static void test_zero_bf16(void **state) {
    (void)state;
    check_layout(1, 1, LOOM_BF16, "zero-bf16");
}

static void test_zero_fp32(void **state) {
    (void)state;
    check_layout(1, 1, LOOM_F32, "zero-fp32");
}

/* A PEFT adapter saved under TP: TP rank 0 writes what every rank
 * gathered, and a write that fails there (a directory below a regular file)
 * fails on every rank, the others naming rank 0 and its message. */
static void test_peft_save_errors(void **state) {
    (void)state;
    loom_dist dist;
    assert_int_equal(loom_dist_layout(world, loom_comm_size(world), &dist), LOOM_OK);
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = 32; c.n_layers = 1; c.n_heads = 2; c.n_kv_heads = 2; c.ffn_dim = 48; c.vocab_size = 64;
    c.max_seq = 8; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    loom_precision p = {LOOM_F32, 0};
    loom_lora_config lc = {.rank = 4, .alpha = 8.0f, .targets = LOOM_LORA_ALL};
    loom_llama *m;
    assert_int_equal(loom_llama_new_lora_tp(&c, p, &lc, 5, dist.tp, &m), LOOM_OK);
    char dir[256], adapter[300];
    snprintf(dir, sizeof dir, "%s/peft", scratch);
    assert_int_equal(loom_lora_save_peft(m, dir, NULL), LOOM_OK);
    assert_int_equal(loom_comm_barrier(world), LOOM_OK);
    struct stat sb;
    snprintf(adapter, sizeof adapter, "%s/adapter_model.safetensors", dir);
    assert_int_equal(stat(adapter, &sb), 0);
    snprintf(dir, sizeof dir, "%s/file/peft", scratch);
    assert_int_not_equal(loom_lora_save_peft(m, dir, NULL), LOOM_OK);
    if (m->tp_rank != 0) {
        assert_non_null(strstr(loom_last_error(), "tensor-parallel rank 0 did not write"));
        assert_non_null(strstr(loom_last_error(), "file/peft"));
    }
    assert_int_equal(loom_comm_barrier(world), LOOM_OK);
    loom_llama_free(m);
    loom_dist_layout_free(&dist);
}

int main(int argc, char **argv) {
    if (loom_dist_init(&argc, &argv, &world) != LOOM_OK) {
        fprintf(stderr, "test_checkpoint_dist: %s\n", loom_last_error());
        return 1;
    }
    if (loom_comm_rank(world) == 0) {
        snprintf(scratch, sizeof scratch, "/tmp/loom-ckdist-XXXXXX");
        char file[160];
        snprintf(file, sizeof file, "%s/file", mkdtemp(scratch) ? scratch : "/nonexistent");
        FILE *f = fopen(file, "w");
        if (f) fclose(f);
    }
    loom_comm_broadcast(world, scratch, sizeof scratch, 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_process_or_tensor_parallel),
        cmocka_unit_test(test_zero_bf16),
        cmocka_unit_test(test_zero_fp32),
        cmocka_unit_test(test_peft_save_errors),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    loom_comm_barrier(world);
    if (loom_comm_rank(world) == 0) {
        char cmd[200];
        snprintf(cmd, sizeof cmd, "rm -rf %s", scratch);
        if (system(cmd) != 0) rc = rc ? rc : 1;
    }
    loom_dist_finalize();
    return rc;
}
