/*
 * attention_ref.c — plain references for the flash attention (attention.c):
 * causal grouped-query attention (with a sliding window and dropout when asked) that
 * materialises each query's softmax row, forward and backward, element by element in fp32 with the inputs'
 * dtype loaded and stored through loom_load / loom_store. The tests hold
 * the flash kernels to these.
 *
 * Owns: attention_fwd_ref, attention_bwd_ref. Must never: be fast at the
 * cost of being obvious.
 */
#include "kernels/attention_internal.h"
#include "kernels/kernels.h"

#include <math.h>
#include <string.h>

/* p: (Tk) softmax row of query t of head h (keys lo .. pos, lo =
 * attn_first_key; p is 0 before lo); returns its lse. With a softcap, dcap
 * (Tk, or NULL) gets each score's d capped / d scaled, 1 - tanh^2. */
static float attn_ref_probs(float *p, float *dcap, const void *q, const void *k, int b, int h, int t,
                            const attn_shape *s) {
    int lo = attn_first_key(s, t), n = s->q_pos0 + t + 1, g = h / s->G;
    float m = -INFINITY, sum = 0.0f;
    for (int j = 0; j < lo; j++) p[j] = 0.0f;
    for (int j = lo; j < n; j++) {
        float acc = 0.0f;
        for (int d = 0; d < s->HS; d++)
            acc += loom_load(q, q_off(s, b, t, h) + d, s->dt) *
                   loom_load(k, kv_off(s, b, j, g) + d, s->dt);
        p[j] = acc * s->scale;
        if (s->softcap > 0.0f) {
            float th = tanhf(p[j] / s->softcap);
            p[j] = s->softcap * th;
            if (dcap) dcap[j] = 1.0f - th * th;
        }
        m = fmaxf(m, p[j]);
    }
    for (int j = lo; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
    for (int j = lo; j < n; j++) p[j] /= sum;
    return m + logf(sum);
}

/* z: (Tk) dropout's factor for each key query t of head h sees (1 without
 * dropout). */
static void attn_ref_dropout(float *z, const attn_shape *s, int b, int h, int t) {
    int lo = attn_first_key(s, t), n = s->q_pos0 + t + 1;
    for (int j = lo; j < n; j++) z[j] = 1.0f;
    if (s->drop.p > 0.0f) attn_dropout_row(z + lo, s, b, h, t, lo, n - lo);
}

void attention_fwd_ref(void *out, float *lse, const void *q, const void *k, const void *v,
                       int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                       loom_dtype dt) {
    attention_fwd_ref_ex(out, lse, q, k, v, B, Tq, Tk, NH, NKV, HS, q_pos0,
                         &(attn_opts){.scale = attn_default_scale(HS)}, dt);
}

void attention_fwd_ref_ex(void *out, float *lse, const void *q, const void *k, const void *v,
                          int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                          loom_dtype dt) {
    attn_shape s = attn_shape_with(attn_shape_plain(B, Tq, Tk, NH, NKV, HS, q_pos0, dt), o);
    float *p = workspace_floats(2 * (size_t)Tk), *z = p + Tk; // (Tk) each
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < Tq; t++) {
                float l = attn_ref_probs(p, NULL, q, k, b, h, t, &s);
                if (lse) lse[lse_off(&s, b, h, t)] = l;
                attn_ref_dropout(z, &s, b, h, t);
                for (int d = 0; d < HS; d++) {
                    float acc = 0.0f;
                    for (int j = attn_first_key(&s, t); j <= q_pos0 + t; j++)
                        acc += p[j] * z[j] * loom_load(v, kv_off(&s, b, j, h / s.G) + d, dt);
                    loom_store(out, q_off(&s, b, t, h) + d, dt, acc);
                }
            }
    loom_free(p);
}

/* One query row over the keys it sees, each probability p weighing its
 * value by p z (z: dropout's factor, or 1): dp = z (dout . v), ds = p (dp
 * - sum(p dp)) (times dcap with a softcap); dq = scale ds K, dk32 += scale
 * ds q, dv32 += p z dout. p, dp, dcap, z: (Tk). */
static void attn_ref_bwd_row(void *dq, float *dk32, float *dv32, float *p, float *dp, const float *dcap,
                             const float *z, const void *dout, const void *q, const void *k, const void *v,
                             int b, int h, int t, const attn_shape *s) {
    int lo = attn_first_key(s, t), n = s->q_pos0 + t + 1, g = h / s->G, HS = s->HS;
    size_t qo = q_off(s, b, t, h);
    float Dt = 0.0f;
    for (int j = lo; j < n; j++) {
        dp[j] = 0.0f;
        for (int d = 0; d < HS; d++)
            dp[j] += loom_load(dout, qo + d, s->dt) * loom_load(v, kv_off(s, b, j, g) + d, s->dt);
        dp[j] *= z[j];
        Dt += p[j] * dp[j];
    }
    for (int d = 0; d < HS; d++) {
        float acc = 0.0f, qd = loom_load(q, qo + d, s->dt), od = loom_load(dout, qo + d, s->dt);
        for (int j = lo; j < n; j++) {
            float ds = p[j] * (dp[j] - Dt) * (s->softcap > 0.0f ? dcap[j] : 1.0f);
            acc += ds * loom_load(k, kv_off(s, b, j, g) + d, s->dt);
            dk32[kv_off(s, b, j, g) + d] += s->scale * ds * qd;
            dv32[kv_off(s, b, j, g) + d] += p[j] * z[j] * od;
        }
        loom_store(dq, qo + d, s->dt, s->scale * acc);
    }
}

void attention_bwd_ref(void *dq, void *dk, void *dv, const void *dout,
                       const void *q, const void *k, const void *v,
                       int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                       loom_dtype dt) {
    attention_bwd_ref_ex(dq, dk, dv, dout, q, k, v, B, Tq, Tk, NH, NKV, HS, q_pos0,
                         &(attn_opts){.scale = attn_default_scale(HS)}, dt);
}

void attention_bwd_ref_ex(void *dq, void *dk, void *dv, const void *dout,
                          const void *q, const void *k, const void *v,
                          int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                          loom_dtype dt) {
    attn_shape s = attn_shape_with(attn_shape_plain(B, Tq, Tk, NH, NKV, HS, q_pos0, dt), o);
    size_t nkv = (size_t)B * Tk * NKV * HS;
    float *dk32 = workspace_floats(2 * nkv + 4 * (size_t)Tk); // (B, Tk, NKV, HS) x 2
    float *dv32 = dk32 + nkv, *p = dv32 + nkv, *dp = p + Tk, *dcap = dp + Tk, *z = dcap + Tk;
    memset(dk32, 0, 2 * nkv * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < Tq; t++) {
                attn_ref_probs(p, dcap, q, k, b, h, t, &s);
                attn_ref_dropout(z, &s, b, h, t);
                attn_ref_bwd_row(dq, dk32, dv32, p, dp, dcap, z, dout, q, k, v, b, h, t, &s);
            }
    for (size_t i = 0; i < nkv; i++) {
        loom_store(dk, i, dt, dk32[i]);
        loom_store(dv, i, dt, dv32[i]);
    }
    loom_free(dk32);
}
