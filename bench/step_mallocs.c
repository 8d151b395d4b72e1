/*
 * step_mallocs.c — how many times one training step calls the C allocator,
 * whole process (loom, oneDNN, OpenMP), per recompute mode.
 *
 * `loom bench` counts only tensor buffers that miss loom's cache
 * (buffer_allocs/step). This counts every malloc, calloc, realloc,
 * aligned_alloc and posix_memalign, by defining them here over glibc's
 * __libc_* entry points, so the small headers of tensors, autograd nodes and
 * function contexts show too. It runs a preset (the model's shapes; the
 * count does not depend on batch or sequence) for --steps steps with
 * AdamW, and prints the last step's counts: forward, backward, optimizer,
 * and what that many calloc + free pairs of header-sized blocks cost here.
 *
 * Usage: build/step_mallocs [--preset tiny|small] [--steps N]
 * glibc only; not built with the sanitizers (they interpose malloc too).
 */
#include "loom/loom.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t count, size_t n);
extern void *__libc_realloc(void *p, size_t n);
extern void *__libc_memalign(size_t align, size_t n);
extern void __libc_free(void *p);

static unsigned long n_calls;

static void *counted(void *p) {
    __atomic_add_fetch(&n_calls, 1, __ATOMIC_RELAXED);
    return p;
}

void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t count, size_t n) { return counted(__libc_calloc(count, n)); }
void *realloc(void *p, size_t n) { return counted(__libc_realloc(p, n)); }
void *aligned_alloc(size_t align, size_t n) { return counted(__libc_memalign(align, n)); }
void free(void *p) { __libc_free(p); }
int posix_memalign(void **out, size_t align, size_t n) {
    *out = counted(__libc_memalign(align, n));
    return *out || !n ? 0 : ENOMEM;
}

static unsigned long calls(void) { return __atomic_load_n(&n_calls, __ATOMIC_RELAXED); }

/* Best of 20 rounds of n calloc + free pairs of 32-176 bytes, in ms. */
static double pairs_ms(unsigned long n) {
    void **p = __libc_malloc((n ? n : 1) * sizeof *p);
    double best = 1e30;
    for (int r = 0; r < 20 && p; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (unsigned long i = 0; i < n; i++) p[i] = calloc(1, 32 + (i % 7) * 24);
        for (unsigned long i = 0; i < n; i++) free(p[i]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6;
        if (ms < best) best = ms;
    }
    __libc_free(p);
    return best;
}

static int fail(const char *what) {
    fprintf(stderr, "step_mallocs: %s: %s\n", what, loom_last_error());
    return 1;
}

int main(int argc, char **argv) {
    const char *preset = "tiny";
    int steps = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--preset") && i + 1 < argc) preset = argv[++i];
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: step_mallocs [--preset tiny|small] [--steps N >= 2]\n");
            return 2;
        }
    }
    if (steps < 2) {
        fprintf(stderr, "step_mallocs: --steps must be at least 2 (the first steps fill the caches)\n");
        return 2;
    }
    loom_llama_config cfg;
    if (loom_llama_preset(preset, &cfg) != LOOM_OK) return fail("preset");
    enum { B = 2, T = 32 };
    int32_t tokens[B * T], targets[B * T];
    for (int i = 0; i < B * T; i++) {
        tokens[i] = (i * 7 + 3) % cfg.vocab_size;
        targets[i] = (i * 7 + 10) % cfg.vocab_size;
    }
    static const struct { loom_recompute_mode mode; const char *name; } modes[] = {
        {LOOM_RECOMPUTE_NONE, "none"}, {LOOM_RECOMPUTE_SELECTIVE, "selective"},
        {LOOM_RECOMPUTE_NONREENTRANT, "full (non-reentrant)"}, {LOOM_RECOMPUTE_REENTRANT, "full (reentrant)"},
    };
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
        loom_llama *model;
        loom_adamw *opt;
        loom_precision prec = {LOOM_F32, 1};
        if (loom_llama_new(&cfg, prec, &model) != LOOM_OK) return fail("model");
        loom_llama_init_weights(model, 5);
        model->recompute.mode = modes[m].mode;
        loom_adamw_config ac = loom_adamw_defaults();
        if (loom_adamw_new(&ac, model->params, model->n_params, &opt) != LOOM_OK) return fail("optimizer");
        unsigned long fwd = 0, bwd = 0, upd = 0;
        for (int s = 0; s < steps; s++) {
            unsigned long c0 = calls();
            loom_llama_zero_grad(model);
            loom_tensor *loss = NULL;
            if (loom_llama_forward(model, tokens, targets, B, T, &loss, NULL) != LOOM_OK) return fail("forward");
            unsigned long c1 = calls();
            loom_status st = loom_backward(loss, 1.0f);
            loom_tensor_release(loss);
            if (st != LOOM_OK) return fail("backward");
            unsigned long c2 = calls();
            if (loom_adamw_step(opt, 1e-3f, 1.0f) != LOOM_OK) return fail("optimizer step");
            fwd = c1 - c0;
            bwd = c2 - c1;
            upd = calls() - c2;
        }
        unsigned long total = fwd + bwd + upd;
        printf("step_mallocs preset=%s recompute=%s forward=%lu backward=%lu optimizer=%lu total=%lu "
               "calloc_free_ms=%.3f (allocator calls in step %d; that many calloc + free pairs, best of 20)\n",
               preset, modes[m].name, fwd, bwd, upd, total, pairs_ms(total), steps);
        loom_adamw_free(opt);
        loom_llama_free(model);
    }
    return 0;
}
