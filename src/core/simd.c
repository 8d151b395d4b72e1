/*
 * simd.c — which instruction-set paths the kernels take, and the bulk
 * dtype conversions (8 at a time with AVX2/F16C, else element by element).
 *
 * Owns: the process-wide AVX2 and AVX-512 switches (detected once;
 * loom_set_simd(0) forces the portable paths, e.g. to test them on an AVX2
 * machine).
 * Must never: give a conversion result that differs from the scalar
 * loom_f32_to_bf16 / loom_f32_to_f16 / loom_*_to_f32 in any bit.
 */
#include "core/simd.h"

int simd_avx2_state_ = -1;
int simd_avx512_state_;
int simd_avx512bf16_state_;

static int cpu_has_avx2(void) {
#if LOOM_HAVE_X86_SIMD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
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

void loom_set_simd(int on) {
    int avx2 = on && cpu_has_avx2();
    /* AVX-512 first: whoever sees the AVX2 state set sees this one too. */
    __atomic_store_n(&simd_avx512_state_, avx2 && cpu_has_avx512(), __ATOMIC_RELAXED);
    __atomic_store_n(&simd_avx512bf16_state_, avx2 && cpu_has_avx512bf16(), __ATOMIC_RELAXED);
    __atomic_store_n(&simd_avx2_state_, avx2, __ATOMIC_RELAXED);
}

int loom_simd_enabled(void) { return simd_avx2(); }

const char *loom_simd_name(void) {
    return simd_avx512bf16() ? "avx512-bf16" : simd_avx512() ? "avx512f" : simd_avx2() ? "avx2" : "portable";
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

void convert_to_f32(float *dst, const void *src, loom_dtype dt, size_t n) {
    if (dt == LOOM_F32) {
        if ((const void *)dst != src) memmove(dst, src, n * sizeof(float));
        return;
    }
    size_t i = 0;
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
#if LOOM_HAVE_X86_SIMD
    if (simd_avx2()) i = from_f32_avx2(dst, dt, src, n);
#endif
    uint16_t *d = dst;
    if (dt == LOOM_BF16)
        for (; i < n; i++) d[i] = loom_f32_to_bf16(src[i]);
    else
        for (; i < n; i++) d[i] = loom_f32_to_f16(src[i]);
}
