/*
 * cmd_bench.c — `loom bench`: full training steps (forward, backward,
 * clipping, AdamW) of a preset on random tokens, timed after a warm-up, with
 * throughput, model FLOPs, MFU against a GEMM peak measured in the same run,
 * peak activation bytes and peak RSS.
 *
 * With neither --precision nor --recompute it runs the standard matrix
 * {fp32, bf16 master-grad} x {none, selective, full}, each configuration in a
 * fresh process (this binary re-executed), so that rss_MiB is per
 * configuration: RSS is a per-process high-water mark.
 *
 * Model FLOPs per step (stated in the output):
 *   6 * N * tokens + 6 * L * T * dim * tokens
 * N = parameters that take part in a matmul (q, k, v, o, gate, up, down of
 * every layer, and lm_head; not the embedding lookup or the norms). The
 * second term is causal attention: QK^T and PV cost 2 * T * dim per token
 * per layer in forward on average (half of the T x T scores), backward twice
 * that. Recomputation is not counted (model FLOPs, not hardware FLOPs).
 */
#include "cli.h"

#include <math.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>

extern char **environ;

typedef struct bench_opts {
    const char *preset, *precision, *master_grad, *recompute, *recompute_mode, *gemm_peak;
    int threads, steps, warmup, batch, seq, json, profile, gemms;
    int recompute_blocks; /* recompute the first N blocks only (0: all) */
    int lockstep; /* each step waits for a line on stdin and reports its time (bench/lockstep_peer.py) */
    int peak_given; /* --gemm-peak came from the user, not from a parent that measured it */
} bench_opts;

typedef struct gemm_peak {
    double f32, bf16; /* GFLOP/s */
} gemm_peak;

typedef struct bench_result {
    double step_ms, tok_s, gflop_per_step, gflops, mfu, peak_act_mib, rss_mib, buffer_allocs_per_step, loss;
    double primitives_per_step; /* oneDNN primitives created (cache misses) */
    double replay_ms;           /* median per step: the recompute's replays inside the backward */
} bench_result;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ------------------------------------------------------------ GEMM peak */

#define PEAK_SIZE 1024 /* M = N = K: the size of the largest GEMMs of a step */
#define PEAK_REPS 40 /* best of: the peak is what the machine gives when it is not shared */

/* The fastest of `reps` calls of one GEMM (C in c_dt, no bias), after
 * `warmup` untimed ones (caches, primitives), in ms. */
static loom_status best_gemm(int warmup, int reps, int trans_a, int trans_b, int M, int N, int K, const void *A,
                             int lda, const void *B, int ldb, loom_dtype dt, float beta, void *C, int ldc,
                             loom_dtype c_dt, double *best_ms) {
    *best_ms = INFINITY;
    for (int r = 0; r < warmup + reps; r++) {
        double t0 = cli_now();
        LOOM_TRY(loom_gemm(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, dt, beta, C, ldc, c_dt, NULL, LOOM_F32));
        double ms = (cli_now() - t0) * 1e3;
        if (r >= warmup && ms < *best_ms) *best_ms = ms;
    }
    return LOOM_OK;
}

/* Best GFLOP/s of C = A · B^T (the forward layout of the fused linear) for
 * square matrices of dtype dt with fp32 accumulation, C in dt. */
static loom_status measure_gemm(loom_dtype dt, double *gflops) {
    int n = PEAK_SIZE;
    size_t elems = (size_t)n * n;
    float *src = malloc(elems * sizeof *src);
    void *a = loom_alloc(elems * loom_dtype_size(dt), LOOM_MEM_WORKSPACE);
    void *b = loom_alloc(elems * loom_dtype_size(dt), LOOM_MEM_WORKSPACE);
    void *c = loom_alloc(elems * loom_dtype_size(dt), LOOM_MEM_WORKSPACE);
    loom_status st = src && a && b && c ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "bench: out of memory");
    if (st == LOOM_OK) {
        loom_rng_uniform(src, elems, 1, 0);
        loom_convert(a, dt, src, LOOM_F32, elems);
        loom_rng_uniform(src, elems, 2, 0);
        loom_convert(b, dt, src, LOOM_F32, elems);
    }
    double ms = INFINITY;
    if (st == LOOM_OK) st = best_gemm(1, PEAK_REPS, 0, 1, n, n, n, a, n, b, n, dt, 0.0f, c, n, dt, &ms);
    free(src);
    loom_free(a);
    loom_free(b);
    loom_free(c);
    *gflops = st == LOOM_OK ? 2.0 * n * n * (double)n / (ms * 1e-3) * 1e-9 : 0.0;
    return st;
}

static loom_status measure_peak(gemm_peak *p) {
    LOOM_TRY(measure_gemm(LOOM_F32, &p->f32));
    return measure_gemm(LOOM_BF16, &p->bf16);
}

/* "F32,BF16" in GFLOP/s; "measured:F32,BF16" is what the standard matrix
 * hands its children (*given = 0). */
static int parse_peak(const char *s, gemm_peak *p, int *given) {
    static const char tag[] = "measured:";
    *given = strncmp(s, tag, sizeof tag - 1) != 0;
    if (!*given) s += sizeof tag - 1;
    char *end;
    p->f32 = strtod(s, &end);
    if (*end != ',') return -1;
    p->bf16 = strtod(end + 1, &end);
    return *end || !(p->f32 > 0.0 && isfinite(p->f32)) || !(p->bf16 > 0.0 && isfinite(p->bf16)) ? -1 : 0;
}

/* -------------------------------------------------------------- model FLOPs */

/* q, o (heads x head size by dim), k, v (kv x dim), gate, up, down (ffn x
 * dim) per layer, and lm_head (vocab x dim). */
static double matmul_params(const loom_llama_config *c) {
    double HS = loom_llama_head_dim(c), q = c->n_heads * HS, kv = c->n_kv_heads * HS;
    double per_layer = 2.0 * q * c->dim + 2.0 * kv * c->dim + 3.0 * c->dim * c->ffn_dim;
    return per_layer * c->n_layers + (double)c->vocab_size * c->dim;
}

static double model_flops_per_token(const loom_llama_config *c, int T) {
    /* the attention's products are heads x head size wide (dim for LLaMA's presets) */
    return 6.0 * matmul_params(c) + 6.0 * c->n_layers * (double)T * c->n_heads * loom_llama_head_dim(c);
}

/* ------------------------------------------------------------ one config */

enum { PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER, N_PHASES };
static const char *const phase_names[N_PHASES] = {"forward", "backward", "zero_grad+norm+adamw"};

typedef struct bench_run {
    loom_llama *m;
    loom_adamw *opt;
    loom_loss_scaler scaler;
    int32_t *tokens, *targets;
    int B, T;
    double phase[N_PHASES]; /* seconds summed over the timed steps */
} bench_run;

static loom_status train_step(bench_run *r, double *loss) {
    double t0 = cli_now();
    loom_llama_zero_grad(r->m);
    double t1 = cli_now();
    loom_tensor *l = NULL;
    LOOM_TRY(loom_llama_forward(r->m, r->tokens, r->targets, r->B, r->T, &l, NULL));
    *loss = loom_tensor_get(l, 0);
    double t2 = cli_now();
    loom_status st = loom_backward(l, r->scaler.scale);
    loom_tensor_release(l);
    LOOM_TRY(st);
    double t3 = cli_now();
    loom_step_info info;
    loom_amp_prepare_step(r->m->params, r->m->n_params, &r->scaler, 1.0f, &info);
    if (!info.found_inf) LOOM_TRY(loom_adamw_step(r->opt, 1e-4f, info.grad_multiplier));
    loom_loss_scaler_update(&r->scaler, info.found_inf);
    double t4 = cli_now();
    r->phase[PHASE_FORWARD] += t2 - t1;
    r->phase[PHASE_BACKWARD] += t3 - t2;
    r->phase[PHASE_OPTIMIZER] += (t1 - t0) + (t4 - t3);
    return LOOM_OK;
}

/* Where the timed steps went: phases, then the functions' self time. */
static void print_profile(const bench_run *r, int steps, double total) {
    loom_profile_entry e[64];
    int n = loom_profile_get(e, 64);
    if (n > 64) n = 64;
    double step = total / steps, inside = 0.0;
    printf("profile: %.1f ms per step (mean of %d)\n", step * 1e3, steps);
    for (int p = 0; p < N_PHASES; p++)
        printf("  phase %-28s %8.1f ms %5.1f%%\n", phase_names[p], r->phase[p] / steps * 1e3,
               100.0 * r->phase[p] / total);
    for (int i = 0; i < n; i++) {
        char label[96];
        snprintf(label, sizeof label, "%s %s", e[i].name, e[i].backward ? "bwd" : "fwd");
        printf("  fn    %-28s %8.1f ms %5.1f%%  (%ld calls)\n", label, e[i].seconds / steps * 1e3,
               100.0 * e[i].seconds / total, e[i].calls / steps);
        inside += e[i].seconds;
    }
    /* The optimizer phase is no autograd function: count it apart. */
    double other = total - inside - r->phase[PHASE_OPTIMIZER];
    printf("  %-34s %8.1f ms %5.1f%%\n", "outside functions and optimizer", other / steps * 1e3, 100.0 * other / total);
    loom_mem_stats ms;
    loom_mem_get_stats(&ms);
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++)
        printf("  mem   %-28s %8.1f MiB peak (%.1f MiB now)\n", loom_mem_category_name((loom_mem_category)c),
               ms.peak[c] / 1048576.0, ms.current[c] / 1048576.0);
    printf("  mem   %-28s %8.1f MiB peak, %.1f MiB cached free blocks\n", "total", ms.peak_total / 1048576.0,
           ms.cached / 1048576.0);
    fflush(stdout);
}

/* Step k (warm-up steps counted) and its time. With --lockstep it first
 * waits for a line on standard input, so that a driver can alternate this
 * process's steps with another program's, and then prints the time. */
static loom_status bench_step(const bench_opts *o, bench_run *r, int k, double *loss, double *seconds) {
    for (int c; o->lockstep && (c = getchar()) != '\n';)
        if (c == EOF)
            return loom_error(LOOM_ERR_INVALID, "--lockstep: standard input ended before step %d of %d", k + 1,
                              o->warmup + o->steps);
    double t0 = cli_now();
    LOOM_TRY(train_step(r, loss));
    *seconds = cli_now() - t0;
    if (o->lockstep) {
        printf("lockstep step=%d warmup=%d ms=%.2f\n", k + 1, k < o->warmup, *seconds * 1e3);
        fflush(stdout);
    }
    return LOOM_OK;
}

/* Steps of one model under n recompute modes. With n > 1 the modes take
 * turns step by step (the same weights, data and machine state for each), so
 * their ratios hold up on a machine shared with other work; rss is then the
 * process's, not any one mode's (res[i].rss_mib < 0). */
static loom_status run_config(const bench_opts *o, const loom_llama_config *cfg, loom_precision prec,
                              const loom_recompute_mode *modes, int n_modes, bench_result *res) {
    bench_run r;
    memset(&r, 0, sizeof r);
    r.B = o->batch;
    r.T = o->seq;
    size_t n = (size_t)r.B * r.T;
    loom_status st = loom_llama_new(cfg, prec, &r.m);
    if (st == LOOM_OK) r.m->recompute.blocks = o->recompute_blocks; /* the modes take turns; the blocks stay */
    loom_adamw_config ac = loom_adamw_defaults();
    if (st == LOOM_OK) {
        loom_llama_init_weights(r.m, 1337);
        st = loom_adamw_new(&ac, r.m->params, r.m->n_params, &r.opt);
    }
    loom_loss_scaler_init(&r.scaler, prec.compute == LOOM_F16);
    r.tokens = malloc(n * sizeof *r.tokens);
    r.targets = malloc(n * sizeof *r.targets);
    float *u = malloc(2 * n * sizeof *u);
    double *times = malloc((size_t)o->steps * n_modes * sizeof *times); /* (n_modes, steps) */
    double *replays = malloc((size_t)o->steps * n_modes * sizeof *replays); /* (n_modes, steps) */
    size_t *peak_act = calloc((size_t)n_modes, sizeof *peak_act);
    uint64_t *allocs = calloc((size_t)n_modes, sizeof *allocs);
    uint64_t *prims = calloc((size_t)n_modes, sizeof *prims);
    double *losses = calloc((size_t)n_modes, sizeof *losses); /* each mode's last loss */
    if (st == LOOM_OK &&
        (!r.tokens || !r.targets || !u || !times || !replays || !peak_act || !allocs || !prims || !losses))
        st = loom_error(LOOM_ERR_NOMEM, "bench: out of memory");
    if (st == LOOM_OK) {
        loom_rng_uniform(u, 2 * n, 7, 0);
        for (size_t i = 0; i < n; i++) {
            r.tokens[i] = (int32_t)(u[i] * cfg->vocab_size) % cfg->vocab_size;
            r.targets[i] = (int32_t)(u[n + i] * cfg->vocab_size) % cfg->vocab_size;
        }
    }
    double loss = 0.0, seconds;
    for (int s = 0; s < o->warmup && st == LOOM_OK; s++)
        for (int m = 0; m < n_modes && st == LOOM_OK; m++) {
            r.m->recompute.mode = modes[m];
            st = bench_step(o, &r, s, &loss, &seconds);
        }
    memset(r.phase, 0, sizeof r.phase);
    loom_profile_reset();
    loom_profile_enable(o->profile);
    double total = 0.0;
    for (int s = 0; s < o->steps && st == LOOM_OK; s++)
        for (int m = 0; m < n_modes && st == LOOM_OK; m++) {
            loom_mem_stats before, after;
            loom_gemm_stats g0, g1;
            loom_recompute_stats rc0, rc1;
            size_t i = (size_t)m * o->steps + s;
            r.m->recompute.mode = modes[m];
            loom_mem_reset_peak();
            loom_mem_get_stats(&before);
            loom_gemm_get_stats(&g0);
            loom_recompute_get_stats(&rc0);
            if ((st = bench_step(o, &r, o->warmup + s, &losses[m], &times[i])) != LOOM_OK) break;
            loom_recompute_get_stats(&rc1);
            replays[i] = rc1.replay_seconds - rc0.replay_seconds;
            total += times[i];
            loom_mem_get_stats(&after);
            loom_gemm_get_stats(&g1);
            prims[m] += g1.primitives_created - g0.primitives_created;
            if (after.peak[LOOM_MEM_ACTIVATIONS] > peak_act[m]) peak_act[m] = after.peak[LOOM_MEM_ACTIVATIONS];
            allocs[m] += after.n_malloc - before.n_malloc;
        }
    loom_profile_enable(0);
    if (st == LOOM_OK && o->profile) print_profile(&r, o->steps, total);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    for (int m = 0; m < n_modes && st == LOOM_OK; m++) {
        bench_result *x = &res[m];
        x->step_ms = median(times + (size_t)m * o->steps, o->steps) * 1e3;
        x->replay_ms = median(replays + (size_t)m * o->steps, o->steps) * 1e3;
        x->tok_s = (double)n / (x->step_ms * 1e-3);
        x->gflop_per_step = model_flops_per_token(cfg, r.T) * (double)n * 1e-9;
        x->gflops = x->gflop_per_step / (x->step_ms * 1e-3);
        x->peak_act_mib = (double)peak_act[m] / (1024.0 * 1024.0);
        x->rss_mib = n_modes == 1 ? (double)ru.ru_maxrss / 1024.0 : -1.0;
        x->buffer_allocs_per_step = (double)allocs[m] / o->steps;
        x->primitives_per_step = (double)prims[m] / o->steps;
        x->loss = losses[m];
    }
    free(u);
    free(times);
    free(replays);
    free(peak_act);
    free(allocs);
    free(prims);
    free(losses);
    free(r.tokens);
    free(r.targets);
    loom_adamw_free(r.opt);
    loom_llama_free(r.m);
    return st;
}

static const char *recompute_label(loom_recompute_mode m) {
    switch (m) {
    case LOOM_RECOMPUTE_NONE: return "none";
    case LOOM_RECOMPUTE_SELECTIVE: return "selective";
    default: return "full";
    }
}

static void print_result(const bench_opts *o, loom_precision prec, loom_recompute_mode mode, const bench_result *r) {
    const char *mg = prec.master_grad ? "on" : "off";
    const char *rm = mode == LOOM_RECOMPUTE_REENTRANT ? "reentrant" : "nonreentrant";
    char rss[32]; /* "null" (JSON) when several modes shared the process */
    if (r->rss_mib < 0) snprintf(rss, sizeof rss, "null");
    else snprintf(rss, sizeof rss, "%.1f", r->rss_mib);
    if (o->json) {
        printf("{\"preset\":\"%s\",\"precision\":\"%s\",\"master_grad\":\"%s\",\"recompute\":\"%s\","
               "\"recompute_mode\":\"%s\",\"batch\":%d,\"seq\":%d,\"threads\":%d,\"steps\":%d,"
               "\"tok_s\":%.1f,\"step_ms\":%.2f,\"gflop_per_step\":%.3f,\"gflops\":%.2f,\"mfu\":%.4f,"
               "\"peak_act_MiB\":%.1f,\"rss_MiB\":%s,\"buffer_allocs_per_step\":%.1f,"
               "\"gemm_primitives_per_step\":%.1f,\"replay_ms\":%.2f,\"loss\":%.5f,\"warmup\":%d,"
               "\"gemm_peak\":\"%s\",\"kernels\":\"%s\",\"recompute_blocks\":%d}\n",
               o->preset, loom_dtype_name(prec.compute), mg, recompute_label(mode), rm, o->batch, o->seq,
               loom_get_threads(), o->steps, r->tok_s, r->step_ms, r->gflop_per_step, r->gflops, r->mfu,
               r->peak_act_mib, rss, r->buffer_allocs_per_step, r->primitives_per_step, r->replay_ms, r->loss,
               o->warmup,
               o->peak_given ? "given" : "measured", loom_simd_name(), o->recompute_blocks);
    } else {
        printf("bench preset=%s precision=%s master_grad=%s recompute=%s tok/s=%.0f step_ms=%.1f gflops=%.1f "
               "mfu=%.3f peak_act_MiB=%.1f rss_MiB=%s recompute_mode=%s batch=%d seq=%d threads=%d "
               "buffer_allocs/step=%.1f gemm_primitives/step=%.1f replay_ms=%.2f loss=%.4f kernels=%s "
               "recompute_blocks=%d\n",
               o->preset, loom_dtype_name(prec.compute), mg, recompute_label(mode), r->tok_s, r->step_ms, r->gflops,
               r->mfu, r->peak_act_mib, r->rss_mib < 0 ? "n/a" : rss, rm, o->batch, o->seq, loom_get_threads(),
               r->buffer_allocs_per_step, r->primitives_per_step, r->replay_ms, r->loss, loom_simd_name(),
               o->recompute_blocks);
    }
    fflush(stdout);
}

static void print_header(const bench_opts *o, const loom_llama_config *c, const gemm_peak *p) {
    double n = matmul_params(c), per_tok = model_flops_per_token(c, o->seq);
    if (o->json) {
        printf("{\"gemm_peak_gflops\":{\"f32\":%.2f,\"bf16\":%.2f},\"gemm_peak\":\"%s\","
               "\"gemm_peak_shape\":[%d,%d,%d],\"matmul_params\":%.0f,\"flops_per_token\":%.0f,"
               "\"flops_formula\":\"6*N*tokens + 6*L*T*dim*tokens\"}\n",
               p->f32, p->bf16, o->peak_given ? "given" : "measured", PEAK_SIZE, PEAK_SIZE, PEAK_SIZE, n, per_tok);
    } else {
        if (o->peak_given)
            printf("bench gemm_peak f32=%.1f bf16=%.1f GFLOP/s (given with --gemm-peak, not measured)\n", p->f32,
                   p->bf16);
        else
            printf("bench gemm_peak f32=%.1f bf16=%.1f GFLOP/s (loom gemm, C = A·B^T, M=N=K=%d, %d threads)\n",
                   p->f32, p->bf16, PEAK_SIZE, loom_get_threads());
        printf("bench flops: 6*N*tokens + 6*L*T*dim*tokens, N = %.0f matmul params, L = %d, T = %d, dim = %d "
               "-> %.1f MFLOP/token; mfu = gflops / gemm_peak of the precision\n",
               n, c->n_layers, o->seq, c->dim, per_tok * 1e-6);
    }
    fflush(stdout);
}

/* ------------------------------------------------------------ GEMM floor */

/* The step's GEMMs one at a time: for each linear shape (out x in weight,
 * applied to batch * seq rows, count of them per step) its forward
 * y = x W^T, its dX = dy W and its dW += dy^T x (into fp32 main_grad with
 * master-grad, as the fused linear does), each the best of --steps timed
 * calls after --warmup. Their sum over a step is the time the step cannot go
 * below with these GEMMs; the rest of a step (attention, norms, optimizer...)
 * is what `loom bench` measures beyond it. */
typedef struct linear_shape {
    const char *name;
    int out, in, count;
    int dx_sums; /* its dX joins a gradient the input has from another use (beta = 1), as in a step */
} linear_shape;

static loom_status run_gemms(const bench_opts *o, const loom_llama_config *c, loom_precision prec) {
    int HS = loom_llama_head_dim(c), q = c->n_heads * HS, kv = HS * c->n_kv_heads, L = c->n_layers;
    int T = o->batch * o->seq;
    const linear_shape shapes[] = {
        /* Backward runs v, k, q and up, gate: v's and up's dX come first, the others sum into them. */
        {"q", q, c->dim, L, 1},           {"k", kv, c->dim, L, 1},            {"v", kv, c->dim, L, 0},
        {"o", c->dim, q, L, 0},      {"gate", c->ffn_dim, c->dim, L, 1}, {"up", c->ffn_dim, c->dim, L, 0},
        {"down", c->dim, c->ffn_dim, L, 0}, {"lm_head", c->vocab_size, c->dim, 1, 0},
    };
    int n_shapes = (int)(sizeof shapes / sizeof shapes[0]);
    int max_dim = c->vocab_size > c->ffn_dim ? c->vocab_size : c->ffn_dim;
    if (q > max_dim) max_dim = q;
    if (c->dim > max_dim) max_dim = c->dim;
    loom_dtype dt = prec.compute, g_dt = prec.master_grad ? LOOM_F32 : dt;
    size_t act = (size_t)T * (size_t)max_dim, wgt = (size_t)max_dim * (size_t)max_dim;
    float *src = malloc((act > wgt ? act : wgt) * sizeof *src);
    void *x = loom_alloc(act * loom_dtype_size(dt), LOOM_MEM_WORKSPACE);  /* (T, in) */
    void *dx = loom_alloc(act * loom_dtype_size(dt), LOOM_MEM_WORKSPACE); /* (T, in) */
    void *y = loom_alloc(act * loom_dtype_size(dt), LOOM_MEM_WORKSPACE);  /* (T, out): y, then dy */
    void *w = loom_alloc(wgt * loom_dtype_size(dt), LOOM_MEM_WORKSPACE);  /* (out, in) */
    void *g = loom_alloc(wgt * loom_dtype_size(g_dt), LOOM_MEM_WORKSPACE); /* (out, in) */
    loom_status st = src && x && dx && y && w && g ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "bench: out of memory");
    if (st == LOOM_OK) {
        loom_rng_uniform(src, act, 3, 0);
        loom_convert(x, dt, src, LOOM_F32, act);
        loom_convert(dx, dt, src, LOOM_F32, act); /* the gradient a summing dX joins */
        loom_convert(y, dt, src, LOOM_F32, act);
        loom_rng_uniform(src, wgt, 4, 0);
        loom_convert(w, dt, src, LOOM_F32, wgt);
        memset(g, 0, wgt * loom_dtype_size(g_dt));
    }
    double total = 0.0, flops = 0.0;
    for (int i = 0; i < n_shapes && st == LOOM_OK; i++) {
        const linear_shape *l = &shapes[i];
        double f = 0.0, d = 0.0, u = 0.0;
        int w0 = o->warmup, n = o->steps;
        st = best_gemm(w0, n, 0, 1, T, l->out, l->in, x, l->in, w, l->in, dt, 0.0f, y, l->out, dt, &f); /* y */
        if (st == LOOM_OK) /* dX = dy W */
            st = best_gemm(w0, n, 0, 0, T, l->in, l->out, y, l->out, w, l->in, dt, l->dx_sums ? 1.0f : 0.0f, dx, l->in,
                           dt, &d);
        if (st == LOOM_OK) /* dW += dy^T x */
            st = best_gemm(w0, n, 1, 0, l->out, l->in, T, y, l->out, x, l->in, dt, 1.0f, g, l->in, g_dt, &u);
        if (st != LOOM_OK) break;
        double gf = 6.0 * T * (double)l->out * l->in * 1e-9;
        total += l->count * (f + d + u);
        flops += l->count * gf;
        if (o->json)
            printf("{\"gemm\":\"%s\",\"rows\":%d,\"out\":%d,\"in\":%d,\"count\":%d,\"fwd_ms\":%.3f,"
                   "\"dx_ms\":%.3f,\"dw_ms\":%.3f,\"gflops\":%.1f}\n",
                   l->name, T, l->out, l->in, l->count, f, d, u, gf / ((f + d + u) * 1e-3));
        else
            printf("bench gemm %-7s rows=%d out=%d in=%d count=%d fwd_ms=%.3f dx_ms=%.3f dw_ms=%.3f gflops=%.1f\n",
                   l->name, T, l->out, l->in, l->count, f, d, u, gf / ((f + d + u) * 1e-3));
    }
    if (st == LOOM_OK) {
        if (o->json)
            printf("{\"preset\":\"%s\",\"precision\":\"%s\",\"master_grad\":%s,\"step_gemm_ms\":%.1f,"
                   "\"gemm_gflops\":%.1f,\"threads\":%d}\n",
                   o->preset, loom_dtype_name(dt), prec.master_grad ? "true" : "false", total, flops / (total * 1e-3),
                   loom_get_threads());
        else
            printf("bench gemms preset=%s precision=%s master_grad=%s step_gemm_ms=%.1f gemm_gflops=%.1f threads=%d "
                   "(every GEMM of a step, each the best of %d calls, summed)\n",
                   o->preset, loom_dtype_name(dt), prec.master_grad ? "on" : "off", total, flops / (total * 1e-3),
                   loom_get_threads(), o->steps);
    }
    fflush(stdout);
    free(src);
    loom_free(x);
    loom_free(dx);
    loom_free(y);
    loom_free(w);
    loom_free(g);
    return st;
}

/* ------------------------------------------------------------ the matrix */

/* Re-execute this binary as `loom bench <user flags> <config flags>` for
 * one configuration; its line goes to stdout. */
static int spawn_config(char **argv0_args, int argc0, const char *precision, const char *recompute,
                        const char *peak) {
    const char *extra[] = {"--precision", precision, "--master-grad", "on", "--recompute", recompute,
                           "--gemm-peak", peak, "--no-header"};
    int n_extra = (int)(sizeof extra / sizeof extra[0]);
    char **args = calloc((size_t)(argc0 + n_extra + 3), sizeof *args);
    if (!args) return -1;
    int k = 0;
    args[k++] = "loom";
    args[k++] = "bench";
    for (int i = 0; i < argc0; i++) args[k++] = argv0_args[i];
    for (int i = 0; i < n_extra; i++) args[k++] = (char *)(uintptr_t)extra[i];
    args[k] = NULL;
    fflush(stdout);
    pid_t pid;
    int rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ);
    free(args);
    if (rc != 0) return -1;
    int status;
    if (waitpid(pid, &status, 0) < 0) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* ------------------------------------------------------------------ run */

/* One recompute mode by name (full takes --recompute-mode). */
static int parse_mode(const char *name, int reentrant, loom_recompute_mode *mode) {
    if (!strcmp(name, "none")) *mode = LOOM_RECOMPUTE_NONE;
    else if (!strcmp(name, "full")) *mode = reentrant ? LOOM_RECOMPUTE_REENTRANT : LOOM_RECOMPUTE_NONREENTRANT;
    else if (!strcmp(name, "selective")) *mode = LOOM_RECOMPUTE_SELECTIVE;
    else return cli_usage_error("bench", "--recompute expects none, selective or full (or a comma list), got '%s'", name);
    return 0;
}

/* --recompute MODE[,MODE...] into modes (at most 3). */
static int parse_modes(const bench_opts *o, loom_recompute_mode *modes, int *n) {
    int reentrant;
    if (!strcmp(o->recompute_mode, "reentrant")) reentrant = 1;
    else if (!strcmp(o->recompute_mode, "nonreentrant") || !strcmp(o->recompute_mode, "non-reentrant")) reentrant = 0;
    else return cli_usage_error("bench", "--recompute-mode expects reentrant or nonreentrant, got '%s'", o->recompute_mode);
    char buf[128];
    snprintf(buf, sizeof buf, "%s", o->recompute);
    *n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (*n == 3) return cli_usage_error("bench", "--recompute takes at most three modes");
        int rc = parse_mode(t, reentrant, &modes[(*n)++]);
        if (rc) return rc;
    }
    if (*n == 0) return cli_usage_error("bench", "--recompute needs a mode");
    return 0;
}

static int run(int argc, char **argv) {
    bench_opts o = {.preset = "tiny", .master_grad = "on", .recompute_mode = "nonreentrant",
                    .steps = 5, .warmup = 2, .batch = 8};
    int no_header = 0;
    const flag flags[] = {
        {"preset", FLAG_STRING, &o.preset, "NAME", "tiny (dim 288, 6 layers, seq 256) or small (512, 8, 512) (default tiny)"},
        {"precision", FLAG_STRING, &o.precision, "P", "fp32, bf16 or fp16 (default: bf16 with --recompute or --gemms; with neither, the standard matrix)"},
        {"master-grad", FLAG_STRING, &o.master_grad, "on|off", "fp32 main_grad for every weight (default on)"},
        {"recompute", FLAG_STRING, &o.recompute, "MODE", "none, selective or full; a comma list takes turns step by step (default: none with --precision, else the standard matrix)"},
        {"recompute-mode", FLAG_STRING, &o.recompute_mode, "M", "full recompute: reentrant or nonreentrant (default)"},
        {"recompute-blocks", FLAG_INT, &o.recompute_blocks, "N",
         "recompute only the first N blocks, keep the rest's activations (default 0: all)"},
        {"threads", FLAG_INT, &o.threads, "N", "OpenMP threads (default: OMP_NUM_THREADS, else the cores this process may use)"},
        {"steps", FLAG_INT, &o.steps, "N", "timed steps; the median is reported (default 5)"},
        {"warmup", FLAG_INT, &o.warmup, "N", "untimed steps first (default 2)"},
        {"batch", FLAG_INT, &o.batch, "B", "sequences per step (default 8)"},
        {"seq", FLAG_INT, &o.seq, "T", "sequence length (default: the preset's context)"},
        {"json", FLAG_BOOL, &o.json, NULL, "one JSON object per line instead of text"},
        {"gemm-peak", FLAG_STRING, &o.gemm_peak, "F32,BF16", "GEMM peaks in GFLOP/s to use instead of measuring"},
        {"profile", FLAG_BOOL, &o.profile, NULL, "also print where the timed steps went (phases, functions)"},
        {"gemms", FLAG_BOOL, &o.gemms, NULL, "time the step's GEMMs one by one instead (forward, dX, dW per shape)"},
        {"no-header", FLAG_BOOL, &no_header, NULL, "print only the configuration lines"},
        {"lockstep", FLAG_BOOL, &o.lockstep, NULL,
         "wait for a line on stdin before each step and print its time (bench/lockstep_peer.py)"},
    };
    int rc = cli_parse(&cmd_bench, flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc > 0 ? 0 : 2;
    loom_llama_config cfg;
    if (loom_llama_preset(o.preset, &cfg) != LOOM_OK) return cli_usage_error("bench", "--preset: %s", loom_last_error());
    if (o.seq == 0) o.seq = cfg.max_seq;
    if (o.seq < 0 || o.seq > cfg.max_seq || o.batch <= 0 || o.steps <= 0 || o.warmup < 0)
        return cli_usage_error("bench", "--batch and --steps must be positive, --warmup >= 0, --seq in 1..%d",
                               cfg.max_seq);
    if (o.recompute_blocks < 0 || o.recompute_blocks > cfg.n_layers)
        return cli_usage_error("bench", "--recompute-blocks expects 0 (every block) to %d, the preset's blocks; got %d",
                               cfg.n_layers, o.recompute_blocks);
    gemm_peak peak = {0, 0};
    if (o.gemm_peak && parse_peak(o.gemm_peak, &peak, &o.peak_given))
        return cli_usage_error("bench", "--gemm-peak expects two positive numbers F32,BF16, got '%s'", o.gemm_peak);
    if ((rc = cli_apply_threads("bench", o.threads))) return rc;

    if (o.lockstep && (o.gemms || (!o.precision && !o.recompute)))
        return cli_usage_error("bench", "--lockstep times one configuration: give --precision or --recompute, "
                               "not --gemms");
    if (!o.precision && !o.recompute && !o.gemms) { /* the standard matrix, one process each */
        if (!o.gemm_peak) {
            loom_status st = measure_peak(&peak);
            if (st != LOOM_OK) return cli_fail("bench", st);
        }
        if (!no_header) print_header(&o, &cfg, &peak);
        char peak_s[64];
        snprintf(peak_s, sizeof peak_s, "%s%.3f,%.3f", o.gemm_peak ? "" : "measured:", peak.f32, peak.bf16);
        const char *precs[] = {"fp32", "bf16"}, *modes[] = {"none", "selective", "full"};
        int failed = 0;
        for (int p = 0; p < 2; p++)
            for (int m = 0; m < 3; m++)
                failed |= spawn_config(argv + 1, argc - 1, precs[p], modes[m], peak_s) != 0;
        return failed ? 1 : 0;
    }

    loom_precision prec = {LOOM_BF16, 1};
    if (o.gemms) {
        if (o.recompute || o.profile) return cli_usage_error("bench", "--gemms takes neither --recompute nor --profile");
        if (loom_dtype_parse(o.precision ? o.precision : "bf16", &prec.compute) != LOOM_OK)
            return cli_usage_error("bench", "--precision: %s", loom_last_error());
        if (cli_parse_on_off("bench", "master-grad", o.master_grad, &prec.master_grad)) return 2;
        loom_status st = run_gemms(&o, &cfg, prec);
        return st == LOOM_OK ? 0 : cli_fail("bench", st);
    }
    if (!o.precision) o.precision = "bf16";
    if (!o.recompute) o.recompute = "none";
    if (loom_dtype_parse(o.precision, &prec.compute) != LOOM_OK)
        return cli_usage_error("bench", "--precision: %s", loom_last_error());
    if (cli_parse_on_off("bench", "master-grad", o.master_grad, &prec.master_grad)) return 2;
    loom_recompute_mode modes[3];
    int n_modes = 0;
    if ((rc = parse_modes(&o, modes, &n_modes))) return rc;
    if (o.profile && n_modes > 1) return cli_usage_error("bench", "--profile takes a single recompute mode");
    if (o.lockstep && (n_modes > 1 || !o.gemm_peak))
        return cli_usage_error("bench", "--lockstep takes a single recompute mode and --gemm-peak (no GEMM peak "
                               "measured between the driver's turns)");
    bench_result res[3];
    memset(res, 0, sizeof res);
    loom_status st = run_config(&o, &cfg, prec, modes, n_modes, res);
    /* Measured after the run, so its buffers do not count in rss_MiB. */
    if (st == LOOM_OK && !o.gemm_peak) st = measure_peak(&peak);
    if (st != LOOM_OK) return cli_fail("bench", st);
    if (!no_header) print_header(&o, &cfg, &peak);
    double p = prec.compute == LOOM_F32 ? peak.f32 : peak.bf16;
    for (int m = 0; m < n_modes; m++) {
        res[m].mfu = res[m].gflops / p;
        print_result(&o, prec, modes[m], &res[m]);
    }
    return 0;
}

const command cmd_bench = {
    "bench",
    "time full training steps of a preset on random tokens",
    "bench [--preset tiny|small] [--precision P] [--recompute MODE] [flags]",
    "Each line: tok/s and step_ms (median of --steps after --warmup), gflops (model FLOPs\n"
    "6*N*tokens + 6*L*T*dim*tokens per step, N = matmul parameters, causal attention),\n"
    "mfu (gflops / the GEMM peak of the precision, measured in the same run through\n"
    "loom's gemm: f32 for fp32, bf16 otherwise), peak_act_MiB (peak bytes of\n"
    "activations during the timed steps, as requested: not the workspace or the\n"
    "allocator's rounding), rss_MiB (the process's peak RSS) and buffer_allocs/step\n"
    "(tensor buffers that missed loom's allocator cache and reached the system\n"
    "allocator; 0 once two steps have run; the small headers of tensors and autograd\n"
    "nodes are allocated per op) and gemm_primitives/step (oneDNN primitives built\n"
    "because loom's cache missed; 0 once two steps have run) and replay_ms (median per\n"
    "step: the time the recompute's replays, forwards run again inside the backward,\n"
    "took; 0 without recompute; the placeholders' bookkeeping is not in it). Set\n"
    "against its own step (step_ms / (step_ms - replay_ms)) it gives the recompute's\n"
    "cost from the same steps, which holds when the machine's speed drifts between\n"
    "the modes' steps. mfu is against loom's own GEMM peak, not the CPU's nominal\n"
    "FLOP rate.\n"
    "With neither --precision nor --recompute it runs {fp32, bf16 master-grad} x\n"
    "{none, selective, full}, each in a fresh process so that rss_MiB is per line.\n"
    "--recompute none,selective,full runs the modes in turns, step by step, on one\n"
    "model: their ratios then hold up on a busy machine (rss_MiB is n/a there).\n"
    "--gemms times the step's GEMMs alone instead: per linear shape its forward, dX\n"
    "and dW (into fp32 main_grad with master-grad), each the best of --steps calls\n"
    "after --warmup, and their sum over a step (step_gemm_ms), the floor a step of\n"
    "these shapes stands on; bench/peer_gemms.py times the same GEMMs in PyTorch.",
    run,
};
