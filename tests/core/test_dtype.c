/*
 * test_dtype.c — bf16 / f16 conversions against bit patterns written from the
 * IEEE 754 definitions, exhaustive round trips over all 65536 half patterns,
 * f32 -> half against a double-precision reference rounding, stochastic bf16
 * rounding, loom_convert over all dtype pairs, dtype names and parsing.
 *
 * Expected values come from the formats' definitions (and an independent
 * reference written with frexp/ldexp/nearbyint), never from running loom.
 */
#include "testutil.h"

#include <fenv.h>
#include <math.h>
#include <string.h>

static float F(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t U(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ------------------------------------------------------------ references */

static int f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu); }
static int f16_is_quiet_nan(uint16_t h) { return f16_is_nan(h) && (h & 0x0200u); }
static int bf16_is_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu); }
static int bf16_is_quiet_nan(uint16_t h) { return bf16_is_nan(h) && (h & 0x0040u); }

/* Round |f| (finite, in double) to a binary format with `mant` stored
 * mantissa bits and minimum normal exponent `emin`, ties to even, and return
 * the magnitude's bit pattern; `inf` is the pattern of +Inf (overflow). The
 * encoding: value = n * 2^(E - mant) with E = max(floor(log2 x), emin), and
 * bits = ((E - emin) << mant) + n — this covers subnormals (E = emin,
 * n < 2^mant), normals (n in [2^mant, 2^(mant+1)]) and the carry into the
 * next binade (n = 2^(mant+1)). */
static uint32_t ref_round(double x, int mant, int emin, uint32_t inf) {
    if (isinf(x)) return inf;
    if (x == 0.0) return 0;
    int e;
    frexp(x, &e); /* x = m 2^e, m in [0.5, 1): floor(log2 x) = e - 1 */
    int E = e - 1 < emin ? emin : e - 1;
    double n = nearbyint(ldexp(x, mant - E)); /* exact scaling, then RNE */
    double bits = ldexp((double)(E - emin), mant) + n;
    return bits >= (double)inf ? inf : (uint32_t)bits;
}

static uint16_t ref_f32_to_f16(float f) {
    uint16_t sign = (uint16_t)((U(f) >> 16) & 0x8000u);
    return (uint16_t)(sign | ref_round(fabs((double)f), 10, -14, 0x7c00u));
}

static uint16_t ref_f32_to_bf16(float f) {
    uint16_t sign = (uint16_t)((U(f) >> 16) & 0x8000u);
    return (uint16_t)(sign | ref_round(fabs((double)f), 7, -126, 0x7f80u));
}

/* Value of a half pattern from the definition (NaN -> NAN). */
static double ref_half_value(uint16_t h, int mant, int bias) {
    int ebits = 15 - mant;
    unsigned emax = (1u << ebits) - 1;
    unsigned e = (h >> mant) & emax, m = h & ((1u << mant) - 1);
    double s = (h & 0x8000u) ? -1.0 : 1.0;
    if (e == emax) return m ? NAN : s * INFINITY;
    if (e == 0) return s * ldexp((double)m, 1 - bias - mant);
    return s * ldexp((double)(m + (1u << mant)), (int)e - bias - mant);
}
static double ref_f16_value(uint16_t h) { return ref_half_value(h, 10, 15); }
static double ref_bf16_value(uint16_t h) { return ref_half_value(h, 7, 127); }

/* splitmix64: an RNG independent of loom's. */
static uint64_t sm_state;
static uint64_t sm_next(void) {
    uint64_t z = (sm_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define ASSERT_BITS16(got, want, in)                                                      \
    do {                                                                                  \
        uint16_t g_ = (got), w_ = (want);                                                 \
        if (g_ != w_) {                                                                   \
            fprintf(stderr, "%s(0x%08x): got 0x%04x, expected 0x%04x\n", #got, (unsigned)(in), \
                    g_, w_);                                                              \
            fail();                                                                       \
        }                                                                                 \
    } while (0)

/* ------------------------------------------------------ known bit patterns */

typedef struct { uint32_t f32; uint16_t half; } pair;

static void test_bf16_known(void **state) {
    (void)state;
    static const pair cases[] = {
        {0x3F800000, 0x3F80}, /* 1.0 */
        {0xBF800000, 0xBF80}, /* -1.0 */
        {0x40000000, 0x4000}, /* 2.0 */
        {0x00000000, 0x0000}, /* +0 */
        {0x80000000, 0x8000}, /* -0 */
        {0x7F800000, 0x7F80}, /* +Inf */
        {0xFF800000, 0xFF80}, /* -Inf */
        {0x40490FDB, 0x4049}, /* pi: 0x0FDB < half */
        {0x3F808000, 0x3F80}, /* tie, even below: down */
        {0x3F818000, 0x3F82}, /* tie, odd below: up */
        {0xBF808000, 0xBF80}, /* negative ties */
        {0xBF818000, 0xBF82},
        {0x3F808001, 0x3F81}, /* just above a tie: up */
        {0x3F807FFF, 0x3F80}, /* just below a tie: down */
        {0x3F81FFFF, 0x3F82}, /* carry within the binade */
        {0x3FFF8000, 0x4000}, /* tie with odd 0x3FFF: carry into the exponent */
        {0x7F7F0000, 0x7F7F}, /* largest finite bf16 */
        {0x7F7F7FFF, 0x7F7F}, /* below the tie: stays finite */
        {0x7F7F8000, 0x7F80}, /* tie, odd 0x7F7F: rounds up to Inf */
        {0x7F7FFFFF, 0x7F80}, /* largest float: overflow to Inf */
        {0xFF7FFFFF, 0xFF80}, /* ... -Inf */
        {0x00800000, 0x0080}, /* smallest normal float */
        {0x00000001, 0x0000}, /* smallest subnormal float: rounds to 0 */
        {0x80000001, 0x8000}, /* ... to -0 */
        {0x00008000, 0x0000}, /* subnormal tie, even: 0 */
        {0x00018000, 0x0002}, /* subnormal tie, odd: up */
        {0x00010000, 0x0001}, /* smallest bf16 subnormal 2^-133 */
        {0x007F8000, 0x0080}, /* largest subnormal tie: up to the smallest normal */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ASSERT_BITS16(loom_f32_to_bf16(F(cases[i].f32)), cases[i].half, cases[i].f32);
        /* The reference agrees with the hand-written table. */
        ASSERT_BITS16(ref_f32_to_bf16(F(cases[i].f32)), cases[i].half, cases[i].f32);
    }
    /* bf16 -> f32 is exact: the top half of the float. */
    assert_int_equal(U(loom_bf16_to_f32(0x3F80)), 0x3F800000u);
    assert_int_equal(U(loom_bf16_to_f32(0x8000)), 0x80000000u);
    assert_int_equal(U(loom_bf16_to_f32(0x0001)), 0x00010000u);
    assert_true(loom_bf16_to_f32(0x0001) == (float)ldexp(1.0, -133));
    assert_true(loom_bf16_to_f32(0x7F7F) == (float)ldexp(255.0, 120));
    assert_true(isinf(loom_bf16_to_f32(0xFF80)) && loom_bf16_to_f32(0xFF80) < 0);
}

static void test_bf16_nan(void **state) {
    (void)state;
    static const uint32_t nans[] = {
        0x7FC00000, /* default quiet NaN */
        0xFFC00000, /* negative quiet NaN */
        0x7F800001, /* signalling, payload only in the low 16 bits: must not become Inf */
        0xFF800001,
        0x7FBFFFFF, /* signalling, all payload bits: must not round up into the sign */
        0x7FFFFFFF, 0xFFFFFFFF, 0x7F808000, 0x7F810000,
    };
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = loom_f32_to_bf16(F(nans[i]));
        if (!bf16_is_quiet_nan(h) || (h & 0x8000u) != ((nans[i] >> 16) & 0x8000u)) {
            fprintf(stderr, "bf16 of NaN 0x%08x is 0x%04x\n", nans[i], h);
            fail();
        }
        assert_true(isnan(loom_bf16_to_f32(h)));
        assert_true(isnan(loom_round_to(F(nans[i]), LOOM_BF16)));
    }
}

static void test_f16_known(void **state) {
    (void)state;
    static const pair cases[] = {
        {0x3F800000, 0x3C00}, /* 1.0 */
        {0xC0000000, 0xC000}, /* -2.0 */
        {0x3F000000, 0x3800}, /* 0.5 */
        {0x3EAAAAAB, 0x3555}, /* 1/3 */
        {0x3DCCCCCD, 0x2E66}, /* 0.1 */
        {0x00000000, 0x0000}, /* +0 */
        {0x80000000, 0x8000}, /* -0 */
        {0x7F800000, 0x7C00}, /* +Inf */
        {0xFF800000, 0xFC00}, /* -Inf */
        {0x477FE000, 0x7BFF}, /* 65504, the largest finite half */
        {0xC77FE000, 0xFBFF}, /* -65504 */
        {0x477FEFFF, 0x7BFF}, /* just below 65520: stays finite */
        {0x477FF000, 0x7C00}, /* 65520: tie with odd 0x7BFF -> Inf */
        {0xC77FF000, 0xFC00}, /* -65520 -> -Inf */
        {0x477FFFFF, 0x7C00},
        {0x47800000, 0x7C00}, /* 65536 */
        {0x49742400, 0x7C00}, /* 1e6 */
        {0x7F7FFFFF, 0x7C00}, /* largest float */
        {0x3F801000, 0x3C00}, /* 1 + 2^-11: tie, even -> down */
        {0x3F803000, 0x3C02}, /* 1 + 3*2^-11: tie, odd -> up */
        {0x3F801001, 0x3C01}, /* just above a tie */
        {0x3F800FFF, 0x3C00}, /* just below a tie */
        {0x3FFFF000, 0x4000}, /* tie with odd 0x3FFF: carry into the exponent */
        {0x38800000, 0x0400}, /* 2^-14, the smallest normal half */
        {0x387FC000, 0x03FF}, /* 1023 * 2^-24, the largest subnormal */
        {0x387FE000, 0x0400}, /* 1023.5 * 2^-24: tie, odd -> up to the smallest normal */
        {0x387FFFFF, 0x0400}, /* just below 2^-14 */
        {0x33800000, 0x0001}, /* 2^-24, the smallest subnormal */
        {0xB3800000, 0x8001}, /* -2^-24 */
        {0x33000000, 0x0000}, /* 2^-25 exactly: tie, even -> 0 */
        {0xB3000000, 0x8000}, /* -2^-25 -> -0 */
        {0x33000001, 0x0001}, /* just above 2^-25 -> 2^-24 */
        {0x32FFFFFF, 0x0000}, /* just below 2^-25 -> 0 */
        {0x33400000, 0x0001}, /* 3 * 2^-26 = 1.5 * 2^-25 -> 2^-24 */
        {0x33C00000, 0x0002}, /* 1.5 * 2^-24: tie, odd -> 2 */
        {0x34200000, 0x0002}, /* 2.5 * 2^-24: tie, even -> 2 */
        {0x34600000, 0x0004}, /* 3.5 * 2^-24: tie, odd -> 4 */
        {0x3A800800, 0x1400}, /* 2^-10 * (1 + 2^-12): below half an ulp, down */
        {0x00000001, 0x0000}, /* float subnormal -> 0 */
        {0x80800000, 0x8000}, /* -smallest normal float -> -0 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ASSERT_BITS16(loom_f32_to_f16(F(cases[i].f32)), cases[i].half, cases[i].f32);
        ASSERT_BITS16(ref_f32_to_f16(F(cases[i].f32)), cases[i].half, cases[i].f32);
    }
    static const struct { uint16_t half; uint32_t f32; } back[] = {
        {0x3C00, 0x3F800000}, {0x0001, 0x33800000}, {0x8001, 0xB3800000},
        {0x03FF, 0x387FC000}, {0x0400, 0x38800000}, {0x7BFF, 0x477FE000},
        {0x7C00, 0x7F800000}, {0xFC00, 0xFF800000}, {0x8000, 0x80000000},
        {0x0000, 0x00000000}, {0x3555, 0x3EAAA000}, {0xC000, 0xC0000000},
        {0x0200, 0x38000000}, /* 2^-15, a subnormal */
    };
    for (size_t i = 0; i < sizeof back / sizeof back[0]; i++) {
        uint32_t got = U(loom_f16_to_f32(back[i].half));
        if (got != back[i].f32) {
            fprintf(stderr, "f16 0x%04x -> 0x%08x, expected 0x%08x\n", back[i].half, got,
                    back[i].f32);
            fail();
        }
    }
}

static void test_f16_nan(void **state) {
    (void)state;
    static const uint32_t nans[] = {
        0x7FC00000, 0xFFC00000,
        0x7F800001, /* signalling, payload below the kept bits: must not become Inf */
        0xFF800001, 0x7F802000, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
    };
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = loom_f32_to_f16(F(nans[i]));
        if (!f16_is_quiet_nan(h) || (h & 0x8000u) != ((nans[i] >> 16) & 0x8000u)) {
            fprintf(stderr, "f16 of NaN 0x%08x is 0x%04x\n", nans[i], h);
            fail();
        }
        assert_true(isnan(loom_f16_to_f32(h)));
        assert_true(isnan(loom_round_to(F(nans[i]), LOOM_F16)));
    }
    assert_true(isnan(loom_f16_to_f32(0x7E00)));
    assert_true(isnan(loom_f16_to_f32(0x7C01))); /* signalling half NaN */
    assert_true(isnan(loom_f16_to_f32(0xFFFF)));
}

/* ----------------------------------------------------------- exhaustive */

/* Every f16 pattern: decoded value matches the definition, and converting it
 * back gives the same bits (NaN stays a NaN of the same sign, quiet). */
static void test_f16_exhaustive_roundtrip(void **state) {
    (void)state;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = loom_f16_to_f32(h);
        double want = ref_f16_value(h);
        if (isnan(want)) {
            assert_true(isnan(f));
            uint16_t back = loom_f32_to_f16(f);
            if (!f16_is_quiet_nan(back) || (back & 0x8000u) != (h & 0x8000u)) {
                fprintf(stderr, "f16 NaN 0x%04x came back as 0x%04x\n", h, back);
                fail();
            }
            continue;
        }
        /* Exact, including the sign of zero. */
        if ((double)f != want || !signbit(f) != !signbit(want)) {
            fprintf(stderr, "f16 0x%04x -> %.9g, expected %.9g\n", h, (double)f, want);
            fail();
        }
        ASSERT_BITS16(loom_f32_to_f16(f), h, i);
        ASSERT_BITS16(ref_f32_to_f16(f), h, i);
    }
}

static void test_bf16_exhaustive_roundtrip(void **state) {
    (void)state;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = loom_bf16_to_f32(h);
        double want = ref_bf16_value(h);
        if (isnan(want)) {
            assert_true(isnan(f));
            uint16_t back = loom_f32_to_bf16(f);
            if (!bf16_is_quiet_nan(back) || (back & 0x8000u) != (h & 0x8000u)) {
                fprintf(stderr, "bf16 NaN 0x%04x came back as 0x%04x\n", h, back);
                fail();
            }
            continue;
        }
        if ((double)f != want || !signbit(f) != !signbit(want)) {
            fprintf(stderr, "bf16 0x%04x -> %.9g, expected %.9g\n", h, (double)f, want);
            fail();
        }
        ASSERT_BITS16(loom_f32_to_bf16(f), h, i);
    }
}

/* f32 -> half against the reference rounding: every combination of the high
 * bits with low bits at and around each rounding boundary (the exact value,
 * just above it, just below the tie, the tie, just above the tie, just below
 * the next value), plus a million random bit patterns. */
static void check_f32_to_half(uint16_t (*conv)(float), uint16_t (*ref)(float),
                              int (*is_quiet_nan)(uint16_t), int drop, const char *name) {
    const uint32_t half = 1u << (drop - 1), mask = (1u << drop) - 1;
    const uint32_t lows[] = {0, 1, half - 1, half, half + 1, mask};
    size_t n_bad = 0;
    for (uint32_t hi = 0; hi < (1u << (32 - drop)); hi++) {
        for (size_t l = 0; l < sizeof lows / sizeof lows[0]; l++) {
            uint32_t u = (hi << drop) | lows[l];
            float f = F(u);
            uint16_t got = conv(f);
            int ok = isnan(f) ? is_quiet_nan(got) && (got & 0x8000u) == ((u >> 16) & 0x8000u)
                              : got == ref(f);
            if (!ok && n_bad++ < 5)
                fprintf(stderr, "%s(0x%08x) = 0x%04x, reference 0x%04x\n", name, u, got, ref(f));
        }
    }
    sm_state = 12345;
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)sm_next();
        float f = F(u);
        uint16_t got = conv(f);
        int ok = isnan(f) ? is_quiet_nan(got) : got == ref(f);
        if (!ok && n_bad++ < 5)
            fprintf(stderr, "%s(0x%08x) = 0x%04x, reference 0x%04x\n", name, u, got, ref(f));
    }
    if (n_bad) {
        fprintf(stderr, "%s: %zu mismatches\n", name, n_bad);
        fail();
    }
}

static uint16_t conv_f16(float f) { return loom_f32_to_f16(f); }
static uint16_t conv_bf16(float f) { return loom_f32_to_bf16(f); }

static void test_f32_to_f16_reference(void **state) {
    (void)state;
    assert_int_equal(fegetround(), FE_TONEAREST);
    check_f32_to_half(conv_f16, ref_f32_to_f16, f16_is_quiet_nan, 13, "f32_to_f16");
}

static void test_f32_to_bf16_reference(void **state) {
    (void)state;
    assert_int_equal(fegetround(), FE_TONEAREST);
    check_f32_to_half(conv_bf16, ref_f32_to_bf16, bf16_is_quiet_nan, 16, "f32_to_bf16");
}

/* ---------------------------------------------------- stochastic rounding */

static void test_bf16_stochastic(void **state) {
    (void)state;
    /* Representable values never move. */
    const uint16_t rnds[] = {0, 1, 0x7fff, 0x8000, 0xffff};
    for (size_t r = 0; r < 5; r++) {
        assert_int_equal(loom_f32_to_bf16_stochastic(1.0f, rnds[r]), 0x3F80);
        assert_int_equal(loom_f32_to_bf16_stochastic(-2.0f, rnds[r]), 0xC000);
        assert_int_equal(loom_f32_to_bf16_stochastic(0.0f, rnds[r]), 0x0000);
        assert_int_equal(loom_f32_to_bf16_stochastic(F(0x7F800000), rnds[r]), 0x7F80);
        assert_int_equal(loom_f32_to_bf16_stochastic(F(0xFF800000), rnds[r]), 0xFF80);
        assert_true(bf16_is_quiet_nan(loom_f32_to_bf16_stochastic(F(0x7FC00000), rnds[r])));
        assert_true(bf16_is_nan(loom_f32_to_bf16_stochastic(F(0x7F800001), rnds[r])));
    }
    /* Rounds up with probability (distance to the lower neighbour) / ulp: the
     * mean over all 65536 random values is the input exactly. */
    const uint32_t inputs[] = {0x3F808000, 0x3F800001, 0x3F80FFFF, 0xBF812345, 0x42C8ABCD,
                               0x00001234, 0x7F7E4000};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) {
        uint32_t u = inputs[i];
        uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
        double sum = 0;
        uint32_t n_up = 0;
        for (uint32_t r = 0; r < 65536; r++) {
            uint16_t h = loom_f32_to_bf16_stochastic(F(u), (uint16_t)r);
            assert_true(h == lo || h == hi); /* one of the two neighbours */
            n_up += h == hi;
            sum += loom_bf16_to_f32(h);
        }
        assert_int_equal(n_up, u & 0xffffu);
        assert_true(sum / 65536.0 == (double)F(u));
    }
}

/* ------------------------------------------------ load / store / round_to */

static void test_load_store(void **state) {
    (void)state;
    uint16_t h[3];
    float f[3];
    loom_store(h, 1, LOOM_BF16, 1.0f);
    assert_int_equal(h[1], 0x3F80);
    loom_store(h, 2, LOOM_F16, 1.0f);
    assert_int_equal(h[2], 0x3C00);
    loom_store(f, 2, LOOM_F32, 0.1f);
    assert_true(f[2] == 0.1f);
    h[0] = 0xC000;
    assert_true(loom_load(h, 0, LOOM_F16) == -2.0f);
    assert_true(loom_load(h, 0, LOOM_BF16) == -2.0f);
    assert_true(loom_load(f, 2, LOOM_F32) == 0.1f);
    assert_true(loom_round_to(0.1f, LOOM_F32) == 0.1f);
    assert_true(loom_round_to(0.1f, LOOM_F16) == (float)ref_f16_value(0x2E66));
    assert_true(loom_round_to(0.1f, LOOM_BF16) == (float)ref_bf16_value(0x3DCD));
    assert_true(loom_round_to(70000.0f, LOOM_F16) == INFINITY);
    assert_true(loom_round_to(70000.0f, LOOM_BF16) == 70144.0f); /* 137 * 2^9 */
}

/* ------------------------------------------------------------ loom_convert */

/* Decode element i of a buffer by the definitions (not loom_load). */
static double ref_load(const void *p, size_t i, loom_dtype dt) {
    switch (dt) {
    case LOOM_F16: return ref_f16_value(((const uint16_t *)p)[i]);
    case LOOM_BF16: return ref_bf16_value(((const uint16_t *)p)[i]);
    default: return (double)((const float *)p)[i];
    }
}

/* Every element of dst is the reference rounding of the src element's value
 * (an exact float in every case), NaN for NaN. */
static void check_convert(const void *src, loom_dtype sdt, const void *dst, loom_dtype ddt,
                          size_t n) {
    for (size_t i = 0; i < n; i++) {
        double v = ref_load(src, i, sdt);
        float fv = (float)v; /* exact: every half value is a float */
        assert_true(isnan(v) || (double)fv == v);
        if (ddt == sdt) {
            size_t sz = loom_dtype_size(ddt);
            assert_memory_equal((const char *)dst + i * sz, (const char *)src + i * sz, sz);
            continue;
        }
        if (isnan(v)) {
            assert_true(isnan(ref_load(dst, i, ddt)));
            continue;
        }
        int ok;
        if (ddt == LOOM_F32)
            ok = U(((const float *)dst)[i]) == U(fv);
        else if (ddt == LOOM_F16)
            ok = ((const uint16_t *)dst)[i] == ref_f32_to_f16(fv);
        else
            ok = ((const uint16_t *)dst)[i] == ref_f32_to_bf16(fv);
        if (!ok) {
            fprintf(stderr, "convert %s -> %s, element %zu (%.9g) wrong\n", loom_dtype_name(sdt),
                    loom_dtype_name(ddt), i, v);
            fail();
        }
    }
}

static void test_convert_all_pairs(void **state) {
    (void)state;
    const loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    /* Long enough for the parallel path (n > 65536); odd length. */
    const size_t n = 70001;
    sm_state = 777;
    for (size_t s = 0; s < 3; s++) {
        loom_dtype sdt = dts[s];
        size_t ssz = loom_dtype_size(sdt);
        unsigned char *src = malloc(n * ssz);
        /* Random bit patterns, then a band of ordinary values, and specials. */
        for (size_t i = 0; i < n; i++) {
            uint64_t r = sm_next();
            if (i % 3 == 0) {
                float v = (float)((double)(int64_t)r / 9.2e18 * 100.0);
                if (ssz == 4) memcpy(src + 4 * i, &v, 4);
                else ((uint16_t *)src)[i] = sdt == LOOM_F16 ? ref_f32_to_f16(v) : ref_f32_to_bf16(v);
            } else if (ssz == 4) {
                uint32_t u = (uint32_t)r;
                memcpy(src + 4 * i, &u, 4);
            } else {
                ((uint16_t *)src)[i] = (uint16_t)r;
            }
        }
        for (size_t t = 0; t < 3; t++) {
            loom_dtype ddt = dts[t];
            size_t dsz = loom_dtype_size(ddt);
            unsigned char *dst = malloc(n * dsz + 8);
            memset(dst, 0xAB, n * dsz + 8);
            loom_convert(dst, ddt, src, sdt, n);
            check_convert(src, sdt, dst, ddt, n);
            for (size_t k = 0; k < 8; k++) assert_int_equal(dst[n * dsz + k], 0xAB); /* no overrun */
            /* A short (serial) conversion agrees element for element. */
            unsigned char *dst2 = malloc(16 * dsz);
            loom_convert(dst2, ddt, src + 100 * ssz, sdt, 16);
            assert_memory_equal(dst2, dst + 100 * dsz, 16 * dsz);
            /* n = 0 touches nothing. */
            memset(dst2, 0xCD, 16 * dsz);
            loom_convert(dst2, ddt, src, sdt, 0);
            for (size_t k = 0; k < 16 * dsz; k++) assert_int_equal(dst2[k], 0xCD);
            free(dst2);
            free(dst);
        }
        /* Same dtype in place is a no-op. */
        unsigned char *copy = malloc(n * ssz);
        memcpy(copy, src, n * ssz);
        loom_convert(src, sdt, src, sdt, n);
        assert_memory_equal(src, copy, n * ssz);
        free(copy);
        free(src);
    }
}

/* ------------------------------------------------------ names and parsing */

static void test_dtype_names_sizes(void **state) {
    (void)state;
    assert_string_equal(loom_dtype_name(LOOM_F32), "fp32");
    assert_string_equal(loom_dtype_name(LOOM_BF16), "bf16");
    assert_string_equal(loom_dtype_name(LOOM_F16), "fp16");
    assert_string_equal(loom_dtype_name((loom_dtype)7), "?");
    assert_int_equal(loom_dtype_size(LOOM_F32), 4);
    assert_int_equal(loom_dtype_size(LOOM_BF16), 2);
    assert_int_equal(loom_dtype_size(LOOM_F16), 2);
    const loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int i = 0; i < 3; i++) {
        loom_dtype d = (loom_dtype)-1;
        assert_int_equal(loom_dtype_parse(loom_dtype_name(dts[i]), &d), LOOM_OK);
        assert_int_equal(d, dts[i]);
    }
}

static void test_dtype_parse(void **state) {
    (void)state;
    static const struct { const char *s; loom_dtype dt; } good[] = {
        {"fp32", LOOM_F32}, {"f32", LOOM_F32}, {"float32", LOOM_F32}, {"FP32", LOOM_F32},
        {"bf16", LOOM_BF16}, {"BF16", LOOM_BF16}, {"bfloat16", LOOM_BF16}, {"Bf16", LOOM_BF16},
        {"fp16", LOOM_F16}, {"f16", LOOM_F16}, {"float16", LOOM_F16}, {"FP16", LOOM_F16},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        loom_dtype d = (loom_dtype)-1;
        assert_int_equal(loom_dtype_parse(good[i].s, &d), LOOM_OK);
        assert_int_equal(d, good[i].dt);
    }
    static const char *bad[] = {"", "fp8", "f64", "int8", "bf", "bf16 ", " fp32", "fp3",
                                "fp322", "float", "bfloat", "fp16x", "b16", "32"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        loom_dtype d = LOOM_BF16;
        loom_clear_error();
        assert_int_equal(loom_dtype_parse(bad[i], &d), LOOM_ERR_INVALID);
        assert_int_equal(d, LOOM_BF16); /* untouched on failure */
        const char *msg = loom_last_error();
        assert_non_null(strstr(msg, "fp32"));
        assert_non_null(strstr(msg, "bf16"));
        char quoted[32];
        snprintf(quoted, sizeof quoted, "'%s'", bad[i]);
        assert_non_null(strstr(msg, quoted));
    }
    /* NULL arguments are bad input, not a crash. */
    loom_dtype d = LOOM_F16;
    loom_clear_error();
    assert_int_equal(loom_dtype_parse(NULL, &d), LOOM_ERR_INVALID);
    assert_int_equal(d, LOOM_F16);
    assert_true(strlen(loom_last_error()) > 0);
    loom_clear_error();
    assert_int_equal(loom_dtype_parse("bf16", NULL), LOOM_ERR_INVALID);
    assert_true(strlen(loom_last_error()) > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_known),
        cmocka_unit_test(test_bf16_nan),
        cmocka_unit_test(test_f16_known),
        cmocka_unit_test(test_f16_nan),
        cmocka_unit_test(test_f16_exhaustive_roundtrip),
        cmocka_unit_test(test_bf16_exhaustive_roundtrip),
        cmocka_unit_test(test_f32_to_f16_reference),
        cmocka_unit_test(test_f32_to_bf16_reference),
        cmocka_unit_test(test_bf16_stochastic),
        cmocka_unit_test(test_load_store),
        cmocka_unit_test(test_convert_all_pairs),
        cmocka_unit_test(test_dtype_names_sizes),
        cmocka_unit_test(test_dtype_parse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
