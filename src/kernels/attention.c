/*
 * attention.c — causal grouped-query attention, flash-style, and references.
 *
 * Owns: softmax(q k^T * scale + causal mask) v for query heads that share
 * key/value heads, its backward, and plain references that materialise the
 * scores. Query t sits at absolute position q_pos0 + t and sees keys
 * 0 .. q_pos0 + t.
 *
 * Both directions work on blocks converted to fp32 once: ATTN_BQ queries
 * against ATTN_BK keys, with the products as small matrix multiplies
 * (mm_f32: AVX2/FMA or portable C) and the exps vectorized.
 * Forward: one task per (b, h, query block); key blocks are folded in with
 * an online softmax (running max m, running sum l, unnormalised output acc):
 * S = (scale q) k^T, P = exp(S - m), acc = acc * exp(m_old - m) + P v, so no
 * Tq x Tk matrix exists. lse = m + log(l).
 * Backward (FlashAttention-2): one task per (b, kv head g). For each key
 * block and each query block of the group's heads it recomputes
 * P = exp(S - lse) exactly as the forward formed S, then with
 * D_i = rowsum(dout_i * out_i): dP = dout v^T, dS = P (dP - D),
 * dV += P^T dout, dK += dS^T (scale q), dq += dS k (times scale at the end).
 * The task owns the dq rows of its heads too, so no two threads write the
 * same row.
 * Must never: let the thread count or the schedule change a result — every
 * output element is summed by one task in a fixed order.
 */
#include "kernels/kernels.h"
#include "kernels/kernel_rows.h"

#include <math.h>
#include <omp.h>

#define ATTN_BQ 64 /* queries per block */
#define ATTN_BK 64 /* keys per block */

typedef struct attn_shape {
    int B, Tq, Tk, NH, NKV, HS, q_pos0;
    int G; /* query heads per kv head */
    float scale;
    loom_dtype dt;
} attn_shape;

static attn_shape attn_shape_make(int B, int Tq, int Tk, int NH, int NKV, int HS,
                                  int q_pos0, loom_dtype dt) {
    attn_shape s = {B, Tq, Tk, NH, NKV, HS, q_pos0, NH / NKV, 1.0f / sqrtf((float)HS), dt};
    return s;
}

/* Element offsets of rows in q/out/dq (B, Tq, NH, HS), k/v (B, Tk, NKV, HS)
 * and of entries in lse (B, NH, Tq). */
static size_t q_off(const attn_shape *s, int b, int t, int h) {
    return (((size_t)b * s->Tq + t) * s->NH + h) * s->HS;
}
static size_t kv_off(const attn_shape *s, int b, int t, int g) {
    return (((size_t)b * s->Tk + t) * s->NKV + g) * s->HS;
}
static size_t lse_off(const attn_shape *s, int b, int h, int t) {
    return ((size_t)b * s->NH + h) * s->Tq + t;
}

static int min_i(int a, int b) { return a < b ? a : b; }

/* Number of keys in [k0, k0 + nk) that query t sees (0 if none). */
static int attn_visible(const attn_shape *s, int t, int k0, int nk) {
    int n = s->q_pos0 + t - k0 + 1;
    return n < 0 ? 0 : (n < nk ? n : nk);
}

/* Load n rows starting at time t0 of head `head` from a (B, T, H, HS) buffer
 * into dst (n, HS) fp32. */
static void load_rows(float *dst, const void *src, int T, int H, int b, int t0, int head,
                      int n, const attn_shape *s) {
    for (int i = 0; i < n; i++)
        row_load(dst + (size_t)i * s->HS, src, (((size_t)b * T + t0 + i) * H + head) * s->HS,
                 s->HS, s->dt);
}

/* Query rows [q0, q0 + nq) of head h, times scale: qs (nq, HS). Forward and
 * backward form S from this same product, so P agrees bit for bit. */
static void load_q_scaled(float *qs, const void *q, int b, int h, int q0, int nq, const attn_shape *s) {
    load_rows(qs, q, s->Tq, s->NH, b, q0, h, nq, s);
    row_scale(qs, s->scale, nq * s->HS);
}

/* Key rows [k0, k0 + nk) of kv head g as kt (HS, ATTN_BK): transposed, so
 * S = qs · kt is a plain product. tmp: (nk, HS) scratch. */
static void load_kt(float *kt, float *tmp, const void *k, int b, int g, int k0, int nk, const attn_shape *s) {
    load_rows(tmp, k, s->Tk, s->NKV, b, k0, g, nk, s);
    transpose_f32(kt, ATTN_BK, tmp, s->HS, nk, s->HS);
}

/* ---------------------------------------------------------------- forward */

typedef struct attn_fwd_scratch {
    float *q, *acc; // (ATTN_BQ, HS)
    float *kt;      // (HS, ATTN_BK)
    float *k, *v;   // (ATTN_BK, HS)
    float *sc;      // (ATTN_BQ, ATTN_BK) scores, then probabilities
    float *m, *l;   // (ATTN_BQ)
} attn_fwd_scratch;

static size_t attn_fwd_scratch_floats(int HS) {
    return (size_t)(2 * ATTN_BQ + 3 * ATTN_BK) * HS + (size_t)ATTN_BQ * ATTN_BK + 2 * ATTN_BQ;
}

static attn_fwd_scratch attn_fwd_scratch_at(float *p, int HS) {
    attn_fwd_scratch w;
    w.q = p;   p += (size_t)ATTN_BQ * HS;
    w.acc = p; p += (size_t)ATTN_BQ * HS;
    w.kt = p;  p += (size_t)ATTN_BK * HS;
    w.k = p;   p += (size_t)ATTN_BK * HS;
    w.v = p;   p += (size_t)ATTN_BK * HS;
    w.sc = p;  p += (size_t)ATTN_BQ * ATTN_BK;
    w.m = p;   p += ATTN_BQ;
    w.l = p;
    return w;
}

/* Fold the scores sc (nq, ATTN_BK) of one key block into the running
 * softmax: sc becomes P (zero where masked), acc rows are rescaled. */
static void attn_fwd_softmax(attn_fwd_scratch *w, int q0, int nq, int k0, int nk, const attn_shape *s) {
    for (int i = 0; i < nq; i++) {
        float *p = w->sc + (size_t)i * ATTN_BK;
        int n = attn_visible(s, q0 + i, k0, nk);
        for (int j = n; j < nk; j++) p[j] = 0.0f;
        if (n == 0) continue; // this row sees none of the block: m, l, acc unchanged
        float mn = fmaxf(w->m[i], row_max(p, n));
        float corr = expf(w->m[i] - mn); // 0 on the first block, where m = -inf
        float sum = row_exp_sum(p, n, mn);
        w->l[i] = w->l[i] * corr + sum;
        w->m[i] = mn;
        row_scale(w->acc + (size_t)i * s->HS, corr, s->HS);
    }
}

/* Queries [q0, q0 + nq) of head h in batch b: out rows and lse entries. */
static void attn_fwd_block(void *out, float *lse, const void *q, const void *k, const void *v,
                           int b, int h, int q0, int nq, const attn_shape *s,
                           attn_fwd_scratch *w) {
    int HS = s->HS, g = h / s->G;
    int kv_end = s->q_pos0 + q0 + nq; // keys the last query of the block sees
    load_q_scaled(w->q, q, b, h, q0, nq, s);
    memset(w->acc, 0, (size_t)nq * HS * sizeof(float));
    for (int i = 0; i < nq; i++) { w->m[i] = -INFINITY; w->l[i] = 0.0f; }
    for (int k0 = 0; k0 < kv_end; k0 += ATTN_BK) {
        int nk = min_i(kv_end - k0, ATTN_BK);
        load_kt(w->kt, w->k, k, b, g, k0, nk, s);
        load_rows(w->v, v, s->Tk, s->NKV, b, k0, g, nk, s);
        mm_f32(nq, nk, HS, w->q, HS, w->kt, ATTN_BK, w->sc, ATTN_BK, 0);     // S = qs kt
        attn_fwd_softmax(w, q0, nq, k0, nk, s);
        mm_f32(nq, HS, nk, w->sc, ATTN_BK, w->v, HS, w->acc, HS, 1);         // acc += P v
    }
    for (int i = 0; i < nq; i++) {
        float *acc = w->acc + (size_t)i * HS;
        row_scale(acc, 1.0f / w->l[i], HS);
        row_store(out, q_off(s, b, q0 + i, h), acc, HS, s->dt);
        if (lse) lse[lse_off(s, b, h, q0 + i)] = w->m[i] + logf(w->l[i]);
    }
}

void attention_fwd(void *out, float *lse, const void *q, const void *k, const void *v,
                   int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                   loom_dtype dt) {
    attn_shape s = attn_shape_make(B, Tq, Tk, NH, NKV, HS, q_pos0, dt);
    int nqb = (Tq + ATTN_BQ - 1) / ATTN_BQ;
    int ntasks = B * NH * nqb;
    size_t per = attn_fwd_scratch_floats(HS);
    float *ws = workspace_floats(per * (size_t)omp_get_max_threads());
    // Round-robin (static, 1): later query blocks see more keys.
    #pragma omp parallel for schedule(static, 1) if (ntasks > 1)
    for (int task = 0; task < ntasks; task++) {
        attn_fwd_scratch w = attn_fwd_scratch_at(ws + per * (size_t)omp_get_thread_num(), HS);
        int qb = task % nqb, h = (task / nqb) % NH, b = task / (nqb * NH);
        int q0 = qb * ATTN_BQ, nq = min_i(Tq - q0, ATTN_BQ);
        attn_fwd_block(out, lse, q, k, v, b, h, q0, nq, &s, &w);
    }
    loom_free(ws);
}

/* --------------------------------------------------------------- backward */

typedef struct attn_bwd_scratch {
    float *k, *dk, *dv;      // (ATTN_BK, HS)
    float *kt, *vt;          // (HS, ATTN_BK)
    float *q, *dout;         // (ATTN_BQ, HS)
    float *p, *ds;           // (ATTN_BQ, ATTN_BK)
    float *t;                // (ATTN_BK, ATTN_BQ) a transposed P or dS
} attn_bwd_scratch;

static size_t attn_bwd_scratch_floats(int HS) {
    return (size_t)(5 * ATTN_BK + 2 * ATTN_BQ) * HS + 3 * (size_t)ATTN_BQ * ATTN_BK;
}

static attn_bwd_scratch attn_bwd_scratch_at(float *p, int HS) {
    attn_bwd_scratch w;
    size_t kb = (size_t)ATTN_BK * HS, qb = (size_t)ATTN_BQ * HS, sb = (size_t)ATTN_BQ * ATTN_BK;
    w.k = p;  p += kb;
    w.dk = p; p += kb;
    w.dv = p; p += kb;
    w.kt = p; p += kb;
    w.vt = p; p += kb;
    w.q = p;  p += qb;
    w.dout = p; p += qb;
    w.p = p;  p += sb;
    w.ds = p; p += sb;
    w.t = p;
    return w;
}

/* D: (B, NH, Tq) = rowsum(dout * out) in fp32. */
static void attn_rowdot(float *D, const void *dout, const void *out, const attn_shape *s) {
    int rows = s->B * s->Tq * s->NH, HS = s->HS;
    int nt = omp_get_max_threads();
    float *tmp = workspace_floats((size_t)nt * 2 * HS);
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *a = tmp + (size_t)omp_get_thread_num() * 2 * HS, *o = a + HS;
        int h = r % s->NH, t = (r / s->NH) % s->Tq, b = r / (s->NH * s->Tq);
        row_load(a, dout, (size_t)r * HS, HS, s->dt);
        row_load(o, out, (size_t)r * HS, HS, s->dt);
        D[lse_off(s, b, h, t)] = row_dot(a, o, HS);
    }
    loom_free(tmp);
}

/* P = exp(S - lse) for the block (zero where masked), then dS = P (dP - D).
 * w->p holds S on entry and P on exit; w->ds holds dP on entry. */
static void attn_bwd_probs(attn_bwd_scratch *w, const float *lse, const float *D, int q0, int nq,
                           int k0, int nk, const attn_shape *s) {
    for (int i = 0; i < nq; i++) {
        float *p = w->p + (size_t)i * ATTN_BK, *ds = w->ds + (size_t)i * ATTN_BK;
        int n = attn_visible(s, q0 + i, k0, nk);
        row_exp_sum(p, n, lse[i]);
        for (int j = n; j < nk; j++) p[j] = 0.0f;
        for (int j = 0; j < nk; j++) ds[j] = p[j] * (ds[j] - D[i]);
    }
}

/* All queries of head h that see the key block [k0, k0 + nk) (k, kt, vt in
 * w). dq32: (B, Tq, NH, HS) fp32 accumulator (unscaled). */
static void attn_bwd_head(float *dq32, attn_bwd_scratch *w, const void *dout, const void *q,
                          const float *lse, const float *D, int b, int h, int k0, int nk,
                          const attn_shape *s) {
    int HS = s->HS, ldq = s->NH * HS;
    int t_first = k0 - s->q_pos0 > 0 ? k0 - s->q_pos0 : 0; // first query seeing k0
    for (int q0 = t_first; q0 < s->Tq; q0 += ATTN_BQ) {
        int nq = min_i(s->Tq - q0, ATTN_BQ);
        size_t l0 = lse_off(s, b, h, q0);
        load_q_scaled(w->q, q, b, h, q0, nq, s);
        load_rows(w->dout, dout, s->Tq, s->NH, b, q0, h, nq, s);
        mm_f32(nq, nk, HS, w->q, HS, w->kt, ATTN_BK, w->p, ATTN_BK, 0);       // S = qs kt
        mm_f32(nq, nk, HS, w->dout, HS, w->vt, ATTN_BK, w->ds, ATTN_BK, 0);   // dP = dout vt
        attn_bwd_probs(w, lse + l0, D + l0, q0, nq, k0, nk, s);
        transpose_f32(w->t, ATTN_BQ, w->p, ATTN_BK, nq, nk);
        mm_f32(nk, HS, nq, w->t, ATTN_BQ, w->dout, HS, w->dv, HS, 1);         // dV += P^T dout
        transpose_f32(w->t, ATTN_BQ, w->ds, ATTN_BK, nq, nk);
        mm_f32(nk, HS, nq, w->t, ATTN_BQ, w->q, HS, w->dk, HS, 1);            // dK += dS^T qs
        mm_f32(nq, HS, nk, w->ds, ATTN_BK, w->k, HS, dq32 + q_off(s, b, q0, h), ldq, 1); // dq += dS k
    }
}

/* Task (b, g): dk, dv rows of kv head g and dq rows of its query heads. */
static void attn_bwd_task(void *dq, void *dk, void *dv, float *dq32, const void *dout,
                          const void *q, const void *k, const void *v, const float *lse,
                          const float *D, int b, int g, const attn_shape *s,
                          attn_bwd_scratch *w) {
    int HS = s->HS, h0 = g * s->G, GHS = s->G * HS; // heads h0 .. h0+G-1 are contiguous
    for (int t = 0; t < s->Tq; t++)
        memset(dq32 + q_off(s, b, t, h0), 0, (size_t)GHS * sizeof(float));
    for (int k0 = 0; k0 < s->Tk; k0 += ATTN_BK) {
        int nk = min_i(s->Tk - k0, ATTN_BK);
        memset(w->dk, 0, (size_t)nk * HS * sizeof(float));
        memset(w->dv, 0, (size_t)nk * HS * sizeof(float));
        if (k0 < s->q_pos0 + s->Tq) { // else no query sees these keys: zero grads
            load_rows(w->k, k, s->Tk, s->NKV, b, k0, g, nk, s);
            transpose_f32(w->kt, ATTN_BK, w->k, HS, nk, HS);
            load_rows(w->dk, v, s->Tk, s->NKV, b, k0, g, nk, s); // v rows, borrowing dk
            transpose_f32(w->vt, ATTN_BK, w->dk, HS, nk, HS);
            memset(w->dk, 0, (size_t)nk * HS * sizeof(float));
            for (int h = h0; h < h0 + s->G; h++)
                attn_bwd_head(dq32, w, dout, q, lse, D, b, h, k0, nk, s);
        }
        for (int j = 0; j < nk; j++) {
            row_store(dk, kv_off(s, b, k0 + j, g), w->dk + (size_t)j * HS, HS, s->dt);
            row_store(dv, kv_off(s, b, k0 + j, g), w->dv + (size_t)j * HS, HS, s->dt);
        }
    }
    for (int t = 0; t < s->Tq; t++) {
        float *r = dq32 + q_off(s, b, t, h0);
        row_scale(r, s->scale, GHS);
        if ((void *)dq32 != dq) row_store(dq, q_off(s, b, t, h0), r, GHS, s->dt);
    }
}

void attention_bwd(void *dq, void *dk, void *dv, const void *dout,
                   const void *q, const void *k, const void *v, const void *out,
                   const float *lse, int B, int Tq, int Tk, int NH, int NKV, int HS,
                   int q_pos0, loom_dtype dt) {
    attn_shape s = attn_shape_make(B, Tq, Tk, NH, NKV, HS, q_pos0, dt);
    size_t nq_elems = (size_t)B * Tq * NH * HS;
    float *D = workspace_floats((size_t)B * NH * Tq);                         // (B, NH, Tq)
    float *dq32 = dt == LOOM_F32 ? (float *)dq : workspace_floats(nq_elems); // (B, Tq, NH, HS)
    size_t per = attn_bwd_scratch_floats(HS);
    float *ws = workspace_floats(per * (size_t)omp_get_max_threads());
    attn_rowdot(D, dout, out, &s);
    #pragma omp parallel for schedule(static) if (B * NKV > 1)
    for (int task = 0; task < B * NKV; task++) {
        attn_bwd_scratch w = attn_bwd_scratch_at(ws + per * (size_t)omp_get_thread_num(), HS);
        attn_bwd_task(dq, dk, dv, dq32, dout, q, k, v, lse, D, task / NKV, task % NKV, &s, &w);
    }
    loom_free(ws);
    if ((void *)dq32 != dq) loom_free(dq32);
    loom_free(D);
}

/* ------------------------------------------------------------- references */

/* p: (Tk) softmax row of query t of head h (keys 0 .. pos); returns its lse. */
static float attn_ref_probs(float *p, const void *q, const void *k, int b, int h, int t,
                            const attn_shape *s) {
    int n = s->q_pos0 + t + 1, g = h / s->G;
    float m = -INFINITY, sum = 0.0f;
    for (int j = 0; j < n; j++) {
        float acc = 0.0f;
        for (int d = 0; d < s->HS; d++)
            acc += loom_load(q, q_off(s, b, t, h) + d, s->dt) *
                   loom_load(k, kv_off(s, b, j, g) + d, s->dt);
        p[j] = acc * s->scale;
        m = fmaxf(m, p[j]);
    }
    for (int j = 0; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
    for (int j = 0; j < n; j++) p[j] /= sum;
    return m + logf(sum);
}

void attention_fwd_ref(void *out, float *lse, const void *q, const void *k, const void *v,
                       int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                       loom_dtype dt) {
    attn_shape s = attn_shape_make(B, Tq, Tk, NH, NKV, HS, q_pos0, dt);
    float *p = workspace_floats((size_t)Tk); // (Tk)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < Tq; t++) {
                float l = attn_ref_probs(p, q, k, b, h, t, &s);
                if (lse) lse[lse_off(&s, b, h, t)] = l;
                for (int d = 0; d < HS; d++) {
                    float o = 0.0f;
                    for (int j = 0; j <= q_pos0 + t; j++)
                        o += p[j] * loom_load(v, kv_off(&s, b, j, h / s.G) + d, dt);
                    loom_store(out, q_off(&s, b, t, h) + d, dt, o);
                }
            }
    loom_free(p);
}

/* One query row: dp = dout . v, ds = p (dp - sum(p dp)); dq = scale ds K,
 * dk32 += scale ds q, dv32 += p dout. p, dp: (n). */
static void attn_ref_bwd_row(void *dq, float *dk32, float *dv32, float *p, float *dp,
                             const void *dout, const void *q, const void *k, const void *v,
                             int b, int h, int t, const attn_shape *s) {
    int n = s->q_pos0 + t + 1, g = h / s->G, HS = s->HS;
    size_t qo = q_off(s, b, t, h);
    float Dt = 0.0f;
    for (int j = 0; j < n; j++) {
        dp[j] = 0.0f;
        for (int d = 0; d < HS; d++)
            dp[j] += loom_load(dout, qo + d, s->dt) * loom_load(v, kv_off(s, b, j, g) + d, s->dt);
        Dt += p[j] * dp[j];
    }
    for (int d = 0; d < HS; d++) {
        float acc = 0.0f, qd = loom_load(q, qo + d, s->dt), od = loom_load(dout, qo + d, s->dt);
        for (int j = 0; j < n; j++) {
            float ds = p[j] * (dp[j] - Dt);
            acc += ds * loom_load(k, kv_off(s, b, j, g) + d, s->dt);
            dk32[kv_off(s, b, j, g) + d] += s->scale * ds * qd;
            dv32[kv_off(s, b, j, g) + d] += p[j] * od;
        }
        loom_store(dq, qo + d, s->dt, s->scale * acc);
    }
}

void attention_bwd_ref(void *dq, void *dk, void *dv, const void *dout,
                       const void *q, const void *k, const void *v,
                       int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                       loom_dtype dt) {
    attn_shape s = attn_shape_make(B, Tq, Tk, NH, NKV, HS, q_pos0, dt);
    size_t nkv = (size_t)B * Tk * NKV * HS;
    float *dk32 = workspace_floats(2 * nkv + 2 * (size_t)Tk); // (B, Tk, NKV, HS) x 2
    float *dv32 = dk32 + nkv, *p = dv32 + nkv, *dp = p + Tk;
    memset(dk32, 0, 2 * nkv * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < Tq; t++) {
                attn_ref_probs(p, q, k, b, h, t, &s);
                attn_ref_bwd_row(dq, dk32, dv32, p, dp, dout, q, k, v, b, h, t, &s);
            }
    for (size_t i = 0; i < nkv; i++) {
        loom_store(dk, i, dt, dk32[i]);
        loom_store(dv, i, dt, dv32[i]);
    }
    loom_free(dk32);
}
