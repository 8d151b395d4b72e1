/*
 * kernels.h — pure compute on raw pointers: no tensors, no autograd.
 *
 * Forward and backward sit side by side. Each fast kernel has a plain
 * reference (`*_ref`) that its test compares against. Activations and weights
 * come in one dtype `dt` (f32, bf16 or f16); internal arithmetic (sums,
 * softmax, statistics) is fp32. Shape comments use B (batch), T (time),
 * C (channels), NH (query heads), NKV (key/value heads), HS (head size),
 * V (vocabulary), N (rows = B*T).
 *
 * Kernels never allocate from the system in steady state: scratch comes from
 * loom_alloc(…, LOOM_MEM_WORKSPACE). They never abort on caller input: the
 * op layer validates shapes before calling.
 *
 * Parallel loops split work into pieces fixed by the problem (rows, chunks,
 * attention's (batch, kv head) tasks), never by the thread count, so results
 * do not depend on it. The kernels' loops hand the pieces out dynamically
 * (the portable GEMM fallback excepted), so a core that runs slower for a
 * while (a shared or virtual machine) takes fewer of them instead of holding
 * up the loop.
 */
#ifndef LOOM_KERNELS_H
#define LOOM_KERNELS_H

#include "loom/core.h"

/* Rows ld elements of dt apart with a stride that is a multiple of 2 KiB
 * (512 floats) put the rows a kernel reads together into a few cache sets:
 * the GEMM (gemm.c) and the attention (attention.c) copy such rows to
 * another stride first (docs/design-notes.md). */
static inline int stride_critical(size_t ld, loom_dtype dt) { return ld * loom_dtype_size(dt) % 2048 == 0; }

/* ------------------------------------------------------------------ GEMM */

typedef enum gemm_backend {
    GEMM_BACKEND_AUTO = 0,     /* oneDNN when built with it, else fallback */
    GEMM_BACKEND_ONEDNN = 1,   /* oneDNN; bf16/f16 it refuses are widened to its fp32 matmul */
    GEMM_BACKEND_FALLBACK = 2, /* loom's blocked loops (AVX2 micro-kernel or portable C) */
    GEMM_BACKEND_WIDEN = 3     /* oneDNN, bf16/f16 always widened to fp32 (for tests) */
} gemm_backend;

/* Row-major C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C + bias[N].
 * op(X) is X or X^T (trans_x != 0). A and B share one dtype; C is f32 or the
 * same dtype as A. Accumulation is fp32. bias (may be NULL) is a row of N
 * values of dtype `bias_dt`, added to every row of C.
 * lda/ldb/ldc are row strides in elements of the stored (untransposed)
 * matrices. beta = 1 accumulates into C (e.g. dW into main_grad). */
loom_status gemm(int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const void *A, int lda, const void *B, int ldb, loom_dtype ab_dt,
                 float beta, void *C, int ldc, loom_dtype c_dt,
                 const void *bias, loom_dtype bias_dt);
void gemm_ref(int trans_a, int trans_b, int M, int N, int K, float alpha,
              const void *A, int lda, const void *B, int ldb, loom_dtype ab_dt,
              float beta, void *C, int ldc, loom_dtype c_dt,
              const void *bias, loom_dtype bias_dt);
void gemm_set_backend(gemm_backend b);
/* Scratch budgets of the widening path, in floats: op(B)'s converted panel
 * and op(A)'s rows and C tiles (0, 0: the defaults). Tests shrink them to
 * exercise the chunking with small matrices. */
void gemm_widen_set_budgets(size_t b_floats, size_t floats);
gemm_backend gemm_get_backend(void);   /* the backend actually in use */
int gemm_have_onednn(void);

/* --------------------------------------------------------------- RMSNorm */

/* out = x / sqrt(mean(x^2) + eps) * (w + w_offset).   x, out: (N, C) dt;
 * w: (C) dt; w_offset 0, or 1 for Gemma's norms (the sum in fp32); rstd:
 * (N) f32, kept for backward. */
void rmsnorm_fwd(void *out, float *rstd, const void *x, const void *w, float w_offset,
                 int N, int C, float eps, loom_dtype dt);
/* dx: (N, C) dt (written; may equal dout); dw: (C) f32, accumulated (+=). */
void rmsnorm_bwd(void *dx, float *dw, const void *dout, const void *x,
                 const void *w, float w_offset, const float *rstd, int N, int C, loom_dtype dt);
void rmsnorm_fwd_ref(void *out, float *rstd, const void *x, const void *w, float w_offset,
                     int N, int C, float eps, loom_dtype dt);
void rmsnorm_bwd_ref(void *dx, float *dw, const void *dout, const void *x,
                     const void *w, float w_offset, const float *rstd, int N, int C, loom_dtype dt);

/* ------------------------------------------------------------------ RoPE */

/* Hugging Face LLaMA rotate-half convention: for each head vector
 * x = [x1, x2] (halves of HS), out = x*cos + rotate_half(x)*sin with
 * rotate_half(x) = [-x2, x1], angle(t, i) = (pos0 + t) * inv_freq[i]
 * (rope_inv_freq). With r->rotary_dim, x1 and x2 are the halves of the
 * head's first rotary_dim elements, and the rest pass through (Phi-3's
 * partial_rotary_factor). x, out: (B, T, NH, HS) dt; out may equal x (in
 * place). */
void rope_fwd(void *out, const void *x, int B, int T, int NH, int HS,
              int pos0, const loom_rope_freqs *r, loom_dtype dt);
/* The transpose rotation: dx from dout. dx may equal dout. */
void rope_bwd(void *dx, const void *dout, int B, int T, int NH, int HS,
              int pos0, const loom_rope_freqs *r, loom_dtype dt);
void rope_fwd_ref(void *out, const void *x, int B, int T, int NH, int HS,
                  int pos0, const loom_rope_freqs *r, loom_dtype dt);
/* inv_freq[0 .. HS/2) of r, in fp32 as Hugging Face computes them; HS here
 * is the rotary part's size (rope_rotary_dim). */
void rope_inv_freq(const loom_rope_freqs *r, int HS, float *inv_freq);
/* The elements of a head of HS that rotate: r->rotary_dim, else HS. */
int rope_rotary_dim(const loom_rope_freqs *r, int HS);
/* cos/sin tables the rope kernels have built so far in this process (a
 * few are cached, one per RoPE and rotary size): for tests. */
unsigned long rope_table_builds(void);
/* A loom_rope_freqs with theta and no scaling. */
static inline loom_rope_freqs rope_plain(float theta) {
    loom_rope_freqs r;
    memset(&r, 0, sizeof r);
    r.theta = theta;
    r.factor = r.low_freq_factor = r.high_freq_factor = 1.0f;
    return r;
}

/* ------------------------------------------------------------- attention */

/* Attention dropout's mask is loom_dropout's over the whole batch's
 * probabilities (B_all, NH_all, Tq, Tk): element e is kept when lane e % 4
 * of Philox(seed, offset + e / 4), mapped to [0, 1), is >= p (dropout.c's
 * rule); the whole draws dropout_blocks(B_all NH_all Tq Tk) blocks. */
typedef struct attn_dropout {
    float p;               /* > 0: each probability is dropped with chance p, the rest scaled by 1 / (1 - p) */
    uint64_t seed, offset; /* the whole mask's Philox stream */
    int b0, B_all;         /* this call's batch rows are rows b0 .. of the whole's B_all (0: its own B) */
    int h0, NH_all;        /* its query heads are heads h0 .. of the whole's NH_all (0: its own NH) */
} attn_dropout;

/* How the scores of an attention call are formed and which keys a query
 * sees: scores are q . k times scale (1/sqrt(HS) for LLaMA; Granite's
 * attention_multiplier, Gemma 2's query_pre_attn_scalar^-0.5), then, with
 * softcap > 0, softcap tanh(s / softcap) (Gemma 2's attn_logit_softcapping;
 * 0: none). With window > 0 the query at position p sees only the keys
 * p - window + 1 .. p (Mistral's sliding_window: window keys, itself
 * included); 0: every key up to p. With drop.p > 0 the softmax's
 * probabilities are dropped out before they weigh the values (P Z v, Z the
 * mask over 1 - p; the softmax's sum is of P), the backward regenerating
 * the mask from (seed, offset), as FlashAttention-2 does. */
typedef struct attn_opts {
    float scale, softcap;
    int window;
    attn_dropout drop; /* attention dropout (Hugging Face's attention_dropout, training); p 0: none */
} attn_opts;

/* Causal scaled-dot-product attention with grouped-query heads, flash-style:
 * blocked over keys with an online softmax; no Tq x Tk matrix is stored.
 * q, out: (B, Tq, NH, HS) dt;  k, v: (B, Tk, NKV, HS) dt;  NH % NKV == 0,
 * query head h uses kv head h / (NH / NKV). Query t sits at absolute position
 * q_pos0 + t and sees keys 0 .. q_pos0 + t (so Tk >= q_pos0 + Tq), or the
 * window's last ones (attn_opts).
 * lse: (B, NH, Tq) f32 log-sum-exp of the scaled (and capped) scores, kept for backward
 * (may be NULL when no backward follows). attention_fwd and attention_bwd
 * are LLaMA's: scale 1/sqrt(HS), no softcap, no window; the _ex forms take
 * the caller's attn_opts. */
void attention_fwd(void *out, float *lse, const void *q, const void *k, const void *v,
                   int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                   loom_dtype dt);
void attention_fwd_ex(void *out, float *lse, const void *q, const void *k, const void *v,
                      int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                      loom_dtype dt);
/* dq: (B,Tq,NH,HS), dk, dv: (B,Tk,NKV,HS), all dt, written (not accumulated);
 * they must not overlap the inputs (fp32 inputs are read where they lie while
 * dk, dv accumulate). */
void attention_bwd(void *dq, void *dk, void *dv, const void *dout,
                   const void *q, const void *k, const void *v, const void *out,
                   const float *lse, int B, int Tq, int Tk, int NH, int NKV, int HS,
                   int q_pos0, loom_dtype dt);
void attention_bwd_ex(void *dq, void *dk, void *dv, const void *dout,
                      const void *q, const void *k, const void *v, const void *out,
                      const float *lse, int B, int Tq, int Tk, int NH, int NKV, int HS,
                      int q_pos0, const attn_opts *o, loom_dtype dt);
/* References (attention_ref.c): materialise each softmax row, fp32 everywhere. */
void attention_fwd_ref(void *out, float *lse, const void *q, const void *k, const void *v,
                       int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                       loom_dtype dt);
void attention_bwd_ref(void *dq, void *dk, void *dv, const void *dout,
                       const void *q, const void *k, const void *v,
                       int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0,
                       loom_dtype dt);
void attention_fwd_ref_ex(void *out, float *lse, const void *q, const void *k, const void *v,
                          int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                          loom_dtype dt);
void attention_bwd_ref_ex(void *dq, void *dk, void *dv, const void *dout,
                          const void *q, const void *k, const void *v,
                          int B, int Tq, int Tk, int NH, int NKV, int HS, int q_pos0, const attn_opts *o,
                          loom_dtype dt);

/* ---------------------------------------------------------- SiLU, SwiGLU */

/* out = silu(x) = x * sigmoid(x).  n elements, dt. */
void silu_fwd(void *out, const void *x, size_t n, loom_dtype dt);
void silu_bwd(void *dx, const void *dout, const void *x, size_t n, loom_dtype dt);
/* out = silu(gate) * up. Outputs may alias inputs (element i is read before
 * it is written), e.g. dgate = dout in place. */
void swiglu_fwd(void *out, const void *gate, const void *up, size_t n, loom_dtype dt);
void swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate,
                const void *up, size_t n, loom_dtype dt);
/* out = gelu_tanh(gate) * up (Gemma's GeGLU; PyTorch's gelu with
 * approximate="tanh"), aliasing as swiglu_*. */
void geglu_fwd(void *out, const void *gate, const void *up, size_t n, loom_dtype dt);
void geglu_bwd(void *dgate, void *dup, const void *dout, const void *gate,
               const void *up, size_t n, loom_dtype dt);

/* ------------------------------------------------------------- embedding */

/* out[i, :] = table[tokens[i], :].  out: (N, C) dt; table: (V, C) dt.
 * Tokens are validated by the caller (0 <= token < V). */
void embedding_fwd(void *out, const int32_t *tokens, const void *table,
                   int N, int C, loom_dtype dt);
/* dtable[tokens[i], :] += dout[i, :]; dtable: (V, C) f32 (accumulated). */
void embedding_bwd(float *dtable, const void *dout, const int32_t *tokens,
                   int N, int C, int V, loom_dtype dt);

/* --------------------------------------------------------- cross-entropy */

/* Softmax cross-entropy fused with its gradient. logits: (N, V) dt;
 * targets: (N) int32, rows with target == ignore_index contribute 0 loss
 * and 0 gradient. losses: (N) f32, written. If dlogits (N, V) dt is not NULL
 * it receives (softmax - onehot) * grad_scale (it may alias logits).
 * Returns nothing; the caller averages. */
void crossentropy_fwd_bwd(float *losses, void *dlogits, const void *logits,
                          const int32_t *targets, int N, int V, int ignore_index,
                          float grad_scale, loom_dtype dt);
void crossentropy_fwd_bwd_ref(float *losses, void *dlogits, const void *logits,
                              const int32_t *targets, int N, int V, int ignore_index,
                              float grad_scale, loom_dtype dt);

/* ------------------------------------------------------------ elementwise */

/* out = a + b; out = a * b; out = a * s.  All n elements of dtype dt.
 * out may alias an input. */
void add_fwd(void *out, const void *a, const void *b, size_t n, loom_dtype dt);
void mul_fwd(void *out, const void *a, const void *b, size_t n, loom_dtype dt);
void scale_fwd(void *out, const void *a, float s, size_t n, loom_dtype dt);
/* out = a / d, one correctly rounded fp32 division each, then rounded to dt
 * (Granite's logits: a multiply by 1/d differs in the last bit for d not a
 * power of two). */
void divide_fwd(void *out, const void *a, float d, size_t n, loom_dtype dt);
/* out = cap tanh(x / cap) (Gemma 2's final_logit_softcapping), in fp32;
 * softcap_bwd: dx = dy (1 - (y / cap)^2) from the output y (dx may be dy). */
void softcap_fwd(void *out, const void *x, float cap, size_t n, loom_dtype dt);
void softcap_bwd(void *dx, const void *dy, const void *y, float cap, size_t n, loom_dtype dt);
/* dst (dst_dt) += scale * src (src_dt): gradient accumulation. */
void accumulate(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt,
                float scale, size_t n);
/* A row vector added to every row: out[r][c] = x[r][c] + b[c] (a bias), all
 * of dtype dt, rounded as add_fwd rounds (out may alias x); rows in
 * parallel. */
void rowadd(void *out, const void *x, const void *b, size_t rows, size_t cols, loom_dtype dt);
/* Column sums (a bias's gradient): dst[c] += sum over r of g[r][c], in fp32
 * in row order (as accumulate row by row: the same bits for any thread
 * count); blocks of columns in parallel. */
void colsum(float *dst, const void *g, size_t rows, size_t cols, loom_dtype dt);
/* Columns scaled: out[r][c] = x[r][c] * s[c], x and out (rows, cols) of
 * dtype dt (out may alias x), s fp32. */
void colscale(void *out, const void *x, const float *s, size_t rows, size_t cols, loom_dtype dt);
/* Column dot products: dst[c] = sum over r of x[r][c] * g[r][c], in fp64
 * in row order (the same bits for any thread count), rounded to fp32. */
void coldot(float *dst, const void *x, const void *g, size_t rows, size_t cols, loom_dtype dt);
/* Both in one pass over g (DoRA's backward): dst as coldot(x, g), and
 * out = colscale(g, s); out may alias g. */
void coldot_colscale(float *dst, void *out, const void *x, const void *g, const float *s, size_t rows, size_t cols,
                     loom_dtype dt);

/* --------------------------------------------------------------- dropout */

/* out = in * mask / (1 - p), mask[i] = (u_i >= p) with u_i uniform drawn from
 * Philox (seed, offset + i / 4), lane i % 4. The mask is never stored:
 * backward regenerates it from the same (seed, offset). */
void dropout_fwd(void *out, const void *in, size_t n, float p,
                 uint64_t seed, uint64_t offset, loom_dtype dt);
void dropout_bwd(void *din, const void *dout, size_t n, float p,
                 uint64_t seed, uint64_t offset, loom_dtype dt);
/* The same over a window: in and out are (rows, cols), rows [row0, row0 +
 * rows) and columns [col0, col0 + cols) of a tensor `width` wide, and
 * element (r, c) takes the mask of that tensor's element (row0 + r) *
 * width + col0 + c. With row0 and col0 0 and width cols it is dropout_fwd /
 * dropout_bwd over rows * cols. */
void dropout_window(void *out, const void *in, size_t rows, size_t cols, size_t row0, size_t col0, size_t width,
                    float p, uint64_t seed, uint64_t offset, loom_dtype dt);
/* z[j] = 1 / (1 - p) where the mask of element e0 + j of a tensor drawn
 * from (seed, offset) keeps it, else 0, j < n (the rule above, the blocks
 * drawn several at a time: loom_philox4x32_blocks); on the calling thread.
 * Attention dropout's factors (attention_internal.h) are these. */
void dropout_factors(float *z, size_t n, uint64_t e0, float p, uint64_t seed, uint64_t offset);
/* Number of Philox blocks a dropout over n elements consumes. */
static inline uint64_t dropout_blocks(size_t n) { return (uint64_t)((n + 3) / 4); }

/* ------------------------------------------------------------ reductions */

/* Sum of squares in fp64 accumulated, returned as double; and whether any
 * element is NaN or Inf. */
double sumsq(const void *x, size_t n, loom_dtype dt);
int has_nonfinite(const void *x, size_t n, loom_dtype dt);

/* ----------------------------------------------------------------- AdamW */

/* Decoupled-weight-decay Adam on fp32: for each i,
 *   g = grad[i] * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 *   p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * p).
 * step t >= 1. */
void adamw_step(float *param, float *m, float *v, const float *grad, size_t n,
                float lr, float b1, float b2, float eps, float wd, int step,
                float grad_scale);

#endif
