/*
 * testutil.h — shared helpers for loom's cmocka tests: deterministic random
 * buffers, comparisons with a tolerance that report the worst element, and
 * dtype-aware buffer helpers. Test-only; never linked into libloom.
 */
#ifndef LOOM_TESTUTIL_H
#define LOOM_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include "loom/core.h"

/* Fill n floats with uniform values in [lo, hi) from a fixed seed. */
void tu_fill_uniform(float *x, size_t n, float lo, float hi, uint64_t seed);
/* Allocate (malloc) a buffer of n elements of dtype dt holding the floats in
 * src rounded to dt. Free with free(). */
void *tu_from_f32(const float *src, size_t n, loom_dtype dt);
/* Read n elements of dtype dt into a fresh malloc'd float array. */
float *tu_to_f32(const void *src, size_t n, loom_dtype dt);
/* Max over i of |a-b| / (atol + rtol*|b|); <= 1 means "close". Prints the
 * worst index when it exceeds 1 and `what` is not NULL. */
double tu_close_ratio(const float *a, const float *b, size_t n, double atol,
                      double rtol, const char *what);
#define TU_ASSERT_CLOSE(a, b, n, atol, rtol) \
    assert_true(tu_close_ratio((a), (b), (n), (atol), (rtol), #a " vs " #b) <= 1.0)
/* Run a cmocka group with the widest kernels this CPU has ("simd", as far
 * as LOOM_SIMD allows), again capped at AVX2 when that is wider ("avx2",
 * loom_set_simd_level), and with the portable ones (loom_set_simd(0));
 * nonzero if any run fails. */
#define TU_RUN_SIMD_AND_PORTABLE(tests) tu_run_levels((tests), sizeof(tests) / sizeof((tests)[0]))
int tu_run_levels(const struct CMUnitTest *tests, size_t n);
int tu_portable_on(void **state);
int tu_portable_off(void **state);
/* Bitwise equality of two buffers, printing the first differing element. */
int tu_bits_equal(const void *a, const void *b, size_t bytes, const char *what);

#endif
