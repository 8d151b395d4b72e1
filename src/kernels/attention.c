/*
 * attention.c — causal grouped-query attention, flash-style (the plain
 * references that materialise the scores are in attention_ref.c).
 *
 * Owns: softmax(q k^T * scale + causal mask) v for query heads that share
 * key/value heads, and its backward. Query t sits at absolute position
 * q_pos0 + t and sees keys 0 .. q_pos0 + t, or with a sliding window W the
 * last W of them (attn_first_key: key blocks before a query block's first
 * window are skipped, keys before each query's window masked).
 *
 * Both directions work in fp32 on blocks of ATTN_BQ queries x ATTN_BK keys,
 * with the products as small matrix multiplies (mm_f32: AVX-512F, AVX2/FMA
 * or portable C) and vectorized exps. With bf16 inputs on a CPU with
 * AVX-512 BF16 (mm_bf16_tiles()) and a head size that is a multiple of 16
 * (whole tile columns; pairs never straddle two heads), every product is a
 * bf16 dot product with fp32 sums (s->dot2): those of two inputs — the
 * scores S = (q k^T) scale in both directions and dP = dout v^T — on the
 * inputs' own pairs (packed transposed per block or kv head); those with a
 * computed factor — P v, P^T dout, dS^T q, dS k — with P or dS rounded to
 * bf16 and paired along the summed dimension, against inputs paired the
 * same way (pack_row_pairs; docs/design-notes.md).
 * Forward: one task per (b, kv head g); fp32 keys and values are read in
 * place (unless their stride is critical and a block of queries or more reads
 * them: attn_shape_make), other dtypes converted once per task; each query block is
 * transposed (8 x 8 vector blocks), then scaled. For each query head of the group and
 * each query block, key blocks are folded in with an online softmax (running
 * max m, running sum l, unnormalised output acc) on the transposed scores
 * St = k (scale q)^T, so each query is a column and the softmax runs down
 * the columns, eight queries at a time: P = exp(St - m),
 * acc = acc * exp(m_old - m) + P^T v. No Tq x Tk matrix exists.
 * lse = m + log(l).
 * Backward (FlashAttention-2): one task per (b, kv head g); fp32 keys,
 * values and dout are read where they lie and dk, dv accumulate in place
 * as dq does (strides allowing); otherwise they go through dense scratch
 * (other dtypes converted once per task). For each query
 * head, key block and query block it recomputes S = (scale q) k^T — the
 * same products as the forward, so P = exp(S - lse) is consistent — then with
 * D_i = rowsum(dout_i * out_i): dP = dout v^T, dS = P (dP - D),
 * dV += P^T dout, dK += dS^T (scale q), dq += dS k (times scale at the end;
 * with dot2, dK += dS^T q is scaled at the end too, and q, dout and the keys
 * are paired by rows instead of converted: attn_bwd_block_pairs).
 * The task owns dk, dv of its kv head and dq of its query heads, so no two
 * threads write the same row.
 * Dropout (FlashAttention-2's): the forward multiplies P by the mask's
 * factors Z (0 or 1 / (1 - p), from Philox counters by element:
 * attn_dropout_row) after the online softmax has summed it, before P v; the
 * backward regenerates Z, dS = P (dP Z - D) and dV += (P Z)^T dout.
 * On blocks the causal mask cuts (the diagonal), or a sliding window (its
 * trailing edge), both directions run their products in strips of
 * ATTN_STRIP rows that start and stop where every further term is masked:
 * what is left out is either never read (masked scores) or exact zeros at
 * the start or end of a sum.
 * Must never: let the thread count or the schedule change a result — every
 * output element is summed by one task in a fixed order.
 */
#include "kernels/attention_internal.h"
#include "kernels/kernels.h"
#include "kernels/kernel_rows.h"

#include <math.h>
#include <omp.h>

#ifndef ATTN_BQ
#define ATTN_BQ 64
#endif /* queries per block (a multiple of 8) */
#ifndef ATTN_BK
#define ATTN_BK 64
#endif /* keys per block */
#define ATTN_STRIP 16 /* rows per product on a block the causal mask cuts */
_Static_assert(ATTN_BQ % 8 == 0 && ATTN_BK % 2 == 0, "query blocks are whole vectors; bf16 pairs need even blocks");

/* Rows of a (B, T, heads, HS) buffer are heads * HS floats apart. With a
 * critical stride (stride_critical: small's 8 heads of 64), copying them to
 * dense scratch first made the backward 24% faster (bench/ab_attention.sh
 * ... small). The copy pays only when rows are read many times: with fewer
 * queries than one block (decoding reads each key row once per query head)
 * fp32 rows are read in place whatever their stride. */

static attn_shape attn_shape_make(int B, int Tq, int Tk, int NH, int NKV, int HS,
                                  int q_pos0, loom_dtype dt) {
    attn_shape s = attn_shape_plain(B, Tq, Tk, NH, NKV, HS, q_pos0, dt);
    s.in_place = dt == LOOM_F32 && (Tq < ATTN_BQ || !(stride_critical((size_t)NH * HS, dt) ||
                                                      stride_critical((size_t)NKV * HS, dt)));
    s.dot2 = dt == LOOM_BF16 && HS % 16 == 0 ? mm_bf16_tiles() : NULL;
    return s;
}

static int round16(int n) { return (n + 15) / 16 * 16; }
static int half_up(int n) { return (n + 1) / 2; }

/* The bf16 rows of a (B, T, H, HS) buffer as pairs: row t, head `head`
 * starts at the returned pointer; rows are NH * HS / 2 pairs apart. */
static const uint32_t *pair_rows(const void *src, size_t off) {
    return (const uint32_t *)((const uint16_t *)src + off);
}

/* dst (HS / 2, ldd) uint32: column j < n is the pairs of row j of src (row
 * stride lds pairs), columns [n, n_pad) are zero pairs. */
static void pack_pairs_t(uint32_t *dst, int ldd, const uint32_t *src, size_t lds, int n, int n_pad, int HS) {
    transpose32(dst, ldd, src, (int)lds, n, HS / 2);
    for (int p = 0; p < HS / 2; p++) memset(dst + (size_t)p * ldd + n, 0, (size_t)(n_pad - n) * sizeof *dst);
}

/* dst ((nr + 1) / 2, ldd) uint32: row p pairs rows 2p and 2p + 1 of the nr
 * rows at src (dtype dt: fp32 rounded to bf16, or bf16 as stored), ld
 * elements apart, over columns [0, n), element by element (a zero row
 * stands in for row nr). */
static void pack_row_pairs(uint32_t *dst, int ldd, const void *src, size_t ld, loom_dtype dt, int nr, int n) {
    size_t pitch = ld * loom_dtype_size(dt);
    for (int p = 0; p < half_up(nr); p++) {
        const char *a = (const char *)src + 2 * (size_t)p * pitch;
        row_pairs(dst + (size_t)p * ldd, a, 2 * p + 1 < nr ? a + pitch : NULL, dt, n);
    }
}

static int min_i(int a, int b) { return a < b ? a : b; }

/* Number of keys in [k0, k0 + nk) up to query t's position, the causal
 * bound (0 if none); a window may hide the first of them (attn_first_key). */
static int attn_visible(const attn_shape *s, int t, int k0, int nk) {
    int n = s->q_pos0 + t - k0 + 1;
    return n < 0 ? 0 : (n < nk ? n : nk);
}

/* Keys before query t's window in a key block at k0 (0 without a window,
 * or where its window starts at or before k0), rounded down to a multiple
 * of `round`: products over the block's keys may start there, every term
 * before it being P = 0 or dS = 0 (never read where the scores are masked). */
static int attn_window_skip(const attn_shape *s, int t, int k0, int round) {
    int first = attn_first_key(s, t);
    return first > k0 ? (first - k0) / round * round : 0;
}

/* One past the last query (of those from q0) whose window holds key `key`,
 * rounded up to a multiple of `round`; n without a window. */
static int attn_window_end(const attn_shape *s, int key, int q0, int n, int round) {
    if (s->window <= 0) return n;
    int end = key + s->window - s->q_pos0 - q0; /* the query at key + window - 1 is its last */
    end = (end + round - 1) / round * round;
    return end < n ? end : n;
}

/* Load n rows starting at time t0 of head `head` from a (B, T, H, HS) buffer
 * into dst (n, HS) fp32. */
static void load_rows(float *dst, const void *src, int T, int H, int b, int t0, int head,
                      int n, const attn_shape *s) {
    for (int i = 0; i < n; i++)
        row_load(dst + (size_t)i * s->HS, src, (((size_t)b * T + t0 + i) * H + head) * s->HS,
                 s->HS, s->dt);
}

/* All Tq query rows of head h, times scale: qs (Tq, HS). Forward and
 * backward form the scores from these same values. */
static void load_q_scaled(float *qs, const void *q, int b, int h, const attn_shape *s) {
    load_rows(qs, q, s->Tq, s->NH, b, 0, h, s->Tq, s);
    row_scale(qs, s->scale, s->Tq * s->HS);
}

/* ---------------------------------------------------------------- forward */

typedef struct attn_fwd_scratch {
    const float *k, *v;    // the kv head's rows, row stride ldkv: the input itself
                           // (fp32) or kbuf, vbuf (converted)
    int ldkv;
    const uint32_t *k2;    // with dot2: the kv head's bf16 key rows as pairs, ldk2 pairs apart
    size_t ldk2;
    float *kbuf, *vbuf;    // (Tk, HS) rows copied (converted) when not in place
    uint32_t *vp;          // with dot2: ((Tk + 1) / 2, HS) the kv head's values as pairs of rows
    uint32_t *pt;          // with dot2: (ATTN_BK / 2, ATTN_BQ) P^T as pairs of key rows
    float *qt;             // (HS, ATTN_BQ) a query block, scaled and transposed
    float *acc;            // (ATTN_BQ, HS)
    float *st;             // (ATTN_BK, ATTN_BQ) transposed scores, then P^T
    float *m, *l, *corr;   // (ATTN_BQ)
} attn_fwd_scratch;

static size_t attn_fwd_scratch_floats(const attn_shape *s) {
    return (size_t)(2 * s->Tk + 2 * ATTN_BQ + half_up(s->Tk)) * s->HS + (size_t)ATTN_BK * ATTN_BQ * 3 / 2 +
           3 * ATTN_BQ;
}

static attn_fwd_scratch attn_fwd_scratch_at(float *p, const attn_shape *s) {
    attn_fwd_scratch w;
    w.k = w.v = NULL;
    w.ldkv = s->HS;
    w.k2 = NULL;
    w.ldk2 = 0;
    w.kbuf = p; p += (size_t)s->Tk * s->HS;
    w.vbuf = p; p += (size_t)s->Tk * s->HS;
    w.vp = (uint32_t *)p; p += (size_t)half_up(s->Tk) * s->HS;
    w.pt = (uint32_t *)p; p += (size_t)ATTN_BK / 2 * ATTN_BQ;
    w.qt = p;   p += (size_t)ATTN_BQ * s->HS;
    w.acc = p;  p += (size_t)ATTN_BQ * s->HS;
    w.st = p;   p += (size_t)ATTN_BK * ATTN_BQ;
    w.m = p;    p += ATTN_BQ;
    w.l = p;    p += ATTN_BQ;
    w.corr = p;
    return w;
}

/* qt (HS, ATTN_BQ) = columns q0 .. q0 + nq of head h, times scale: the same
 * fp32 products the backward's load_q_scaled forms. fp32 rows are
 * transposed where they lie; other dtypes are converted into tmp (nq, HS)
 * first. */
static void load_qt_scaled(float *qt, float *tmp, const void *q, int b, int h, int q0, int nq,
                           const attn_shape *s) {
    const float *rows = tmp;
    int ld = s->HS;
    if (s->dt == LOOM_F32) {
        rows = (const float *)q + q_off(s, b, q0, h);
        ld = s->NH * s->HS;
    } else {
        load_rows(tmp, q, s->Tq, s->NH, b, q0, h, nq, s);
    }
    transpose32(qt, ATTN_BQ, rows, ld, nq, s->HS);
    for (int d = 0; d < s->HS; d++) row_scale(qt + (size_t)d * ATTN_BQ, s->scale, nq);
}

/* Column j of st (nk, ATTN_BQ) is query q0 + j; set the keys it does not
 * see (later than itself, or before its window), and the padding columns
 * [nq, nqp), to -inf. */
static void attn_fwd_mask(float *st, int q0, int nq, int nqp, int k0, int nk, const attn_shape *s) {
    for (int r = 0; r < nk; r++) {
        float *row = st + (size_t)r * ATTN_BQ;
        int first = k0 + r - s->q_pos0 - q0; // first query column that sees key k0 + r
        for (int j = 0; j < nq && j < first; j++) row[j] = -INFINITY;
        if (s->window > 0) /* and the columns whose window starts after it */
            for (int j = first + s->window < 0 ? 0 : first + s->window; j < nq; j++) row[j] = -INFINITY;
        for (int j = nq; j < nqp; j++) row[j] = -INFINITY;
    }
}

/* Gemma 2's softcap of the visible scores of st (nk rows of ATTN_BQ, nq
 * columns), each st * sc: attn_softcap; masked ones (-inf) stay masked.
 * The backward caps the same products the same way (attn_bwd_probs). */
static void attn_fwd_softcap(float *st, int nq, int nk, float sc, float softcap) {
    for (int r = 0; r < nk; r++)
        for (int j = 0; j < nq; j++) {
            float *v = st + (size_t)r * ATTN_BQ + j;
            if (*v != -INFINITY) *v = attn_softcap(*v * sc, softcap);
        }
}

/* The online softmax step down the columns of st (nk, nq), the scores
 * being st * sc (sc = 1 where st holds them scaled already): st becomes P^T
 * (0 where masked), m and l are updated, corr gets each column's rescale
 * factor exp(m_old - m_new). A column with no visible key so far keeps
 * m = -inf and gets P = 0, corr = 0 (its acc and l are still 0). */
static void attn_fwd_softmax_c(float *st, float *m, float *l, float *corr, int nq, int nk, float sc) {
    for (int j = 0; j < nq; j++) {
        float mx = m[j];
        for (int r = 0; r < nk; r++) mx = fmaxf(mx, st[(size_t)r * ATTN_BQ + j] * sc);
        float base = mx == -INFINITY ? 0.0f : mx, sum = 0.0f;
        for (int r = 0; r < nk; r++) {
            float *p = &st[(size_t)r * ATTN_BQ + j];
            *p = expf(*p * sc - base);
            sum += *p;
        }
        corr[j] = expf(m[j] - base);
        l[j] = l[j] * corr[j] + sum;
        m[j] = mx;
    }
}

#if LOOM_HAVE_X86_SIMD
/* Eight columns at a time; nq is padded to a multiple of 8 by the caller
 * (padding columns hold -inf and are never read back). */
SIMD_AVX2 static void attn_fwd_softmax_avx2(float *st, float *m, float *l, float *corr, int nq, int nk, float sc) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps(), vsc = _mm256_set1_ps(sc);
    for (int j = 0; j < nq; j += 8) {
        __m256 mo = _mm256_loadu_ps(m + j), mx = mo;
        for (int r = 0; r < nk; r++)
            mx = _mm256_max_ps(mx, _mm256_mul_ps(_mm256_loadu_ps(st + (size_t)r * ATTN_BQ + j), vsc));
        __m256 base = _mm256_blendv_ps(mx, zero, _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ));
        __m256 sum = zero;
        for (int r = 0; r < nk; r++) {
            float *p = st + (size_t)r * ATTN_BQ + j;
            __m256 e = simd_exp(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p), vsc), base));
            _mm256_storeu_ps(p, e);
            sum = _mm256_add_ps(sum, e);
        }
        __m256 c = simd_exp(_mm256_sub_ps(mo, base));
        _mm256_storeu_ps(corr + j, c);
        _mm256_storeu_ps(l + j, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(l + j), c), sum));
        _mm256_storeu_ps(m + j, mx);
    }
}
#endif

#if LOOM_HAVE_SIMD512
/* attn_fwd_softmax_avx2 sixteen columns at a time (the same operations per
 * column, so the same bits); a last eight go to the AVX2 version. */
SIMD_AVX512 static void attn_fwd_softmax_avx512(float *st, float *m, float *l, float *corr, int nq, int nk,
                                                float sc) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps(), vsc = _mm512_set1_ps(sc);
    int j = 0;
    for (; j + 16 <= nq; j += 16) {
        __m512 mo = _mm512_loadu_ps(m + j), mx = mo;
        for (int r = 0; r < nk; r++)
            mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(st + (size_t)r * ATTN_BQ + j), vsc));
        __m512 base = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), zero);
        __m512 sum = zero;
        for (int r = 0; r < nk; r++) {
            float *p = st + (size_t)r * ATTN_BQ + j;
            __m512 e = simd_exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p), vsc), base));
            _mm512_storeu_ps(p, e);
            sum = _mm512_add_ps(sum, e);
        }
        __m512 c = simd_exp16(_mm512_sub_ps(mo, base));
        _mm512_storeu_ps(corr + j, c);
        _mm512_storeu_ps(l + j, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l + j), c), sum));
        _mm512_storeu_ps(m + j, mx);
    }
    if (j < nq) attn_fwd_softmax_avx2(st + j, m + j, l + j, corr + j, nq - j, nk, sc);
}
#endif

/* St (nk, ATTN_BQ) = k qs^T for keys [k0, k0 + nk) and queries [q0, q0 + nq),
 * in strips of ATTN_STRIP keys: a strip starts at the first column (rounded
 * down to a whole tile) that sees one of its keys and, with a window, ends
 * past the last column whose window holds one (rounded up); what it skips
 * is masked. */
static void attn_fwd_scores(const attn_fwd_scratch *w, int q0, int nq, int k0, int nk, const attn_shape *s) {
    int ld = w->ldkv;
    for (int r0 = 0; r0 < nk; r0 += ATTN_STRIP) {
        int c0 = k0 + r0 - s->q_pos0 - q0; // first column that sees key k0 + r0
        c0 = c0 <= 0 ? 0 : c0 / ATTN_STRIP * ATTN_STRIP;
        int nr = min_i(nk - r0, ATTN_STRIP);
        int c1 = attn_window_end(s, k0 + r0 + nr - 1, q0, nq, ATTN_STRIP);
        if (c0 >= c1) continue;
        float *st = w->st + (size_t)r0 * ATTN_BQ + c0;
        if (s->dot2) { /* k q^T from the bf16 pairs (the softmax scales it); qt holds the packed queries */
            s->dot2(nr, round16(c1 - c0), s->HS / 2, w->k2 + (size_t)(k0 + r0) * w->ldk2, w->ldk2, 1,
                    (const uint32_t *)w->qt + c0, ATTN_BQ, st, ATTN_BQ, 0);
            continue;
        }
        mm_f32(nr, c1 - c0, s->HS, w->k + (size_t)(k0 + r0) * ld, ld, 0, w->qt + c0, ATTN_BQ, st, ATTN_BQ, 0);
    }
}

/* acc += P v, P = st^T (nq, nk), in strips of ATTN_STRIP queries, each over
 * the keys its last query sees, from the first key its first query's
 * window holds: the products left out are exact zeros at the start or end
 * of each sum. With dot2, over pairs of keys, P rounded to bf16 (a strip's
 * odd last key pairs with one it does not see: P = 0 there). */
static void attn_fwd_pv(const attn_fwd_scratch *w, int q0, int nq, int k0, int nk, const attn_shape *s) {
    int ld = w->ldkv, HS = s->HS;
    if (s->dot2) pack_row_pairs(w->pt, ATTN_BQ, w->st, ATTN_BQ, LOOM_F32, nk, (nq + 7) / 8 * 8);
    for (int j0 = 0; j0 < nq; j0 += ATTN_STRIP) {
        int nj = min_i(nq - j0, ATTN_STRIP);
        int kn = attn_visible(s, q0 + j0 + nj - 1, k0, nk);
        int lo = attn_window_skip(s, q0 + j0, k0, 2); // before the strip's first window: P = 0 (even: pairs)
        if (lo >= kn) continue;
        if (s->dot2) {
            s->dot2(nj, HS, half_up(kn) - lo / 2, w->pt + (size_t)lo / 2 * ATTN_BQ + j0, 1, ATTN_BQ,
                    w->vp + (size_t)(k0 + lo) / 2 * HS, HS, w->acc + (size_t)j0 * HS, HS, 1);
            continue;
        }
        mm_f32(nj, HS, kn - lo, w->st + (size_t)lo * ATTN_BQ + j0, ATTN_BQ, 1, w->v + (size_t)(k0 + lo) * ld, ld,
               w->acc + (size_t)j0 * HS, HS, 1);
    }
}

/* Attention dropout on P^T (st: nk keys x nq query columns) before it
 * weighs the values: each probability a query sees times its mask's factor
 * (attn_dropout_row); the others are 0 already, and l keeps the sum of P. */
static void attn_fwd_dropout(float *st, int b, int h, int q0, int nq, int k0, int nk, const attn_shape *s) {
    float z[ATTN_BK];
    for (int j = 0; j < nq; j++) {
        int n = attn_visible(s, q0 + j, k0, nk), first = attn_first_key(s, q0 + j);
        int lo = first > k0 ? min_i(first - k0, n) : 0;
        attn_dropout_row(z + lo, s, b, h, q0 + j, k0 + lo, n - lo);
        for (int r = lo; r < n; r++) st[(size_t)r * ATTN_BQ + j] *= z[r];
    }
}

/* Queries [q0, q0 + nq) of head h: out rows and lse. */
static void attn_fwd_block(void *out, float *lse, const void *q, int b, int h, int q0, int nq, const attn_shape *s,
                           attn_fwd_scratch *w) {
    int HS = s->HS, nqp = (nq + 7) / 8 * 8;
    int kv_end = s->q_pos0 + q0 + nq; // keys the last query of the block sees
    float sc = s->dot2 ? s->scale : 1.0f; // dot2 scores come unscaled; the fp32 path scaled q
    if (s->dot2) /* the block's bf16 pairs, transposed, zero past nq */
        pack_pairs_t((uint32_t *)w->qt, ATTN_BQ, pair_rows(q, q_off(s, b, q0, h)), (size_t)s->NH * HS / 2, nq,
                     round16(nq), HS);
    else
        load_qt_scaled(w->qt, w->acc, q, b, h, q0, nq, s);
    memset(w->acc, 0, (size_t)nq * HS * sizeof(float));
    for (int j = 0; j < nqp; j++) { w->m[j] = -INFINITY; w->l[j] = 0.0f; }
    /* from the key block holding the first key the block's first query sees */
    for (int k0 = attn_first_key(s, q0) / ATTN_BK * ATTN_BK; k0 < kv_end; k0 += ATTN_BK) {
        int nk = min_i(kv_end - k0, ATTN_BK);
        attn_fwd_scores(w, q0, nq, k0, nk, s);
        attn_fwd_mask(w->st, q0, nq, nqp, k0, nk, s);
        float ssc = sc; /* the softmax's scale: 1 once softcapped scores hold it */
        if (s->softcap > 0.0f) {
            attn_fwd_softcap(w->st, nq, nk, sc, s->softcap);
            ssc = 1.0f;
        }
#if LOOM_HAVE_SIMD512
        if (simd_avx512()) attn_fwd_softmax_avx512(w->st, w->m, w->l, w->corr, nqp, nk, ssc);
        else
#endif
#if LOOM_HAVE_X86_SIMD
        if (simd_avx2()) attn_fwd_softmax_avx2(w->st, w->m, w->l, w->corr, nqp, nk, ssc);
        else
#endif
            attn_fwd_softmax_c(w->st, w->m, w->l, w->corr, nq, nk, ssc);
        for (int j = 0; j < nq; j++) /* exactly 1 where the column max did not move */
            if (w->corr[j] != 1.0f) row_scale(w->acc + (size_t)j * HS, w->corr[j], HS);
        if (s->drop.p > 0.0f) attn_fwd_dropout(w->st, b, h, q0, nq, k0, nk, s);
        attn_fwd_pv(w, q0, nq, k0, nk, s);
    }
    for (int j = 0; j < nq; j++) {
        float *acc = w->acc + (size_t)j * HS;
        row_scale(acc, 1.0f / w->l[j], HS);
        row_store(out, q_off(s, b, q0 + j, h), acc, HS, s->dt);
        if (lse) lse[lse_off(s, b, h, q0 + j)] = w->m[j] + logf(w->l[j]);
    }
}

/* Task (b, g): every query of the heads that share kv head g. Keys and
 * values are read where they lie (s->in_place) or copied (converted) once. */
static void attn_fwd_task(void *out, float *lse, const void *q, const void *k, const void *v, int b, int g,
                          const attn_shape *s, attn_fwd_scratch *w) {
    int kv_end = s->q_pos0 + s->Tq; // keys any query sees
    if (s->in_place) {
        w->k = (const float *)k + kv_off(s, b, 0, g);
        w->v = (const float *)v + kv_off(s, b, 0, g);
        w->ldkv = s->NKV * s->HS;
    } else {
        if (s->dot2) { /* keys as stored (pairs along the head) and values as pairs of rows */
            w->k2 = pair_rows(k, kv_off(s, b, 0, g));
            w->ldk2 = (size_t)s->NKV * s->HS / 2;
            pack_row_pairs(w->vp, s->HS, (const uint16_t *)v + kv_off(s, b, 0, g), (size_t)s->NKV * s->HS, s->dt,
                           kv_end, s->HS);
        } else {
            load_rows(w->kbuf, k, s->Tk, s->NKV, b, 0, g, kv_end, s);
            load_rows(w->vbuf, v, s->Tk, s->NKV, b, 0, g, kv_end, s);
        }
        w->k = w->kbuf;
        w->v = w->vbuf;
        w->ldkv = s->HS;
    }
    for (int h = g * s->G; h < (g + 1) * s->G; h++)
        for (int q0 = 0; q0 < s->Tq; q0 += ATTN_BQ)
            attn_fwd_block(out, lse, q, b, h, q0, min_i(s->Tq - q0, ATTN_BQ), s, w);
}

void attention_fwd(void *out, float *lse, const void *q, const void *k, const void *v,
                   int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                   loom_dtype dt) {
    attention_fwd_ex(out, lse, q, k, v, B, Tq, Tk, NH, NKV, HS, q_pos0, &(attn_opts){.scale = attn_default_scale(HS)},
                     dt);
}

void attention_fwd_ex(void *out, float *lse, const void *q, const void *k, const void *v,
                      int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                      loom_dtype dt) {
    attn_shape s = attn_shape_with(attn_shape_make(B, Tq, Tk, NH, NKV, HS, q_pos0, dt), o);
    size_t per = attn_fwd_scratch_floats(&s);
    float *ws = workspace_floats(per * (size_t)omp_get_max_threads());
    #pragma omp parallel for schedule(dynamic, 1) if (B * NKV > 1)
    for (int task = 0; task < B * NKV; task++) {
        attn_fwd_scratch w = attn_fwd_scratch_at(ws + per * (size_t)omp_get_thread_num(), &s);
        attn_fwd_task(out, lse, q, k, v, task / NKV, task % NKV, &s, &w);
    }
    loom_free(ws);
}

/* --------------------------------------------------------------- backward */

/* Rows of one task, each a pointer and a row stride: fp32 inputs and
 * outputs where they lie (s->in_place), otherwise the scratch buffers. */
typedef struct attn_bwd_scratch {
    const float *k, *dout; // kv head's keys (Tk rows), one query head's dout (Tq rows)
    int ldk, lddo;
    float *dk, *dv;        // fp32 accumulators of the kv head (Tk rows, stride lddkv)
    int lddkv;
    float *kt, *vt;        // (HS, Tk) the kv head, transposed; with dot2 (HS / 2, Tkp) bf16 pairs
    int ldkt;              // Tk, or Tkp = Tk rounded up to 16 with dot2
    const uint32_t *q2, *do2; // with dot2: one query head's bf16 q and dout rows as pairs, ldq2 apart
    size_t ldq2;
    float *qs;             // (Tq, HS) one query head, times scale (unused with dot2)
    float *dq;             // its dq accumulator, rows lddq apart: dq itself (in place) or dqbuf
    int lddq;
    float *dqbuf;          // (Tq, HS)
    float *kbuf, *dobuf;   // (Tk, HS), (Tq, HS) converted rows when not in place (unused with dot2)
    float *dkbuf, *dvbuf;  // (Tk, HS) accumulators when not in place
    float *p, *ds;         // (ATTN_BQ, ATTN_BK)
    uint32_t *kp;          // with dot2: ((Tk + 1) / 2, HS) the kv head's keys as pairs of rows
    uint32_t *qp, *dop;    // with dot2: ((Tq + 1) / 2, HS) one query head's q and dout as pairs of rows
    uint32_t *pp, *dsp;    // with dot2: (ATTN_BQ / 2, ATTN_BK) P and dS as pairs of query rows
    uint32_t *dsr;         // with dot2: (ATTN_BQ, ATTN_BK / 2) dS rows, as pairs of keys
} attn_bwd_scratch;

static size_t attn_bwd_scratch_floats(const attn_shape *s) {
    return (size_t)(2 * (s->Tk + 16) + 3 * s->Tk + 3 * s->Tq + half_up(s->Tk) + 2 * half_up(s->Tq)) * s->HS +
           (size_t)ATTN_BQ * ATTN_BK * 7 / 2;
}

static attn_bwd_scratch attn_bwd_scratch_at(float *p, const attn_shape *s) {
    attn_bwd_scratch w;
    size_t kb = (size_t)s->Tk * s->HS, qb = (size_t)s->Tq * s->HS, tb = (size_t)(s->Tk + 16) * s->HS;
    w.kt = p;    p += tb;
    w.vt = p;    p += tb;
    w.ldkt = s->dot2 ? round16(s->Tk) : s->Tk;
    w.q2 = w.do2 = NULL;
    w.ldq2 = (size_t)s->NH * s->HS / 2;
    w.kbuf = p;  p += kb;
    w.dkbuf = p; p += kb;
    w.dvbuf = p; p += kb;
    w.qs = p;    p += qb;
    w.dqbuf = p; p += qb;
    w.dq = NULL;
    w.lddq = s->HS;
    w.dobuf = p; p += qb;
    w.p = p;     p += (size_t)ATTN_BQ * ATTN_BK;
    w.ds = p;   p += (size_t)ATTN_BQ * ATTN_BK;
    w.kp = (uint32_t *)p;  p += (size_t)half_up(s->Tk) * s->HS;
    w.qp = (uint32_t *)p;  p += (size_t)half_up(s->Tq) * s->HS;
    w.dop = (uint32_t *)p; p += (size_t)half_up(s->Tq) * s->HS;
    w.pp = (uint32_t *)p;  p += (size_t)ATTN_BQ / 2 * ATTN_BK;
    w.dsp = (uint32_t *)p; p += (size_t)ATTN_BQ / 2 * ATTN_BK;
    w.dsr = (uint32_t *)p;
    w.k = w.dout = NULL;
    w.dk = w.dv = NULL;
    w.ldk = w.lddo = w.lddkv = s->HS;
    return w;
}

/* D: (B, NH, Tq) = rowsum(dout * out) in fp32. */
static void attn_rowdot(float *D, const void *dout, const void *out, const attn_shape *s) {
    int rows = s->B * s->Tq * s->NH, HS = s->HS;
    int nt = omp_get_max_threads();
    float *tmp = workspace_floats((size_t)nt * 2 * HS);
    #pragma omp parallel for schedule(dynamic, 256)
    for (int r = 0; r < rows; r++) {
        const float *a, *o;
        int h = r % s->NH, t = (r / s->NH) % s->Tq, b = r / (s->NH * s->Tq);
        if (s->dt == LOOM_F32) {
            a = (const float *)dout + (size_t)r * HS;
            o = (const float *)out + (size_t)r * HS;
        } else {
            float *ta = tmp + (size_t)omp_get_thread_num() * 2 * HS, *to = ta + HS;
            row_load(ta, dout, (size_t)r * HS, HS, s->dt);
            row_load(to, out, (size_t)r * HS, HS, s->dt);
            a = ta;
            o = to;
        }
        D[lse_off(s, b, h, t)] = row_dot(a, o, HS);
    }
    loom_free(tmp);
}

/* ds[j] = p[j] * (ds[j] - d) for j < n */
static void attn_ds_c(float *ds, const float *p, float d, int lo, int n) {
    for (int j = lo; j < n; j++) ds[j] = p[j] * (ds[j] - d);
}

#if LOOM_HAVE_X86_SIMD
SIMD_AVX2 static void attn_ds_avx2(float *ds, const float *p, float d, int n) {
    __m256 vd = _mm256_set1_ps(d);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(ds + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_sub_ps(_mm256_loadu_ps(ds + j), vd)));
    attn_ds_c(ds, p, d, j, n);
}
#endif
#if LOOM_HAVE_SIMD512
SIMD_AVX512 static void attn_ds_avx512(float *ds, const float *p, float d, int n) {
    __m512 vd = _mm512_set1_ps(d);
    int j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(ds + j, _mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_sub_ps(_mm512_loadu_ps(ds + j), vd)));
    attn_ds_avx2(ds + j, p + j, d, n - j);
}
#endif

/* P = exp(S - lse) for the block, then dS = P (dP - D); both exactly 0
 * outside the keys a query sees (past them S and dP were not computed;
 * before its window they were, and are dropped), up to an even column
 * count. w->p holds S on entry (with dot2 the unscaled q k^T: the exp
 * applies the scale, rounding as the forward's softmax) and P on exit; w->ds
 * holds dP on entry. With dropout (mask factors Z, the forward's) dS = P
 * (dP Z - D) and w->p gets P Z, the weights of the values (FlashAttention-2). */
static void attn_bwd_probs(attn_bwd_scratch *w, const float *lse, const float *D, int b, int h, int q0, int nq,
                           int k0, int nk, const attn_shape *s) {
    float sc = s->dot2 ? s->scale : 1.0f, dcap[ATTN_BK]; /* with a softcap: d capped / d score, 1 - tanh^2 */
    float z[ATTN_BK];                                     /* with dropout: the mask's factors */
    for (int i = 0; i < nq; i++) {
        float *p = w->p + (size_t)i * ATTN_BK, *ds = w->ds + (size_t)i * ATTN_BK;
        int n = attn_visible(s, q0 + i, k0, nk);
        int first = attn_first_key(s, q0 + i), lo = min_i(n, first > k0 ? first - k0 : 0); // the window's start
        for (int j = 0; j < lo; j++) p[j] = ds[j] = 0.0f;
        p += lo, ds += lo, n -= lo;
        if (s->softcap > 0.0f) { /* the forward's capped scores, bit for bit (attn_fwd_softcap) */
            for (int j = 0; j < n; j++) {
                p[j] = attn_softcap(p[j] * sc, s->softcap);
                float th = p[j] / s->softcap;
                dcap[j] = 1.0f - th * th;
            }
        }
        row_exp_sum(p, n, s->softcap > 0.0f ? 1.0f : sc, lse[i]);
        if (s->drop.p > 0.0f) { /* through the mask to P */
            attn_dropout_row(z, s, b, h, q0 + i, k0 + lo, n);
            for (int j = 0; j < n; j++) ds[j] *= z[j];
        }
#if LOOM_HAVE_SIMD512
        if (simd_avx512()) attn_ds_avx512(ds, p, D[i], n);
        else
#endif
#if LOOM_HAVE_X86_SIMD
        if (simd_avx2()) attn_ds_avx2(ds, p, D[i], n);
        else
#endif
            attn_ds_c(ds, p, D[i], 0, n);
        if (s->softcap > 0.0f) /* through the cap to the scaled score */
            for (int j = 0; j < n; j++) ds[j] *= dcap[j];
        if (s->drop.p > 0.0f)
            for (int j = 0; j < n; j++) p[j] *= z[j];
        for (int j = n; j < 2 * half_up(nk) - lo; j++) p[j] = ds[j] = 0.0f;
    }
}

/* attn_bwd_block's dV, dK and dq products with dot2: P and dS rounded to
 * bf16, as pairs of query rows (dV, dK) or of keys (dq), against the bf16
 * inputs as stored, paired the same way. q0 is even (attn_bwd_head), and a
 * key strip's first query is rounded down to even: the query added sees no
 * key of the strip (P = dS = 0). dK lacks the scale (attn_bwd_task applies
 * it once). */
static void attn_bwd_block_pairs(attn_bwd_scratch *w, int q0, int nq, int k0, int nk, const attn_shape *s) {
    int HS = s->HS;
    pack_row_pairs(w->pp, ATTN_BK, w->p, ATTN_BK, LOOM_F32, nq, nk);
    pack_row_pairs(w->dsp, ATTN_BK, w->ds, ATTN_BK, LOOM_F32, nq, nk);
    /* neighbouring fp32 -> bf16 make the pairs; ds and dsr rows are both
     * ATTN_BK elements apart, so a full block converts in one call */
    if (2 * half_up(nk) == ATTN_BK)
        convert_from_f32(w->dsr, LOOM_BF16, w->ds, (size_t)nq * ATTN_BK);
    else
        for (int i = 0; i < nq; i++)
            convert_from_f32(w->dsr + (size_t)i * ATTN_BK / 2, LOOM_BF16, w->ds + (size_t)i * ATTN_BK,
                             2 * half_up(nk));
    for (int r0 = 0; r0 < nk; r0 += ATTN_STRIP) {
        int nr = min_i(nk - r0, ATTN_STRIP);
        int i0 = k0 + r0 - s->q_pos0 - q0; // first query that sees key k0 + r0
        i0 = i0 < 0 ? 0 : i0 / 2 * 2;
        int i1 = attn_window_end(s, k0 + r0 + nr - 1, q0, nq, 2); // past the last window holding the strip
        if (i0 >= i1) continue;
        size_t o = (size_t)(k0 + r0) * w->lddkv, a = (size_t)i0 / 2 * ATTN_BK + r0, bq = (size_t)(q0 + i0) / 2 * HS;
        int kp = half_up(i1 - i0);
        s->dot2(nr, HS, kp, w->pp + a, 1, ATTN_BK, w->dop + bq, HS, w->dv + o, w->lddkv, 1);  // dV += P^T dout
        s->dot2(nr, HS, kp, w->dsp + a, 1, ATTN_BK, w->qp + bq, HS, w->dk + o, w->lddkv, 1); // dK += dS^T q
    }
    for (int i0 = 0; i0 < nq; i0 += ATTN_STRIP) {
        int ni = min_i(nq - i0, ATTN_STRIP);
        int kn = attn_visible(s, q0 + i0 + ni - 1, k0, nk), lo = attn_window_skip(s, q0 + i0, k0, 2);
        if (lo >= kn) continue;
        s->dot2(ni, HS, half_up(kn) - lo / 2, w->dsr + (size_t)i0 * ATTN_BK / 2 + lo / 2, ATTN_BK / 2, 1,
                w->kp + (size_t)(k0 + lo) / 2 * HS, HS, w->dq + (size_t)(q0 + i0) * w->lddq, w->lddq, 1); // dq += dS k
    }
}

/* Query block [q0, q0 + nq) of head h (qs, dout in w, or their pairs with
 * dot2) against key block
 * [k0, k0 + nk). Each product runs in strips of ATTN_STRIP rows and stops
 * where the causal mask makes every further term zero: the scores of a
 * query strip cover the keys its last query sees (rounded up to a tile),
 * dV and dK rows of a key strip start at the first query that sees it, dq
 * of a query strip stops at its last visible key. */
static void attn_bwd_block(attn_bwd_scratch *w, const float *lse, const float *D, int b, int h,
                           int q0, int nq, int k0, int nk, const attn_shape *s) {
    int HS = s->HS, Tk = w->ldkt;
    size_t l0 = lse_off(s, b, h, q0);
    const float *qs = w->qs + (size_t)q0 * HS, *dout = w->dout + (size_t)q0 * w->lddo;
    for (int i0 = 0; i0 < nq; i0 += ATTN_STRIP) {
        int ni = min_i(nq - i0, ATTN_STRIP);
        int kn = attn_visible(s, q0 + i0 + ni - 1, k0, nk);
        kn = min_i(nk, (kn + ATTN_STRIP - 1) / ATTN_STRIP * ATTN_STRIP);
        int lo = attn_window_skip(s, q0 + i0, k0, ATTN_STRIP); // keys before every window of the strip
        if (lo >= kn) continue;
        float *sp = w->p + (size_t)i0 * ATTN_BK + lo, *dp = w->ds + (size_t)i0 * ATTN_BK + lo;
        if (s->dot2) { /* from the bf16 pairs, as the forward's scores */
            size_t r = (size_t)(q0 + i0) * w->ldq2;
            const uint32_t *kt = (const uint32_t *)w->kt + k0 + lo, *vt = (const uint32_t *)w->vt + k0 + lo;
            s->dot2(ni, round16(kn - lo), HS / 2, w->q2 + r, w->ldq2, 1, kt, Tk, sp, ATTN_BK, 0);
            s->dot2(ni, round16(kn - lo), HS / 2, w->do2 + r, w->ldq2, 1, vt, Tk, dp, ATTN_BK, 0); // dP = dout v^T
            continue;
        }
        mm_f32(ni, kn - lo, HS, qs + (size_t)i0 * HS, HS, 0, w->kt + k0 + lo, Tk, sp, ATTN_BK, 0); // S = qs k^T
        mm_f32(ni, kn - lo, HS, dout + (size_t)i0 * w->lddo, w->lddo, 0, w->vt + k0 + lo, Tk, dp, ATTN_BK,
               0);                                                                            // dP = dout v^T
    }
    attn_bwd_probs(w, lse + l0, D + l0, b, h, q0, nq, k0, nk, s);
    if (s->dot2) {
        attn_bwd_block_pairs(w, q0, nq, k0, nk, s);
        return;
    }
    for (int r0 = 0; r0 < nk; r0 += ATTN_STRIP) {
        int nr = min_i(nk - r0, ATTN_STRIP);
        int i0 = k0 + r0 - s->q_pos0 - q0; // first query that sees key k0 + r0
        i0 = i0 < 0 ? 0 : i0;
        int i1 = attn_window_end(s, k0 + r0 + nr - 1, q0, nq, 1); // past the last window holding the strip
        if (i0 >= i1) continue;
        size_t o = (size_t)(k0 + r0) * w->lddkv;
        mm_f32(nr, HS, i1 - i0, w->p + (size_t)i0 * ATTN_BK + r0, ATTN_BK, 1, dout + (size_t)i0 * w->lddo, w->lddo,
               w->dv + o, w->lddkv, 1);                                                       // dV += P^T dout
        mm_f32(nr, HS, i1 - i0, w->ds + (size_t)i0 * ATTN_BK + r0, ATTN_BK, 1, qs + (size_t)i0 * HS, HS, w->dk + o,
               w->lddkv, 1);                                                                  // dK += dS^T qs
    }
    for (int i0 = 0; i0 < nq; i0 += ATTN_STRIP) {
        int ni = min_i(nq - i0, ATTN_STRIP);
        int kn = attn_visible(s, q0 + i0 + ni - 1, k0, nk), lo = attn_window_skip(s, q0 + i0, k0, 1);
        if (lo >= kn) continue;
        mm_f32(ni, HS, kn - lo, w->ds + (size_t)i0 * ATTN_BK + lo, ATTN_BK, 0, w->k + (size_t)(k0 + lo) * w->ldk,
               w->ldk, w->dq + (size_t)(q0 + i0) * w->lddq, w->lddq, 1);                      // dq += dS k
    }
}

/* Query head h (its qs and dout in w) against every key block it sees:
 * dk, dv and w->dq accumulate. */
static void attn_bwd_head(attn_bwd_scratch *w, const float *lse, const float *D, int b, int h,
                          const attn_shape *s) {
    for (int k0 = 0; k0 < s->q_pos0 + s->Tq && k0 < s->Tk; k0 += ATTN_BK) {
        int nk = min_i(s->Tk - k0, ATTN_BK);
        int t_first = k0 - s->q_pos0 > 0 ? k0 - s->q_pos0 : 0; // first query seeing k0
        if (s->dot2) t_first = t_first / 2 * 2;                  // pairs of queries start even
        int t_end = s->Tq; // past the last query whose window holds a key of the block
        if (s->window > 0) t_end = min_i(t_end, k0 + nk - 1 + s->window - s->q_pos0);
        for (int q0 = t_first; q0 < t_end; q0 += ATTN_BQ)
            attn_bwd_block(w, lse, D, b, h, q0, min_i(s->Tq - q0, ATTN_BQ), k0, nk, s);
    }
}

/* rows (ld floats apart) x n floats times sc: one pass when they are dense. */
static void scale_rows(float *p, int ld, int rows, int n, float sc) {
    if (ld == n) {
        row_scale(p, sc, rows * n);
        return;
    }
    for (int t = 0; t < rows; t++) row_scale(p + (size_t)t * ld, sc, n);
}

/* rows (ld floats apart) x n floats set to 0: one memset when they are
 * dense (scratch), else one per row (rows in place, between other heads'). */
static void zero_rows(float *p, int ld, int rows, int n) {
    if (ld == n) {
        memset(p, 0, (size_t)rows * n * sizeof(float));
        return;
    }
    for (int t = 0; t < rows; t++) memset(p + (size_t)t * ld, 0, (size_t)n * sizeof(float));
}

/* Task (b, g): dk, dv rows of kv head g and dq rows of its query heads.
 * With s->in_place, fp32 keys, values, dout, dk and dv are used where they
 * lie (dk, dv are accumulated in place); otherwise they go through the
 * scratch rows. */
static void attn_bwd_task(void *dq, void *dk, void *dv, const void *dout,
                          const void *q, const void *k, const void *v, const float *lse,
                          const float *D, int b, int g, const attn_shape *s,
                          attn_bwd_scratch *w) {
    int HS = s->HS, Tk = s->Tk, f32 = s->in_place;
    const float *vrows = w->dvbuf; // v rows, borrowing the dv accumulator until it is cleared
    if (f32) {
        w->k = (const float *)k + kv_off(s, b, 0, g);
        vrows = (const float *)v + kv_off(s, b, 0, g);
        w->ldk = s->NKV * HS;
        w->dk = (float *)dk + kv_off(s, b, 0, g);
        w->dv = (float *)dv + kv_off(s, b, 0, g);
        w->lddkv = s->NKV * HS;
    } else {
        if (!s->dot2) {
            load_rows(w->kbuf, k, Tk, s->NKV, b, 0, g, Tk, s);
            load_rows(w->dvbuf, v, Tk, s->NKV, b, 0, g, Tk, s);
        }
        w->k = w->kbuf;
        w->dk = w->dkbuf;
        w->dv = w->dvbuf;
    }
    if (s->dot2) { /* keys and values as transposed bf16 pairs for S and dP */
        size_t ld2 = (size_t)s->NKV * HS / 2;
        pack_pairs_t((uint32_t *)w->kt, w->ldkt, pair_rows(k, kv_off(s, b, 0, g)), ld2, Tk, w->ldkt, HS);
        pack_pairs_t((uint32_t *)w->vt, w->ldkt, pair_rows(v, kv_off(s, b, 0, g)), ld2, Tk, w->ldkt, HS);
        /* and the keys any query sees as pairs of rows, for dq: with an odd
         * count the last pairs with a zero row, never with an unseen key
         * (0 x NaN is NaN) */
        pack_row_pairs(w->kp, HS, (const uint16_t *)k + kv_off(s, b, 0, g), 2 * ld2, s->dt,
                       min_i(Tk, s->q_pos0 + s->Tq), HS);
    } else {
        transpose32(w->kt, Tk, w->k, w->ldk, Tk, HS);
        transpose32(w->vt, Tk, vrows, w->ldk, Tk, HS);
    }
    zero_rows(w->dk, w->lddkv, Tk, HS);
    zero_rows(w->dv, w->lddkv, Tk, HS);
    for (int h = g * s->G; h < (g + 1) * s->G; h++) {
        if (s->dot2) { /* q and dout as stored, and as pairs of rows */
            w->q2 = pair_rows(q, q_off(s, b, 0, h));
            w->do2 = pair_rows(dout, q_off(s, b, 0, h));
            pack_row_pairs(w->qp, HS, (const uint16_t *)q + q_off(s, b, 0, h), (size_t)s->NH * HS, s->dt, s->Tq, HS);
            pack_row_pairs(w->dop, HS, (const uint16_t *)dout + q_off(s, b, 0, h), (size_t)s->NH * HS, s->dt, s->Tq,
                           HS);
        } else {
            load_q_scaled(w->qs, q, b, h, s);
        }
        if (f32) {
            w->dout = (const float *)dout + q_off(s, b, 0, h);
            w->lddo = s->NH * HS;
        } else {
            if (!s->dot2) load_rows(w->dobuf, dout, s->Tq, s->NH, b, 0, h, s->Tq, s);
            w->dout = w->dobuf; /* unread with dot2, but a real row for attn_bwd_block's pointers */
        }
        w->dq = f32 ? (float *)dq + q_off(s, b, 0, h) : w->dqbuf;
        w->lddq = f32 ? s->NH * HS : HS;
        zero_rows(w->dq, w->lddq, s->Tq, HS);
        attn_bwd_head(w, lse, D, b, h, s);
        scale_rows(w->dq, w->lddq, s->Tq, HS, s->scale);
        if (!f32)
            for (int t = 0; t < s->Tq; t++) row_store(dq, q_off(s, b, t, h), w->dq + (size_t)t * HS, HS, s->dt);
    }
    if (!f32) {
        if (s->dot2) scale_rows(w->dk, HS, Tk, HS, s->scale); /* dK's products left it out */
        for (int t = 0; t < Tk; t++) {
            row_store(dk, kv_off(s, b, t, g), w->dk + (size_t)t * HS, HS, s->dt);
            row_store(dv, kv_off(s, b, t, g), w->dv + (size_t)t * HS, HS, s->dt);
        }
    }
}

void attention_bwd(void *dq, void *dk, void *dv, const void *dout,
                   const void *q, const void *k, const void *v, const void *out,
                   const float *lse, int B, int Tq, int Tk, int NH, int NKV, int HS,
                   int q_pos0, loom_dtype dt) {
    attention_bwd_ex(dq, dk, dv, dout, q, k, v, out, lse, B, Tq, Tk, NH, NKV, HS, q_pos0,
                     &(attn_opts){.scale = attn_default_scale(HS)}, dt);
}

void attention_bwd_ex(void *dq, void *dk, void *dv, const void *dout,
                      const void *q, const void *k, const void *v, const void *out,
                      const float *lse, int B, int Tq, int Tk, int NH, int NKV, int HS,
                      int q_pos0, const attn_opts *o, loom_dtype dt) {
    attn_shape s = attn_shape_with(attn_shape_make(B, Tq, Tk, NH, NKV, HS, q_pos0, dt), o);
    float *D = workspace_floats((size_t)B * NH * Tq);                                  // (B, NH, Tq)
    size_t per = attn_bwd_scratch_floats(&s);
    float *ws = workspace_floats(per * (size_t)omp_get_max_threads());
    attn_rowdot(D, dout, out, &s);
    #pragma omp parallel for schedule(dynamic, 1) if (B * NKV > 1)
    for (int task = 0; task < B * NKV; task++) {
        attn_bwd_scratch w = attn_bwd_scratch_at(ws + per * (size_t)omp_get_thread_num(), &s);
        attn_bwd_task(dq, dk, dv, dout, q, k, v, lse, D, task / NKV, task % NKV, &s, &w);
    }
    loom_free(ws);
    loom_free(D);
}
