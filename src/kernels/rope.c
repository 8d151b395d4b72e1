/*
 * rope.c — rotary position embedding, Hugging Face LLaMA convention.
 *
 * Owns: the rotation of each head vector x = [x1, x2] (halves of HS, or of
 * its first rotary_dim elements, the rest passing through) by
 * angle(t, i) = (pos0 + t) * inv_freq[i], and its transpose for backward
 * (longrope's cosines and sines are scaled: its transpose is scaled the
 * same). Angles follow Hugging Face exactly: inv_freq = 1 / theta^(2i/HS),
 * scaled as its rope_scaling says (linear, llama3, longrope, yarn: rope_inv_freq), and
 * position * inv_freq are fp32, cos/sin of that fp32 angle are taken in double
 * and rounded to fp32 (torch's fp32 cos/sin agree to an ulp). Unlike Hugging
 * Face in bf16, cos/sin are not rounded to the activation dtype and the
 * rotation is fp32 with one rounding at the store.
 * Must never: read an element after writing its pair partner (out may be x).
 */
#include "kernels/kernels.h"
#include "kernels/kernel_rows.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* YaRN's dimension that turns num_rotations times over the original
 * context (Hugging Face's find_correction_dim, in double as Python). */
static double yarn_dim(double num_rotations, int HS, double theta, int original) {
    return (HS * log(original / (num_rotations * 2.0 * 3.141592653589793))) / (2.0 * log(theta));
}

/* YaRN's blend of the interpolated and extrapolated frequency of pair i,
 * its ramp over the correction range [low, high] (find_correction_range,
 * linear_ramp_factor): the fp32 operations Hugging Face's tensors take. */
static float yarn_freq(const loom_rope_freqs *r, int HS, int i) {
    double low = yarn_dim(r->beta_fast, HS, r->theta, r->original_max_pos);
    double high = yarn_dim(r->beta_slow, HS, r->theta, r->original_max_pos);
    if (r->truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0.0 ? low : 0.0;
    high = high < HS - 1 ? high : HS - 1;
    if (low == high) high += 0.001; /* as Hugging Face keeps the ramp finite */
    float ramp = ((float)i - (float)low) / (float)(high - low);
    ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
    float p = powf(r->theta, (float)(2 * i) / (float)HS), e = 1.0f - ramp;
    float extrapolated = 1.0f / p, interpolated = 1.0f / (r->factor * p);
    return interpolated * (1.0f - e) + extrapolated * e;
}

/* Hugging Face's order of fp32 operations (modeling_rope_utils.py). */
void rope_inv_freq(const loom_rope_freqs *r, int HS, float *inv_freq) {
    const float two_pi = (float)6.283185307179586; /* Python's 2 * math.pi, as a float32 tensor takes it */
    for (int i = 0; i < HS / 2; i++) {
        float f = 1.0f / powf(r->theta, (float)(2 * i) / (float)HS);
        if (r->type == LOOM_ROPE_LONGROPE) { /* 1 / (ext * theta^x), as Hugging Face's longrope */
            f = 1.0f / (r->ext[i] * powf(r->theta, (float)(2 * i) / (float)HS));
        } else if (r->type == LOOM_ROPE_YARN) {
            f = yarn_freq(r, HS, i);
        } else if (r->type == LOOM_ROPE_LINEAR) {
            f = f / r->factor;
        } else if (r->type == LOOM_ROPE_LLAMA3) {
            float old = (float)r->original_max_pos, wavelen = two_pi / f;
            float low_wavelen = old / r->low_freq_factor, high_wavelen = old / r->high_freq_factor;
            float scaled = wavelen > low_wavelen ? f / r->factor : f;
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) { /* between: blended */
                float s = (old / wavelen - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
                scaled = (1.0f - s) * scaled / r->factor + s * scaled;
            }
            f = scaled;
        }
        inv_freq[i] = f;
    }
}

int rope_rotary_dim(const loom_rope_freqs *r, int HS) { return r->rotary_dim > 0 ? r->rotary_dim : HS; }

/* The same frequencies: the fields each type uses. */
static int rope_same(const loom_rope_freqs *a, const loom_rope_freqs *b) {
    if (a->theta != b->theta || a->type != b->type || a->rotary_dim != b->rotary_dim) return 0;
    if (a->type == LOOM_ROPE_DEFAULT) return 1;
    if (a->type == LOOM_ROPE_LONGROPE)
        return a->attention_factor == b->attention_factor && a->n_ext == b->n_ext &&
               !memcmp(a->ext, b->ext, sizeof(float) * (size_t)a->n_ext);
    if (a->factor != b->factor) return 0;
    if (a->type == LOOM_ROPE_YARN)
        return a->original_max_pos == b->original_max_pos && a->attention_factor == b->attention_factor &&
               a->beta_fast == b->beta_fast && a->beta_slow == b->beta_slow && !a->truncate == !b->truncate;
    return a->type == LOOM_ROPE_LINEAR ||
           (a->low_freq_factor == b->low_freq_factor && a->high_freq_factor == b->high_freq_factor &&
            a->original_max_pos == b->original_max_pos);
}

/* What longrope and YaRN multiply the cosines and sines by (1 otherwise). */
static float rope_amplitude(const loom_rope_freqs *r) {
    return r->type == LOOM_ROPE_LONGROPE || r->type == LOOM_ROPE_YARN ? r->attention_factor : 1.0f;
}

/* cs, sn: (npos, HS/2) cos and sin of the angles of positions 0 .. npos-1
 * (times rope_amplitude, in fp32, as Hugging Face scales them). */
static void rope_fill(float *cs, float *sn, int npos, int HS, const loom_rope_freqs *r) {
    int H2 = HS / 2;
    float *f = malloc(sizeof *f * (size_t)(H2 ? H2 : 1));
    LOOM_ASSERT(f != NULL); /* HS/2 floats */
    rope_inv_freq(r, HS, f);
    float amp = rope_amplitude(r);
    #pragma omp parallel for schedule(static) if (npos * H2 > 4096)
    for (int t = 0; t < npos; t++) {
        for (int i = 0; i < H2; i++) {
            double a = (float)t * f[i];
            cs[(size_t)t * H2 + i] = (float)cos(a) * amp;
            sn[(size_t)t * H2 + i] = (float)sin(a) * amp;
        }
    }
    free(f);
}

/* The angles depend only on (HS, the frequencies, position), so one table
 * serves every call of a RoPE: it is built once per shape (and grown when a
 * call reaches past its last position) instead of taking T x HS/2
 * double-precision cos/sin per call. A few tables are kept, the least
 * recently used replaced: a model whose blocks alternate between RoPEs
 * (Gemma 3's local and global ones) reuses each instead of rebuilding at
 * every switch. Tables are immutable and reference-counted: a call holds
 * the one it reads, and a table replaced meanwhile is freed by the last
 * holder. The cache's own tables are released with the process. */
typedef struct rope_cache_table {
    int HS, npos, refs;
    loom_rope_freqs r;
    float *cs, *sn; /* (npos, HS/2) each */
} rope_cache_table;

#define ROPE_CACHE_SLOTS 4
static pthread_mutex_t rope_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static rope_cache_table *rope_cache[ROPE_CACHE_SLOTS]; /* guarded by rope_cache_lock, as the two below */
static unsigned long rope_cache_used[ROPE_CACHE_SLOTS], rope_cache_clock, rope_cache_builds;

unsigned long rope_table_builds(void) {
    pthread_mutex_lock(&rope_cache_lock);
    unsigned long n = rope_cache_builds;
    pthread_mutex_unlock(&rope_cache_lock);
    return n;
}

/* The slot of (HS, r): its table's, else an empty one, else the least recently used. */
static int rope_slot_locked(int HS, const loom_rope_freqs *r) {
    int best = 0;
    for (int s = 0; s < ROPE_CACHE_SLOTS; s++) {
        const rope_cache_table *t = rope_cache[s];
        if (t && t->HS == HS && rope_same(&t->r, r)) return s;
        if (!rope_cache[best]) continue;
        if (!t || rope_cache_used[s] < rope_cache_used[best]) best = s;
    }
    return best;
}

static void rope_table_unref_locked(rope_cache_table *tb) {
    if (--tb->refs == 0) {
        free(tb->cs);
        free(tb);
    }
}

/* A table covering positions [0, need) of (HS, r), held by the caller;
 * NULL when out of memory. */
static rope_cache_table *rope_table_get(int HS, const loom_rope_freqs *r, int need) {
    pthread_mutex_lock(&rope_cache_lock);
    int slot = rope_slot_locked(HS, r);
    rope_cache_table *tb = rope_cache[slot];
    if (!tb || tb->HS != HS || !rope_same(&tb->r, r) || tb->npos < need) {
        int npos = need;
        if (tb && tb->HS == HS && rope_same(&tb->r, r) && need < 2 * tb->npos) npos = 2 * tb->npos;
        rope_cache_table *nt = malloc(sizeof *nt);
        float *buf = malloc(sizeof(float) * (size_t)npos * (size_t)HS); /* cs and sn: npos * HS/2 each */
        if (!nt || !buf) {
            free(nt);
            free(buf);
            pthread_mutex_unlock(&rope_cache_lock);
            return NULL;
        }
        *nt = (rope_cache_table){HS, npos, 1, *r, buf, buf + (size_t)npos * (HS / 2)};
        rope_fill(nt->cs, nt->sn, npos, HS, r);
        if (tb) rope_table_unref_locked(tb);
        rope_cache[slot] = tb = nt;
        rope_cache_builds++;
    }
    rope_cache_used[slot] = ++rope_cache_clock;
    tb->refs++;
    pthread_mutex_unlock(&rope_cache_lock);
    return tb;
}

static void rope_table_put(rope_cache_table *tb) {
    pthread_mutex_lock(&rope_cache_lock);
    rope_table_unref_locked(tb);
    pthread_mutex_unlock(&rope_cache_lock);
}

/* Rotate pairs [lo, H2) of one head vector x = [x1, x2] (HS floats) into y
 * (which may be x) by the angles (c, sn): sign = +1 is the forward
 * rotation, -1 its transpose. */
static void rope_rotate_c(float *y, const float *x, const float *c, const float *sn, float sign, int lo, int H2) {
    for (int i = lo; i < H2; i++) {
        float x1 = x[i], x2 = x[i + H2], si = sign * sn[i];
        y[i] = x1 * c[i] - x2 * si;
        y[i + H2] = x2 * c[i] + x1 * si;
    }
}

#if LOOM_HAVE_X86_SIMD
/* The same operations eight pairs at a time (same bits as the portable loop). */
SIMD_AVX2 static void rope_rotate_avx2(float *y, const float *x, const float *c, const float *sn, float sign,
                                       int H2) {
    __m256 vsign = _mm256_set1_ps(sign);
    int i = 0;
    for (; i + 8 <= H2; i += 8) {
        __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + i + H2), ci = _mm256_loadu_ps(c + i);
        __m256 si = _mm256_mul_ps(vsign, _mm256_loadu_ps(sn + i));
        _mm256_storeu_ps(y + i, _mm256_sub_ps(_mm256_mul_ps(x1, ci), _mm256_mul_ps(x2, si)));
        _mm256_storeu_ps(y + i + H2, _mm256_add_ps(_mm256_mul_ps(x2, ci), _mm256_mul_ps(x1, si)));
    }
    rope_rotate_c(y, x, c, sn, sign, i, H2);
}
#endif

/* out, x: (B, T, NH, HS). fp32 rows are rotated from x into out where they
 * lie; other dtypes are converted to fp32 a (b, t) row of NH heads at a
 * time, rotated and stored. Either way out may be x. */
static void rope_apply(void *out, const void *x, int B, int T, int NH, int HS,
                       int pos0, const loom_rope_freqs *r, float sign, loom_dtype dt) {
    int RD = rope_rotary_dim(r, HS), H2 = RD / 2, nt = omp_get_max_threads();
    size_t row = (size_t)NH * HS;
    rope_cache_table *tb = rope_table_get(RD, r, pos0 + T);
    LOOM_ASSERT(tb != NULL); /* kernels have no error channel; a few KiB */
    const float *cs = tb->cs + (size_t)pos0 * H2, *sn = tb->sn + (size_t)pos0 * H2;
    float *rows = workspace_floats((size_t)nt * row);
    int avx2 = simd_avx2();
    #pragma omp parallel for schedule(dynamic, 64) if ((size_t)B * T * NH * HS > 16384)
    for (int bt = 0; bt < B * T; bt++) {
        int t = bt % T;
        const float *c = cs + (size_t)t * H2, *s = sn + (size_t)t * H2;
        float *y = rows + (size_t)omp_get_thread_num() * row; // (NH, HS)
        const float *xr = y;
        if (dt == LOOM_F32) {
            xr = (const float *)x + (size_t)bt * row;
            y = (float *)out + (size_t)bt * row;
        } else {
            row_load(y, x, (size_t)bt * row, (int)row, dt);
        }
        for (int h = 0; h < NH; h++) {
            size_t o = (size_t)h * HS;
            if (RD < HS && y != xr) /* the part that does not rotate, as it is */
                memcpy(y + o + RD, xr + o + RD, sizeof(float) * (size_t)(HS - RD));
#if LOOM_HAVE_X86_SIMD
            if (avx2) {
                rope_rotate_avx2(y + o, xr + o, c, s, sign, H2);
                continue;
            }
#endif
            rope_rotate_c(y + o, xr + o, c, s, sign, 0, H2);
        }
        if (dt != LOOM_F32) row_store(out, (size_t)bt * row, y, (int)row, dt);
    }
    loom_free(rows);
    rope_table_put(tb);
}

void rope_fwd(void *out, const void *x, int B, int T, int NH, int HS,
              int pos0, const loom_rope_freqs *r, loom_dtype dt) {
    rope_apply(out, x, B, T, NH, HS, pos0, r, 1.0f, dt);
}

/* The rotation is orthogonal: its transpose is the rotation by -angle. */
void rope_bwd(void *dx, const void *dout, int B, int T, int NH, int HS,
              int pos0, const loom_rope_freqs *r, loom_dtype dt) {
    rope_apply(dx, dout, B, T, NH, HS, pos0, r, -1.0f, dt);
}

void rope_fwd_ref(void *out, const void *x, int B, int T, int NH, int HS,
                  int pos0, const loom_rope_freqs *r, loom_dtype dt) {
    int RD = rope_rotary_dim(r, HS), H2 = RD / 2;
    float f[H2 > 0 ? H2 : 1];
    rope_inv_freq(r, RD, f);
    float amp = rope_amplitude(r);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) {
                for (int i = RD; i < HS; i++) { /* passed through */
                    size_t off = (((size_t)b * T + t) * NH + h) * HS + i;
                    loom_store(out, off, dt, loom_load(x, off, dt));
                }
                for (int i = 0; i < H2; i++) {
                    size_t off = (((size_t)b * T + t) * NH + h) * HS + i;
                    double a = (float)(pos0 + t) * f[i];
                    float c = (float)cos(a) * amp, s = (float)sin(a) * amp;
                    float x1 = loom_load(x, off, dt), x2 = loom_load(x, off + H2, dt);
                    loom_store(out, off, dt, x1 * c - x2 * s);
                    loom_store(out, off + H2, dt, x2 * c + x1 * s);
                }
            }
}
