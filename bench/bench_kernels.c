/*
 * bench_kernels.c — the row-wise kernels of a step alone, at a preset's
 * shapes: flash attention forward and backward, RMSNorm, RoPE and SwiGLU,
 * each the best of --reps calls (so a busy machine inflates it least).
 * For A/B comparisons of kernel changes, which a whole step's ±15% noise on
 * a shared machine hides; `loom bench --profile` says what each is worth in
 * a step.
 *
 * Usage: build/bench_kernels [--preset tiny|small] [--batch B] [--dtype f32|bf16]
 *                            [--threads N] [--reps R] [--seq T] [--window W] [--dropout P]
 * --seq sets the sequence length (the preset's context by default);
 * --window gives the attention a sliding window of W keys (0: none);
 * --dropout drops its probabilities with chance P (0: none).
 */
#include "kernels/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* n values in [-0.5, 0.5) stored as dt (deterministic). */
static void *random_data(size_t n, loom_dtype dt, uint32_t seed) {
    void *p = malloc(n * loom_dtype_size(dt));
    if (!p) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        loom_store(p, i, dt, (float)(seed >> 8) / 16777216.0f - 0.5f);
    }
    return p;
}

/* Times `call` reps times: best (what the code can do) and mean (what a
 * step gets on this machine, where one core can run slower than the other
 * for a while: a loop split statically waits for the slower one). */
typedef struct timing {
    double best_ms, mean_ms;
} timing;

#define TIME_CALL(reps, call)                                 \
    ({                                                        \
        timing t_ = {1e30, 0.0};                              \
        for (int r_ = 0; r_ < (reps); r_++) {                 \
            double t0_ = now();                               \
            call;                                             \
            double d_ = (now() - t0_) * 1e3;                  \
            if (d_ < t_.best_ms) t_.best_ms = d_;             \
            t_.mean_ms += d_ / (reps);                        \
        }                                                     \
        t_;                                                   \
    })

static void print_pair(const char *name, timing f, timing b, const char *shape) {
    printf("%-9s fwd=%.3f bwd=%.3f  mean fwd=%.3f bwd=%.3f  (%s)\n", name, f.best_ms, b.best_ms, f.mean_ms,
           b.mean_ms, shape);
}

static int usage(void) {
    fprintf(stderr, "usage: bench_kernels [--preset tiny|small] [--batch B] [--dtype f32|bf16] "
                    "[--threads N] [--reps R] [--seq T] [--window W] [--dropout P]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *preset = "tiny", *dtype = "f32";
    int batch = 8, threads = 0, reps = 30, seq = 0, window = 0;
    float dropout = 0.0f;
    for (int i = 1; i < argc; i += 2) { /* --flag value pairs */
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return usage();
        if (!strcmp(argv[i], "--preset")) preset = v;
        else if (!strcmp(argv[i], "--dtype")) dtype = v;
        else if (!strcmp(argv[i], "--batch")) batch = atoi(v);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(v);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(v);
        else if (!strcmp(argv[i], "--seq")) seq = atoi(v);
        else if (!strcmp(argv[i], "--window")) window = atoi(v);
        else if (!strcmp(argv[i], "--dropout")) dropout = strtof(v, NULL);
        else return usage();
    }
    int tiny = !strcmp(preset, "tiny");
    if ((!tiny && strcmp(preset, "small")) || batch < 1 || reps < 1 || threads < 0 || seq < 0 || window < 0 ||
        !(dropout >= 0.0f && dropout < 1.0f) ||
        (strcmp(dtype, "f32") && strcmp(dtype, "bf16")))
        return usage();
    loom_dtype dt = strcmp(dtype, "f32") ? LOOM_BF16 : LOOM_F32;
    int B = batch, T = seq ? seq : tiny ? 256 : 512, C = tiny ? 288 : 512, NH = tiny ? 6 : 8, F = tiny ? 768 : 1376;
    int HS = C / NH, N = B * T;
    if (threads) loom_set_threads(threads);

    size_t nq = (size_t)N * C, nf = (size_t)N * F;
    void *q = random_data(nq, dt, 1), *k = random_data(nq, dt, 2), *v = random_data(nq, dt, 3);
    void *dout = random_data(nq, dt, 4), *out = random_data(nq, dt, 5);
    void *dq = random_data(nq, dt, 6), *dk = random_data(nq, dt, 7), *dv = random_data(nq, dt, 8);
    void *w = random_data((size_t)C, dt, 9), *g = random_data(nf, dt, 10), *u = random_data(nf, dt, 11);
    void *h = random_data(nf, dt, 12), *dg = random_data(nf, dt, 13), *du = random_data(nf, dt, 14);
    float *lse = random_data((size_t)B * NH * T, LOOM_F32, 15), *rstd = random_data((size_t)N, LOOM_F32, 16);
    float *dw = random_data((size_t)C, LOOM_F32, 17);

    attn_opts ao = {.scale = 1.0f / sqrtf((float)HS), .window = window, .drop = {.p = dropout, .seed = 1}};
    attention_fwd_ex(out, lse, q, k, v, B, T, T, NH, NH, HS, 0, &ao, dt); /* real lse for the backward */
    timing af = TIME_CALL(reps, attention_fwd_ex(out, lse, q, k, v, B, T, T, NH, NH, HS, 0, &ao, dt));
    timing ab =
        TIME_CALL(reps, attention_bwd_ex(dq, dk, dv, dout, q, k, v, out, lse, B, T, T, NH, NH, HS, 0, &ao, dt));
    timing nf_ = TIME_CALL(reps, rmsnorm_fwd(out, rstd, q, w, 0.0f, N, C, 1e-5f, dt));
    timing nb = TIME_CALL(reps, rmsnorm_bwd(dq, dw, dout, q, w, 0.0f, rstd, N, C, dt));
    loom_rope_freqs rope = rope_plain(10000.0f);
    timing rf = TIME_CALL(reps, rope_fwd(out, q, B, T, NH, HS, 0, &rope, dt));
    timing rb = TIME_CALL(reps, rope_bwd(dq, dout, B, T, NH, HS, 0, &rope, dt));
    timing sf = TIME_CALL(reps, swiglu_fwd(h, g, u, nf, dt));
    timing sb = TIME_CALL(reps, swiglu_bwd(dg, du, h, g, u, nf, dt));

    char shape[96];
    printf("bench_kernels preset=%s batch=%d dtype=%s threads=%d reps=%d (ms per call: best, then mean)\n", preset,
           batch, dtype, loom_get_threads(), reps);
    int n = snprintf(shape, sizeof shape, "B=%d T=%d heads=%d head_size=%d, causal", B, T, NH, HS);
    if (window && n > 0 && n < (int)sizeof shape)
        n += snprintf(shape + n, sizeof shape - (size_t)n, ", window=%d", window);
    if (dropout > 0.0f && n > 0 && n < (int)sizeof shape)
        snprintf(shape + n, sizeof shape - (size_t)n, ", dropout=%g", (double)dropout);
    print_pair("attention", af, ab, shape);
    snprintf(shape, sizeof shape, "%d x %d", N, C);
    print_pair("rmsnorm", nf_, nb, shape);
    print_pair("rope", rf, rb, shape);
    snprintf(shape, sizeof shape, "%d x %d", N, F);
    print_pair("swiglu", sf, sb, shape);
    free(q); free(k); free(v); free(dout); free(out); free(dq); free(dk); free(dv);
    free(w); free(g); free(u); free(h); free(dg); free(du); free(lse); free(rstd); free(dw);
    return 0;
}
