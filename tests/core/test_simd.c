/*
 * test_simd.c — the AVX-512F and AVX2/F16C paths against the scalar
 * definitions: bulk conversions must agree in every bit (all 65536 half
 * patterns, and f32 patterns: specials, rounding ties, subnormals, random
 * bits) on every level, the switch must force the portable path and the
 * level cap each level, the vector exp must stay within its stated error,
 * and its 16-wide form must give the 8-wide one's bits. Skips the vector
 * checks on CPUs without them.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "core/simd.h"

#if LOOM_HAVE_X86_SIMD
#include <cpuid.h>
#endif

static float F(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t U(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Interesting f32 bit patterns followed by pseudo-random ones. */
static uint32_t *f32_patterns(size_t *n_out) {
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
        0x7fbfffffu, 0x00000001u, 0x807fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu, 0x3f808000u,
        0x3f818000u, 0x3f80ffffu, 0x477ff000u, 0x477fefffu, 0x477fe000u, 0x38800000u, 0x387fffffu,
        0x33000000u, 0x33000001u, 0x32ffffffu, 0x3f800fffu, 0x3f801000u, 0x3f803000u, 0xc7800000u,
    };
    size_t ns = sizeof special / sizeof special[0], n = ns + (1u << 20);
    uint32_t *p = malloc(n * sizeof *p);
    memcpy(p, special, sizeof special);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = ns; i < n; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        p[i] = (uint32_t)(x >> 11);
    }
    *n_out = n;
    return p;
}

static void check_to_f32(loom_dtype dt) {
    uint16_t *h = malloc(65536 * sizeof *h);
    float *got = malloc(65537 * sizeof *got);
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    /* odd offset and length: the vector loop and the scalar tail both run */
    convert_to_f32(got + 1, h + 1, dt, 65535);
    for (uint32_t i = 1; i < 65536; i++) {
        float want = dt == LOOM_BF16 ? loom_bf16_to_f32(h[i]) : loom_f16_to_f32(h[i]);
        if (U(got[i + 0]) != U(want)) {
            fprintf(stderr, "%s pattern 0x%04x: got 0x%08x, want 0x%08x\n", loom_dtype_name(dt), i,
                    U(got[i]), U(want));
            fail();
        }
    }
    free(h);
    free(got);
}

static void check_from_f32(loom_dtype dt) {
    size_t n;
    uint32_t *bits = f32_patterns(&n);
    float *src = malloc(n * sizeof *src);
    uint16_t *got = malloc(n * sizeof *got);
    for (size_t i = 0; i < n; i++) src[i] = F(bits[i]);
    convert_from_f32(got, dt, src, n);
    for (size_t i = 0; i < n; i++) {
        uint16_t want = dt == LOOM_BF16 ? loom_f32_to_bf16(src[i]) : loom_f32_to_f16(src[i]);
        if (got[i] != want) {
            fprintf(stderr, "%s of 0x%08x: got 0x%04x, want 0x%04x\n", loom_dtype_name(dt), bits[i], got[i], want);
            fail();
        }
    }
    free(bits);
    free(src);
    free(got);
}

static void test_conversions(void **state) {
    (void)state;
    static const char *const levels[] = {"native", "avx2", "portable"}; /* as far as the CPU has them */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(loom_set_simd_level(levels[i]), LOOM_OK);
        check_to_f32(LOOM_BF16);
        check_to_f32(LOOM_F16);
        check_from_f32(LOOM_BF16);
        check_from_f32(LOOM_F16);
    }
    loom_set_simd(1);
}

static void test_switch(void **state) {
    (void)state;
    loom_set_simd(0);
    assert_int_equal(loom_simd_enabled(), 0);
    loom_set_simd(1);
#if LOOM_HAVE_X86_SIMD
    __builtin_cpu_init();
    unsigned a, b, c, d; /* F16C from CPUID: clang's __builtin_cpu_supports has no "f16c" */
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    int have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    assert_int_equal(loom_simd_enabled(), have);
#endif
    /* Each cap gives its own level where the CPU has it, a narrower one
     * where it does not; an unknown name changes nothing. */
    static const char *const levels[] = {"portable", "avx2", "avx512f", "avx512-bf16"};
    loom_set_simd(1);
    const char *native = loom_simd_name();
    int n_native = 0;
    while (strcmp(levels[n_native], native) != 0) n_native++;
    for (int i = 0; i < 4; i++) {
        assert_int_equal(loom_set_simd_level(levels[i]), LOOM_OK);
        assert_string_equal(loom_simd_name(), levels[i <= n_native ? i : n_native]);
        assert_int_equal(loom_set_simd_level("avx3"), LOOM_ERR_INVALID);
        assert_non_null(strstr(loom_last_error(), "avx3"));
        assert_string_equal(loom_simd_name(), levels[i <= n_native ? i : n_native]);
    }
    assert_int_equal(loom_set_simd_level(NULL), LOOM_ERR_INVALID);
    assert_int_equal(loom_set_simd_level("native"), LOOM_OK);
    assert_string_equal(loom_simd_name(), native);
}

#if LOOM_HAVE_X86_SIMD
SIMD_AVX2 static void exp8(float *out, const float *in) { _mm256_storeu_ps(out, simd_exp(_mm256_loadu_ps(in))); }
#endif
#if LOOM_HAVE_SIMD512
SIMD_AVX512 static void exp16(float *out, const float *in) { _mm512_storeu_ps(out, simd_exp16(_mm512_loadu_ps(in))); }

/* simd_exp16 gives simd_exp's bits, on the range and on specials. */
static void test_exp16(void **state) {
    (void)state;
    if (!simd_avx512()) skip();
    float x[16], y8[16], y16[16];
    for (int i = 0; i <= 400000; i += 16) {
        for (int k = 0; k < 16; k++) x[k] = -100.0f + 200.0f * (float)(i + k) / 400016.0f;
        if (i == 0) {
            const float sp[] = {-INFINITY, INFINITY, NAN, -87.34f, 88.38f, 0.0f, -0.0f, 1e-30f};
            memcpy(x, sp, sizeof sp);
        }
        exp8(y8, x);
        exp8(y8 + 8, x + 8);
        exp16(y16, x);
        assert_true(tu_bits_equal(y8, y16, sizeof y8, "exp16 vs exp8"));
    }
}
#else
static void test_exp16(void **state) {
    (void)state;
    skip();
}
#endif

static void test_exp(void **state) {
    (void)state;
#if LOOM_HAVE_X86_SIMD
    if (!loom_simd_enabled()) skip();
    double worst = 0.0;
    for (int i = 0; i <= 200000; i += 8) {
        float x[8], y[8];
        for (int k = 0; k < 8; k++) x[k] = -87.0f + 175.0f * (float)(i + k) / 200008.0f;
        exp8(y, x);
        for (int k = 0; k < 8; k++) {
            double want = exp((double)x[k]);
            if (want > 3.0e38) continue; /* beyond the stated range */
            double rel = fabs((double)y[k] - want) / want;
            if (!(rel <= worst)) worst = isnan(rel) ? INFINITY : rel; /* a NaN fails the bound */
        }
    }
    assert_true(worst < 5e-7);
    float sp[8] = {-INFINITY, INFINITY, NAN, -200.0f, 200.0f, 0.0f, -0.0f, 1.0f}, y[8];
    exp8(y, sp);
    assert_true(y[0] == 0.0f && isinf(y[1]) && isnan(y[2]) && y[3] == 0.0f && isinf(y[4]));
    assert_true(y[5] == 1.0f && y[6] == 1.0f && fabsf(y[7] - 2.7182818f) < 1e-6f);
#else
    skip();
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conversions),
        cmocka_unit_test(test_switch),
        cmocka_unit_test(test_exp),
        cmocka_unit_test(test_exp16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
