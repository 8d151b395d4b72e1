/*
 * test_attention.c — causal GQA attention: flash kernels vs the materialised
 * references (f32, bf16, f16), forward vs a double-precision formula,
 * backward vs central finite differences, the causal mask, the KV-cache
 * shapes (q_pos0 > 0, Tq = 1 and 3), sizes off the block sizes (32 queries,
 * 64 keys), a scale of the caller's (Granite's), softcapped scores (Gemma
 * 2's), sliding windows (Mistral's), attention dropout (Granite 3's: the
 * mask loom_dropout's over the whole batch, a call on part of it told where
 * it lies), and bit-reproducibility across thread counts.
 */
#include "testutil.h"
#include "kernels/kernels.h"
#include "kernels/kernel_rows.h"

#include <limits.h>
#include <math.h>

#define FD_STEP 1e-3f

static double unit_roundoff(loom_dtype dt) {
    return dt == LOOM_BF16 ? 0x1p-8 : dt == LOOM_F16 ? 0x1p-11 : 0x1p-24;
}

typedef struct attn_case {
    int B, Tq, Tk, NH, NKV, HS, pos0;
} attn_case;

static const attn_case CASES[] = {
    {2, 37, 37, 4, 2, 16, 0},   // GQA, T off both block sizes
    {1, 70, 70, 4, 1, 8, 0},    // one kv head, several query and key blocks
    {2, 1, 50, 4, 2, 16, 49},   // KV cache: one new token
    {1, 3, 43, 4, 2, 16, 40},   // KV cache: three new tokens
    {1, 3, 47, 4, 1, 16, 40},   // keys past the last query are never seen
    {1, 100, 140, 4, 2, 8, 40}, // q_pos0 > 0 with many blocks of both kinds
    {1, 1, 65, 4, 2, 8, 64},    // a key block only the last query sees
    {1, 130, 130, 2, 2, 48, 0}, // a model's head size, blocks full and partial
    {2, 70, 70, 16, 8, 64, 0},  // strides of 2 and 4 KiB: fp32 rows go through dense scratch
    {1, 70, 100, 16, 4, 32, 30}, // GQA, only the query stride 2 KiB, q_pos0 > 0: dense scratch
    {1, 3, 75, 8, 2, 64, 67},   // KV cache, query stride 2 KiB, unseen keys: few queries, in place
    {2, 1, 80, 8, 8, 64, 60},   // one new token, both strides 2 KiB: in place
    {2, 40, 40, 4, 2, 7, 0},    // an odd head size: bf16 pairs would straddle two heads
    {1, 69, 100, 4, 2, 16, 31}, // odd q_pos0 and Tq: blocks and strips start on odd queries, odd counts
    {1, 1, 65, 4, 2, 16, 64},   // a key block only the last query sees, with bf16 pairs
    {1, 100, 141, 4, 2, 16, 41}, // odd q_pos0 > 0, many blocks of both kinds, with bf16 pairs
};
#define N_CASES (sizeof CASES / sizeof CASES[0])

/* Inputs as f32 and as dt; outputs as dt; sizes. */
typedef struct attn_data {
    attn_case c;
    loom_dtype dt;
    size_t nq, nkv, nlse;     // elements of q/out, k/v, lse
    float *qf, *kf, *vf, *df; // f32 sources
    void *q, *k, *v, *dout;   // dt copies
} attn_data;

static attn_data data_make(const attn_case *c, loom_dtype dt, uint64_t seed) {
    attn_data d = {.c = *c, .dt = dt};
    d.nq = (size_t)c->B * c->Tq * c->NH * c->HS;
    d.nkv = (size_t)c->B * c->Tk * c->NKV * c->HS;
    d.nlse = (size_t)c->B * c->NH * c->Tq;
    d.qf = malloc(d.nq * 4); d.df = malloc(d.nq * 4);
    d.kf = malloc(d.nkv * 4); d.vf = malloc(d.nkv * 4);
    tu_fill_uniform(d.qf, d.nq, -2.0f, 2.0f, seed); // peaked enough to matter
    tu_fill_uniform(d.kf, d.nkv, -2.0f, 2.0f, seed + 1);
    tu_fill_uniform(d.vf, d.nkv, -1.0f, 1.0f, seed + 2);
    tu_fill_uniform(d.df, d.nq, -1.0f, 1.0f, seed + 3);
    d.q = tu_from_f32(d.qf, d.nq, dt); d.dout = tu_from_f32(d.df, d.nq, dt);
    d.k = tu_from_f32(d.kf, d.nkv, dt); d.v = tu_from_f32(d.vf, d.nkv, dt);
    return d;
}

static void data_free(attn_data *d) {
    free(d->qf); free(d->kf); free(d->vf); free(d->df);
    free(d->q); free(d->k); free(d->v); free(d->dout);
}

#define CASE_ARGS(c) (c).B, (c).Tq, (c).Tk, (c).NH, (c).NKV, (c).HS, (c).pos0

static void assert_close_dt(const void *a, const void *b, size_t n, loom_dtype dt,
                            double atol, double rtol) {
    float *fa = tu_to_f32(a, n, dt), *fb = tu_to_f32(b, n, dt);
    TU_ASSERT_CLOSE(fa, fb, n, atol, rtol);
    free(fa);
    free(fb);
}

/* ---------------------------------------------------------------- forward */

/* With bf16 pairs (bf16 inputs, a head size that is a multiple of 16, and
 * AVX-512 BF16 tiles, native or emulated) the forward rounds P to bf16 for
 * P v, which moves an output by up to u sum_j p_j |v_j| on top of the
 * fp32 path's error. The bound per element (a reference run on |v| with the
 * scores times scale, times 1 + 2u for its own rounding), or NULL when P
 * stays fp32. */
static float *pv_rounding_bound_opts(const attn_data *d, const attn_opts *ao) {
    if (d->dt != LOOM_BF16 || d->c.HS % 16 != 0 || !mm_bf16_tiles()) return NULL;
    float *va = tu_to_f32(d->v, d->nkv, d->dt);
    for (size_t i = 0; i < d->nkv; i++) va[i] = fabsf(va[i]);
    void *vabs = tu_from_f32(va, d->nkv, d->dt), *o = malloc(d->nq * 2);
    attention_fwd_ref_ex(o, NULL, d->q, d->k, vabs, CASE_ARGS(d->c), ao, d->dt);
    float *bound = tu_to_f32(o, d->nq, d->dt);
    double u = unit_roundoff(d->dt);
    for (size_t i = 0; i < d->nq; i++) bound[i] = (float)(u * (1.0 + 2.0 * u) * bound[i]);
    free(va); free(vabs); free(o);
    return bound;
}

static float *pv_rounding_bound(const attn_data *d) {
    attn_opts ao = {.scale = 1.0f / sqrtf((float)d->c.HS)};
    return pv_rounding_bound_opts(d, &ao);
}

/* |got - want| <= atol + bound[i] + rtol |want| for every element (bound
 * NULL: no per-element term). */
static void assert_close_bound(const float *got, const float *want, const float *bound, size_t n, double atol,
                               double rtol) {
    size_t worst = 0;
    double ratio = 0.0;
    for (size_t i = 0; i < n; i++) {
        double tol = atol + (bound ? bound[i] : 0.0) + rtol * fabs(want[i]);
        double r = fabs((double)got[i] - want[i]) / tol;
        if (!(r <= ratio)) { ratio = r; worst = i; }
    }
    if (!(ratio <= 1.0)) {
        fprintf(stderr, "worst at [%zu]: %.9g vs %.9g, bound %.3g (ratio %.3g)\n", worst, got[worst], want[worst],
                bound ? bound[worst] : 0.0, ratio);
        fail();
    }
}

/* Online softmax vs one pass over the whole row: fp32 reassociation, a few
 * 2^-24 relative on |out| <= 1; after one rounding to dt, one ulp (2u); and
 * P's rounding where bf16 pairs take P v. */
static void check_fwd_vs_ref(const attn_case *c, loom_dtype dt) {
    attn_data d = data_make(c, dt, 100);
    void *o1 = malloc(d.nq * 4), *o2 = malloc(d.nq * 4);
    float *l1 = malloc(d.nlse * 4), *l2 = malloc(d.nlse * 4);
    attention_fwd(o1, l1, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    attention_fwd_ref(o2, l2, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    float *f1 = tu_to_f32(o1, d.nq, dt), *f2 = tu_to_f32(o2, d.nq, dt), *bound = pv_rounding_bound(&d);
    assert_close_bound(f1, f2, bound, d.nq, 1e-6, 2.0 * unit_roundoff(dt) + 1e-5);
    free(f1); free(f2); free(bound);
    TU_ASSERT_CLOSE(l1, l2, d.nlse, 1e-5, 1e-5);
    free(o1); free(o2); free(l1); free(l2);
    data_free(&d);
}

static void test_fwd_vs_ref(void **state) {
    (void)state;
    for (size_t i = 0; i < N_CASES; i++) {
        check_fwd_vs_ref(&CASES[i], LOOM_F32);
        check_fwd_vs_ref(&CASES[i], LOOM_BF16);
        check_fwd_vs_ref(&CASES[i], LOOM_F16);
    }
}

/* Independent oracle in double on the dt-rounded inputs: query t of head h
 * uses kv head h / (NH / NKV) and keys 0 .. pos0 + t (with a window W > 0,
 * only the last W of them); scores times scale, then softcap tanh(. /
 * softcap) with a softcap; with z (B, NH, Tq, Tk) each probability weighs
 * its value times z (dropout's factors). */
static void attention_double_opts(float *out, float *lse, const attn_data *d, double scale, double softcap,
                                  int window, const float *z) {
    const attn_case *c = &d->c;
    int G = c->NH / c->NKV;
    double *p = malloc(sizeof(double) * c->Tk);
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->Tq; t++)
            for (int h = 0; h < c->NH; h++) {
                size_t qo = (((size_t)b * c->Tq + t) * c->NH + h) * c->HS;
                int n = c->pos0 + t + 1, lo = window > 0 && n > window ? n - window : 0;
                double m = -INFINITY, sum = 0.0;
                for (int j = lo; j < n; j++) {
                    size_t ko = (((size_t)b * c->Tk + j) * c->NKV + h / G) * c->HS;
                    p[j] = 0.0;
                    for (int e = 0; e < c->HS; e++)
                        p[j] += (double)loom_load(d->q, qo + e, d->dt) *
                                loom_load(d->k, ko + e, d->dt);
                    p[j] *= scale;
                    if (softcap > 0.0) p[j] = softcap * tanh(p[j] / softcap);
                    m = fmax(m, p[j]);
                }
                for (int j = lo; j < n; j++) sum += (p[j] = exp(p[j] - m));
                lse[((size_t)b * c->NH + h) * c->Tq + t] = (float)(m + log(sum));
                for (int e = 0; e < c->HS; e++) {
                    double o = 0.0;
                    for (int j = lo; j < n; j++) {
                        size_t vo = (((size_t)b * c->Tk + j) * c->NKV + h / G) * c->HS;
                        double zj = z ? z[(((size_t)b * c->NH + h) * c->Tq + t) * c->Tk + j] : 1.0;
                        o += p[j] * zj * loom_load(d->v, vo + e, d->dt);
                    }
                    out[qo + e] = (float)(o / sum);
                }
            }
    free(p);
}

static void attention_double(float *out, float *lse, const attn_data *d) {
    attention_double_opts(out, lse, d, 1.0 / sqrt((double)d->c.HS), 0.0, 0, NULL);
}

/* fp32 accumulation error (< 1e-5 here) plus one rounding to dt (u), and
 * P's rounding where bf16 pairs take P v. */
static void check_fwd_formula(const attn_case *c, loom_dtype dt) {
    attn_data d = data_make(c, dt, 200);
    void *o = malloc(d.nq * 4);
    float *l = malloc(d.nlse * 4), *wo = malloc(d.nq * 4), *wl = malloc(d.nlse * 4);
    attention_fwd(o, l, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    attention_double(wo, wl, &d);
    float *got = tu_to_f32(o, d.nq, dt), *bound = pv_rounding_bound(&d);
    assert_close_bound(got, wo, bound, d.nq, 1e-5, unit_roundoff(dt) + 1e-5);
    free(bound);
    TU_ASSERT_CLOSE(l, wl, d.nlse, 1e-5, 1e-5);
    free(o); free(l); free(wo); free(wl); free(got);
    data_free(&d);
}

static void test_fwd_formula(void **state) {
    (void)state;
    for (size_t i = 0; i < N_CASES; i++) {
        check_fwd_formula(&CASES[i], LOOM_F32);
        check_fwd_formula(&CASES[i], LOOM_BF16);
    }
}

/* lse = NULL is allowed and changes nothing else. */
static void test_fwd_without_lse(void **state) {
    (void)state;
    attn_data d = data_make(&CASES[0], LOOM_F32, 300);
    float *o1 = malloc(d.nq * 4), *o2 = malloc(d.nq * 4), *l = malloc(d.nlse * 4);
    attention_fwd(o1, l, d.q, d.k, d.v, CASE_ARGS(d.c), LOOM_F32);
    attention_fwd(o2, NULL, d.q, d.k, d.v, CASE_ARGS(d.c), LOOM_F32);
    assert_true(tu_bits_equal(o1, o2, d.nq * 4, "out"));
    free(o1); free(o2); free(l);
    data_free(&d);
}

/* Changing key/value t' must leave every query before position t' bit-for-bit
 * unchanged, and must change the ones at or after it. */
static void test_causal_mask(void **state) {
    (void)state;
    attn_case c = {1, 70, 70, 4, 2, 8, 0};
    attn_data d = data_make(&c, LOOM_F32, 400);
    int tp = 45;
    float *o1 = malloc(d.nq * 4), *o2 = malloc(d.nq * 4);
    attention_fwd(o1, NULL, d.qf, d.kf, d.vf, CASE_ARGS(c), LOOM_F32);
    for (int e = 0; e < c.NKV * c.HS; e++) {
        d.kf[(size_t)tp * c.NKV * c.HS + e] += 0.5f;
        d.vf[(size_t)tp * c.NKV * c.HS + e] -= 0.5f;
    }
    attention_fwd(o2, NULL, d.qf, d.kf, d.vf, CASE_ARGS(c), LOOM_F32);
    size_t row = (size_t)c.NH * c.HS; // elements per time step
    assert_true(tu_bits_equal(o1, o2, tp * row * 4, "queries before t'"));
    for (int t = tp; t < c.Tq; t++)
        assert_false(tu_bits_equal(o1 + t * row, o2 + t * row, row * 4, NULL));
    free(o1); free(o2);
    data_free(&d);
}

/* In the KV-cache shape, keys at or past q_pos0 + Tq are never seen:
 * filling them with NaN changes nothing, and their gradients are zero. fp32
 * and bf16, a head size that takes the bf16 pairs and one that does not,
 * q_pos0 + Tq odd (a pair of keys would take the first unseen one). */
static void check_kv_cache_unseen_keys(const attn_case *c, loom_dtype dt) {
    attn_data d = data_make(c, dt, 500);
    size_t es = loom_dtype_size(dt);
    void *o1 = malloc(d.nq * es), *o2 = malloc(d.nq * es), *dq = malloc(d.nq * es);
    void *dk = malloc(d.nkv * es), *dv = malloc(d.nkv * es);
    float *l = malloc(d.nlse * 4);
    attention_fwd(o1, l, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    size_t seen = (size_t)(c->pos0 + c->Tq) * c->NKV * c->HS;
    for (size_t i = seen; i < d.nkv; i++) {
        loom_store(d.k, i, dt, NAN);
        loom_store(d.v, i, dt, NAN);
    }
    attention_fwd(o2, NULL, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    assert_true(tu_bits_equal(o1, o2, d.nq * es, "out"));
    memset(dk, 0xff, d.nkv * es); // NaN: every element must be written
    memset(dv, 0xff, d.nkv * es);
    attention_bwd(dq, dk, dv, d.dout, d.q, d.k, d.v, o1, l, CASE_ARGS(*c), dt);
    for (size_t i = seen; i < d.nkv; i++) assert_true(loom_load(dk, i, dt) == 0.0f && loom_load(dv, i, dt) == 0.0f);
    for (size_t i = 0; i < seen; i++) assert_true(isfinite(loom_load(dk, i, dt)) && isfinite(loom_load(dv, i, dt)));
    for (size_t i = 0; i < d.nq; i++) assert_true(isfinite(loom_load(dq, i, dt)));
    free(o1); free(o2); free(l); free(dq); free(dk); free(dv);
    data_free(&d);
}

static void test_kv_cache_unseen_keys(void **state) {
    (void)state;
    const attn_case cases[] = {{1, 3, 47, 4, 2, 8, 40}, {1, 3, 47, 4, 2, 16, 40}, {1, 1, 48, 4, 2, 16, 40}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        check_kv_cache_unseen_keys(&cases[i], LOOM_F32);
        check_kv_cache_unseen_keys(&cases[i], LOOM_BF16);
    }
}

/* --------------------------------------------------------------- backward */

typedef struct attn_grads {
    void *dq, *dk, *dv;
} attn_grads;

static attn_grads grads_alloc(const attn_data *d) {
    attn_grads g = {malloc(d->nq * 4), malloc(d->nkv * 4), malloc(d->nkv * 4)};
    return g;
}

static void grads_free(attn_grads *g) { free(g->dq); free(g->dk); free(g->dv); }

/* The flash backward with ao (NULL: LLaMA's): forward for out and lse, then backward. */
static void run_flash_bwd_opts(attn_grads *g, const attn_data *d, const attn_opts *ao) {
    attn_opts plain = {.scale = 1.0f / sqrtf((float)d->c.HS)};
    void *o = malloc(d->nq * 4);
    float *l = malloc(d->nlse * 4);
    attention_fwd_ex(o, l, d->q, d->k, d->v, CASE_ARGS(d->c), ao ? ao : &plain, d->dt);
    attention_bwd_ex(g->dq, g->dk, g->dv, d->dout, d->q, d->k, d->v, o, l, CASE_ARGS(d->c), ao ? ao : &plain, d->dt);
    free(o);
    free(l);
}

static void run_flash_bwd(attn_grads *g, const attn_data *d) { run_flash_bwd_opts(g, d, NULL); }

/* f32: recomputation from lse and D = rowsum(dout * out) vs the materialised
 * softmax: fp32 reassociation only, relative 1e-5 of gradients that are
 * O(0.1 .. 1); atol for the ones that cancel to near 0.
 * bf16 / f16: the kernel takes D from out rounded to dt; the HS roundings are
 * independent, so |dD| ~ sqrt(HS) * u * rms(dout * out) ~ u. That moves
 * ds = p (dp - D) by p * dD: dq by scale * max|k| * dD ~ 0.5u, dk by the sum
 * of p over the queries of the group that see the key (~G * ln T < 8) times
 * scale * max|q| * dD ~ 4u. Plus one final rounding: one ulp, 2u relative.
 * With bf16 pairs P and dS are rounded to bf16 as well (u relative each,
 * summed over the keys or queries of a product); on these cases that stays
 * within the same atol (at most two thirds of it in a review's sweep). */
static void check_bwd_vs_ref(const attn_case *c, loom_dtype dt) {
    attn_data d = data_make(c, dt, 600);
    attn_grads g1 = grads_alloc(&d), g2 = grads_alloc(&d);
    run_flash_bwd(&g1, &d);
    attention_bwd_ref(g2.dq, g2.dk, g2.dv, d.dout, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    double u = unit_roundoff(dt);
    double atol = dt == LOOM_F32 ? 1e-5 : 4.0 * u, rtol = 2.0 * u + 1e-5;
    assert_close_dt(g1.dq, g2.dq, d.nq, dt, atol, rtol);
    assert_close_dt(g1.dk, g2.dk, d.nkv, dt, atol, rtol);
    assert_close_dt(g1.dv, g2.dv, d.nkv, dt, atol, rtol);
    grads_free(&g1); grads_free(&g2);
    data_free(&d);
}

static void test_bwd_vs_ref(void **state) {
    (void)state;
    for (size_t i = 0; i < N_CASES; i++) {
        check_bwd_vs_ref(&CASES[i], LOOM_F32);
        check_bwd_vs_ref(&CASES[i], LOOM_BF16);
        check_bwd_vs_ref(&CASES[i], LOOM_F16);
    }
}

/* L = sum(dout * attention(q, k, v)) in double from the f32 kernel, with
 * the scores and keys of ao. */
static double loss_f32(const attn_data *d, const attn_opts *ao) {
    float *o = malloc(d->nq * 4);
    attention_fwd_ex(o, NULL, d->qf, d->kf, d->vf, CASE_ARGS(d->c), ao, LOOM_F32);
    double L = 0.0;
    for (size_t i = 0; i < d->nq; i++) L += (double)d->df[i] * o[i];
    free(o);
    return L;
}

/* Central differences of L w.r.t. every element of p (n): num (n). */
static void fd_grad(float *num, attn_data *d, const attn_opts *ao, float *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float p0 = p[i], pp = p0 + FD_STEP, pm = p0 - FD_STEP;
        p[i] = pp;
        double lp = loss_f32(d, ao);
        p[i] = pm;
        double lm = loss_f32(d, ao);
        p[i] = p0;
        num[i] = (float)((lp - lm) / ((double)pp - (double)pm));
    }
}

/* Truncation h^2 |L'''| / 6 ~ 1e-6. Rounding: moving k_j changes every output
 * row that sees it (<= Tq * NH * HS = 288 here), each by independent fp32
 * noise ~2^-24 |out|: ~1e-6 on L, ~5e-4 on the quotient by 2h at the very
 * worst, ~1e-4 typically. Gradients here are O(0.1 .. 1). */
static void check_bwd_fd(const attn_case *c, int window, float dropout) {
    attn_data d = data_make(c, LOOM_F32, 700);
    attn_opts ao = {.scale = 1.0f / sqrtf((float)c->HS), .window = window,
                    .drop = {.p = dropout, .seed = 3, .offset = 40}}; /* one mask for every evaluation */
    attn_grads g = grads_alloc(&d);
    run_flash_bwd_opts(&g, &d, &ao);
    float *num = malloc((d.nq > d.nkv ? d.nq : d.nkv) * 4);
    fd_grad(num, &d, &ao, d.qf, d.nq);
    TU_ASSERT_CLOSE((float *)g.dq, num, d.nq, 1e-3, 5e-3);
    fd_grad(num, &d, &ao, d.kf, d.nkv);
    TU_ASSERT_CLOSE((float *)g.dk, num, d.nkv, 1e-3, 5e-3);
    fd_grad(num, &d, &ao, d.vf, d.nkv);
    TU_ASSERT_CLOSE((float *)g.dv, num, d.nkv, 1e-3, 5e-3);
    free(num);
    grads_free(&g);
    data_free(&d);
}

static void test_bwd_finite_differences(void **state) {
    (void)state;
    const attn_case fd_cases[] = {
        {1, 9, 9, 4, 2, 8, 0},  // GQA, training shape
        {1, 3, 10, 4, 1, 8, 5}, // KV-cache shape with two unseen keys
        {2, 1, 6, 4, 2, 4, 5},  // one new token
    };
    for (size_t i = 0; i < sizeof fd_cases / sizeof fd_cases[0]; i++) {
        check_bwd_fd(&fd_cases[i], 0, 0.0f);
        check_bwd_fd(&fd_cases[i], 3, 0.0f); /* a sliding window of three keys */
        check_bwd_fd(&fd_cases[i], 0, 0.3f); /* dropout (the mask fixed by its stream) */
        check_bwd_fd(&fd_cases[i], 3, 0.3f);
    }
}

/* The flash output o and lse l of d with ao: against the formula in double
 * (probabilities times z, dropout's factors, when given), and the backward
 * against the reference, within the tolerances of the checks above (the
 * gradients' atol scaled by dropout's 1 / (1 - p), as they are). */
static void check_against_references(const attn_data *d, const void *o, const float *l, const attn_opts *ao,
                                     const float *z) {
    loom_dtype dt = d->dt;
    float *wo = malloc(d->nq * 4), *wl = malloc(d->nlse * 4);
    attention_double_opts(wo, wl, d, ao->scale, ao->softcap, ao->window, z);
    float *got = tu_to_f32(o, d->nq, dt), *bound = pv_rounding_bound_opts(d, ao);
    assert_close_bound(got, wo, bound, d->nq, 1e-5, unit_roundoff(dt) + 1e-5);
    TU_ASSERT_CLOSE(l, wl, d->nlse, 1e-5, 1e-5);
    attn_grads g1 = grads_alloc(d), g2 = grads_alloc(d);
    attention_bwd_ex(g1.dq, g1.dk, g1.dv, d->dout, d->q, d->k, d->v, o, l, CASE_ARGS(d->c), ao, dt);
    attention_bwd_ref_ex(g2.dq, g2.dk, g2.dv, d->dout, d->q, d->k, d->v, CASE_ARGS(d->c), ao, dt);
    double u = unit_roundoff(dt), atol = (dt == LOOM_F32 ? 1e-5 : 4.0 * u) / (1.0 - ao->drop.p);
    double rtol = 2.0 * u + 1e-5;
    assert_close_dt(g1.dq, g2.dq, d->nq, dt, atol, rtol);
    assert_close_dt(g1.dk, g2.dk, d->nkv, dt, atol, rtol);
    assert_close_dt(g1.dv, g2.dv, d->nkv, dt, atol, rtol);
    grads_free(&g1); grads_free(&g2);
    free(wo); free(wl); free(got); free(bound);
}

/* The kernels with ao on case c in dt: the forward against the formula in
 * double, the backward against the reference, within the tolerances of the
 * checks above; and the output the same bits as LLaMA's attention's
 * (scale 1/sqrt(HS), no cap, no window) exactly when same_as_plain. */
static void check_opts(const attn_case *c, loom_dtype dt, uint64_t seed, const attn_opts *ao, int same_as_plain) {
    attn_data d = data_make(c, dt, seed);
    void *o = malloc(d.nq * 4), *o0 = malloc(d.nq * 4);
    float *l = malloc(d.nlse * 4);
    attention_fwd_ex(o, l, d.q, d.k, d.v, CASE_ARGS(*c), ao, dt);
    attention_fwd(o0, NULL, d.q, d.k, d.v, CASE_ARGS(*c), dt);
    assert_int_equal(tu_bits_equal(o, o0, d.nq * loom_dtype_size(dt), NULL), same_as_plain);
    check_against_references(&d, o, l, ao, NULL);
    free(o); free(o0); free(l);
    data_free(&d);
}

/* A scale of the caller's (Granite's attention_multiplier, here 0.9 and
 * 0.05, not 1/sqrt(HS)), and softcapped scores (Gemma 2's, a cap of 2
 * that the scores, up to ~20, press against): the forward against the
 * formula in double, the backward against the reference, within the
 * tolerances of the checks above; and not the default's output. */
static void test_caller_scale(void **state) {
    (void)state;
    const float scales[3] = {0.9f, 0.05f, 0.9f}, caps[3] = {0.0f, 0.0f, 2.0f};
    const attn_case *cases[3] = {&CASES[0], &CASES[2], &CASES[15]}; /* GQA, one new token, bf16 pairs */
    for (int ci = 0; ci < 3; ci++)
        for (int di = 0; di < 2; di++)
            for (int si = 0; si < 3; si++) {
                const attn_case *c = cases[ci];
                loom_dtype dt = di ? LOOM_BF16 : LOOM_F32;
                float sc = scales[si], cap = caps[si];
                attn_opts ao = {.scale = sc, .softcap = cap};
                check_opts(c, dt, 900, &ao, 0);
            }
}

/* Sliding windows (Mistral's): the forward against the formula in double,
 * the backward against the reference, within the tolerances above; windows
 * of one key (itself), a few, one key block and one past it, and ones wider
 * than the context (the same bits as none); on cases with several blocks
 * of queries and keys (whole key blocks before every window are skipped),
 * the KV-cache shapes and the bf16 pairs. */
static void check_sliding_windows(int nw) {
    const attn_case many = {1, 200, 200, 2, 1, 16, 0}; /* windows far shorter than the context */
    const attn_case *cases[5] = {&CASES[1], &CASES[2], &CASES[5], &CASES[15], &many};
    const int windows[6] = {5, 65, INT_MAX, 1, 64, 1000}; /* INT_MAX: no sum of it with a position overflows */
    for (int ci = 0; ci < 5; ci++)
        for (int di = 0; di < 2; di++)
            for (int wi = 0; wi < nw; wi++) {
                const attn_case *c = cases[ci];
                attn_opts ao = {.scale = 1.0f / sqrtf((float)c->HS), .window = windows[wi]};
                /* a window as long as the keys any query sees changes nothing; a shorter one changes outputs */
                check_opts(c, di ? LOOM_BF16 : LOOM_F32, 950 + ci, &ao, windows[wi] >= c->pos0 + c->Tq);
            }
}

static void test_sliding_window(void **state) {
    (void)state;
    check_sliding_windows(6);
}

/* A key that no query's window holds counts for nothing: keys and values
 * there made huge (scores that would overflow exp unless masked first)
 * change no output bit, and their gradients are exactly 0; a key inside
 * some window changes the queries whose window holds it and no other. fp32
 * and bf16 (the pairs), key blocks skipped whole and cut by a window. (A
 * block cut by a window multiplies the rows before it by P = 0, so they
 * must be finite, as a model's earlier keys and values are.) */
static void check_window_unseen_keys(const attn_case *c, loom_dtype dt, int window, int key) {
    attn_data d = data_make(c, dt, 990);
    attn_opts ao = {.scale = 1.0f / sqrtf((float)c->HS), .window = window};
    size_t es = loom_dtype_size(dt), row = (size_t)c->NKV * c->HS, qrow = (size_t)c->NH * c->HS;
    void *o1 = malloc(d.nq * es), *o2 = malloc(d.nq * es), *dq = malloc(d.nq * es);
    void *dk = malloc(d.nkv * es), *dv = malloc(d.nkv * es);
    float *l = malloc(d.nlse * 4);
    attention_fwd_ex(o1, l, d.q, d.k, d.v, CASE_ARGS(*c), &ao, dt);
    int first_seen = c->pos0 - window + 1 > 0 ? c->pos0 - window + 1 : 0; /* the first query's first key */
    for (size_t i = 0; i < (size_t)first_seen * row; i++) { /* keys before every window */
        loom_store(d.k, i, dt, 1e4f);
        loom_store(d.v, i, dt, -1e4f);
    }
    attention_fwd_ex(o2, NULL, d.q, d.k, d.v, CASE_ARGS(*c), &ao, dt);
    assert_true(tu_bits_equal(o1, o2, d.nq * es, "out"));
    memset(dk, 0xff, d.nkv * es);
    memset(dv, 0xff, d.nkv * es);
    attention_bwd_ex(dq, dk, dv, d.dout, d.q, d.k, d.v, o1, l, CASE_ARGS(*c), &ao, dt);
    for (size_t i = 0; i < (size_t)first_seen * row; i++)
        assert_true(loom_load(dk, i, dt) == 0.0f && loom_load(dv, i, dt) == 0.0f);
    for (size_t i = (size_t)first_seen * row; i < d.nkv; i++)
        assert_true(isfinite(loom_load(dk, i, dt)) && isfinite(loom_load(dv, i, dt)));
    /* move one key inside the windows: queries key - pos0 .. key - pos0 + window - 1 change, the rest do not */
    data_free(&d);
    d = data_make(c, dt, 990);
    for (size_t e = 0; e < row; e++) loom_store(d.v, (size_t)key * row + e, dt, loom_load(d.v, (size_t)key * row + e, dt) + 0.5f);
    attention_fwd_ex(o2, NULL, d.q, d.k, d.v, CASE_ARGS(*c), &ao, dt);
    for (int t = 0; t < c->Tq; t++) {
        int pos = c->pos0 + t, sees = key <= pos && pos - key < window;
        assert_int_equal(!tu_bits_equal((char *)o1 + t * qrow * es, (char *)o2 + t * qrow * es, qrow * es, NULL), sees);
    }
    free(o1); free(o2); free(l); free(dq); free(dk); free(dv);
    data_free(&d);
}

static void test_window_unseen_keys(void **state) {
    (void)state;
    const attn_case kv = {1, 3, 200, 4, 2, 16, 190}, train = {1, 200, 200, 2, 1, 16, 0};
    for (int di = 0; di < 2; di++) {
        loom_dtype dt = di ? LOOM_BF16 : LOOM_F32;
        check_window_unseen_keys(&kv, dt, 70, 130);   /* the cache's first 121 keys: one block whole, one cut */
        check_window_unseen_keys(&kv, dt, 7, 186);
        check_window_unseen_keys(&train, dt, 5, 100); /* every key is in some window: no key set to NaN */
        check_window_unseen_keys(&train, dt, 64, 3);
    }
}

/* ---------------------------------------------------------------- dropout */

/* Dropout p (with a window, softcap and scale as given) from one stream. */
static attn_opts dropout_opts(const attn_case *c, float p, int window, float softcap) {
    attn_opts ao = {.scale = 1.0f / sqrtf((float)c->HS), .softcap = softcap, .window = window,
                    .drop = {.p = p, .seed = 77, .offset = 1000}};
    return ao;
}

/* Attention dropout is loom_dropout's mask over the whole (B, NH, Tq, Tk)
 * probabilities: the forward against the formula in double whose
 * probabilities weigh the values times the factors dropout_fwd (dropout.c)
 * gives a tensor of ones with the same stream (that mask dropping about p
 * of the probabilities the queries see), within the tolerances of the
 * checks above, and not the output without dropout; lse is the softmax's,
 * which dropout leaves as it is. The backward against the reference. */
static void check_dropout(const attn_case *c, loom_dtype dt, const attn_opts *ao) {
    attn_data d = data_make(c, dt, 960);
    size_t nz = (size_t)c->B * c->NH * c->Tq * c->Tk, dropped = 0, seen = 0;
    float *ones = malloc(nz * 4), *z = malloc(nz * 4);
    for (size_t i = 0; i < nz; i++) ones[i] = 1.0f;
    dropout_fwd(z, ones, nz, ao->drop.p, ao->drop.seed, ao->drop.offset, LOOM_F32);
    for (int bh = 0; bh < c->B * c->NH; bh++)
        for (int t = 0; t < c->Tq; t++) {
            int n = c->pos0 + t + 1, lo = ao->window > 0 && n > ao->window ? n - ao->window : 0;
            for (int j = lo; j < n; j++) dropped += z[((size_t)bh * c->Tq + t) * c->Tk + j] == 0.0f;
            seen += (size_t)(n - lo);
        }
    double frac = (double)dropped / (double)seen, sd = sqrt(ao->drop.p * (1.0 - ao->drop.p) / (double)seen);
    assert_true(fabs(frac - ao->drop.p) < 5.0 * sd);
    void *o = malloc(d.nq * 4), *o0 = malloc(d.nq * 4);
    float *l = malloc(d.nlse * 4);
    attention_fwd_ex(o, l, d.q, d.k, d.v, CASE_ARGS(*c), ao, dt);
    attn_opts none = *ao;
    none.drop.p = 0.0f;
    attention_fwd_ex(o0, NULL, d.q, d.k, d.v, CASE_ARGS(*c), &none, dt);
    assert_false(tu_bits_equal(o, o0, d.nq * loom_dtype_size(dt), NULL));
    check_against_references(&d, o, l, ao, z);
    free(o); free(o0); free(l); free(ones); free(z);
    data_free(&d);
}

/* Granite 3's 0.1 and a heavy 0.5; on GQA, several blocks of both kinds,
 * the KV-cache shapes, the bf16 pairs, with a window and a softcap. */
static void test_dropout(void **state) {
    (void)state;
    const attn_case many = {1, 200, 200, 2, 1, 16, 0};
    const attn_case *cases[5] = {&CASES[0], &CASES[1], &CASES[3], &CASES[15], &many};
    for (int ci = 0; ci < 5; ci++)
        for (int di = 0; di < 2; di++) {
            loom_dtype dt = di ? LOOM_BF16 : LOOM_F32;
            attn_opts a = dropout_opts(cases[ci], 0.1f, 0, 0.0f), b = dropout_opts(cases[ci], 0.5f, 21, 2.0f);
            check_dropout(cases[ci], dt, &a);
            check_dropout(cases[ci], dt, &b);
        }
}

/* Rows [r0, r0 + nr) of heads [h0, h0 + nh) of a (B, T, H, HS) buffer of
 * dt: a (nr, T, nh, HS) copy. */
static void *part_of(const void *src, loom_dtype dt, int T, int H, int HS, int r0, int nr, int h0, int nh) {
    size_t es = loom_dtype_size(dt), row = (size_t)nh * HS * es;
    char *dst = malloc((size_t)nr * T * row);
    for (int b = 0; b < nr; b++)
        for (int t = 0; t < T; t++)
            memcpy(dst + ((size_t)b * T + t) * row, (const char *)src + ((((size_t)(r0 + b) * T + t) * H + h0) * HS) * es,
                   row);
    return dst;
}

/* A call on batch row 1 of 2 and query heads 2..3 of 4 (kv head 1 of 2),
 * told where it lies (drop.b0, B_all, h0, NH_all: a data-parallel rank's
 * rows, a tensor-parallel rank's heads), gives the bits the whole call
 * gives there, forward and backward: the ranks together draw one
 * process's mask. */
static void check_dropout_part(loom_dtype dt) {
    const attn_case *c = &CASES[0], part = {1, c->Tq, c->Tk, 2, 1, c->HS, c->pos0}; /* B 2, GQA, bf16 pairs */
    attn_data d = data_make(c, dt, 970);
    size_t es = loom_dtype_size(dt);
    attn_opts whole = dropout_opts(c, 0.2f, 0, 0.0f), ao = whole;
    ao.drop.b0 = 1, ao.drop.B_all = 2, ao.drop.h0 = 2, ao.drop.NH_all = 4;
    attn_grads g = grads_alloc(&d);
    void *o = malloc(d.nq * es);
    float *l = malloc(d.nlse * 4);
    attention_fwd_ex(o, l, d.q, d.k, d.v, CASE_ARGS(*c), &whole, dt);
    attention_bwd_ex(g.dq, g.dk, g.dv, d.dout, d.q, d.k, d.v, o, l, CASE_ARGS(*c), &whole, dt);
    void *q = part_of(d.q, dt, c->Tq, 4, c->HS, 1, 1, 2, 2), *k = part_of(d.k, dt, c->Tk, 2, c->HS, 1, 1, 1, 1);
    void *v = part_of(d.v, dt, c->Tk, 2, c->HS, 1, 1, 1, 1), *dout = part_of(d.dout, dt, c->Tq, 4, c->HS, 1, 1, 2, 2);
    size_t nq = (size_t)c->Tq * 2 * c->HS, nkv = (size_t)c->Tk * c->HS;
    void *po = malloc(nq * es), *pdq = malloc(nq * es), *pdk = malloc(nkv * es), *pdv = malloc(nkv * es);
    float *pl = malloc((size_t)2 * c->Tq * 4);
    attention_fwd_ex(po, pl, q, k, v, CASE_ARGS(part), &ao, dt);
    attention_bwd_ex(pdq, pdk, pdv, dout, q, k, v, po, pl, CASE_ARGS(part), &ao, dt);
    void *wo = part_of(o, dt, c->Tq, 4, c->HS, 1, 1, 2, 2), *wdq = part_of(g.dq, dt, c->Tq, 4, c->HS, 1, 1, 2, 2);
    void *wdk = part_of(g.dk, dt, c->Tk, 2, c->HS, 1, 1, 1, 1), *wdv = part_of(g.dv, dt, c->Tk, 2, c->HS, 1, 1, 1, 1);
    assert_true(tu_bits_equal(po, wo, nq * es, "out"));
    assert_true(tu_bits_equal(pdq, wdq, nq * es, "dq"));
    assert_true(tu_bits_equal(pdk, wdk, nkv * es, "dk"));
    assert_true(tu_bits_equal(pdv, wdv, nkv * es, "dv"));
    /* told nothing, the part draws the whole's first rows' mask instead: other bits */
    attention_fwd_ex(po, NULL, q, k, v, CASE_ARGS(part), &whole, dt);
    assert_false(tu_bits_equal(po, wo, nq * es, NULL));
    free(q); free(k); free(v); free(dout); free(po); free(pdq); free(pdk); free(pdv); free(pl);
    free(wo); free(wdq); free(wdk); free(wdv); free(o); free(l);
    grads_free(&g);
    data_free(&d);
}

static void test_dropout_part_of_batch(void **state) {
    (void)state;
    check_dropout_part(LOOM_F32);
    check_dropout_part(LOOM_BF16);
}

/* Every output element is summed by one task in a fixed order: 1 and 2
 * threads give the same bits, forward and backward. */
/* The flash kernels as an AVX-512 CPU runs them: every small product
 * through the AVX-512F tiles, then also every product of the bf16 inputs'
 * through the AVX-512 BF16 ones (SIMDe-emulated here), against the
 * references. */
static void test_avx512_tiles(void **state) {
#if LOOM_HAVE_AVX512
    mm_f32_set_tiles(mm_avx512_emulated);
    test_fwd_vs_ref(state);
    test_bwd_vs_ref(state);
    /* and with bf16 inputs, every product from AVX-512 BF16 dot products */
    mm_bf16_set_tiles(mm_bf16_avx512_emulated);
    test_fwd_vs_ref(state);
    test_fwd_formula(state);
    test_bwd_vs_ref(state);
    test_kv_cache_unseen_keys(state);
    check_sliding_windows(3); /* a window inside a key block, one past it, and none */
    test_window_unseen_keys(state);
    mm_bf16_set_tiles(NULL);
    mm_f32_set_tiles(NULL);
#else
    (void)state;
    skip(); /* built without SIMDe or -mavx512f: there are no AVX-512 tiles */
#endif
}

static void check_thread_count_invariant(const attn_case *c, const attn_opts *ao) {
    attn_data d = data_make(c, LOOM_BF16, 800);
    attn_grads g1 = grads_alloc(&d), g2 = grads_alloc(&d);
    loom_set_threads(1);
    run_flash_bwd_opts(&g1, &d, ao);
    loom_set_threads(2);
    run_flash_bwd_opts(&g2, &d, ao);
    loom_set_threads(0);
    assert_true(tu_bits_equal(g1.dq, g2.dq, d.nq * 2, "dq"));
    assert_true(tu_bits_equal(g1.dk, g2.dk, d.nkv * 2, "dk"));
    assert_true(tu_bits_equal(g1.dv, g2.dv, d.nkv * 2, "dv"));
    grads_free(&g1); grads_free(&g2);
    data_free(&d);
}

/* A head size of 8 (fp32 products) and of 16 (bf16 pairs where the CPU has
 * them), several tasks per thread; dropout's mask is the same. */
static void test_thread_count_invariant(void **state) {
    (void)state;
    check_thread_count_invariant(&CASES[5], NULL);
    check_thread_count_invariant(&CASES[0], NULL);
    attn_opts drop = dropout_opts(&CASES[0], 0.3f, 0, 0.0f); /* and with dropout */
    check_thread_count_invariant(&CASES[0], &drop);
}

/* The AVX-512F and AVX2 paths run the same fp32 operations on every
 * element (the tiles add each element's products in order, the softmax
 * works column by column, the exps are the same): forward and backward give
 * the same bits at both levels, fp32 and bf16 (fp32 products: the bf16 dot
 * products are capped off), on every case, every other one with a scale of
 * its own and softcapped scores, every third with a sliding window, every
 * fourth with dropout. */
static void test_levels_agree(void **state) {
    (void)state;
    const char *was = loom_simd_name(); /* a static name: restored at the end */
    if (strncmp(was, "avx512", 6) != 0) skip(); /* one level only, or capped by the group */
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16};
    for (size_t i = 0; i < N_CASES; i++)
        for (int t = 0; t < 2; t++) {
            attn_data d = data_make(&CASES[i], dts[t], 900 + i);
            size_t es = loom_dtype_size(dts[t]);
            void *o[2];
            float *l[2];
            attn_grads g[2];
            /* every other case with a scale of its own and softcapped scores (Granite's, Gemma 2's) */
            float sc = i % 2 ? 0.5f : 1.0f / sqrtf((float)d.c.HS), cap = i % 2 ? 2.0f : 0.0f;
            attn_opts ao = {.scale = sc, .softcap = cap, .window = i % 3 ? 0 : 21}; /* and every third with Mistral's window */
            if (i % 4 == 1) ao.drop = (attn_dropout){.p = 0.25f, .seed = 9, .offset = 5}; /* every fourth with dropout */
            for (int lv = 0; lv < 2; lv++) {
                assert_int_equal(loom_set_simd_level(lv ? "avx2" : "avx512f"), LOOM_OK);
                o[lv] = malloc(d.nq * 4);
                l[lv] = malloc(d.nlse * 4);
                attention_fwd_ex(o[lv], l[lv], d.q, d.k, d.v, CASE_ARGS(d.c), &ao, d.dt);
                g[lv] = grads_alloc(&d);
                attention_bwd_ex(g[lv].dq, g[lv].dk, g[lv].dv, d.dout, d.q, d.k, d.v, o[lv], l[lv], CASE_ARGS(d.c), &ao,
                                 d.dt);
            }
            assert_int_equal(loom_set_simd_level(was), LOOM_OK);
            assert_true(tu_bits_equal(o[0], o[1], d.nq * es, "out"));
            assert_true(tu_bits_equal(l[0], l[1], d.nlse * 4, "lse"));
            assert_true(tu_bits_equal(g[0].dq, g[1].dq, d.nq * es, "dq"));
            assert_true(tu_bits_equal(g[0].dk, g[1].dk, d.nkv * es, "dk"));
            assert_true(tu_bits_equal(g[0].dv, g[1].dv, d.nkv * es, "dv"));
            for (int lv = 0; lv < 2; lv++) {
                free(o[lv]);
                free(l[lv]);
                grads_free(&g[lv]);
            }
            data_free(&d);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fwd_vs_ref),
        cmocka_unit_test(test_fwd_formula),
        cmocka_unit_test(test_fwd_without_lse),
        cmocka_unit_test(test_caller_scale),
        cmocka_unit_test(test_causal_mask),
        cmocka_unit_test(test_kv_cache_unseen_keys),
        cmocka_unit_test(test_sliding_window),
        cmocka_unit_test(test_window_unseen_keys),
        cmocka_unit_test(test_bwd_vs_ref),
        cmocka_unit_test(test_bwd_finite_differences),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_dropout_part_of_batch),
        cmocka_unit_test(test_thread_count_invariant),
        cmocka_unit_test(test_avx512_tiles),
        cmocka_unit_test(test_levels_agree),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
