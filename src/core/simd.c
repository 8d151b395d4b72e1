/*
 * simd.c — which instruction-set paths the kernels take, and the bulk
 * dtype conversions (16 at a time with AVX-512F, 8 with AVX2/F16C, else
 * element by element).
 *
 * Owns: the process-wide AVX2 and AVX-512 switches (detected once;
 * loom_set_simd(0) forces the portable paths, loom_set_simd_level caps
 * them at a level, e.g. to test the AVX2 paths on an AVX-512 machine).
 * Must never: give a conversion result that differs from the scalar
 * loom_f32_to_bf16 / loom_f32_to_f16 / loom_*_to_f32 in any bit.
 */
#include "core/simd.h"

#if LOOM_HAVE_X86_SIMD
#include <cpuid.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int simd_avx2_state_ = -1;
int simd_avx512_state_;
int simd_avx512bf16_state_;

/* F16C from CPUID leaf 1 (clang's __builtin_cpu_supports has no "f16c");
 * the OS's saving of the AVX registers it needs is part of the avx2 check. */
static int cpu_has_f16c(void) {
#if LOOM_HAVE_X86_SIMD
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
#else
    return 0;
#endif
}

static int cpu_has_avx2(void) {
#if LOOM_HAVE_X86_SIMD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
#else
    return 0;
#endif
}

/* AVX-512F with the OS saving its registers (libgcc checks XCR0). */
static int cpu_has_avx512(void) {
#if LOOM_HAVE_X86_SIMD && LOOM_HAVE_AVX512
    return __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

static int cpu_has_avx512bf16(void) {
#if LOOM_HAVE_X86_SIMD && LOOM_HAVE_AVX512
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* The levels, narrowest first; loom_simd_name gives these names. */
enum { LEVEL_PORTABLE, LEVEL_AVX2, LEVEL_AVX512F, LEVEL_AVX512BF16, N_LEVELS };
static const char *const level_names[N_LEVELS] = {"portable", "avx2", "avx512f", "avx512-bf16"};

/* Every path the CPU has, up to cap. */
static void set_cap(int cap) {
    int avx2 = cap >= LEVEL_AVX2 && cpu_has_avx2();
    /* AVX-512 first: whoever sees the AVX2 state set sees this one too. */
    __atomic_store_n(&simd_avx512_state_, avx2 && cap >= LEVEL_AVX512F && cpu_has_avx512(), __ATOMIC_RELAXED);
    __atomic_store_n(&simd_avx512bf16_state_, avx2 && cap >= LEVEL_AVX512BF16 && cpu_has_avx512bf16(),
                     __ATOMIC_RELAXED);
    __atomic_store_n(&simd_avx2_state_, avx2, __ATOMIC_RELAXED);
}

void loom_set_simd(int on) { set_cap(on ? LEVEL_AVX512BF16 : LEVEL_PORTABLE); }

/* The level a name caps at ("native": the widest), or -1. */
static int level_of(const char *name) {
    if (name && !strcmp(name, "native")) return LEVEL_AVX512BF16;
    for (int i = 0; name && i < N_LEVELS; i++)
        if (!strcmp(name, level_names[i])) return i;
    return -1;
}

loom_status loom_set_simd_level(const char *level) {
    int cap = level_of(level);
    if (cap < 0)
        return loom_error(LOOM_ERR_INVALID, "unknown SIMD level '%s' (use portable, avx2, avx512f, avx512-bf16 or "
                          "native)", level ? level : "(null)");
    set_cap(cap);
    return LOOM_OK;
}

/* The first detection: LOOM_SIMD's cap, if it names one. A name it does
 * not know is said once on stderr (a kernel has no error to return; the
 * loom command refuses it before any kernel runs). */
void simd_detect(void) {
    const char *env = getenv("LOOM_SIMD");
    int cap = env && *env ? level_of(env) : LEVEL_AVX512BF16;
    if (cap < 0) {
        static int warned; /* two threads detecting at once warn once */
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
            fprintf(stderr, "loom: LOOM_SIMD=%s names no level (portable, avx2, avx512f, avx512-bf16, native); "
                            "using native\n", env);
        cap = LEVEL_AVX512BF16;
    }
    set_cap(cap);
}

int loom_simd_enabled(void) { return simd_avx2(); }

const char *loom_simd_name(void) {
    return level_names[simd_avx512bf16()  ? LEVEL_AVX512BF16
                       : simd_avx512()    ? LEVEL_AVX512F
                       : simd_avx2()      ? LEVEL_AVX2
                                          : LEVEL_PORTABLE];
}

#if LOOM_HAVE_X86_SIMD
SIMD_AVX2 static size_t to_f32_avx2(float *dst, const void *src, loom_dtype dt, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, simd_load8(src, i, dt));
    return i;
}

SIMD_AVX2 static size_t from_f32_avx2(void *dst, loom_dtype dt, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) simd_store8(dst, i, dt, _mm256_loadu_ps(src + i));
    return i;
}
#endif

#if LOOM_HAVE_SIMD512
/* Sixteen at a time, then one AVX2 vector when eight or more are left. */
SIMD_AVX512 static size_t to_f32_avx512(float *dst, const void *src, loom_dtype dt, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, simd_load16(src, i, dt));
    if (i + 8 <= n) {
        _mm256_storeu_ps(dst + i, simd_load8(src, i, dt));
        i += 8;
    }
    return i;
}

SIMD_AVX512 static size_t from_f32_avx512(void *dst, loom_dtype dt, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) simd_store16(dst, i, dt, _mm512_loadu_ps(src + i));
    if (i + 8 <= n) {
        simd_store8(dst, i, dt, _mm256_loadu_ps(src + i));
        i += 8;
    }
    return i;
}
#endif

void convert_to_f32(float *dst, const void *src, loom_dtype dt, size_t n) {
    if (dt == LOOM_F32) {
        if ((const void *)dst != src) memmove(dst, src, n * sizeof(float));
        return;
    }
    size_t i = 0;
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) i = to_f32_avx512(dst, src, dt, n);
    else
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) i = to_f32_avx2(dst, src, dt, n);
#endif
    const uint16_t *s = src;
    if (dt == LOOM_BF16)
        for (; i < n; i++) dst[i] = loom_bf16_to_f32(s[i]);
    else
        for (; i < n; i++) dst[i] = loom_f16_to_f32(s[i]);
}

void convert_from_f32(void *dst, loom_dtype dt, const float *src, size_t n) {
    if (dt == LOOM_F32) {
        if (dst != (const void *)src) memmove(dst, src, n * sizeof(float));
        return;
    }
    size_t i = 0;
#if LOOM_HAVE_SIMD512
    if (simd_avx512()) i = from_f32_avx512(dst, dt, src, n);
    else
#endif
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) i = from_f32_avx2(dst, dt, src, n);
#endif
    uint16_t *d = dst;
    if (dt == LOOM_BF16)
        for (; i < n; i++) d[i] = loom_f32_to_bf16(src[i]);
    else
        for (; i < n; i++) d[i] = loom_f32_to_f16(src[i]);
}
