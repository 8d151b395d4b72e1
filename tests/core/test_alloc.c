/*
 * test_alloc.c — the accounting, caching allocator: 64-byte alignment,
 * per-category current/peak accounting, size classes and reuse of cached
 * blocks, trim, concurrent use from OpenMP threads, and impossible sizes.
 *
 * The allocator is process-wide, so every check is made against figures read
 * at the start of the test.
 */
#include "testutil.h"

#include <omp.h>
#include <stdint.h>
#include <string.h>

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
/* Let the impossible-size test see NULL from the system allocator instead of
 * ASan's allocation-size-too-big report. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }
#endif

static loom_mem_stats get(void) {
    loom_mem_stats s;
    loom_mem_get_stats(&s);
    return s;
}

static size_t sum_current(const loom_mem_stats *s) {
    size_t t = 0;
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++) t += s->current[c];
    return t;
}

/* The documented size classes: 256 B, then {1, 1.25, 1.5, 1.75} x 2^k. */
static size_t expected_class(size_t bytes) {
    if (bytes <= 256) return 256;
    for (size_t base = 256;; base *= 2)
        for (size_t q = 0; q < 4; q++)
            if (base + q * (base / 4) >= bytes) return base + q * (base / 4);
}

static void test_alignment_and_size(void **state) {
    (void)state;
    size_t sizes[200];
    size_t n = 0;
    sizes[n++] = 0;
    sizes[n++] = 1;
    sizes[n++] = 63;
    sizes[n++] = 64;
    sizes[n++] = 65;
    /* Every class boundary and its neighbours up to 4 MiB. */
    for (size_t base = 256; base <= (4u << 20); base *= 2) {
        for (size_t q = 0; q < 4 && n + 3 <= 200; q++) {
            size_t c = base + q * (base / 4);
            sizes[n++] = c - 1;
            sizes[n++] = c;
            sizes[n++] = c + 1;
        }
    }
    void *p[200];
    for (size_t i = 0; i < n; i++) {
        p[i] = loom_alloc(sizes[i], LOOM_MEM_WORKSPACE);
        assert_non_null(p[i]);
        assert_int_equal((uintptr_t)p[i] % 64, 0);
        /* The whole requested size is usable (ASan checks the bounds). */
        memset(p[i], (int)(i & 0xff), sizes[i]);
    }
    /* No two live blocks overlap. */
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < i; j++) {
            uintptr_t a = (uintptr_t)p[i], b = (uintptr_t)p[j];
            size_t la = sizes[i] ? sizes[i] : 1, lb = sizes[j] ? sizes[j] : 1;
            assert_true(a + la <= b || b + lb <= a);
        }
    }
    for (size_t i = 0; i < n; i++) {
        const unsigned char *c = p[i];
        for (size_t k = 0; k < sizes[i]; k += 97) assert_int_equal(c[k], i & 0xff);
        if (sizes[i]) assert_int_equal(c[sizes[i] - 1], i & 0xff);
        loom_free(p[i]);
    }
    /* Zeroed allocations are zero, also when they reuse a dirty block. */
    for (size_t i = 0; i < n; i++) {
        unsigned char *z = loom_alloc_zeroed(sizes[i], LOOM_MEM_ACTIVATIONS);
        assert_non_null(z);
        assert_int_equal((uintptr_t)z % 64, 0);
        for (size_t k = 0; k < sizes[i]; k++) assert_int_equal(z[k], 0);
        p[i] = z;
    }
    for (size_t i = 0; i < n; i++) loom_free(p[i]);
    loom_free(NULL); /* a no-op */
}

static void test_accounting(void **state) {
    (void)state;
    loom_mem_stats s0 = get();
    const size_t sz[LOOM_MEM_N_CATEGORIES] = {1000, 2048, 3, 70000, 12345};
    void *p[LOOM_MEM_N_CATEGORIES];
    size_t total = 0;
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++) {
        p[c] = loom_alloc(sz[c], (loom_mem_category)c);
        assert_non_null(p[c]);
        total += sz[c];
        loom_mem_stats s = get();
        for (int d = 0; d < LOOM_MEM_N_CATEGORIES; d++)
            assert_int_equal(s.current[d], s0.current[d] + (d <= c ? sz[d] : 0));
        assert_int_equal(s.current_total, s0.current_total + total);
        assert_int_equal(s.current_total, sum_current(&s));
        assert_int_equal(s.n_alloc, s0.n_alloc + (uint64_t)c + 1);
    }
    /* Two blocks in one category add up. */
    void *extra = loom_alloc(500, LOOM_MEM_GRADS);
    assert_int_equal(get().current[LOOM_MEM_GRADS], s0.current[LOOM_MEM_GRADS] + 2048 + 500);
    loom_free(extra);
    assert_int_equal(get().current[LOOM_MEM_GRADS], s0.current[LOOM_MEM_GRADS] + 2048);
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++) loom_free(p[c]);
    loom_mem_stats s1 = get();
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++)
        assert_int_equal(s1.current[c], s0.current[c]);
    assert_int_equal(s1.current_total, s0.current_total);

    /* A category out of range is counted as workspace, not lost. */
    void *q = loom_alloc(777, (loom_mem_category)99);
    assert_non_null(q);
    assert_int_equal(get().current[LOOM_MEM_WORKSPACE], s0.current[LOOM_MEM_WORKSPACE] + 777);
    loom_free(q);
    assert_int_equal(get().current_total, s0.current_total);

    assert_string_equal(loom_mem_category_name(LOOM_MEM_PARAMS), "parameters");
    assert_string_equal(loom_mem_category_name(LOOM_MEM_GRADS), "gradients");
    assert_string_equal(loom_mem_category_name(LOOM_MEM_OPTIMIZER), "optimizer");
    assert_string_equal(loom_mem_category_name(LOOM_MEM_ACTIVATIONS), "activations");
    assert_string_equal(loom_mem_category_name(LOOM_MEM_WORKSPACE), "workspace");
    assert_string_equal(loom_mem_category_name(LOOM_MEM_N_CATEGORIES), "?");
}

static void test_peak(void **state) {
    (void)state;
    loom_mem_reset_peak();
    loom_mem_stats s0 = get();
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++) assert_int_equal(s0.peak[c], s0.current[c]);
    assert_int_equal(s0.peak_total, s0.current_total);

    void *a = loom_alloc(4000, LOOM_MEM_ACTIVATIONS);
    void *b = loom_alloc(6000, LOOM_MEM_ACTIVATIONS);
    void *c = loom_alloc(1000, LOOM_MEM_OPTIMIZER);
    loom_free(b);
    void *d = loom_alloc(2000, LOOM_MEM_ACTIVATIONS); /* below the earlier high */
    loom_mem_stats s1 = get();
    assert_int_equal(s1.peak[LOOM_MEM_ACTIVATIONS], s0.current[LOOM_MEM_ACTIVATIONS] + 10000);
    assert_int_equal(s1.peak[LOOM_MEM_OPTIMIZER], s0.current[LOOM_MEM_OPTIMIZER] + 1000);
    assert_int_equal(s1.peak[LOOM_MEM_PARAMS], s0.current[LOOM_MEM_PARAMS]);
    assert_int_equal(s1.peak_total, s0.current_total + 11000);
    assert_int_equal(s1.current_total, s0.current_total + 7000);
    loom_free(a);
    loom_free(c);
    loom_free(d);
    /* Freeing returns `current` to the start; the peak is kept ... */
    loom_mem_stats s2 = get();
    assert_int_equal(s2.current_total, s0.current_total);
    assert_int_equal(s2.current[LOOM_MEM_ACTIVATIONS], s0.current[LOOM_MEM_ACTIVATIONS]);
    assert_int_equal(s2.peak[LOOM_MEM_ACTIVATIONS], s1.peak[LOOM_MEM_ACTIVATIONS]);
    assert_int_equal(s2.peak_total, s1.peak_total);
    /* ... until reset. */
    loom_mem_reset_peak();
    loom_mem_stats s3 = get();
    for (int k = 0; k < LOOM_MEM_N_CATEGORIES; k++) assert_int_equal(s3.peak[k], s3.current[k]);
    assert_int_equal(s3.peak_total, s0.current_total);
}

static void test_size_classes_and_cache(void **state) {
    (void)state;
    loom_mem_trim();
    loom_mem_stats s0 = get();
    assert_int_equal(s0.cached, 0);
    /* A freed block goes to the cache with its class size. */
    const size_t sizes[] = {0, 1, 255, 256, 257, 320, 321, 384, 448, 449, 512, 513, 1000, 4096,
                            5000, 100000, 1u << 20, (1u << 20) + 1, 3u << 20, (7u << 20) + 5};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        loom_mem_trim();
        void *p = loom_alloc(sizes[i], LOOM_MEM_WORKSPACE);
        assert_int_equal(get().cached, 0);
        loom_free(p);
        loom_mem_stats s = get();
        if (s.cached != expected_class(sizes[i])) {
            fprintf(stderr, "after freeing %zu bytes: cached %zu, expected class %zu\n",
                    sizes[i], s.cached, expected_class(sizes[i]));
            fail();
        }
    }
    assert_int_equal(expected_class(257), 320);
    assert_int_equal(expected_class(449), 512);
    assert_int_equal(expected_class((1u << 20) + 1), (1u << 20) + (1u << 18));
    loom_mem_trim();
    assert_int_equal(get().cached, 0);

    /* Same class: the cached block is handed back; next class: a new one. */
    void *a = loom_alloc(300, LOOM_MEM_PARAMS);
    loom_free(a);
    uint64_t m0 = get().n_malloc;
    void *b = loom_alloc(320, LOOM_MEM_PARAMS);
    assert_ptr_equal(a, b);
    assert_int_equal(get().n_malloc, m0);
    assert_int_equal(get().cached, 0);
    void *c = loom_alloc(321, LOOM_MEM_PARAMS);
    assert_int_equal(get().n_malloc, m0 + 1);
    loom_free(b);
    loom_free(c);
    loom_mem_trim();
}

/* After allocating and freeing a set of sizes, the same set again is served
 * entirely from the cache; trim empties the cache and malloc is called
 * again. */
static void test_reuse_and_trim(void **state) {
    (void)state;
    enum { N = 64 };
    size_t sizes[N];
    void *p[N];
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < N; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        sizes[i] = (size_t)(x % 300000) + (i % 7 == 0 ? 0 : 1);
    }
    loom_mem_trim();
    loom_mem_stats s0 = get();
    for (int i = 0; i < N; i++) p[i] = loom_alloc(sizes[i], (loom_mem_category)(i % 5));
    loom_mem_stats s1 = get();
    assert_int_equal(s1.n_malloc, s0.n_malloc + N); /* empty cache: all new */
    for (int i = 0; i < N; i++) loom_free(p[i]);
    loom_mem_stats s2 = get();
    assert_true(s2.cached > 0);
    assert_int_equal(s2.current_total, s0.current_total);
    for (int round = 0; round < 3; round++) {
        /* In a different order, and in different categories. */
        for (int i = N - 1; i >= 0; i--) p[i] = loom_alloc(sizes[i], (loom_mem_category)(i % 3));
        loom_mem_stats s3 = get();
        assert_int_equal(s3.n_malloc, s1.n_malloc);
        assert_int_equal(s3.n_alloc, s2.n_alloc + (uint64_t)(round + 1) * N);
        assert_int_equal(s3.cached, 0);
        for (int i = 0; i < N; i++) loom_free(p[i]);
        assert_int_equal(get().cached, s2.cached);
    }
    loom_mem_trim();
    loom_mem_stats s4 = get();
    assert_int_equal(s4.cached, 0);
    assert_int_equal(s4.current_total, s0.current_total);
    for (int i = 0; i < N; i++) p[i] = loom_alloc(sizes[i], LOOM_MEM_WORKSPACE);
    assert_int_equal(get().n_malloc, s4.n_malloc + N);
    for (int i = 0; i < N; i++) loom_free(p[i]);
    loom_mem_trim();
}

/* Many threads allocating and freeing at once: every block is private to its
 * thread (a block handed out twice would have its pattern overwritten), the
 * figures stay consistent while it runs, and return to the start after. */
static void test_threads(void **state) {
    (void)state;
    loom_mem_stats s0 = get();
    enum { THREADS = 4, ITERS = 3000, LIVE = 16 };
    uint64_t n_done[THREADS] = {0};
    int bad[THREADS] = {0};
    #pragma omp parallel num_threads(THREADS)
    {
        int t = omp_get_thread_num();
        unsigned char *live[LIVE] = {0};
        size_t live_n[LIVE] = {0};
        unsigned char tag[LIVE] = {0};
        uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(t + 1);
        for (int it = 0; it < ITERS; it++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            int slot = (int)(x % LIVE);
            if (live[slot]) {
                const unsigned char *q = live[slot];
                size_t nb = live_n[slot];
                if (q[0] != tag[slot] || q[nb / 2] != tag[slot] || q[nb - 1] != tag[slot]) bad[t]++;
                loom_free(live[slot]);
                live[slot] = NULL;
            } else {
                size_t nb = 1 + (size_t)((x >> 20) % 20000);
                live[slot] = loom_alloc(nb, (loom_mem_category)((x >> 40) % 5));
                if (!live[slot] || (uintptr_t)live[slot] % 64) { bad[t]++; continue; }
                live_n[slot] = nb;
                tag[slot] = (unsigned char)(t * 64 + it);
                memset(live[slot], tag[slot], nb);
                n_done[t]++;
            }
            if (it % 256 == 0) {
                loom_mem_stats s;
                loom_mem_get_stats(&s);
                if (s.current_total != sum_current(&s) || s.current_total < s0.current_total ||
                    s.peak_total < s.current_total)
                    bad[t]++;
            }
        }
        for (int i = 0; i < LIVE; i++) {
            if (live[i] && live[i][live_n[i] - 1] != tag[i]) bad[t]++;
            loom_free(live[i]);
        }
    }
    uint64_t total = 0;
    for (int t = 0; t < THREADS; t++) {
        assert_int_equal(bad[t], 0);
        total += n_done[t];
    }
    loom_mem_stats s1 = get();
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++) assert_int_equal(s1.current[c], s0.current[c]);
    assert_int_equal(s1.current_total, s0.current_total);
    assert_int_equal(s1.n_alloc, s0.n_alloc + total);
    assert_true(s1.n_malloc - s0.n_malloc <= total);
    loom_mem_trim();
    assert_int_equal(get().cached, 0);
}

/* Sizes no system can provide: NULL and an out-of-memory message, never an
 * abort, and nothing counted. Includes sizes whose class would overflow
 * size_t. */
static void test_impossible_sizes(void **state) {
    (void)state;
    const size_t huge[] = {
        SIZE_MAX / 2,
        SIZE_MAX / 2 + 1,
        (SIZE_MAX / 2 + 1) + (SIZE_MAX / 8 + 1) * 3,     /* the largest class, 2^63 + 3*2^61 */
        (SIZE_MAX / 2 + 1) + (SIZE_MAX / 8 + 1) * 3 + 1, /* above it: no class */
        SIZE_MAX - 64,
        SIZE_MAX - 1,
        SIZE_MAX,
        (size_t)1 << 52,
    };
    for (int cat = 0; cat < LOOM_MEM_N_CATEGORIES; cat += 2) {
        for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
            loom_mem_stats s0 = get();
            loom_clear_error();
            void *p = loom_alloc(huge[i], (loom_mem_category)cat);
            assert_null(p);
            const char *msg = loom_last_error();
            if (!strstr(msg, "out of memory")) {
                fprintf(stderr, "loom_alloc(%zu): message '%s'\n", huge[i], msg);
                fail();
            }
            assert_non_null(strstr(msg, loom_mem_category_name((loom_mem_category)cat)));
            loom_clear_error();
            assert_null(loom_alloc_zeroed(huge[i], (loom_mem_category)cat));
            assert_non_null(strstr(loom_last_error(), "out of memory"));
            loom_mem_stats s1 = get();
            assert_int_equal(s1.current_total, s0.current_total);
            assert_int_equal(s1.current[cat], s0.current[cat]);
            assert_int_equal(s1.peak_total, s0.peak_total);
            assert_int_equal(s1.n_alloc, s0.n_alloc);
            assert_int_equal(s1.cached, s0.cached);
        }
    }
    /* The allocator still works afterwards. */
    void *p = loom_alloc(1000, LOOM_MEM_WORKSPACE);
    assert_non_null(p);
    loom_free(p);
}

#ifdef __SANITIZE_ADDRESS__
/* Under ASan the bytes past the requested size and freed (cached) blocks are
 * poisoned, and a reused block is usable again. */
static void test_asan_poisoning(void **state) {
    (void)state;
    const size_t sizes[] = {1, 100, 300, 1000, 5000};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        char *p = loom_alloc(n, LOOM_MEM_WORKSPACE);
        assert_non_null(p);
        assert_null(__asan_region_is_poisoned(p, n));
        assert_true(__asan_address_is_poisoned(p + n));
        assert_true(__asan_address_is_poisoned(p + expected_class(n) - 1));
        loom_free(p);
        assert_true(__asan_address_is_poisoned(p));
        assert_true(__asan_address_is_poisoned(p + n - 1));
        char *q = loom_alloc(n, LOOM_MEM_WORKSPACE); /* the cached block again */
        assert_ptr_equal(p, q);
        assert_null(__asan_region_is_poisoned(q, n));
        memset(q, 1, n);
        loom_free(q);
    }
    loom_mem_trim();
}
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alignment_and_size),
        cmocka_unit_test(test_accounting),
        cmocka_unit_test(test_peak),
        cmocka_unit_test(test_size_classes_and_cache),
        cmocka_unit_test(test_reuse_and_trim),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_impossible_sizes),
#ifdef __SANITIZE_ADDRESS__
        cmocka_unit_test(test_asan_poisoning),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
