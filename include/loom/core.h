/*
 * loom/core.h — status codes, the last-error message, dtypes and their
 * conversions, the accounting allocator, the counter-based RNG, threads.
 *
 * Everything here is plain C with no autograd. Conversions are inline so that
 * kernels can use them in inner loops.
 *
 * Errors: every public function that can fail returns a loom_status; on
 * failure loom_last_error() holds a message (thread-local) that names what was
 * wrong and what to do. Nothing here aborts on bad input.
 */
#ifndef LOOM_CORE_H
#define LOOM_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status */

typedef enum loom_status {
    LOOM_OK = 0,
    LOOM_ERR_INVALID = 1,  /* a bad argument: shape, dtype, flag, value */
    LOOM_ERR_NOMEM = 2,    /* allocation failed */
    LOOM_ERR_IO = 3,       /* a file could not be read or written */
    LOOM_ERR_FORMAT = 4,   /* a file's contents are corrupt or unexpected */
    LOOM_ERR_STATE = 5,    /* API misuse: freed graph, wrong call order */
    LOOM_ERR_NUMERIC = 6,  /* NaN/Inf where a finite value was required */
    LOOM_ERR_UNSUPPORTED = 7,
    LOOM_ERR_DIST = 8      /* a communication error between ranks */
} loom_status;

/* The message of the most recent failure on this thread ("" if none). The
 * string is owned by loom and valid until the next failing call. */
const char *loom_last_error(void);
/* Set the thread's error message; returns `st` so callers can
 * `return loom_error(LOOM_ERR_INVALID, "...", ...)`. */
loom_status loom_error(loom_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void loom_clear_error(void);
const char *loom_status_name(loom_status st);

/* Evaluate `expr` (a loom_status); return it from the caller on failure. */
#define LOOM_TRY(expr)                      \
    do {                                    \
        loom_status loom_try_st_ = (expr);  \
        if (loom_try_st_ != LOOM_OK)        \
            return loom_try_st_;            \
    } while (0)

/* Internal invariant check: a broken invariant is a bug in loom, never the
 * caller's input, so it aborts with file and line. */
void loom_panic(const char *file, int line, const char *msg) __attribute__((noreturn));
#define LOOM_ASSERT(cond) \
    do { if (!(cond)) loom_panic(__FILE__, __LINE__, #cond); } while (0)

/* ---------------------------------------------------------------- dtypes */

typedef enum loom_dtype {
    LOOM_F32 = 0,
    LOOM_BF16 = 1,
    LOOM_F16 = 2
} loom_dtype;

static inline size_t loom_dtype_size(loom_dtype dt) { return dt == LOOM_F32 ? 4 : 2; }
/* dt is one of the dtypes above (a value from outside, checked before use). */
static inline int loom_dtype_valid(loom_dtype dt) { return dt == LOOM_F32 || dt == LOOM_BF16 || dt == LOOM_F16; }
const char *loom_dtype_name(loom_dtype dt);
/* Parses "fp32"/"f32", "bf16", "fp16"/"f16". */
loom_status loom_dtype_parse(const char *s, loom_dtype *out);

static inline uint32_t loom_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float loom_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t loom_f32_to_bf16(float f) {
    uint32_t u = loom_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float loom_bf16_to_f32(uint16_t h) { return loom_bits_f32((uint32_t)h << 16); }

/* float -> IEEE binary16, round to nearest even, with subnormals, overflow to
 * Inf, NaN kept (quiet). */
static inline uint16_t loom_f32_to_f16(float f) {
    uint32_t u = loom_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: Inf */
    if (a < 0x38800000u) {                                    /* result is subnormal or 0 */
        if (a < 0x33000000u) return (uint16_t)sign;           /* < 2^-25: rounds to 0 */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - 0x38000000u; /* rebias exponent 127 -> 15 */
    uint32_t h = r >> 13;
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}
static inline float loom_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    /* Inf, or a NaN that comes out quiet (as F16C's vcvtph2ps gives it) */
    if (e == 0x1f) return loom_bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
    if (e == 0) {
        if (m == 0) return loom_bits_f32(sign);
        float f = (float)m * (1.0f / 16777216.0f); /* m * 2^-24 */
        return sign ? -f : f;
    }
    return loom_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* Load element i of a buffer of dtype dt as float / store a float into it. */
static inline float loom_load(const void *p, size_t i, loom_dtype dt) {
    switch (dt) {
    case LOOM_BF16: return loom_bf16_to_f32(((const uint16_t *)p)[i]);
    case LOOM_F16: return loom_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}
static inline void loom_store(void *p, size_t i, loom_dtype dt, float v) {
    switch (dt) {
    case LOOM_BF16: ((uint16_t *)p)[i] = loom_f32_to_bf16(v); break;
    case LOOM_F16: ((uint16_t *)p)[i] = loom_f32_to_f16(v); break;
    default: ((float *)p)[i] = v; break;
    }
}
/* The shortest decimal that reads back as x (0.22 rather than the float's
 * 0.219999999), as a double: the number a config file said, as Python
 * holds it. */
double loom_float_decimal(float x);
/* Round a float through dtype dt and back (the value a store/load would give). */
static inline float loom_round_to(float v, loom_dtype dt) {
    switch (dt) {
    case LOOM_BF16: return loom_bf16_to_f32(loom_f32_to_bf16(v));
    case LOOM_F16: return loom_f16_to_f32(loom_f32_to_f16(v));
    default: return v;
    }
}
/* Convert n elements between dtypes (src and dst must not overlap unless equal). */
void loom_convert(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt, size_t n);
/* float -> bf16 with stochastic rounding driven by a 16-bit random value. */
static inline uint16_t loom_f32_to_bf16_stochastic(float f, uint16_t rnd) {
    uint32_t u = loom_f32_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return loom_f32_to_bf16(f);
    u += rnd;
    return (uint16_t)(u >> 16);
}

/* ------------------------------------------------------------- allocator */

/* Every byte loom allocates belongs to a category; the allocator keeps the
 * current and the peak bytes of each. Freed blocks are cached by size class
 * and reused, so a steady-state training step does not call malloc. */
typedef enum loom_mem_category {
    LOOM_MEM_PARAMS = 0,     /* compute copies of parameters, fp32 masters */
    LOOM_MEM_GRADS = 1,      /* main_grad / gradients of parameters */
    LOOM_MEM_OPTIMIZER = 2,  /* optimizer state */
    LOOM_MEM_ACTIVATIONS = 3,/* tensors produced in forward and backward */
    LOOM_MEM_WORKSPACE = 4,  /* scratch inside kernels */
    LOOM_MEM_N_CATEGORIES = 5
} loom_mem_category;

typedef struct loom_mem_stats {
    size_t current[LOOM_MEM_N_CATEGORIES]; /* bytes in use, by category */
    size_t peak[LOOM_MEM_N_CATEGORIES];    /* highest `current` since the last reset */
    size_t current_total, peak_total;
    size_t cached;      /* bytes held in the free-block cache */
    uint64_t n_malloc;  /* calls that reached the system allocator */
    uint64_t n_alloc;   /* all allocations served */
} loom_mem_stats;

/* Allocate `bytes` (64-byte aligned) for `cat`. Returns NULL (and sets the
 * error) when out of memory. Free with loom_free. Thread-safe. */
void *loom_alloc(size_t bytes, loom_mem_category cat);
/* Like loom_alloc, zero-filled. */
void *loom_alloc_zeroed(size_t bytes, loom_mem_category cat);
void loom_free(void *p);
void loom_mem_get_stats(loom_mem_stats *out);
/* Restart peak tracking from the current figures. */
void loom_mem_reset_peak(void);
/* Return cached free blocks to the system. */
void loom_mem_trim(void);
const char *loom_mem_category_name(loom_mem_category cat);

/* ------------------------------------------------------------------- RNG */

/* Philox4x32-10: a counter-based generator. A stream is addressed by
 * (seed, offset); the same pair always gives the same numbers, so any random
 * stream (dropout in a recomputed block, say) can be replayed exactly. */
void loom_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]);
/* n consecutive blocks: out[4 i + lane] = lane of loom_philox4x32(seed,
 * first + i), i < n (the same words, several blocks at a time where the CPU
 * has AVX-512F or AVX2). */
void loom_philox4x32_blocks(uint64_t seed, uint64_t first, size_t n, uint32_t *out);

typedef struct loom_rng {
    uint64_t seed;
    uint64_t offset; /* number of 4x32 blocks consumed so far */
} loom_rng;

void loom_rng_init(loom_rng *rng, uint64_t seed);
/* Reserve `n_blocks` counter blocks and return the first one's offset. A
 * consumer then draws from loom_philox4x32(seed, offset + i), i < n_blocks. */
uint64_t loom_rng_reserve(loom_rng *rng, uint64_t n_blocks);
/* Uniform float in [0, 1) from 32 random bits. */
static inline float loom_u32_to_unit(uint32_t x) { return (float)(x >> 8) * (1.0f / 16777216.0f); }
/* Fill `n` floats: uniform [0,1) or normal(mean, std), from (seed, offset). */
void loom_rng_uniform(float *out, size_t n, uint64_t seed, uint64_t offset);
void loom_rng_normal(float *out, size_t n, float mean, float std, uint64_t seed, uint64_t offset);
/* The process-wide default generator (thread-local; used by dropout). */
loom_rng *loom_rng_default(void);

/* ------------------------------------------------------------------ SIMD */

/* Kernels pick AVX-512F or AVX2/FMA/F16C code at run time when the CPU has
 * it (and AVX-512 BF16 dot products for the attention's bf16 products),
 * else portable C. loom_set_simd(0) forces the portable paths (to compare
 * them, or to rule them out when chasing a numerical difference);
 * loom_set_simd(1) restores detection. loom_set_simd_level caps the paths
 * at a level, by the names loom_simd_name gives: "portable", "avx2",
 * "avx512f" (no bf16 dot products), "avx512-bf16", or "native" (all the CPU
 * has); an unknown name is LOOM_ERR_INVALID and changes nothing. The
 * environment variable LOOM_SIMD, read when the first kernel runs, sets the
 * starting cap the same way (a name it does not know is said on stderr and
 * ignored); loom_set_simd and loom_set_simd_level override it. Not meant
 * to change while kernels run. Each path is deterministic; they may differ
 * in the last bits of sums and exps, never in conversions (and the AVX-512F
 * and AVX2 paths of an element-wise kernel agree in every bit). */
void loom_set_simd(int on);
loom_status loom_set_simd_level(const char *level);
int loom_simd_enabled(void);   /* 1 when the AVX2 paths are in use */
/* The widest kernel paths in use: "avx512-bf16" (also the attention's bf16
 * dot products), "avx512f", "avx2" or "portable" (a static string). */
const char *loom_simd_name(void);

/* --------------------------------------------------------------- threads */

/* Number of OpenMP threads loom's kernels use (defaults to the number of
 * cores, or OMP_NUM_THREADS). n <= 0 restores the default. Counts above
 * LOOM_MAX_THREADS (from either) are clamped to it: the OpenMP runtime
 * crashes when it cannot create a team that large. */
#define LOOM_MAX_THREADS 1024
void loom_set_threads(int n);
int loom_get_threads(void);

/* ------------------------------------------------------ RoPE frequencies */

/* The rotary embedding's frequencies, shared by the rope kernel, loom_rope_ex
 * and the model config: inv_freq[i] = theta^(-2i/HS) for i < HS/2 (HS the
 * rotary part of a head: rotary_dim, else the head), then
 * scaled as Hugging Face's rope_scaling says:
 *  - LOOM_ROPE_LINEAR: each divided by factor;
 *  - LOOM_ROPE_LLAMA3 (Llama 3.1 and later): with wavelength w = 2 pi / f,
 *    f / factor where w > original_max_pos / low_freq_factor, f where
 *    w < original_max_pos / high_freq_factor, and between them
 *    (1 - s) f / factor + s f, s = (original_max_pos / w - low_freq_factor) /
 *    (high_freq_factor - low_freq_factor);
 *  - LOOM_ROPE_LONGROPE (Phi-3's, for positions up to its original
 *    context): 1 / (ext[i] theta^(2i/HS)), ext its short_factor, and the
 *    cosines and sines times attention_factor;
 *  - LOOM_ROPE_YARN (YaRN: Qwen's long contexts, DeepSeek's): with p_i =
 *    theta^(2i/HS), the correction range [low, high] of dimensions
 *    HS log(original_max_pos / (2 pi beta)) / (2 log theta) for beta =
 *    beta_fast and beta_slow (floored and ceiled when truncate, clamped to
 *    [0, HS - 1]) and ramp r_i = clamp((i - low) / (high - low), 0, 1),
 *    e = 1 - r: (1 / (factor p_i)) (1 - e) + (1 / p_i) e, and the cosines
 *    and sines times attention_factor;
 *  - LOOM_ROPE_DYNAMIC (dynamic NTK scaling, factor): the default
 *    frequencies, which Hugging Face's dynamic scaling keeps up to
 *    max_position_embeddings and changes only past it (a model config
 *    with it stops its context there). */
typedef enum loom_rope_type {
    LOOM_ROPE_DEFAULT = 0, LOOM_ROPE_LINEAR = 1, LOOM_ROPE_LLAMA3 = 2, LOOM_ROPE_LONGROPE = 3, LOOM_ROPE_YARN = 4,
    LOOM_ROPE_DYNAMIC = 5
} loom_rope_type;
#define LOOM_ROPE_EXT_MAX 256 /* LONGROPE: frequencies a head may have (a rotary part of 512) */
typedef struct loom_rope_freqs {
    float theta;
    loom_rope_type type;
    float factor, low_freq_factor, high_freq_factor; /* factor: LINEAR, LLAMA3, YARN, DYNAMIC; the others: LLAMA3 */
    int original_max_pos;                           /* LLAMA3 and YARN */
    float attention_factor;                         /* LONGROPE and YARN: cos and sin times it */
    int n_ext;                                      /* LONGROPE: rotary size / 2 factors in ext */
    float ext[LOOM_ROPE_EXT_MAX];
    float beta_fast, beta_slow;                     /* YARN: the correction range's rotations (32 and 1) */
    int truncate;                                   /* YARN: the range floored and ceiled (Hugging Face's default) */
    int rotary_dim; /* > 0: only the first rotary_dim of each head rotate (Phi-4-mini's partial_rotary_factor:
                       its halves pair, its frequencies theta^(-2i/rotary_dim)), the rest pass through; 0: all */
} loom_rope_freqs;

#ifdef __cplusplus
}
#endif
#endif
