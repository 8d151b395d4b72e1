/*
 * test_rng.c — Philox4x32 against the Random123 known-answer vectors
 * (Random123 examples/kat_vectors), replay by (seed, offset), counter
 * reservation, and loose statistics of the uniform and normal fills.
 */
#include "testutil.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include "core/rng_internal.h"

typedef struct kat {
    int rounds;
    uint32_t ctr[4];
    uint32_t key[2];
    uint32_t expect[4];
} kat;

/* Random123 kat_vectors, "philox4x32 R ctr[4] key[2] -> out[4]". */
static const kat KATS[] = {
    {7, {0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48}},
    {7, {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662}},
    {7, {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a}},
    {10, {0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {10, {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {10, {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

static void check4(const uint32_t got[4], const uint32_t want[4], const char *what) {
    for (int i = 0; i < 4; i++) {
        if (got[i] != want[i]) {
            fprintf(stderr, "%s: word %d is %08x, expected %08x\n", what, i, got[i], want[i]);
            fail();
        }
    }
}

static void test_kat_rounds(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof KATS / sizeof KATS[0]; i++) {
        uint32_t out[4];
        char what[64];
        snprintf(what, sizeof what, "philox4x32-%d vector %zu", KATS[i].rounds, i);
        loom_philox4x32_rounds(KATS[i].ctr, KATS[i].key, KATS[i].rounds, out);
        check4(out, KATS[i].expect, what);
        if (KATS[i].rounds == 10) {
            loom_philox4x32_full(KATS[i].ctr, KATS[i].key, out);
            check4(out, KATS[i].expect, what);
        }
    }
}

/* The public entry point: counter {c0, c1} = low/high of `counter`, c2 = c3
 * = 0; key {low(seed), high(seed)}. The all-zero vector goes through it
 * directly; the others check that the word mapping agrees with the full
 * function. */
static void test_kat_public(void **state) {
    (void)state;
    uint32_t out[4];
    loom_philox4x32(0, 0, out);
    check4(out, KATS[3].expect, "loom_philox4x32(0, 0)");

    const uint64_t seeds[] = {0, 1, 0xffffffffull, 0x299f31d0a4093822ull, ~0ull};
    const uint64_t ctrs[] = {0, 1, 0x85a308d3243f6a88ull, 0xffffffff00000000ull, ~0ull};
    for (size_t s = 0; s < 5; s++) {
        for (size_t c = 0; c < 5; c++) {
            uint32_t ctr[4] = {(uint32_t)ctrs[c], (uint32_t)(ctrs[c] >> 32), 0, 0};
            uint32_t key[2] = {(uint32_t)seeds[s], (uint32_t)(seeds[s] >> 32)};
            uint32_t want[4];
            loom_philox4x32_full(ctr, key, want);
            loom_philox4x32(seeds[s], ctrs[c], out);
            check4(out, want, "loom_philox4x32 word mapping");
        }
    }
}

/* Distinct counters and distinct seeds give distinct blocks. */
static void test_distinct(void **state) {
    (void)state;
    uint32_t a[4], b[4], c[4];
    loom_philox4x32(42, 0, a);
    loom_philox4x32(42, 1, b);
    loom_philox4x32(43, 0, c);
    assert_memory_not_equal(a, b, sizeof a);
    assert_memory_not_equal(a, c, sizeof a);
    /* The high key word matters too. */
    loom_philox4x32(42 | (1ull << 32), 0, c);
    assert_memory_not_equal(a, c, sizeof a);
    /* So does the high counter word. */
    loom_philox4x32(42, 1ull << 32, c);
    assert_memory_not_equal(a, c, sizeof a);
}

static void test_unit_range(void **state) {
    (void)state;
    assert_true(loom_u32_to_unit(0) == 0.0f);
    assert_true(loom_u32_to_unit(0xffffffffu) < 1.0f);
    assert_true(loom_u32_to_unit(0xffffffffu) == 1.0f - 1.0f / 16777216.0f);
    assert_true(loom_u32_to_unit(0x80000000u) == 0.5f);
    assert_true(loom_u32_to_unit(0x000000ffu) == 0.0f); /* only the top 24 bits count */
    assert_true(loom_u32_to_unit(0x00000100u) == 1.0f / 16777216.0f);
}

/* Uniform: element 4b+j is lane j of block (seed, offset + b). */
static void test_uniform_matches_blocks(void **state) {
    (void)state;
    enum { N = 103 };
    float u[N];
    const uint64_t seed = 0x0123456789abcdefull, off = 1000;
    loom_rng_uniform(u, N, seed, off);
    for (size_t i = 0; i < N; i++) {
        uint32_t r[4];
        loom_philox4x32(seed, off + i / 4, r);
        assert_true(u[i] == loom_u32_to_unit(r[i % 4]));
    }
}

/* loom_philox4x32_blocks gives loom_philox4x32's words at every SIMD
 * level (16 and 8 blocks at a time, and one by one): counts around the
 * vector widths, runs whose counters cross 2^32 (the high word carries),
 * seeds with both halves set; nothing past the n blocks is written. */
static void test_blocks_match(void **state) {
    (void)state;
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    const char *levels[3] = {"avx512f", "avx2", "portable"};
    const size_t ns[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100};
    const uint64_t firsts[] = {0, 5, 0xFFFFFFF5ull, 0x123456789ull}, seeds[] = {0, 0x0123456789abcdefull};
    uint32_t got[4 * 100 + 1], want[4];
    int ran = 0;
    for (int lv = 0; lv < 3; lv++) {
        /* a CPU or build without the level runs a lower one: that level's pass covers it */
        if (loom_set_simd_level(levels[lv]) != LOOM_OK || strcmp(loom_simd_name(), levels[lv]) != 0) continue;
        ran++;
        for (size_t a = 0; a < sizeof seeds / sizeof seeds[0]; a++)
            for (size_t f = 0; f < sizeof firsts / sizeof firsts[0]; f++)
                for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                    size_t n = ns[k];
                    got[4 * n] = 0xA5A5A5A5u;
                    loom_philox4x32_blocks(seeds[a], firsts[f], n, got);
                    assert_true(got[4 * n] == 0xA5A5A5A5u);
                    for (size_t i = 0; i < n; i++) {
                        loom_philox4x32(seeds[a], firsts[f] + i, want);
                        assert_memory_equal(got + 4 * i, want, sizeof want);
                    }
                }
    }
    assert_int_equal(loom_set_simd_level(was), LOOM_OK);
    assert_true(ran == 3 || strncmp(was, "avx512", 6) != 0); /* every level where the CPU has them all */
}

static void test_replay(void **state) {
    (void)state;
    enum { N = 4099 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
    loom_rng_uniform(a, N, 7, 123);
    loom_rng_uniform(b, N, 7, 123);
    assert_memory_equal(a, b, N * sizeof *a);
    loom_rng_normal(a, N, 0.5f, 2.0f, 7, 123);
    loom_rng_normal(b, N, 0.5f, 2.0f, 7, 123);
    assert_memory_equal(a, b, N * sizeof *a);
    /* A different seed or offset is a different stream. */
    loom_rng_uniform(a, N, 7, 123);
    loom_rng_uniform(b, N, 8, 123);
    assert_memory_not_equal(a, b, N * sizeof *a);
    loom_rng_uniform(b, N, 7, 124);
    assert_memory_not_equal(a, b, N * sizeof *a);
    free(a);
    free(b);
}

/* Reading from block offset k equals the tail (from element 4k) of the stream
 * read from 0, for uniform and normal, and for a length that is not a
 * multiple of 4. Also large enough for the OpenMP path (n > 65536). */
static void test_offset_is_tail(void **state) {
    (void)state;
    const size_t n = 70001, k = 37;
    float *full = malloc(n * sizeof *full), *tail = malloc(n * sizeof *tail);
    loom_rng_uniform(full, n, 99, 0);
    loom_rng_uniform(tail, n - 4 * k, 99, k);
    assert_memory_equal(full + 4 * k, tail, (n - 4 * k) * sizeof *full);
    loom_rng_normal(full, n, 1.0f, 3.0f, 99, 0);
    loom_rng_normal(tail, n - 4 * k, 1.0f, 3.0f, 99, k);
    assert_memory_equal(full + 4 * k, tail, (n - 4 * k) * sizeof *full);
    /* A shorter read is a prefix of a longer one (the partial last block). */
    float ref_u[16], ref_z[16], part[16];
    loom_rng_uniform(ref_u, 16, 99, 3);
    loom_rng_normal(ref_z, 16, 1.0f, 3.0f, 99, 3);
    for (size_t m = 1; m <= 9; m++) {
        loom_rng_uniform(part, m, 99, 3);
        assert_memory_equal(ref_u, part, m * sizeof *part);
        loom_rng_normal(part, m, 1.0f, 3.0f, 99, 3);
        assert_memory_equal(ref_z, part, m * sizeof *part);
    }
    free(full);
    free(tail);
}

static void test_reserve(void **state) {
    (void)state;
    loom_rng rng;
    loom_rng_init(&rng, 1234);
    assert_int_equal(rng.seed, 1234);
    assert_int_equal(rng.offset, 0);
    uint64_t a = loom_rng_reserve(&rng, 10);
    uint64_t b = loom_rng_reserve(&rng, 5);
    uint64_t c = loom_rng_reserve(&rng, 0);
    uint64_t d = loom_rng_reserve(&rng, 1);
    assert_int_equal(a, 0);
    assert_int_equal(b, 10); /* [0,10) and [10,15) do not overlap */
    assert_int_equal(c, 15);
    assert_int_equal(d, 15);
    assert_int_equal(rng.offset, 16);

    /* Two consecutive reservations give disjoint, back-to-back streams: the
     * two fills together equal one fill of the combined length. */
    loom_rng_init(&rng, 77);
    enum { NA = 40, NB = 24 };
    float x[NA + NB], y[NA + NB];
    uint64_t oa = loom_rng_reserve(&rng, NA / 4);
    uint64_t ob = loom_rng_reserve(&rng, NB / 4);
    assert_true(ob >= oa + NA / 4);
    loom_rng_uniform(x, NA, rng.seed, oa);
    loom_rng_uniform(x + NA, NB, rng.seed, ob);
    loom_rng_uniform(y, NA + NB, 77, 0);
    assert_memory_equal(x, y, sizeof x);

    /* Re-initialising restarts the stream. */
    loom_rng_init(&rng, 77);
    assert_int_equal(loom_rng_reserve(&rng, 3), 0);
}

static void test_default_rng(void **state) {
    (void)state;
    loom_rng *r = loom_rng_default();
    assert_non_null(r);
    assert_ptr_equal(r, loom_rng_default());
    uint64_t before = r->offset;
    assert_int_equal(loom_rng_reserve(r, 4), before);
    assert_int_equal(loom_rng_default()->offset, before + 4);
    /* Thread-local: another thread gets its own generator. */
    loom_rng *other = NULL;
    #pragma omp parallel num_threads(2)
    {
        if (omp_get_thread_num() == 1) other = loom_rng_default();
    }
    if (other) assert_ptr_not_equal(other, r);
}

static void test_uniform_stats(void **state) {
    (void)state;
    const size_t n = 1 << 20;
    float *u = malloc(n * sizeof *u);
    loom_rng_uniform(u, n, 2024, 5);
    double sum = 0, sum2 = 0;
    float lo = 1, hi = 0;
    size_t hist[16] = {0};
    for (size_t i = 0; i < n; i++) {
        assert_true(u[i] >= 0.0f && u[i] < 1.0f);
        sum += u[i];
        sum2 += (double)u[i] * u[i];
        if (u[i] < lo) lo = u[i];
        if (u[i] > hi) hi = u[i];
        hist[(int)(u[i] * 16)]++;
    }
    double mean = sum / n, var = sum2 / n - mean * mean;
    /* Standard error of the mean is 0.29/sqrt(2^20) ~ 3e-4: allow ~15 sigma. */
    assert_true(fabs(mean - 0.5) < 5e-3);
    assert_true(fabs(var - 1.0 / 12.0) < 2e-3);
    assert_true(lo < 1e-4f && hi > 1.0f - 1e-4f);
    /* Each of 16 bins holds 1/16 of the samples (sd ~ 250 of 65536). */
    for (int b = 0; b < 16; b++)
        assert_true(fabs((double)hist[b] - n / 16.0) < 3000.0);
    free(u);
}

static void test_normal_stats(void **state) {
    (void)state;
    const size_t n = 1 << 20;
    float *z = malloc(n * sizeof *z);
    loom_rng_normal(z, n, 0.0f, 1.0f, 31337, 0);
    double sum = 0, sum2 = 0, sum3 = 0, sum4 = 0;
    size_t within1 = 0;
    for (size_t i = 0; i < n; i++) {
        assert_true(isfinite(z[i]));
        double v = z[i];
        sum += v; sum2 += v * v; sum3 += v * v * v; sum4 += v * v * v * v;
        if (fabs(v) < 1.0) within1++;
    }
    double mean = sum / n, var = sum2 / n - mean * mean;
    assert_true(fabs(mean) < 1e-2);
    assert_true(fabs(sqrt(var) - 1.0) < 1e-2);
    assert_true(fabs(sum3 / n) < 5e-2);          /* skewness ~ 0 */
    assert_true(fabs(sum4 / n - 3.0) < 0.1);     /* kurtosis ~ 3 */
    assert_true(fabs((double)within1 / n - 0.682689492) < 5e-3);

    /* mean and std are applied: same stream, shifted and scaled. */
    float *w = malloc(n * sizeof *w);
    loom_rng_normal(w, n, 3.0f, 2.0f, 31337, 0);
    for (size_t i = 0; i < n; i += 997) assert_true(fabsf(w[i] - (3.0f + 2.0f * z[i])) < 1e-5f * (1 + fabsf(w[i])));
    free(w);
    free(z);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kat_rounds),
        cmocka_unit_test(test_kat_public),
        cmocka_unit_test(test_distinct),
        cmocka_unit_test(test_unit_range),
        cmocka_unit_test(test_uniform_matches_blocks),
        cmocka_unit_test(test_blocks_match),
        cmocka_unit_test(test_replay),
        cmocka_unit_test(test_offset_is_tail),
        cmocka_unit_test(test_reserve),
        cmocka_unit_test(test_default_rng),
        cmocka_unit_test(test_uniform_stats),
        cmocka_unit_test(test_normal_stats),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
