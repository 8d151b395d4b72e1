/*
 * ab_attention.c — flash attention of two builds in one process, call by
 * call: this tree's (attention_fwd/bwd from libloom) and another revision's
 * (attention_fwd_B/bwd_B, its attention.c and kernel_rows.c compiled with
 * renamed symbols by bench/ab_attention.sh). On a shared machine whose
 * speed drifts by 10-20% within seconds, separate runs cannot show a 5%
 * change; alternating the two builds call by call (A B B A ...) exposes
 * both to the same drift. Prints each side's best and median and the ratio
 * of their summed times, and the largest difference between their results
 * (0 when the change keeps every sum's order).
 *
 * Usage (through bench/ab_attention.sh): ab_attention [reps] [threads] [tiny|small] [window]
 * A window > 0 runs both sides' attention_*_ex with that sliding window
 * (revisions from 2026-12-02 on have them).
 */
#include "kernels/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void attention_fwd_B(void *out, float *lse, const void *q, const void *k, const void *v, int B, int Tq, int Tk,
                     int NH, int NKV, int HS, int q_pos0, loom_dtype dt);
void attention_bwd_B(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k, const void *v,
                     const void *out, const float *lse, int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                     loom_dtype dt);

/* The other side's _ex forms, weak: revisions before sliding windows have none. */
__attribute__((weak)) void attention_fwd_ex_B(void *out, float *lse, const void *q, const void *k, const void *v,
                                              int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                                              const attn_opts *o, loom_dtype dt);
__attribute__((weak)) void attention_bwd_ex_B(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                              const void *k, const void *v, const void *out, const float *lse, int B,
                                              int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                                              loom_dtype dt);

static int B = 8, T = 256, NH = 6, HS = 48; /* tiny's attention; small's with "small" */
static attn_opts window_opts; /* window > 0: the _ex forms with it */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static float *random_floats(size_t n, unsigned seed) {
    float *p = malloc(n * sizeof *p);
    if (!p) exit(1);
    loom_rng_uniform(p, n, seed, 0);
    for (size_t i = 0; i < n; i++) p[i] -= 0.5f;
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct side {
    float *out, *lse, *dq, *dk, *dv;
} side;

static void run(int b_side, const side *s, float *const in[4]) {
    const float *q = in[0], *k = in[1], *v = in[2], *dout = in[3];
    const attn_opts *o = &window_opts;
    if (o->window && b_side) attention_fwd_ex_B(s->out, s->lse, q, k, v, B, T, T, NH, NH, HS, 0, o, LOOM_F32);
    else if (o->window) attention_fwd_ex(s->out, s->lse, q, k, v, B, T, T, NH, NH, HS, 0, o, LOOM_F32);
    else if (b_side) attention_fwd_B(s->out, s->lse, q, k, v, B, T, T, NH, NH, HS, 0, LOOM_F32);
    else attention_fwd(s->out, s->lse, q, k, v, B, T, T, NH, NH, HS, 0, LOOM_F32);
    (void)dout;
}

static void run_bwd(int b_side, const side *s, float *const in[4]) {
    const float *q = in[0], *k = in[1], *v = in[2], *dout = in[3];
    const attn_opts *o = &window_opts;
    if (o->window && b_side)
        attention_bwd_ex_B(s->dq, s->dk, s->dv, dout, q, k, v, s->out, s->lse, B, T, T, NH, NH, HS, 0, o, LOOM_F32);
    else if (o->window)
        attention_bwd_ex(s->dq, s->dk, s->dv, dout, q, k, v, s->out, s->lse, B, T, T, NH, NH, HS, 0, o, LOOM_F32);
    else if (b_side)
        attention_bwd_B(s->dq, s->dk, s->dv, dout, q, k, v, s->out, s->lse, B, T, T, NH, NH, HS, 0, LOOM_F32);
    else attention_bwd(s->dq, s->dk, s->dv, dout, q, k, v, s->out, s->lse, B, T, T, NH, NH, HS, 0, LOOM_F32);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 40, threads = argc > 2 ? atoi(argv[2]) : 2;
    const char *preset = argc > 3 ? argv[3] : "tiny";
    int window = argc > 4 ? atoi(argv[4]) : 0;
    if (reps < 2 || threads < 1 || (strcmp(preset, "tiny") && strcmp(preset, "small")) || window < 0) {
        fprintf(stderr, "usage: ab_attention [reps >= 2] [threads >= 1] [tiny|small] [window >= 0]\n");
        return 2;
    }
    if (window && (!attention_fwd_ex_B || !attention_bwd_ex_B)) {
        fprintf(stderr, "ab_attention: the other revision has no attention_fwd_ex (no windows)\n");
        return 2;
    }
    if (!strcmp(preset, "small")) { B = 4; T = 512; NH = 8; HS = 64; }
    window_opts = (attn_opts){.scale = 1.0f / sqrtf((float)HS), .window = window};
    loom_set_threads(threads);
    size_t n = (size_t)B * T * NH * HS, nl = (size_t)B * NH * T;
    float *in[4] = {random_floats(n, 1), random_floats(n, 2), random_floats(n, 3), random_floats(n, 4)};
    side sd[2];
    for (int s = 0; s < 2; s++)
        sd[s] = (side){random_floats(n, 5), random_floats(nl, 6), random_floats(n, 7), random_floats(n, 8),
                       random_floats(n, 9)};
    double *t[4]; /* fwd A, fwd B, bwd A, bwd B */
    for (int i = 0; i < 4; i++) t[i] = malloc((size_t)reps * sizeof *t[i]);
    for (int s = 0; s < 2; s++) run(s, &sd[s], in); /* warm up, and real lse for the backward */
    for (int r = 0; r < reps; r++) {
        int first = r & 1; /* A B, then B A: neither side always runs on the other's warm caches */
        for (int j = 0; j < 2; j++) {
            int s = j ? !first : first;
            double t0 = now();
            run(s, &sd[s], in);
            t[s][r] = now() - t0;
        }
        for (int j = 0; j < 2; j++) {
            int s = j ? !first : first;
            double t0 = now();
            run_bwd(s, &sd[s], in);
            t[2 + s][r] = now() - t0;
        }
    }
    double sum[2] = {0, 0}, diff_out = 0, diff_grad = 0;
    for (int r = 0; r < reps; r++) {
        sum[0] += t[0][r] + t[2][r];
        sum[1] += t[1][r] + t[3][r];
    }
    for (size_t i = 0; i < n; i++) {
        diff_out = fmax(diff_out, fabs(sd[0].out[i] - sd[1].out[i]));
        diff_grad = fmax(diff_grad, fmax(fabs(sd[0].dq[i] - sd[1].dq[i]),
                                         fmax(fabs(sd[0].dk[i] - sd[1].dk[i]), fabs(sd[0].dv[i] - sd[1].dv[i]))));
    }
    const char *name[4] = {"forward, this tree", "forward, the other", "backward, this tree", "backward, the other"};
    for (int i = 0; i < 4; i++) {
        qsort(t[i], (size_t)reps, sizeof(double), cmp_double);
        double med = reps % 2 ? t[i][reps / 2] : 0.5 * (t[i][reps / 2 - 1] + t[i][reps / 2]);
        printf("ab_attention %-20s best %.3f ms, median %.3f ms\n", name[i], t[i][0] * 1e3, med * 1e3);
    }
    printf("ab_attention B=%d T=%d heads=%d head_size=%d window=%d fp32, %d threads, %d alternating calls each: "
           "this tree / the other = %.3f (summed time); max difference: output %.3g, gradients %.3g\n",
           B, T, NH, HS, window, threads, reps, sum[0] / sum[1], diff_out, diff_grad);
    return 0;
}
