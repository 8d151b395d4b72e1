/*
 * ops_llama.c — the LLaMA ops as loom_functions: RMSNorm, RoPE, attention,
 * embedding and cross-entropy. Forward and backward side by side; kernels in
 * src/kernels do the arithmetic.
 */
#include "nn/op_util.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>

/* --------------------------------------------------------------- RMSNorm */

typedef struct rmsnorm_args {
    float eps, w_offset;
} rmsnorm_args;

static loom_status rmsnorm_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const rmsnorm_args *a = loom_ctx_args(ctx);
    loom_tensor *x = in[0], *w = in[1];
    int64_t N = op_rows(x), C = op_last_dim(x);
    out[0] = op_new_like(x, x->dtype);
    loom_tensor *rstd = loom_tensor_new_1d(LOOM_F32, N, LOOM_MEM_ACTIVATIONS); /* (N) */
    if (!out[0] || !rstd) { loom_tensor_release(rstd); return LOOM_ERR_NOMEM; }
    rmsnorm_fwd(loom_tensor_data(out[0]), loom_tensor_data(rstd), loom_tensor_data(x), loom_tensor_data(w),
                a->w_offset, (int)N, (int)C, a->eps, x->dtype);
    loom_tensor *save[3] = {x, w, rstd};
    loom_status st = loom_ctx_save(ctx, save, 3);
    loom_tensor_release(rstd);
    return st;
}

static loom_status rmsnorm_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    const rmsnorm_args *a = loom_ctx_args(ctx);
    loom_tensor *x, *w, *rstd;
    OP_SAVED(ctx, 0, x);
    OP_SAVED(ctx, 1, w);
    OP_SAVED(ctx, 2, rstd);
    int64_t N = op_rows(x), C = op_last_dim(x);
    float *dw = loom_alloc_zeroed((size_t)C * sizeof(float), LOOM_MEM_WORKSPACE); /* (C) */
    gin[0] = op_grad_in_place(gout[0]); /* rmsnorm_bwd reads each dout row before writing it */
    if (!dw || !gin[0]) { loom_free(dw); return LOOM_ERR_NOMEM; }
    rmsnorm_bwd(loom_tensor_data(gin[0]), dw, loom_tensor_data(gout[0]), loom_tensor_data(x), loom_tensor_data(w),
                a->w_offset, loom_tensor_data(rstd), (int)N, (int)C, x->dtype);
    loom_status st = LOOM_OK;
    if (loom_ctx_needs_input_grad(ctx, 1)) st = op_grad_from_f32(w, dw, &gin[1]);
    loom_free(dw);
    return st;
}

static const loom_function rmsnorm_function = {"rmsnorm", 2, 1, 0, rmsnorm_forward, rmsnorm_backward};

loom_status loom_rmsnorm(loom_tensor *x, loom_tensor *w, float eps, loom_tensor **out) {
    return loom_rmsnorm_ex(x, w, eps, 0.0f, out);
}

loom_status loom_rmsnorm_ex(loom_tensor *x, loom_tensor *w, float eps, float w_offset, loom_tensor **out) {
    char a[96], b[96];
    *out = NULL;
    LOOM_TRY(op_check_contiguous("rmsnorm", "x", x));
    LOOM_TRY(op_check_contiguous("rmsnorm", "w", w));
    LOOM_TRY(op_check_dtype("rmsnorm", x, w));
    if (w->ndim != 1 || w->shape[0] != op_last_dim(x))
        return loom_error(LOOM_ERR_INVALID, "rmsnorm: weight %s does not match the last dimension of x %s",
                          loom_tensor_describe(w, a, sizeof a), loom_tensor_describe(x, b, sizeof b));
    if (!isfinite(w_offset))
        return loom_error(LOOM_ERR_INVALID, "rmsnorm: the weight offset %g is not finite", (double)w_offset);
    rmsnorm_args args = {eps, w_offset};
    loom_tensor *in[2] = {x, w};
    return loom_function_apply(&rmsnorm_function, in, 2, out, 1, &args, sizeof args);
}

/* ------------------------------------------------------------------ RoPE */

typedef struct rope_args {
    loom_rope_freqs r;
    int pos0;
} rope_args;

static loom_status rope_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const rope_args *a = loom_ctx_args(ctx);
    loom_tensor *x = in[0];
    out[0] = op_new_like(x, x->dtype);
    if (!out[0]) return LOOM_ERR_NOMEM;
    rope_fwd(loom_tensor_data(out[0]), loom_tensor_data(x), (int)x->shape[0], (int)x->shape[1], (int)x->shape[2],
             (int)x->shape[3], a->pos0, &a->r, x->dtype);
    return LOOM_OK;
}

static loom_status rope_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    const rope_args *a = loom_ctx_args(ctx);
    loom_tensor *g = gout[0];
    gin[0] = op_grad_in_place(g); /* rope_bwd may work in place */
    if (!gin[0]) return LOOM_ERR_NOMEM;
    rope_bwd(loom_tensor_data(gin[0]), loom_tensor_data(g), (int)g->shape[0], (int)g->shape[1], (int)g->shape[2],
             (int)g->shape[3], a->pos0, &a->r, g->dtype);
    return LOOM_OK;
}

static const loom_function rope_function = {"rope", 1, 1, 0, rope_forward, rope_backward};

loom_status loom_rope_check(const loom_rope_freqs *r) {
    if (!r || !(r->theta > 0.0f) || !isfinite(r->theta))
        return loom_error(LOOM_ERR_INVALID, "rope: theta must be a positive number");
    if (r->rotary_dim < 0 || r->rotary_dim % 2)
        return loom_error(LOOM_ERR_INVALID, "rope: the rotary part of a head (%d) must be even and positive (0: all)",
                          r->rotary_dim);
    if (r->type == LOOM_ROPE_DEFAULT) return LOOM_OK;
    if (r->type == LOOM_ROPE_LONGROPE) {
        int ok = r->n_ext > 0 && r->n_ext <= LOOM_ROPE_EXT_MAX && r->attention_factor > 0.0f &&
                 isfinite(r->attention_factor);
        for (int i = 0; ok && i < r->n_ext; i++) ok = r->ext[i] > 0.0f && isfinite(r->ext[i]);
        if (!ok)
            return loom_error(LOOM_ERR_INVALID, "rope: longrope needs 1..%d factors and an attention factor, all "
                              "finite and positive", LOOM_ROPE_EXT_MAX);
        return LOOM_OK;
    }
    if (r->type != LOOM_ROPE_LINEAR && r->type != LOOM_ROPE_LLAMA3 && r->type != LOOM_ROPE_YARN &&
        r->type != LOOM_ROPE_DYNAMIC)
        return loom_error(LOOM_ERR_INVALID, "rope: unknown scaling type %d", (int)r->type);
    if (!(r->factor > 0.0f) || !isfinite(r->factor))
        return loom_error(LOOM_ERR_INVALID, "rope: the scaling factor %g must be positive", (double)r->factor);
    if (r->type == LOOM_ROPE_YARN &&
        (r->original_max_pos <= 0 || !(r->attention_factor > 0.0f) || !isfinite(r->attention_factor) ||
         !(r->beta_fast > 0.0f) || !isfinite(r->beta_fast) || !(r->beta_slow > 0.0f) || !isfinite(r->beta_slow)))
        return loom_error(LOOM_ERR_INVALID, "rope: yarn needs original_max_position_embeddings (%d) > 0 and an "
                          "attention factor (%g), beta_fast (%g) and beta_slow (%g), all finite and positive",
                          r->original_max_pos, (double)r->attention_factor, (double)r->beta_fast,
                          (double)r->beta_slow);
    if (r->type == LOOM_ROPE_LLAMA3 &&
        (!(r->low_freq_factor > 0.0f) || !(r->high_freq_factor > r->low_freq_factor) ||
         !isfinite(r->high_freq_factor) || r->original_max_pos <= 0))
        return loom_error(LOOM_ERR_INVALID, "rope: llama3 scaling needs 0 < low_freq_factor (%g) < high_freq_factor "
                          "(%g) and original_max_position_embeddings (%d) > 0", (double)r->low_freq_factor,
                          (double)r->high_freq_factor, r->original_max_pos);
    return LOOM_OK;
}

loom_status loom_rope_ex(loom_tensor *x, const loom_rope_freqs *r, int pos0, loom_tensor **out) {
    char d[96];
    *out = NULL;
    LOOM_TRY(op_check_contiguous("rope", "x", x));
    if (x->ndim != 4 || x->shape[3] % 2 != 0)
        return loom_error(LOOM_ERR_INVALID, "rope: x %s must be (B, T, NH, HS) with an even head size",
                          loom_tensor_describe(x, d, sizeof d));
    if (!r || !(r->theta > 0.0f) || pos0 < 0)
        return loom_error(LOOM_ERR_INVALID, "rope: theta %g must be > 0 and pos0 %d >= 0", r ? (double)r->theta : 0.0,
                          pos0);
    LOOM_TRY(loom_rope_check(r));
    if (r->rotary_dim > x->shape[3])
        return loom_error(LOOM_ERR_INVALID, "rope: a rotary part of %d is more than the head of %lld", r->rotary_dim,
                          (long long)x->shape[3]);
    int rd = r->rotary_dim > 0 ? r->rotary_dim : (int)x->shape[3];
    if (r->type == LOOM_ROPE_LONGROPE && r->n_ext != rd / 2)
        return loom_error(LOOM_ERR_INVALID, "rope: longrope has %d factors for a rotary part of %d (half of it "
                          "needed)", r->n_ext, rd);
    rope_args a;
    memset(&a, 0, sizeof a); /* no stray padding: the arguments are copied as bytes */
    a.r = *r;
    a.pos0 = pos0;
    loom_tensor *in[1] = {x};
    return loom_function_apply(&rope_function, in, 1, out, 1, &a, sizeof a);
}

loom_status loom_rope(loom_tensor *x, float theta, int pos0, loom_tensor **out) {
    loom_rope_freqs r = rope_plain(theta);
    return loom_rope_ex(x, &r, pos0, out);
}

/* ------------------------------------------------------------- attention */

/* The Philox stream of a dropout's mask, drawn in forward and kept for backward. */
typedef struct attention_state {
    uint64_t seed, offset;
} attention_state;

/* The call's options with its dropout's stream (when it has a dropout). */
static attn_opts attention_opts(loom_fn_ctx *ctx) {
    attn_opts o = *(const attn_opts *)loom_ctx_args(ctx);
    if (o.drop.p > 0.0f) {
        const attention_state *st = loom_ctx_state(ctx, sizeof *st);
        o.drop.seed = st->seed;
        o.drop.offset = st->offset;
    }
    return o;
}

static loom_status attention_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *q = in[0], *k = in[1], *v = in[2];
    int B = (int)q->shape[0], T = (int)q->shape[1], NH = (int)q->shape[2], HS = (int)q->shape[3];
    int NKV = (int)k->shape[2];
    const attn_opts *args = loom_ctx_args(ctx);
    if (args->drop.p > 0.0f) { /* the whole batch's mask's draws, as loom_dropout's of it */
        loom_rng *rng = loom_rng_default();
        attention_state *st = loom_ctx_state(ctx, sizeof *st);
        st->seed = rng->seed;
        st->offset = loom_rng_reserve(rng, dropout_blocks((size_t)args->drop.B_all * (size_t)args->drop.NH_all *
                                                          (size_t)T * (size_t)T));
    }
    attn_opts o = attention_opts(ctx), *a = &o;
    int64_t lse_shape[3] = {B, NH, T};
    out[0] = op_new_like(q, q->dtype);
    loom_tensor *lse = loom_tensor_new(LOOM_F32, 3, lse_shape, LOOM_MEM_ACTIVATIONS); /* (B, NH, T) */
    if (!out[0] || !lse) { loom_tensor_release(lse); return LOOM_ERR_NOMEM; }
    attention_fwd_ex(loom_tensor_data(out[0]), loom_tensor_data(lse), loom_tensor_data(q), loom_tensor_data(k),
                     loom_tensor_data(v), B, T, T, NH, NKV, HS, 0, a, q->dtype);
    loom_tensor *save[5] = {q, k, v, out[0], lse};
    loom_status st = loom_ctx_save(ctx, save, 5);
    loom_tensor_release(lse);
    return st;
}

static loom_status attention_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                      int n_in) {
    (void)n_out; (void)n_in;
    attn_opts opts = attention_opts(ctx), *a = &opts;
    loom_tensor *q, *k, *v, *o, *lse;
    OP_SAVED(ctx, 0, q);
    OP_SAVED(ctx, 1, k);
    OP_SAVED(ctx, 2, v);
    OP_SAVED(ctx, 3, o);
    OP_SAVED(ctx, 4, lse);
    int B = (int)q->shape[0], T = (int)q->shape[1], NH = (int)q->shape[2], HS = (int)q->shape[3];
    int NKV = (int)k->shape[2];
    gin[0] = op_new_like(q, q->dtype);
    gin[1] = op_new_like(k, k->dtype);
    gin[2] = op_new_like(v, v->dtype);
    if (!gin[0] || !gin[1] || !gin[2]) return LOOM_ERR_NOMEM;
    attention_bwd_ex(loom_tensor_data(gin[0]), loom_tensor_data(gin[1]), loom_tensor_data(gin[2]),
                     loom_tensor_data(gout[0]), loom_tensor_data(q), loom_tensor_data(k), loom_tensor_data(v),
                     loom_tensor_data(o), loom_tensor_data(lse), B, T, T, NH, NKV, HS, 0, a, q->dtype);
    return LOOM_OK;
}

/* Flagged expensive: the flash kernel stores nothing of size T x T, so
 * keeping its saves costs O(T) memory while recomputing it costs O(T^2)
 * flops — the opposite of the unfused attention core that selective
 * recompute (Korthikanti et al.) drops. The default selective policy keeps it. */
static const loom_function attention_function = {"attention", 3, 1, LOOM_FN_EXPENSIVE, attention_forward,
                                                 attention_backward};

loom_status loom_attention(loom_tensor *q, loom_tensor *k, loom_tensor *v, loom_tensor **out) {
    return loom_attention_ex(q, k, v, NULL, out);
}

loom_status loom_attention_ex(loom_tensor *q, loom_tensor *k, loom_tensor *v, const loom_attention_opts *opts,
                              loom_tensor **out) {
    static const loom_attention_opts plain = {0};
    if (!opts) opts = &plain;
    float scale = opts->scale, softcap = opts->softcap;
    char a[96], b[96];
    *out = NULL;
    LOOM_TRY(op_check_contiguous("attention", "q", q));
    LOOM_TRY(op_check_contiguous("attention", "k", k));
    LOOM_TRY(op_check_contiguous("attention", "v", v));
    LOOM_TRY(op_check_same("attention", k, v));
    LOOM_TRY(op_check_dtype("attention", q, k));
    if (q->ndim != 4 || k->ndim != 4 || q->shape[0] != k->shape[0] || q->shape[1] != k->shape[1] ||
        q->shape[3] != k->shape[3] || k->shape[2] == 0 || q->shape[2] % k->shape[2] != 0)
        return loom_error(LOOM_ERR_INVALID, "attention: q %s and k/v %s must be (B, T, NH, HS) and (B, T, NKV, HS) "
                          "with NH a multiple of NKV", loom_tensor_describe(q, a, sizeof a),
                          loom_tensor_describe(k, b, sizeof b));
    if (!(scale >= 0.0f) || !isfinite(scale))
        return loom_error(LOOM_ERR_INVALID, "attention: the scale %g must be a finite number > 0 (0: 1/sqrt(HS))",
                          (double)scale);
    if (!(softcap >= 0.0f) || !isfinite(softcap))
        return loom_error(LOOM_ERR_INVALID, "attention: the softcap %g must be a finite number >= 0 (0: none)",
                          (double)softcap);
    if (opts->window < 0)
        return loom_error(LOOM_ERR_INVALID, "attention: the window %d must be >= 0 (0: every earlier key)",
                          opts->window);
    const loom_window *at = &opts->dropout_at;
    if (!(opts->dropout >= 0.0f && opts->dropout < 1.0f))
        return loom_error(LOOM_ERR_INVALID, "attention: the dropout %g must be in [0, 1)", (double)opts->dropout);
    if (!op_window_fits(at->row0, q->shape[0], at->rows) || !op_window_fits(at->col0, q->shape[2], at->cols))
        return loom_error(LOOM_ERR_INVALID, "attention: dropout_at's %lld batch rows from row %lld and %lld heads "
                          "from head %lld do not lie in a batch of %lld rows of %lld heads (0: the call's own)",
                          (long long)q->shape[0], (long long)at->row0, (long long)q->shape[2], (long long)at->col0,
                          (long long)at->rows, (long long)at->cols);
    int64_t B_all = at->rows ? at->rows : q->shape[0], NH_all = at->cols ? at->cols : q->shape[2], T = q->shape[1];
    if (opts->dropout > 0.0f &&
        (B_all > INT_MAX || NH_all > INT_MAX || (NH_all && T && B_all > INT64_MAX / NH_all / T / T)))
        return loom_error(LOOM_ERR_INVALID, "attention: a dropout mask over %lld batch rows of %lld heads of %lld x "
                          "%lld probabilities is too large", (long long)B_all, (long long)NH_all, (long long)T,
                          (long long)T);
    attn_opts args = {.scale = scale != 0.0f ? scale : 1.0f / sqrtf((float)q->shape[3]), .softcap = softcap,
                      .window = opts->window};
    if (opts->dropout > 0.0f)
        args.drop = (attn_dropout){.p = opts->dropout, .b0 = (int)at->row0, .B_all = (int)B_all, .h0 = (int)at->col0,
                                   .NH_all = (int)NH_all};
    loom_tensor *in[3] = {q, k, v};
    return loom_function_apply(&attention_function, in, 3, out, 1, &args, sizeof args);
}

/* ------------------------------------------------------------- embedding */

typedef struct token_args {
    int n;
    int ignore_index;
    int32_t tokens[];
} token_args;

static token_args *token_args_new(const int32_t *tokens, int n, int ignore_index, size_t *size) {
    *size = sizeof(token_args) + (size_t)n * sizeof(int32_t);
    token_args *a = malloc(*size);
    if (!a) return NULL;
    a->n = n;
    a->ignore_index = ignore_index;
    memcpy(a->tokens, tokens, (size_t)n * sizeof(int32_t));
    return a;
}

static loom_status embedding_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                     int n_out) {
    (void)n_in; (void)n_out;
    const token_args *a = loom_ctx_args(ctx);
    loom_tensor *table = in[0];
    int64_t shape[2] = {a->n, table->shape[1]};
    out[0] = loom_tensor_new(table->dtype, 2, shape, LOOM_MEM_ACTIVATIONS); /* (n, C) */
    if (!out[0]) return LOOM_ERR_NOMEM;
    embedding_fwd(loom_tensor_data(out[0]), a->tokens, loom_tensor_data(table), a->n, (int)shape[1], table->dtype);
    return loom_ctx_save(ctx, in, 1);
}

static loom_status embedding_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                      int n_in) {
    (void)n_out; (void)n_in;
    const token_args *a = loom_ctx_args(ctx);
    loom_tensor *table;
    OP_SAVED(ctx, 0, table);
    int V = (int)table->shape[0], C = (int)table->shape[1];
    if (table->param && table->param->grad_dtype == LOOM_F32) {
        /* Scatter-add straight into main_grad: no (V, C) temporary. */
        loom_dtype dt;
        float *dst = loom_param_grad_target(table->param, &dt);
        embedding_bwd(dst, loom_tensor_data(gout[0]), a->tokens, a->n, C, V, gout[0]->dtype);
        return LOOM_OK;
    }
    float *dtable = loom_alloc_zeroed((size_t)V * (size_t)C * sizeof(float), LOOM_MEM_WORKSPACE); /* (V, C) */
    if (!dtable) return LOOM_ERR_NOMEM;
    embedding_bwd(dtable, loom_tensor_data(gout[0]), a->tokens, a->n, C, V, gout[0]->dtype);
    loom_status st = op_grad_from_f32(table, dtable, &gin[0]);
    loom_free(dtable);
    return st;
}

static const loom_function embedding_function = {"embedding", 1, 1, 0, embedding_forward, embedding_backward};

loom_status loom_embedding(loom_tensor *table, const int32_t *tokens, int n, loom_tensor **out) {
    char d[96];
    *out = NULL;
    LOOM_TRY(op_check_contiguous("embedding", "table", table));
    if (table->ndim != 2 || n < 0)
        return loom_error(LOOM_ERR_INVALID, "embedding: table %s must be (V, C) and n >= 0",
                          loom_tensor_describe(table, d, sizeof d));
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= table->shape[0])
            return loom_error(LOOM_ERR_INVALID, "embedding: token %d at position %d is outside the vocabulary [0, %lld)",
                              tokens[i], i, (long long)table->shape[0]);
    size_t size;
    token_args *a = token_args_new(tokens, n, -1, &size);
    if (!a) return loom_error(LOOM_ERR_NOMEM, "embedding: out of memory");
    loom_tensor *in[1] = {table};
    loom_status st = loom_function_apply(&embedding_function, in, 1, out, 1, a, size);
    free(a);
    return st;
}

/* --------------------------------------------------------- cross-entropy */

static int count_valid(const token_args *a) {
    int n = 0;
    for (int i = 0; i < a->n; i++) n += a->tokens[i] != a->ignore_index;
    return n;
}

static loom_status xent_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const token_args *a = loom_ctx_args(ctx);
    loom_tensor *logits = in[0];
    int V = (int)logits->shape[1];
    int64_t one = 1;
    out[0] = loom_tensor_new(LOOM_F32, 1, &one, LOOM_MEM_ACTIVATIONS);
    float *losses = loom_alloc((size_t)(a->n ? a->n : 1) * sizeof(float), LOOM_MEM_WORKSPACE); /* (N) */
    if (!out[0] || !losses) { loom_free(losses); return LOOM_ERR_NOMEM; }
    crossentropy_fwd_bwd(losses, NULL, loom_tensor_data(logits), a->tokens, a->n, V, a->ignore_index, 0.0f,
                         logits->dtype);
    double sum = 0.0;
    for (int i = 0; i < a->n; i++) sum += losses[i];
    loom_free(losses);
    int valid = count_valid(a);
    ((float *)loom_tensor_data(out[0]))[0] = valid ? (float)(sum / valid) : 0.0f;
    return loom_ctx_save(ctx, in, 1);
}

/* The softmax is recomputed here with the incoming gradient (e.g. the fp16
 * loss scale) folded in before rounding to the logits' dtype, so small
 * gradients do not underflow. When this op holds the only reference to the
 * logits (nobody else can read them again), the gradient overwrites them in
 * place: (N, V) is the largest activation of a language model, and this
 * keeps one copy of it alive instead of two. */
static loom_status xent_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin, int n_in) {
    (void)n_out; (void)n_in;
    const token_args *a = loom_ctx_args(ctx);
    loom_tensor *logits;
    OP_SAVED(ctx, 0, logits);
    int V = (int)logits->shape[1];
    int valid = count_valid(a);
    float scale = valid ? loom_tensor_get(gout[0], 0) / (float)valid : 0.0f;
    gin[0] = op_grad_in_place(logits);
    float *losses = loom_alloc((size_t)(a->n ? a->n : 1) * sizeof(float), LOOM_MEM_WORKSPACE);
    if (!gin[0] || !losses) { loom_free(losses); return LOOM_ERR_NOMEM; }
    crossentropy_fwd_bwd(losses, loom_tensor_data(gin[0]), loom_tensor_data(logits), a->tokens, a->n, V,
                         a->ignore_index, scale, logits->dtype);
    loom_free(losses);
    return LOOM_OK;
}

static const loom_function xent_function = {"cross_entropy", 1, 1, 0, xent_forward, xent_backward};

loom_status loom_cross_entropy(loom_tensor *logits, const int32_t *targets, int n, int ignore_index,
                               loom_tensor **out) {
    char d[96];
    *out = NULL;
    LOOM_TRY(op_check_contiguous("cross_entropy", "logits", logits));
    if (logits->ndim != 2 || logits->shape[0] != n)
        return loom_error(LOOM_ERR_INVALID, "cross_entropy: logits %s must be (N, V) with N = %d targets",
                          loom_tensor_describe(logits, d, sizeof d), n);
    for (int i = 0; i < n; i++)
        if (targets[i] != ignore_index && (targets[i] < 0 || targets[i] >= logits->shape[1]))
            return loom_error(LOOM_ERR_INVALID, "cross_entropy: target %d at row %d is outside [0, %lld)", targets[i],
                              i, (long long)logits->shape[1]);
    size_t size;
    token_args *a = token_args_new(targets, n, ignore_index, &size);
    if (!a) return loom_error(LOOM_ERR_NOMEM, "cross_entropy: out of memory");
    loom_tensor *in[1] = {logits};
    loom_status st = loom_function_apply(&xent_function, in, 1, out, 1, a, size);
    free(a);
    return st;
}
