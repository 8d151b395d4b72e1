/*
 * loom/ops.h — built-in differentiable ops. Each is a loom_function applied
 * through loom_function_apply, the same interface user code uses.
 *
 * Conventions: every op returns a status and, on success, a new tensor
 * reference in *out (release it with loom_tensor_release). Inputs are
 * borrowed. Activations keep the dtype of their inputs; internal math
 * (statistics, softmax, loss, reductions) is fp32. Row-wise ops treat the
 * last dimension as C and all leading dimensions as rows. Shapes are checked
 * and a mismatch is LOOM_ERR_INVALID with both shapes in the message.
 */
#ifndef LOOM_OPS_H
#define LOOM_OPS_H

#include "loom/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ element-wise */

loom_status loom_add(loom_tensor *a, loom_tensor *b, loom_tensor **out);   /* same shape */
loom_status loom_mul(loom_tensor *a, loom_tensor *b, loom_tensor **out);   /* same shape */
loom_status loom_scale(loom_tensor *a, float s, loom_tensor **out);
/* a / d, each element one fp32 division rounded to a's dtype (Granite's
 * logits / logits_scaling, as PyTorch divides); the gradient is divided
 * the same way. */
loom_status loom_divide(loom_tensor *a, float d, loom_tensor **out);
/* cap tanh(x / cap), in fp32 and rounded once (Gemma 2's
 * final_logit_softcapping; cap > 0); the gradient dy (1 - (y / cap)^2). */
loom_status loom_softcap(loom_tensor *x, float cap, loom_tensor **out);
loom_status loom_silu(loom_tensor *x, loom_tensor **out);
/* silu(gate) * up */
loom_status loom_swiglu(loom_tensor *gate, loom_tensor *up, loom_tensor **out);
/* gelu_tanh(gate) * up: Gemma's GeGLU, with the tanh approximation of GELU
 * (PyTorch's gelu(approximate="tanh"), Hugging Face's gelu_pytorch_tanh). */
loom_status loom_geglu(loom_tensor *gate, loom_tensor *up, loom_tensor **out);
/* Inverted dropout with probability p, driven by the default RNG
 * (loom_rng_default): the mask is regenerated in backward from the
 * (seed, offset) reserved in forward, never stored. */
loom_status loom_dropout(loom_tensor *x, float p, loom_tensor **out);
/* Where a tensor lies in a larger one, both seen as matrices (rows: every
 * dimension but the last, flattened): its rows are rows [row0, row0 + its
 * rows) of `rows`, its columns [col0, col0 + its columns) of `cols`. rows
 * 0 (cols 0): the larger one has the tensor's own rows (columns), and row0
 * (col0) must be 0. */
typedef struct loom_window {
    int64_t row0, rows;
    int64_t col0, cols;
} loom_window;
/* The same for x lying at w (NULL: x is the whole), such as a
 * tensor-parallel rank's columns or a data-parallel rank's rows of a
 * global batch: each element gets the mask it has in the larger tensor,
 * whose draws the RNG moves past, so the ranks together draw one
 * process's masks. */
loom_status loom_dropout_window(loom_tensor *x, float p, const loom_window *w, loom_tensor **out);
/* Convert to dtype dt (gradient converted back). */
loom_status loom_cast(loom_tensor *x, loom_dtype dt, loom_tensor **out);
/* Differentiable reshape of a contiguous tensor (shares storage). */
loom_status loom_reshape(loom_tensor *x, int ndim, const int64_t *shape, loom_tensor **out);
/* Sum of all elements as a 1-element f32 tensor. */
loom_status loom_sum(loom_tensor *x, loom_tensor **out);

/* ----------------------------------------------------------------- linear */

/* out = x · w^T: x (..., K), w (M, K), out (..., M). The weight gradient is
 * returned to the engine as a tensor (which accumulates it into the
 * parameter). See loom/nn.h for the fused linear that accumulates straight
 * into main_grad. */
loom_status loom_matmul(loom_tensor *x, loom_tensor *w, loom_tensor **out);
/* out = x + b with b (C) broadcast over the rows of x (..., C). */
loom_status loom_add_bias(loom_tensor *x, loom_tensor *b, loom_tensor **out);
/* DoRA's column scale: out = x * (m / n) with m (C) (the magnitudes, fp32
 * or x's dtype) and n (C, fp32: the weight's column norms, a constant that gets no
 * gradient, as DoRA detaches it) broadcast over the rows of x (..., C).
 * Backward: x's gradient g * m / n, m's sum over rows of x * g / n. */
loom_status loom_dora_scale(loom_tensor *x, loom_tensor *m, loom_tensor *n, loom_tensor **out);

/* The GEMM kernel, for user functions: row-major
 * C[M,N] = alpha * op(A) · op(B) + beta * C (+ bias[N]); A and B of dtype
 * ab_dt, C of dtype c_dt (f32 or ab_dt), fp32 accumulation. beta = 1
 * accumulates into C. */
loom_status loom_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const void *A, int lda, const void *B, int ldb, loom_dtype ab_dt,
                      float beta, void *C, int ldc, loom_dtype c_dt,
                      const void *bias, loom_dtype bias_dt);

/* What loom_gemm has done since the process started (counters only grow;
 * compare two readings). primitives_created counts oneDNN primitives built
 * on a cache miss: a training step creates none once its shapes are cached.
 * padded_calls counts calls whose operands were copied to padded strides
 * first (a transposed A with rows 2 KiB apart). */
typedef struct loom_gemm_stats {
    uint64_t onednn_calls, primitives_created, fallback_calls, widened_calls, padded_calls;
} loom_gemm_stats;
void loom_gemm_get_stats(loom_gemm_stats *out);

/* ------------------------------------------------------------- LLaMA ops */

/* RMSNorm over the last dimension with weight w (C). */
loom_status loom_rmsnorm(loom_tensor *x, loom_tensor *w, float eps, loom_tensor **out);
/* The same scaled by w + w_offset (added in fp32): Gemma's norms, whose
 * weights are stored as offsets from 1, take w_offset 1. */
loom_status loom_rmsnorm_ex(loom_tensor *x, loom_tensor *w, float eps, float w_offset, loom_tensor **out);
/* Rotary embedding, Hugging Face rotate-half convention, on x of shape
 * (B, T, NH, HS); position of x[:, t] is pos0 + t; frequencies
 * theta^(-2i/HS). */
loom_status loom_rope(loom_tensor *x, float theta, int pos0, loom_tensor **out);
/* The same with the frequencies of r (loom_rope_freqs in core.h: scaled as
 * Hugging Face's rope_scaling says; with rotary_dim, on that part of each
 * head). Errors: LOOM_ERR_INVALID (theta or a factor not positive or not
 * finite, low_freq_factor >= high_freq_factor, original_max_pos <= 0 for
 * llama3 or yarn, an unknown type, a rotary part odd or longer than the
 * head, longrope's factors not half the rotary part). */
loom_status loom_rope_ex(loom_tensor *x, const loom_rope_freqs *r, int pos0, loom_tensor **out);
/* LOOM_OK when r is a RoPE loom_rope_ex takes, else LOOM_ERR_INVALID naming the field. */
loom_status loom_rope_check(const loom_rope_freqs *r);
/* Causal grouped-query attention: q (B, T, NH, HS), k and v (B, T, NKV, HS)
 * with NH % NKV == 0; out (B, T, NH, HS). Flash-style kernel: nothing of
 * size T x T is stored. The scores q . k are scaled by 1/sqrt(HS). */
loom_status loom_attention(loom_tensor *q, loom_tensor *k, loom_tensor *v, loom_tensor **out);
/* How loom_attention_ex forms the scores and which keys each query sees. */
typedef struct loom_attention_opts {
    float scale;   /* the scores' scale, > 0 (Granite's attention_multiplier); 0: 1/sqrt(HS) */
    float softcap; /* > 0: each scaled score s made softcap tanh(s / softcap) before the mask and the
                      softmax (Gemma 2's attn_logit_softcapping); 0: none */
    int window;    /* > 0: the query at position t sees keys t - window + 1 .. t only (a sliding
                      window of that many keys, itself included: Mistral's sliding_window); 0: 0 .. t */
    float dropout; /* > 0: each probability of the softmax dropped with this chance before it weighs
                      the values, the kept ones scaled by 1 / (1 - dropout) (Hugging Face's
                      attention_dropout in training); the mask drawn from the default RNG as
                      loom_dropout's over the whole batch's (B, NH, T, T) probabilities and
                      regenerated in backward; 0: none */
    loom_window dropout_at; /* where the call lies in that whole batch: its batch rows are rows row0 ..
                               of `rows`, its query heads heads col0 .. of `cols` (a data-parallel
                               rank's rows, a tensor-parallel rank's heads); zeros: the call is the whole */
} loom_attention_opts;
/* loom_attention with opts (NULL: loom_attention's). A scale or softcap
 * that is negative or not finite, a negative window, a dropout outside
 * [0, 1) or a dropout_at the call does not lie in is LOOM_ERR_INVALID. */
loom_status loom_attention_ex(loom_tensor *q, loom_tensor *k, loom_tensor *v, const loom_attention_opts *opts,
                              loom_tensor **out);
/* out[i] = table[tokens[i]]: table (V, C), n tokens (copied), out (n, C).
 * A token outside [0, V) is LOOM_ERR_INVALID. */
loom_status loom_embedding(loom_tensor *table, const int32_t *tokens, int n, loom_tensor **out);
/* Mean softmax cross-entropy over the rows of logits (N, V) whose target is
 * not ignore_index; a 1-element f32 tensor. Targets are copied. A target
 * outside [0, V) (other than ignore_index) is LOOM_ERR_INVALID. */
loom_status loom_cross_entropy(loom_tensor *logits, const int32_t *targets, int n, int ignore_index,
                               loom_tensor **out);

#ifdef __cplusplus
}
#endif
#endif
