/* testutil.c — see testutil.h. */
#include "testutil.h"

#include <math.h>
#include <string.h>

void tu_fill_uniform(float *x, size_t n, float lo, float hi, uint64_t seed) {
    loom_rng_uniform(x, n, seed, 0);
    for (size_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * x[i];
}

void *tu_from_f32(const float *src, size_t n, loom_dtype dt) {
    void *p = malloc(n * loom_dtype_size(dt) + 1);
    for (size_t i = 0; i < n; i++) loom_store(p, i, dt, src[i]);
    return p;
}

float *tu_to_f32(const void *src, size_t n, loom_dtype dt) {
    float *p = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) p[i] = loom_load(src, i, dt);
    return p;
}

double tu_close_ratio(const float *a, const float *b, size_t n, double atol,
                      double rtol, const char *what) {
    double worst = 0.0;
    size_t wi = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double r = d / (atol + rtol * fabs((double)b[i]));
        if (isnan(a[i]) != isnan(b[i]) || (isnan(r) && !isnan(a[i]))) r = INFINITY;
        if (r > worst) { worst = r; wi = i; }
    }
    if (worst > 1.0 && what)
        fprintf(stderr, "%s: worst at [%zu]: %.9g vs %.9g (ratio %.3g, atol %g rtol %g)\n",
                what, wi, (double)a[wi], (double)b[wi], worst, atol, rtol);
    return worst;
}

int tu_bits_equal(const void *a, const void *b, size_t bytes, const char *what) {
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < bytes; i++) {
        if (x[i] != y[i]) {
            if (what) fprintf(stderr, "%s: first difference at byte %zu\n", what, i);
            return 0;
        }
    }
    return 1;
}

/* The level a group restores: what detection chose (LOOM_SIMD honoured). */
static const char *base_level = "native";

int tu_portable_on(void **state) {
    (void)state;
    loom_set_simd(0);
    return 0;
}

int tu_portable_off(void **state) {
    (void)state;
    return loom_set_simd_level(base_level) == LOOM_OK ? 0 : -1;
}

static int avx2_on(void **state) {
    (void)state;
    return loom_set_simd_level("avx2") == LOOM_OK ? 0 : -1;
}

int tu_run_levels(const struct CMUnitTest *tests, size_t n) {
    base_level = loom_simd_name();
    int rc = _cmocka_run_group_tests("simd", tests, n, NULL, NULL);
    if (strncmp(base_level, "avx512", 6) == 0)
        rc |= _cmocka_run_group_tests("avx2", tests, n, avx2_on, tu_portable_off);
    return rc | _cmocka_run_group_tests("portable", tests, n, tu_portable_on, tu_portable_off);
}
