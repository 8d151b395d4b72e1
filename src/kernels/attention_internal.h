/*
 * attention_internal.h — private to src/kernels/attention*.c: the shape of
 * one attention call and the element offsets of its buffers, shared by the
 * flash kernels (attention.c) and the plain references (attention_ref.c).
 *
 * Must never: be included elsewhere, or hold state.
 */
#ifndef LOOM_ATTENTION_INTERNAL_H
#define LOOM_ATTENTION_INTERNAL_H

#include "kernels/kernel_rows.h"
#include "kernels/kernels.h"

#include <math.h>

typedef struct attn_shape {
    int B, Tq, Tk, NH, NKV, HS, q_pos0;
    int G; /* query heads per kv head */
    float scale;
    loom_dtype dt;
    int in_place; /* fp32 rows read (and dk, dv, dq summed) where they lie: attention.c's attn_shape_make */
    mm_bf16_fn dot2; /* bf16 inputs, HS a multiple of 16, a CPU with bf16 dot products: every product */
    float softcap;   /* > 0: each scaled score s becomes softcap tanh(s / softcap) (Gemma 2's); 0: none */
    int window;      /* > 0: query t sees keys from attn_first_key on (a sliding window); 0: from key 0 */
    attn_dropout drop; /* p > 0: the probabilities dropped out (attn_dropout_row); B_all, NH_all filled in */
} attn_shape;

/* A scaled score s softcapped (softcap > 0), as Hugging Face's Gemma 2 computes it: s / c, tanh, times c. */
static inline float attn_softcap(float s, float softcap) { return softcap * tanhf(s / softcap); }

/* LLaMA's scale of the scores: 1 / sqrt(HS). */
static inline float attn_default_scale(int HS) { return 1.0f / sqrtf((float)HS); }

/* The call's dimensions, scale 1 / sqrt(HS); no flash-kernel choices made. */
static inline attn_shape attn_shape_plain(int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                                          loom_dtype dt) {
    attn_shape s = {.B = B, .Tq = Tq, .Tk = Tk, .NH = NH, .NKV = NKV, .HS = HS, .q_pos0 = q_pos0, .G = NH / NKV,
                    .scale = attn_default_scale(HS), .dt = dt};
    return s;
}

/* The call's dimensions with the caller's scale, softcap and window; a
 * window that holds every key up to the last query is none (so the
 * kernels' sums of positions and the window stay far from INT_MAX). */
static inline attn_shape attn_shape_with(attn_shape s, const attn_opts *o) {
    s.scale = o->scale;
    s.softcap = o->softcap;
    s.window = o->window >= s.q_pos0 + s.Tq ? 0 : o->window;
    s.drop = o->drop;
    if (!s.drop.B_all) s.drop.B_all = s.B;
    if (!s.drop.NH_all) s.drop.NH_all = s.NH;
    return s;
}

/* The first key that query t sees: its window's first (0 without a window,
 * or while the window reaches back past key 0). It sees keys up to q_pos0 + t. */
static inline int attn_first_key(const attn_shape *s, int t) {
    int lo = s->q_pos0 + t - s->window + 1;
    return s->window > 0 && lo > 0 ? lo : 0;
}

/* z[j] = attention dropout's factor for the probability of query t of
 * head h (batch row b) for key k0 + j, j < n: 1 / (1 - p) where the mask
 * keeps it, else 0 (loom_dropout's rule on the whole batch's (B_all,
 * NH_all, Tq, Tk) probabilities: kernels.h's attn_dropout). */
static inline void attn_dropout_row(float *z, const attn_shape *s, int b, int h, int t, int k0, int n) {
    const attn_dropout *d = &s->drop;
    uint64_t e0 = (((uint64_t)(d->b0 + b) * (uint64_t)d->NH_all + (uint64_t)(d->h0 + h)) * (uint64_t)s->Tq +
                   (uint64_t)t) * (uint64_t)s->Tk + (uint64_t)k0;
    dropout_factors(z, (size_t)n, e0, d->p, d->seed, d->offset);
}

/* Element offsets of rows in q/out/dq (B, Tq, NH, HS), k/v (B, Tk, NKV, HS)
 * and of entries in lse (B, NH, Tq). */
static inline size_t q_off(const attn_shape *s, int b, int t, int h) {
    return (((size_t)b * s->Tq + t) * s->NH + h) * s->HS;
}
static inline size_t kv_off(const attn_shape *s, int b, int t, int g) {
    return (((size_t)b * s->Tk + t) * s->NKV + g) * s->HS;
}
static inline size_t lse_off(const attn_shape *s, int b, int h, int t) {
    return ((size_t)b * s->NH + h) * s->Tq + t;
}

#endif
