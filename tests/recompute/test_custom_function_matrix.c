/*
 * test_custom_function_matrix.c — a user's custom function trained under
 * every combination the framework promises to compose.
 *
 * The function is a fused linear written with the public interface only. Its
 * forward saves five slots: NULL, the activation x, the weight, the bias (NULL
 * for one layer) and the weight again. Its backward checks that it gets back
 * NULL, the very parameters (the same weight twice) and NULL for a missing
 * bias, and accumulates dW straight into the parameter's gradient target
 * (fp32 main_grad, or the half-precision gradient with master-grad off).
 *
 * A 3-layer MLP of it trains for STEPS AdamW steps, with a loss scaler (fp16
 * starts at a scale that overflows, so steps are skipped and the scale backs
 * off), over every precision x master-grad on/off x 1 or 2 micro-batches x
 * every recompute mode, each layer its own region, and again with layers 1-2
 * inside an outer region of each mode holding inner regions of each mode.
 * All of it again with layer 1's weight frozen (loom_param_freeze, as
 * LoRA's base weights are): its saved slots still give back the very
 * parameter, which gets no gradient and never moves, and bf16 holds it
 * without a master.
 * Every step's gradients and the final masters and compute copies must be
 * the same bytes as the run without recompute, and the loss the same float.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "loom/loom.h"

enum { N_LAYERS = 3, BATCH = 32, IN = 32, HIDDEN = 64, CLASSES = 16, STEPS = 6 };

#define OK(expr) assert_int_equal((expr), LOOM_OK)

/* ---------------------------------------------------- the user's function */

typedef struct linear_args {
    loom_param *w, *b; /* what backward must get back; b may be NULL */
} linear_args;

static loom_status linear_forward(loom_fn_ctx *ctx, loom_tensor *const *in, int n_in, loom_tensor **out,
                                  int n_out) {
    (void)n_in; (void)n_out;
    loom_tensor *x = in[0], *w = in[1], *b = in[2];
    int N = (int)x->shape[0], K = (int)x->shape[1], M = (int)w->shape[0];
    out[0] = loom_tensor_new_2d(x->dtype, N, M, LOOM_MEM_ACTIVATIONS);
    if (!out[0]) return LOOM_ERR_NOMEM;
    LOOM_TRY(loom_gemm(0, 1, N, M, K, 1.0f, loom_tensor_data(x), K, loom_tensor_data(w), K, x->dtype, 0.0f,
                       loom_tensor_data(out[0]), M, x->dtype, b ? loom_tensor_data(b) : NULL, x->dtype));
    loom_tensor *save[5] = {NULL, x, w, b, w};
    return loom_ctx_save(ctx, save, 5);
}

static loom_status linear_backward(loom_fn_ctx *ctx, loom_tensor *const *gout, int n_out, loom_tensor **gin,
                                   int n_in) {
    (void)n_out; (void)n_in;
    const linear_args *a = loom_ctx_args(ctx);
    loom_tensor *none, *x, *w, *b, *w_again;
    LOOM_TRY(loom_ctx_saved(ctx, 0, &none));
    LOOM_TRY(loom_ctx_saved(ctx, 1, &x));
    LOOM_TRY(loom_ctx_saved(ctx, 2, &w));
    LOOM_TRY(loom_ctx_saved(ctx, 3, &b));
    LOOM_TRY(loom_ctx_saved(ctx, 4, &w_again));
    if (none || w_again != w || loom_tensor_param(w) != a->w || (a->b ? loom_tensor_param(b) != a->b : b != NULL))
        return loom_error(LOOM_ERR_STATE, "%s: the saved slots are not NULL, x, the weight, the bias, the weight",
                          a->w->name);
    const loom_tensor *dy = gout[0];
    int N = (int)x->shape[0], K = (int)x->shape[1], M = (int)w->shape[0];
    if (loom_ctx_needs_input_grad(ctx, 0)) {
        gin[0] = loom_tensor_new_2d(x->dtype, N, K, LOOM_MEM_ACTIVATIONS);
        if (!gin[0]) return LOOM_ERR_NOMEM;
        LOOM_TRY(loom_gemm(0, 0, N, K, M, 1.0f, loom_tensor_data(dy), M, loom_tensor_data(w), K, x->dtype, 0.0f,
                           loom_tensor_data(gin[0]), K, x->dtype, NULL, LOOM_F32));
    }
    loom_dtype dt;
    void *g;
    if (loom_ctx_needs_input_grad(ctx, 1)) { /* not for a frozen weight */
        g = loom_param_grad_target(a->w, &dt);
        LOOM_TRY(loom_gemm(1, 0, M, K, N, 1.0f, loom_tensor_data(dy), M, loom_tensor_data(x), K, x->dtype, 1.0f, g,
                           K, dt, NULL, LOOM_F32));
    }
    if (b && loom_ctx_needs_input_grad(ctx, 2)) {
        g = loom_param_grad_target(a->b, &dt);
        for (int j = 0; j < M; j++) {
            float s = 0.0f;
            for (int r = 0; r < N; r++) s += loom_tensor_get(dy, (int64_t)r * M + j);
            loom_store(g, (size_t)j, dt, loom_load(g, (size_t)j, dt) + s);
        }
    }
    return LOOM_OK;
}

static const loom_function user_linear = {"user_fused_linear", 3, 1, LOOM_FN_EXPENSIVE, linear_forward,
                                          linear_backward};

/* -------------------------------------------------------------- the model */

typedef struct model model;

/* A region's user pointer: it must live until the backward (a reentrant
 * region runs again from it there). */
typedef struct layer_ref {
    const model *m;
    int l;
} layer_ref;

struct model {
    loom_param *w[N_LAYERS], *b[N_LAYERS]; /* b[1] is NULL */
    loom_param *params[2 * N_LAYERS];
    int n_params;
    layer_ref refs[N_LAYERS];
    loom_recompute_mode inner; /* the mode of the regions inside the outer one */
};

/* Layer l as a region: x W^T + b, then SiLU except on the last layer. */
static loom_status layer_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const layer_ref *r = user;
    loom_param *w = r->m->w[r->l], *b = r->m->b[r->l];
    loom_tensor *lin_in[3] = {in[0], w->tensor, b ? b->tensor : NULL}, *y = NULL;
    linear_args a = {w, b};
    LOOM_TRY(loom_function_apply(&user_linear, lin_in, 3, &y, 1, &a, sizeof a));
    if (r->l == N_LAYERS - 1) {
        out[0] = y;
        return LOOM_OK;
    }
    loom_status st = loom_silu(y, &out[0]);
    loom_tensor_release(y);
    return st;
}

/* Layers from..N_LAYERS-1, each a region of `mode`; h is consumed. */
static loom_status layers(const model *m, loom_recompute_mode mode, int from, loom_tensor *h, loom_tensor **out) {
    for (int l = from; l < N_LAYERS; l++) {
        loom_tensor *next = NULL;
        loom_status st = loom_checkpoint(mode, layer_region, (void *)&m->refs[l], &h, 1, &next, 1);
        loom_tensor_release(h);
        if (st != LOOM_OK) return st;
        h = next;
    }
    *out = h;
    return LOOM_OK;
}

static loom_status outer_region(void *user, loom_tensor *const *in, int n_in, loom_tensor **out, int n_out) {
    (void)n_in; (void)n_out;
    const model *m = user;
    return layers(m, m->inner, 1, loom_tensor_retain(in[0]), out);
}

static void model_init(model *m, loom_dtype dt, int master_grad, int frozen) {
    memset(m, 0, sizeof *m);
    const int fan_in[N_LAYERS] = {IN, HIDDEN, HIDDEN}, fan_out[N_LAYERS] = {HIDDEN, HIDDEN, CLASSES};
    for (int l = 0; l < N_LAYERS; l++) {
        m->refs[l] = (layer_ref){m, l};
        char name[32];
        int64_t shape[2] = {fan_out[l], fan_in[l]};
        snprintf(name, sizeof name, "layers.%d.weight", l);
        OK(loom_param_new(name, dt, 2, shape, master_grad, &m->w[l]));
        loom_rng_normal(loom_param_master(m->w[l]), (size_t)(shape[0] * shape[1]), 0.0f,
                        1.0f / sqrtf((float)fan_in[l]), 100 + (uint64_t)l, 0);
        m->params[m->n_params++] = m->w[l];
        if (l == 1) continue; /* saves (x, W, NULL) */
        snprintf(name, sizeof name, "layers.%d.bias", l);
        OK(loom_param_new(name, dt, 1, shape, master_grad, &m->b[l]));
        loom_rng_normal(loom_param_master(m->b[l]), (size_t)shape[0], 0.0f, 0.1f, 200 + (uint64_t)l, 0);
        m->b[l]->no_weight_decay = 1;
        m->params[m->n_params++] = m->b[l];
    }
    for (int i = 0; i < m->n_params; i++) loom_param_sync_from_master(m->params[i]);
    if (frozen) OK(loom_param_freeze(m->w[1])); /* bf16: its master goes, its values stay */
}

static void model_free(model *m) {
    for (int i = 0; i < m->n_params; i++) loom_param_free(m->params[i]);
}

/* The data every run trains on: inputs, and as each row's class the
 * position of its largest value among the first CLASSES (a rule the MLP can
 * learn). Made once, by the group setup. */
static float data_x[BATCH * IN];
static int32_t data_targets[BATCH];

static int make_data(void **state) {
    (void)state;
    loom_rng_normal(data_x, BATCH * IN, 0.0f, 1.0f, 7, 0);
    for (int r = 0; r < BATCH; r++) {
        int best = 0;
        for (int c = 1; c < CLASSES; c++)
            if (data_x[r * IN + c] > data_x[r * IN + best]) best = c;
        data_targets[r] = best;
    }
    return 0;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

typedef struct setting {
    loom_dtype dt;
    int master_grad, micro;
    int nested;                 /* layers 1-2 in an outer region holding inner ones */
    int frozen;                 /* layer 1's weight frozen (LoRA's base weights are) */
    loom_recompute_mode outer, inner;
} setting;

typedef struct outcome {
    uint64_t hash; /* every step's gradients, then the final masters and compute copies */
    float loss;    /* the last micro-batch's */
    int skipped;
} outcome;

static outcome train(const setting *s) {
    const float *x = data_x;
    const int32_t *targets = data_targets;
    model m;
    model_init(&m, s->dt, s->master_grad, s->frozen);
    size_t n_frozen = (size_t)loom_param_numel(m.w[1]);
    float *frozen_before = malloc(n_frozen * sizeof(float)), *frozen_after = malloc(n_frozen * sizeof(float));
    loom_param_get_f32(m.w[1], frozen_before);
    m.inner = s->inner;
    loom_adamw_config cfg = loom_adamw_defaults();
    loom_adamw *opt;
    OK(loom_adamw_new(&cfg, m.params, m.n_params, &opt));
    loom_loss_scaler scaler;
    loom_loss_scaler_init(&scaler, s->dt == LOOM_F16);
    if (s->dt == LOOM_F16) scaler.scale = 0x1p23f; /* overflows fp16 gradients: the first steps are skipped */
    outcome o = {14695981039346656037ull, 0.0f, 0};
    const int rows = BATCH / s->micro;
    for (int step = 0; step < STEPS; step++) {
        for (int i = 0; i < m.n_params; i++) loom_param_zero_grad(m.params[i]);
        for (int mb = 0; mb < s->micro; mb++) {
            int64_t shape[2] = {rows, IN};
            loom_tensor *h = loom_tensor_from_f32(x + mb * rows * IN, s->dt, 2, shape, LOOM_MEM_ACTIVATIONS), *y;
            assert_non_null(h);
            if (s->nested) {
                loom_tensor *h1 = NULL;
                OK(loom_checkpoint(s->outer, layer_region, &m.refs[0], &h, 1, &h1, 1));
                loom_tensor_release(h);
                OK(loom_checkpoint(s->outer, outer_region, &m, &h1, 1, &y, 1));
                loom_tensor_release(h1);
            } else {
                OK(layers(&m, s->outer, 0, h, &y));
            }
            loom_tensor *loss = NULL;
            OK(loom_cross_entropy(y, targets + mb * rows, rows, -1, &loss));
            o.loss = loom_tensor_get(loss, 0);
            OK(loom_backward(loss, scaler.scale / (float)s->micro));
            loom_tensor_release(loss);
            loom_tensor_release(y);
        }
        OK(loom_grad_audit(m.params, m.n_params, NULL, 0));
        for (int i = 0; i < m.n_params; i++)
            if (m.params[i]->trainable)
                o.hash = fnv1a(o.hash, m.params[i]->grad,
                               (size_t)loom_param_numel(m.params[i]) * loom_dtype_size(m.params[i]->grad_dtype));
            else
                assert_null(m.params[i]->grad);
        loom_step_info info;
        loom_amp_prepare_step(m.params, m.n_params, &scaler, 1.0f, &info);
        if (info.found_inf) o.skipped++;
        else OK(loom_adamw_step(opt, 5e-2f, info.grad_multiplier));
        loom_loss_scaler_update(&scaler, info.found_inf);
    }
    for (int i = 0; i < m.n_params; i++) {
        loom_param *p = m.params[i];
        if (loom_param_has_master(p)) /* a frozen bf16 weight has none */
            o.hash = fnv1a(o.hash, loom_param_master(p), (size_t)loom_param_numel(p) * sizeof(float));
        o.hash = fnv1a(o.hash, loom_tensor_data(p->tensor), loom_tensor_nbytes(p->tensor));
    }
    loom_param_get_f32(m.w[1], frozen_after);
    if (s->frozen) assert_memory_equal(frozen_before, frozen_after, n_frozen * sizeof(float)); /* never moved */
    else assert_memory_not_equal(frozen_before, frozen_after, n_frozen * sizeof(float));
    free(frozen_before);
    free(frozen_after);
    loom_adamw_free(opt);
    model_free(&m);
    return o;
}

static const loom_recompute_mode modes[4] = {LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_REENTRANT,
                                             LOOM_RECOMPUTE_NONREENTRANT, LOOM_RECOMPUTE_SELECTIVE};

static void check_precision(loom_dtype dt) {
    for (int mg = 0; mg <= 1; mg++) {
        for (int micro = 1; micro <= 2; micro++) {
            for (int frozen = 0; frozen <= 1; frozen++) {
                setting s = {dt, mg, micro, 0, frozen, LOOM_RECOMPUTE_NONE, LOOM_RECOMPUTE_NONE};
                outcome ref = train(&s);
                assert_true(isfinite(ref.loss));
                /* fp16 skips its first steps and still trains; the others skip none. */
                assert_true(dt == LOOM_F16 ? ref.skipped > 0 && ref.skipped < STEPS : ref.skipped == 0);
                for (int nested = 0; nested <= 1; nested++) {
                    for (int k = 0; k < 4; k++) {
                        for (int ki = 0; ki < (nested ? 4 : 1); ki++) {
                            s = (setting){dt, mg, micro, nested, frozen, modes[k], modes[ki]};
                            outcome got = train(&s);
                            if (got.hash != ref.hash || memcmp(&got.loss, &ref.loss, sizeof got.loss) ||
                                got.skipped != ref.skipped)
                                fail_msg("%s master-grad %d, %d micro-batches, %s%s %s/%s: differs from no "
                                         "recompute (loss %.9g vs %.9g, %d vs %d skipped)", loom_dtype_name(dt), mg,
                                         micro, frozen ? "a frozen weight, " : "", nested ? "nested" : "flat",
                                         loom_recompute_mode_name(modes[k]),
                                         nested ? loom_recompute_mode_name(modes[ki]) : "-", (double)got.loss,
                                         (double)ref.loss, got.skipped, ref.skipped);
                        }
                    }
                }
            }
        }
    }
}

static void test_fp32(void **state) { (void)state; check_precision(LOOM_F32); }
static void test_bf16(void **state) { (void)state; check_precision(LOOM_BF16); }
static void test_fp16(void **state) { (void)state; check_precision(LOOM_F16); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp32),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_fp16),
    };
    return cmocka_run_group_tests(tests, make_data, NULL);
}
