/*
 * test_model_dir.c — replacing a model directory is all or nothing: a save
 * that fails at any file (weights, config, tokenizer) leaves every old file
 * byte for byte and no staged file behind; a save that succeeds replaces
 * all of them (and removes a tokenizer.json the new model does not have),
 * and the directory loads back as the saved model. A directory in Hugging
 * Face's sharded layout (model.safetensors.index.json and the files it
 * maps each tensor to) loads too, and a broken index is a clear error.
 * A training checkpoint with a loss scale its loader would refuse is never
 * written. A GGUF export refuses what it cannot write (no tokenizer, one
 * larger than the model's vocabulary, one with two tokens of the same bytes
 * or no end of text, another type, a NaN weight) and a failed write leaves
 * no file. (tests/python/gguf_check.py checks the file itself.)
 */
#include "io_test.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

#include "io/io_internal.h"
#include "kernels/kernels.h"
#include "loom/loom.h"

static loom_llama *model(uint64_t seed) {
    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = 16; c.n_layers = 1; c.n_heads = 2; c.n_kv_heads = 2; c.ffn_dim = 24; c.vocab_size = 40;
    c.max_seq = 8; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    loom_llama *m;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    loom_llama_init_weights(m, seed);
    return m;
}

static const char *const files[] = {"config.json", "model.safetensors", "tokenizer.json"};

/* The three files' bytes, in `files` order. */
typedef struct snapshot {
    unsigned char *data[3];
    size_t n[3];
} snapshot;

static snapshot take(void) {
    snapshot s;
    for (int i = 0; i < 3; i++) s.data[i] = io_read_raw(io_path(files[i]), &s.n[i]);
    return s;
}

static void assert_same(const snapshot *a, const snapshot *b, const char *when) {
    for (int i = 0; i < 3; i++) {
        if (a->n[i] != b->n[i]) fail_msg("%s: %s changed size", when, files[i]);
        assert_true(tu_bits_equal(a->data[i], b->data[i], a->n[i], files[i]));
    }
}

static void release(snapshot *s) {
    for (int i = 0; i < 3; i++) free(s->data[i]);
}

static void test_failed_save_keeps_old_directory(void **state) {
    (void)state;
    char tok_a[512], tok_b[512]; /* io_path's buffers rotate */
    snprintf(tok_a, sizeof tok_a, "%s", io_path("tok-a.json"));
    snprintf(tok_b, sizeof tok_b, "%s", io_path("tok-b.json"));
    io_write_raw(tok_a, "{\"a\": 1}", 8);
    io_write_raw(tok_b, "{\"b\": 22}", 9);
    loom_llama *a = model(1), *b = model(2);
    assert_int_equal(loom_model_dir_save(a, LOOM_F32, tok_a, io_scratch), LOOM_OK);
    snapshot before = take();

    /* The weights, the config and the tokenizer are committed in that
     * order: fail each one's rename in turn, then each one's write. */
    for (int skip = 0; skip < 3; skip++) {
        io_test_inject_failure(IO_FAIL_RENAME, skip, EIO);
        assert_int_equal(loom_model_dir_save(b, LOOM_BF16, tok_b, io_scratch), LOOM_ERR_IO);
        snapshot after = take();
        assert_same(&before, &after, "after a failed rename");
        release(&after);
        assert_int_equal(io_count_files(".new"), 0);
        assert_int_equal(io_count_files(".tmp."), 0);
    }
    for (int skip = 0; skip < 3; skip++) {
        io_test_inject_failure(IO_FAIL_WRITE, skip, ENOSPC);
        assert_int_equal(loom_model_dir_save(b, LOOM_BF16, tok_b, io_scratch), LOOM_ERR_IO);
        IO_ASSERT_MSG("disk full?");
        snapshot after = take();
        assert_same(&before, &after, "after a full disk");
        release(&after);
        assert_int_equal(io_count_files(".new"), 0);
    }
    /* A tokenizer that cannot be read fails before anything is replaced. */
    assert_int_equal(loom_model_dir_save(b, LOOM_BF16, io_path("no-such-tokenizer.json"), io_scratch), LOOM_ERR_IO);
    IO_ASSERT_MSG("no-such-tokenizer.json");
    snapshot after = take();
    assert_same(&before, &after, "after a missing tokenizer");
    release(&after);
    assert_int_equal(io_count_files(".new"), 0);
    io_test_inject_failure(IO_FAIL_NONE, 0, 0);

    /* A save that succeeds replaces all three and loads back as b. */
    assert_int_equal(loom_model_dir_save(b, LOOM_F32, tok_b, io_scratch), LOOM_OK);
    size_t n;
    unsigned char *tok = io_read_raw(io_path("tokenizer.json"), &n);
    assert_int_equal(n, 9);
    assert_memory_equal(tok, "{\"b\": 22}", 9);
    free(tok);
    loom_llama *back;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_model_dir_load(io_scratch, p, &back), LOOM_OK);
    for (int i = 0; i < b->n_params; i++)
        assert_true(tu_bits_equal(loom_param_master(back->params[i]), loom_param_master(b->params[i]),
                                  (size_t)loom_param_numel(b->params[i]) * sizeof(float), b->params[i]->name));
    loom_llama_free(back);
    /* Without a tokenizer, the one of the earlier model goes. */
    assert_int_equal(loom_model_dir_save(a, LOOM_F32, NULL, io_scratch), LOOM_OK);
    assert_int_equal(io_count_files("tokenizer.json"), 0);
    assert_int_equal(io_count_files(".new"), 0);
    release(&before);
    loom_llama_free(a);
    loom_llama_free(b);
}

/* Write the index of a sharded directory: every parameter of m to
 * "part-<i % 2>.safetensors", except that `skip` (if not NULL) is left out
 * and `odd_file` (if not NULL) replaces the file of parameter 0. */
static void write_index(const loom_llama *m, const char *skip, const char *odd_file) {
    char text[8192];
    size_t n = (size_t)snprintf(text, sizeof text, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
    int first = 1;
    for (int i = 0; i < m->n_params; i++) {
        if (skip && !strcmp(m->params[i]->name, skip)) continue;
        char file[64];
        snprintf(file, sizeof file, "part-%d.safetensors", i % 2);
        n += (size_t)snprintf(text + n, sizeof text - n, "%s\"%s\": \"%s\"", first ? "" : ", ", m->params[i]->name,
                              i == 0 && odd_file ? odd_file : file);
        first = 0;
    }
    n += (size_t)snprintf(text + n, sizeof text - n, "}}");
    assert_true(n < sizeof text);
    io_write_raw(io_path("sharded/model.safetensors.index.json"), text, n);
}

static void expect_load_error(loom_status want, const char *message) {
    loom_llama *back = NULL;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_model_dir_load(io_path("sharded"), p, &back), want);
    assert_null(back);
    if (!strstr(loom_last_error(), message)) fail_msg("'%s' does not say '%s'", loom_last_error(), message);
}

static void test_sharded_directory(void **state) {
    (void)state;
    loom_llama *a = model(7);
    assert_int_equal(mkdir(io_path("sharded"), 0755), 0);
    assert_int_equal(loom_llama_config_save(&a->cfg, LOOM_F32, io_path("sharded/config.json")), LOOM_OK);
    loom_safetensors_writer *w[2];
    for (int k = 0; k < 2; k++) assert_int_equal(loom_safetensors_writer_init(&w[k]), LOOM_OK);
    for (int i = 0; i < a->n_params; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(a, i, fs);
        assert_int_equal(loom_safetensors_writer_add(w[i % 2], a->params[i]->name, LOOM_SAFETENSORS_F32, fs,
                                                     a->params[i]->tensor->ndim, loom_param_master(a->params[i])),
                         LOOM_OK);
    }
    assert_int_equal(loom_safetensors_writer_write(w[0], io_path("sharded/part-0.safetensors")), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_write(w[1], io_path("sharded/part-1.safetensors")), LOOM_OK);
    for (int k = 0; k < 2; k++) loom_safetensors_writer_free(w[k]);
    write_index(a, NULL, NULL);
    loom_llama *back;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_model_dir_load(io_path("sharded"), p, &back), LOOM_OK);
    for (int i = 0; i < a->n_params; i++)
        assert_true(tu_bits_equal(loom_param_master(back->params[i]), loom_param_master(a->params[i]),
                                  (size_t)loom_param_numel(a->params[i]) * sizeof(float), a->params[i]->name));
    loom_llama_free(back);

    const char *name = a->params[1]->name;
    write_index(a, name, NULL);
    expect_load_error(LOOM_ERR_FORMAT, "is missing from its weight_map");
    expect_load_error(LOOM_ERR_FORMAT, name);
    write_index(a, NULL, "../part-0.safetensors");
    expect_load_error(LOOM_ERR_FORMAT, "must name a file beside it");
    write_index(a, NULL, "part-9.safetensors");
    expect_load_error(LOOM_ERR_IO, "part-9.safetensors");
    write_index(a, NULL, "part-1.safetensors"); /* parameter 0 is in part-0 */
    expect_load_error(LOOM_ERR_FORMAT, a->params[0]->name);
    io_write_raw(io_path("sharded/model.safetensors.index.json"), "{\"weight_map\": [", 16);
    expect_load_error(LOOM_ERR_FORMAT, "invalid JSON");
    io_write_raw(io_path("sharded/model.safetensors.index.json"), "{\"weight_map\": 3}", 17);
    expect_load_error(LOOM_ERR_FORMAT, "no \"weight_map\" object");
    unlink(io_path("sharded/model.safetensors.index.json"));
    expect_load_error(LOOM_ERR_IO, "model.safetensors");
    loom_llama_free(a);
}

/* A checkpoint whose state loom_checkpoint_load would refuse (a loss scale
 * of 0, below 2^-16, or NaN) is never written; one with a valid scale
 * writes and loads back with that scale and the step. */
static void test_checkpoint_refuses_bad_loss_scale(void **state) {
    (void)state;
    loom_llama *m = model(3);
    float *mm[16] = {0}, *vv[16] = {0};
    assert_true(m->n_params <= 16);
    for (int i = 0; i < m->n_params; i++) {
        mm[i] = calloc((size_t)loom_param_numel(m->params[i]), sizeof(float));
        vv[i] = calloc((size_t)loom_param_numel(m->params[i]), sizeof(float));
    }
    loom_train_state st;
    memset(&st, 0, sizeof st);
    st.step = 7;
    const float bad[] = {0.0f, 1e-6f, NAN};
    struct stat sb;
    for (int k = 0; k < 3; k++) {
        st.loss_scale = bad[k];
        assert_int_equal(loom_checkpoint_save(io_path("ckpt-bad"), m, mm, vv, 7, &st, NULL), LOOM_ERR_INVALID);
        assert_non_null(strstr(loom_last_error(), "loss_scale"));
        assert_int_not_equal(stat(io_path("ckpt-bad"), &sb), 0);
    }
    st.loss_scale = 1.0f;
    assert_int_equal(loom_checkpoint_save(io_path("ckpt-good"), m, mm, vv, 7, &st, NULL), LOOM_OK);
    loom_train_state back;
    int adam_steps = 0;
    assert_int_equal(loom_checkpoint_load(io_path("ckpt-good"), m, mm, vv, &adam_steps, &back), LOOM_OK);
    assert_true(back.loss_scale == 1.0f && back.step == 7 && adam_steps == 7);
    for (int i = 0; i < m->n_params; i++) { free(mm[i]); free(vv[i]); }
    loom_llama_free(m);
}

/* A LoRA model's checkpoint: the frozen weights without moments (NULL),
 * the adapters with theirs; it loads back into a model with the same
 * adapters only. Its model directory holds the merged weights and no
 * adapter tensor. */
static void test_lora_checkpoint(void **state) {
    (void)state;
    loom_llama *m = model(5), *back = model(6), *plain = model(5);
    loom_lora_config lc = {.rank = 2, .alpha = 3.0f, .targets = (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_DOWN)};
    assert_int_equal(loom_llama_add_lora(m, &lc, 1), LOOM_OK);
    assert_int_equal(loom_llama_add_lora(back, &lc, 2), LOOM_OK); /* other adapters: the load must replace them */
    float *mm[32] = {0}, *vv[32] = {0}, *mb[32] = {0}, *vb[32] = {0};
    assert_true(m->n_params <= 32);
    for (int i = m->n_base; i < m->n_params; i++) {
        size_t n = (size_t)loom_param_numel(m->params[i]);
        mm[i] = malloc(n * sizeof(float)); vv[i] = malloc(n * sizeof(float));
        mb[i] = calloc(n, sizeof(float)); vb[i] = calloc(n, sizeof(float));
        tu_fill_uniform(mm[i], n, -1, 1, 10 + (uint64_t)i);
        tu_fill_uniform(vv[i], n, 0, 1, 50 + (uint64_t)i);
        float *b = loom_param_master(m->params[i]); /* B nonzero, so the merge shows */
        if (strstr(m->params[i]->name, "lora_B")) tu_fill_uniform(b, n, -1, 1, 90 + (uint64_t)i);
        loom_param_sync_from_master(m->params[i]);
    }
    loom_train_state st;
    memset(&st, 0, sizeof st);
    st.step = 4;
    st.loss_scale = 1.0f;
    assert_int_equal(loom_checkpoint_save(io_path("ckpt-lora"), m, mm, vv, 4, &st, NULL), LOOM_OK);
    int adam_steps = 0;
    loom_train_state got;
    assert_int_equal(loom_checkpoint_load(io_path("ckpt-lora"), back, mb, vb, &adam_steps, &got), LOOM_OK);
    for (int i = 0; i < m->n_params; i++) {
        size_t bytes = (size_t)loom_param_numel(m->params[i]) * sizeof(float);
        assert_memory_equal(loom_param_master(m->params[i]), loom_param_master(back->params[i]), bytes);
        if (i >= m->n_base) {
            assert_memory_equal(mm[i], mb[i], bytes);
            assert_memory_equal(vv[i], vb[i], bytes);
        }
    }
    /* The directory: merged weights (q_proj moved, v_proj as it was), no adapters. */
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", io_path("ckpt-lora"));
    loom_safetensors *sf;
    assert_int_equal(loom_safetensors_open(path, &sf), LOOM_OK);
    assert_false(loom_safetensors_has(sf, "model.layers.0.self_attn.q_proj.lora_A.weight"));
    loom_safetensors_close(sf);
    assert_int_equal(loom_model_dir_load_weights(plain, io_path("ckpt-lora")), LOOM_OK);
    loom_param *q = loom_llama_find_param(m, "model.layers.0.self_attn.q_proj.weight");
    loom_param *v = loom_llama_find_param(m, "model.layers.0.self_attn.v_proj.weight");
    size_t nq = (size_t)loom_param_numel(q);
    float *merged = malloc(nq * sizeof *merged);
    for (int i = 0; i < m->n_base; i++)
        if (m->params[i] == q) assert_int_equal(loom_llama_param_merged(m, i, merged), LOOM_OK);
    float *pq = loom_param_master(loom_llama_find_param(plain, q->name));
    assert_memory_equal(pq, merged, nq * sizeof(float));
    assert_memory_not_equal(pq, loom_param_master(q), nq * sizeof(float));
    assert_memory_equal(loom_param_master(loom_llama_find_param(plain, v->name)), loom_param_master(v),
                        (size_t)loom_param_numel(v) * sizeof(float));
    free(merged);
    /* Into a model without adapters, or with others: refused, naming the setting. */
    float *pm[32] = {0}, *pv[32] = {0};
    for (int i = 0; i < plain->n_params; i++) {
        pm[i] = calloc((size_t)loom_param_numel(plain->params[i]), sizeof(float));
        pv[i] = calloc((size_t)loom_param_numel(plain->params[i]), sizeof(float));
    }
    assert_int_equal(loom_checkpoint_load(io_path("ckpt-lora"), plain, pm, pv, &adam_steps, &got), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("--lora 2 --lora-alpha 3 --lora-targets q,down");
    loom_llama *other = model(5);
    loom_lora_config lo = {.rank = 2, .alpha = 3.0f, .targets = 1u << LOOM_LORA_Q};
    assert_int_equal(loom_llama_add_lora(other, &lo, 1), LOOM_OK);
    assert_int_equal(loom_checkpoint_load(io_path("ckpt-lora"), other, mb, vb, &adam_steps, &got), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("--lora-targets q;");
    /* A checkpoint without adapters into a LoRA model: refused too. */
    assert_int_equal(loom_checkpoint_save(io_path("ckpt-plain"), plain, pm, pv, 4, &st, NULL), LOOM_OK);
    assert_int_equal(loom_checkpoint_load(io_path("ckpt-plain"), back, mb, vb, &adam_steps, &got), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("no LoRA adapters");
    for (int i = 0; i < 32; i++) { free(mm[i]); free(vv[i]); free(mb[i]); free(vb[i]); free(pm[i]); free(pv[i]); }
    loom_llama_free(other);
    loom_llama_free(plain);
    loom_llama_free(back);
    loom_llama_free(m);
}

/* bf16: the frozen weights hold no fp32 master; the checkpoint stores them
 * as their bf16 values (in its state and, those without an adapter, in its
 * model directory), and loads them back into the compute copies bit for
 * bit. */
static void test_lora_checkpoint_bf16(void **state) {
    (void)state;
    loom_llama *m = model(5), *ref = NULL;
    loom_llama_config c = m->cfg;
    loom_llama_free(m);
    loom_precision prec = {LOOM_BF16, 1};
    loom_llama *ms[2];
    for (int k = 0; k < 2; k++) {
        assert_int_equal(loom_llama_new(&c, prec, &ms[k]), LOOM_OK);
        loom_llama_init_weights(ms[k], 20 + (uint64_t)k);
        loom_lora_config lc = {.rank = 2, .alpha = 4.0f, .targets = LOOM_LORA_ALL};
        assert_int_equal(loom_llama_add_lora(ms[k], &lc, 30 + (uint64_t)k), LOOM_OK);
    }
    m = ms[0];
    ref = ms[1];
    float *mm[64] = {0}, *vv[64] = {0};
    assert_true(m->n_params <= 64);
    for (int i = m->n_base; i < m->n_params; i++) {
        size_t n = (size_t)loom_param_numel(m->params[i]);
        mm[i] = calloc(n, sizeof(float));
        vv[i] = calloc(n, sizeof(float));
    }
    loom_train_state st;
    memset(&st, 0, sizeof st);
    st.loss_scale = 1.0f;
    assert_int_equal(loom_checkpoint_save(io_path("ckpt-bf16"), m, mm, vv, 1, &st, NULL), LOOM_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/state.safetensors", io_path("ckpt-bf16"));
    loom_safetensors *sf;
    loom_safetensors_tensor t;
    assert_int_equal(loom_safetensors_open(path, &sf), LOOM_OK);
    assert_int_equal(loom_safetensors_get(sf, "master.model.layers.0.mlp.up_proj.weight", &t), LOOM_OK);
    assert_int_equal(t.dtype, LOOM_SAFETENSORS_BF16);
    assert_int_equal(loom_safetensors_get(sf, "master.model.layers.0.mlp.up_proj.lora_A.weight", &t), LOOM_OK);
    assert_int_equal(t.dtype, LOOM_SAFETENSORS_F32);
    assert_false(loom_safetensors_has(sf, "adam_m.model.layers.0.mlp.up_proj.weight"));
    loom_safetensors_close(sf);
    int adam_steps;
    loom_train_state got;
    assert_int_equal(loom_checkpoint_load(io_path("ckpt-bf16"), ref, mm, vv, &adam_steps, &got), LOOM_OK);
    for (int i = 0; i < m->n_params; i++) {
        const loom_tensor *a = m->params[i]->tensor, *b = ref->params[i]->tensor;
        assert_memory_equal(loom_tensor_data(a), loom_tensor_data(b), (size_t)loom_tensor_numel(a) * 2);
    }
    for (int i = 0; i < 64; i++) { free(mm[i]); free(vv[i]); }
    loom_llama_free(ref);
    loom_llama_free(m);
}

/* A PEFT adapter directory round-trips: loom_lora_save_peft, then
 * loom_lora_load_peft into the base model, gives the same adapters and the
 * same forward; settings loom does not compute, and files that do not
 * match their config, are refused by name. */
static void test_peft_adapter(void **state) {
    (void)state;
    loom_llama *m = model(5), *back = model(5);
    loom_lora_config lc = {.rank = 2, .alpha = 3.0f, .targets = (1u << LOOM_LORA_V) | (1u << LOOM_LORA_UP),
                           .dropout = 0.1f, .rslora = 1}; /* rsLoRA */
    assert_int_equal(loom_llama_add_lora(m, &lc, 9), LOOM_OK);
    for (int i = m->n_base; i < m->n_params; i++) { /* B nonzero */
        size_t n = (size_t)loom_param_numel(m->params[i]);
        tu_fill_uniform(loom_param_master(m->params[i]), n, -1, 1, 60 + (uint64_t)i);
    }
    assert_int_equal(loom_lora_save_peft(m, io_path("adapter"), "/models/base"), LOOM_OK);
    assert_int_equal(loom_lora_load_peft(back, io_path("adapter")), LOOM_OK);
    assert_true(back->lora.rank == 2 && back->lora.alpha == 3.0f && back->lora.targets == lc.targets &&
                back->lora.dropout == 0.1f && back->lora.rslora == 1);
    assert_int_equal(back->n_params, m->n_params);
    for (int i = 0; i < m->n_params; i++)
        assert_memory_equal(loom_param_master(m->params[i]), loom_param_master(back->params[i]),
                            (size_t)loom_param_numel(m->params[i]) * sizeof(float));
    loom_llama_free(back);
    /* Refusals: each config below, or file, against a fresh base model. */
    char cfg_path[512], st_path[512];
    snprintf(cfg_path, sizeof cfg_path, "%s/adapter_config.json", io_path("adapter"));
    snprintf(st_path, sizeof st_path, "%s/adapter_model.safetensors", io_path("adapter"));
    size_t n_cfg;
    unsigned char *good = io_read_raw(cfg_path, &n_cfg);
    char *text = strndup((const char *)good, n_cfg);
    assert_non_null(strstr(text, "\"use_rslora\": true")); /* as PEFT reads it */
    free(text);
    loom_llama *plain = model(5); /* adapters made already, without rsLoRA: not this adapter's setting */
    loom_lora_config pc = lc;
    pc.rslora = 0;
    assert_int_equal(loom_llama_add_lora(plain, &pc, 9), LOOM_OK);
    assert_int_equal(loom_lora_load_peft(plain, io_path("adapter")), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("use_rslora");
    loom_llama_free(plain);
    static const struct { const char *json, *msg; loom_status st; } bad[] = {
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 3, \"target_modules\": [\"v_proj\", \"up_proj\"], "
         "\"fan_in_fan_out\": true}", "fan_in_fan_out", LOOM_ERR_UNSUPPORTED},
        /* DoRA's magnitudes named by the config, which the file lacks */
        {"{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": [\"v_proj\", \"up_proj\"], \"use_rslora\": true, "
         "\"use_dora\": true}", "v_proj.lora_magnitude_vector is missing", LOOM_ERR_FORMAT},
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", \"up_proj\"], \"use_dora\": \"yes\"}",
         "use_dora must be true or false", LOOM_ERR_FORMAT},
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", \"up_proj\"], \"use_rslora\": 1}", "use_rslora must be true or false",
         LOOM_ERR_FORMAT},
        /* a pattern that selects every linear, where the file has two */
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"target_modules\": \".*proj\"}", "q_proj.lora_A.weight is missing",
         LOOM_ERR_FORMAT},
        {"{\"r\": 2, \"target_modules\": \"model\\\\.layers\\\\.\\\\d+\\\\.self_attn\\\\.v_proj\"}", "uses \\d",
         LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"(?:v|up)_proj\"}", "(?...) group", LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"model.layers.[0-9]{1,3}.self_attn.v_proj\"}", "counted repeat",
         LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"model.layers.[0-9]++.self_attn.v_proj\"}", "a repeat of a repeat",
         LOOM_ERR_UNSUPPORTED},
        /* glibc's regcomp doubles a +-repeated group per level of nesting */
        {"{\"r\": 2, \"target_modules\": \"((((((((a+)+)+)+)+)+)+)+)+\"}", "repeated with +",
         LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"(((((((((v_proj)))))))))\"}", "nested more than 8 deep",
         LOOM_ERR_UNSUPPORTED},
        /* what glibc and Python read differently */
        {"{\"r\": 2, \"target_modules\": \".*\\\\<v_proj\"}", "uses \\<", LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"model.layers.[[:digit:]]+.self_attn.v_proj\"}", "[:class:]",
         LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"model.layers.[\\\\d]+.self_attn.v_proj\"}", "backslash inside",
         LOOM_ERR_UNSUPPORTED},
        /* layer 1 of a model of one layer */
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", \"model.layers.1.mlp.up_proj\"]}",
         "entry \"model.layers.1.mlp.up_proj\" selects none", LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"(v_proj\"}", "not a regular expression", LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": \"lm_head\"}", "selects none of q_proj", LOOM_ERR_UNSUPPORTED},
        /* a pattern matches whole names: "v_proj" alone names no module */
        {"{\"r\": 2, \"target_modules\": \"v_proj\"}", "selects none of q_proj", LOOM_ERR_UNSUPPORTED},
        {"{\"peft_type\": \"PREFIX_TUNING\", \"r\": 2}", "peft_type", LOOM_ERR_UNSUPPORTED},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"target_modules\": [\"v_proj\", \"lm_head\"]}", "lm_head",
         LOOM_ERR_UNSUPPORTED},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"target_modules\": [\"v_proj\"], \"bias\": \"all\"}", "bias",
         LOOM_ERR_UNSUPPORTED},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"target_modules\": [\"v_proj\"], \"modules_to_save\": "
         "[\"lm_head\"]}", "modules_to_save", LOOM_ERR_UNSUPPORTED},
        /* the file holds up_proj's adapters too, which this config does not name */
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 3, \"target_modules\": [\"v_proj\"]}",
         "up_proj.lora_A.weight is not one of the adapters", LOOM_ERR_UNSUPPORTED},
        /* and a rank that does not match its tensors */
        {"{\"peft_type\": \"LORA\", \"r\": 3, \"target_modules\": [\"v_proj\", \"up_proj\"]}", "v_proj.lora_A",
         LOOM_ERR_FORMAT},
        {"{\"r\": 2, ", "invalid JSON", LOOM_ERR_FORMAT},
        {"{\"r\": 2, \"target_modules\": [\"v\", \"up_proj\"]}", "entry \"v\" selects none", LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", 3]}", "entry 1 is not a string", LOOM_ERR_FORMAT},
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", \"up_proj\"], \"lora_bias\": true}", "lora_bias",
         LOOM_ERR_UNSUPPORTED},
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", \"up_proj\"], \"lora_dropout\": 0.99999999999}",
         "lora_dropout", LOOM_ERR_FORMAT},
        /* all-linear names every linear, and the file has two of them */
        {"{\"r\": 2, \"target_modules\": \"all-linear\"}", "q_proj.lora_A.weight is missing", LOOM_ERR_FORMAT},
        {"{\"peft_type\": \"LORA\", \"target_modules\": [\"v_proj\"]}", "\"r\"", LOOM_ERR_FORMAT},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        io_write_raw(cfg_path, bad[k].json, strlen(bad[k].json));
        loom_llama *b = model(5);
        assert_int_equal(loom_lora_load_peft(b, io_path("adapter")), bad[k].st);
        IO_ASSERT_MSG(bad[k].msg);
        loom_llama_free(b);
    }
    /* The same two linears named by the ends of their names, and by
     * patterns (PEFT's re.fullmatch over the module names). */
    static const char *const same[] = {
        "{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": [\"self_attn.v_proj\", \"mlp.up_proj\"]}",
        "{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": \".*\\\\.(v_proj|up_proj)\"}",
        "{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": \"model\\\\.layers\\\\.[0-9]+\\\\.(self_attn\\\\.v|mlp\\\\.up)_proj\"}",
        "{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": \"^.*?(v|up)_proj$\"}",
        "{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": \"(.*[.*+?{(])?(v|up)_proj\"}",
    };
    for (size_t k = 0; k < sizeof same / sizeof same[0]; k++) {
        io_write_raw(cfg_path, same[k], strlen(same[k]));
        loom_llama *e = model(5);
        assert_int_equal(loom_lora_load_peft(e, io_path("adapter")), LOOM_OK);
        assert_true(e->lora.targets == lc.targets);
        loom_llama_free(e);
    }
    /* Some layers only: refused against a model of two layers, and with
     * no model known (layers 0..127); the one layer of this model is all
     * of them. */
    static const struct { const char *json; int layers; const char *msg; } some[] = {
        {"{\"r\": 2, \"target_modules\": \"model.layers.0.self_attn.v_proj\"}", 2, "v_proj in some layers only"},
        {"{\"r\": 2, \"target_modules\": \"model.layers.[0-9].mlp.up_proj\"}", 0, "up_proj in some layers only"},
        {"{\"r\": 2, \"target_modules\": [\"v_proj\", \"model.layers.1.mlp.up_proj\"]}", 2,
         "up_proj in some layers only"},
    };
    for (size_t k = 0; k < sizeof some / sizeof some[0]; k++) {
        loom_lora_config sc;
        io_write_raw(cfg_path, some[k].json, strlen(some[k].json));
        assert_int_equal(some[k].layers ? loom_lora_peft_config_layers(io_path("adapter"), some[k].layers, &sc)
                                        : loom_lora_peft_config(io_path("adapter"), &sc),
                         LOOM_ERR_UNSUPPORTED);
        IO_ASSERT_MSG(some[k].msg);
    }
    const char *exact = "{\"r\": 2, \"lora_alpha\": 3, \"target_modules\": "
                        "\"model\\\\.layers\\\\.0\\\\.(self_attn\\\\.v|mlp\\\\.up)_proj\"}";
    io_write_raw(cfg_path, exact, strlen(exact));
    loom_llama *x = model(5);
    assert_int_equal(loom_lora_load_peft(x, io_path("adapter")), LOOM_OK);
    assert_true(x->lora.targets == lc.targets);
    loom_llama_free(x);
    /* PEFT's default alpha (8) when the config leaves it out */
    const char *no_alpha = "{\"r\": 2, \"target_modules\": [\"up_proj\", \"v_proj\"]}";
    io_write_raw(cfg_path, no_alpha, strlen(no_alpha));
    loom_llama *d = model(5);
    assert_int_equal(loom_lora_load_peft(d, io_path("adapter")), LOOM_OK);
    assert_true(d->lora.alpha == 8.0f && d->lora.dropout == 0.0f && d->lora.targets == lc.targets);
    loom_llama_free(d);
    io_write_raw(cfg_path, good, n_cfg);
    free(good);
    unlink(st_path); /* a missing file */
    loom_llama *b = model(5);
    assert_int_equal(loom_lora_load_peft(b, io_path("adapter")), LOOM_ERR_IO);
    IO_ASSERT_MSG("adapter_model.safetensors");
    loom_llama_free(b);
    loom_llama_free(m);
}

/* rope_scaling survives config.json: llama3 and linear, written in Hugging
 * Face's form and read back field for field; "default" is none. */
/* The config that config.json text `json` loads as (it must load). */
static loom_llama_config config_of(const char *json) {
    loom_llama_config c;
    io_write_raw(io_path("config.json"), json, strlen(json));
    loom_status st = loom_llama_config_load(io_path("config.json"), &c);
    if (st != LOOM_OK) fprintf(stderr, "config_of: %s\n", loom_last_error());
    assert_int_equal(st, LOOM_OK);
    return c;
}

/* A small config with `extra` members is refused, naming msg. */
static void assert_config_refused(const char *extra, const char *msg) {
    char json[512];
    loom_llama_config c;
    snprintf(json, sizeof json, "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
             "\"intermediate_size\": 24, \"vocab_size\": 40%s}", extra);
    io_write_raw(io_path("config.json"), json, strlen(json));
    assert_int_not_equal(loom_llama_config_load(io_path("config.json"), &c), LOOM_OK);
    IO_ASSERT_MSG(msg);
}

/* The config text head (an object's first members) followed by extra
 * (which closes it) is refused, naming msg. */
static void assert_refused_with(const char *head, const char *extra, const char *msg) {
    char json[1024];
    loom_llama_config c;
    snprintf(json, sizeof json, "%s%s", head, extra);
    io_write_raw(io_path("config.json"), json, strlen(json));
    assert_int_not_equal(loom_llama_config_load(io_path("config.json"), &c), LOOM_OK);
    IO_ASSERT_MSG(msg);
}

/* Whether the config file written last holds `what`. */
static int saved_text_has(const char *what) {
    size_t n;
    char *text = (char *)io_read_raw(io_path("config.json"), &n);
    int has = strstr(text, what) != NULL;
    free(text);
    return has;
}

/* c saved as config.json and loaded back. */
static loom_llama_config saved_and_loaded(const loom_llama_config *c) {
    loom_llama_config back;
    assert_int_equal(loom_llama_config_save(c, LOOM_F32, io_path("config.json")), LOOM_OK);
    assert_int_equal(loom_llama_config_load(io_path("config.json"), &back), LOOM_OK);
    return back;
}

static void test_rope_scaling_config(void **state) {
    (void)state;
    loom_llama_config c, back;
    memset(&c, 0, sizeof c);
    c.dim = 16; c.n_layers = 1; c.n_heads = 2; c.n_kv_heads = 1; c.ffn_dim = 24; c.vocab_size = 40;
    c.max_seq = 8; c.rope_theta = 500000.0f; c.norm_eps = 1e-5f;
    c.rope_type = LOOM_ROPE_LLAMA3; c.rope_factor = 32.0f; c.rope_low_freq_factor = 1.0f;
    c.rope_high_freq_factor = 4.0f; c.rope_original_max_pos = 8192;
    for (int k = 0; k < 2; k++) {
        if (k == 1) { c.rope_type = LOOM_ROPE_LINEAR; c.rope_factor = 2.5f; c.rope_low_freq_factor = 0.0f;
                      c.rope_high_freq_factor = 0.0f; c.rope_original_max_pos = 0; }
        assert_int_equal(loom_llama_config_save(&c, LOOM_BF16, io_path("config.json")), LOOM_OK);
        assert_int_equal(loom_llama_config_load(io_path("config.json"), &back), LOOM_OK);
        assert_int_equal(back.rope_type, c.rope_type);
        assert_true(back.rope_factor == c.rope_factor && back.rope_low_freq_factor == c.rope_low_freq_factor &&
                    back.rope_high_freq_factor == c.rope_high_freq_factor &&
                    back.rope_original_max_pos == c.rope_original_max_pos);
    }
    const char *def = "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                      "\"intermediate_size\": 24, \"vocab_size\": 40, \"rope_scaling\": {\"rope_type\": \"default\"}}";
    back = config_of(def);
    assert_int_equal(back.rope_type, LOOM_ROPE_DEFAULT);
    /* transformers v5: theta and the scaling in rope_parameters */
    const char *v5 = "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                     "\"intermediate_size\": 24, \"vocab_size\": 40, \"rope_parameters\": {\"rope_theta\": 500000.0, "
                     "\"rope_type\": \"llama3\", \"factor\": 32.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                     "\"original_max_position_embeddings\": 8192}}";
    back = config_of(v5);
    assert_true(back.rope_theta == 500000.0f && back.rope_type == LOOM_ROPE_LLAMA3 && back.rope_factor == 32.0f &&
                back.rope_original_max_pos == 8192);
    /* Mistral: the window (4096 unless said) on every block, the context as the file says */
    const char *mistral = "{\"model_type\": \"mistral\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                          "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40, "
                          "\"max_position_embeddings\": 32768}";
    back = config_of(mistral);
    assert_true(back.max_seq == 32768 && back.sliding_window == 4096 && loom_llama_layer_window(&back, 0) == 4096);
}

/* The attention's biases in config.json: Qwen 2's model_type gives q, k
 * and v biases (whatever attention_bias says), LLaMA's attention_bias all
 * four (Mistral's none); each saves as Hugging Face writes it and loads
 * back; Qwen 2's window applies only with use_sliding_window, and its
 * defaults are Qwen2Config's; what is not a boolean, an MLP bias and a bias
 * on o alone are refused by name. */
static void test_bias_config(void **state) {
    (void)state;
    static const struct { const char *extra; int qkv, o, max_seq, window; } good[] = {
        {"", 0, 0, 2048, 0},
        {", \"attention_bias\": false", 0, 0, 2048, 0},
        {", \"attention_bias\": true, \"attention_dropout\": 0.0", 1, 1, 2048, 0},
        {", \"model_type\": \"qwen2\"", 1, 0, 32768, 0}, /* Qwen2Config's context */
        {", \"model_type\": \"qwen2\", \"attention_bias\": true, \"sliding_window\": 64, "
         "\"use_sliding_window\": false", 1, 0, 32768, 0},
        /* from max_window_layers on: Qwen2Config's 28, past the one block */
        {", \"model_type\": \"qwen2\", \"sliding_window\": 64, \"use_sliding_window\": true", 1, 0, 32768, 0},
        {", \"model_type\": \"qwen2\", \"sliding_window\": 64, \"use_sliding_window\": true, "
         "\"max_window_layers\": 0", 1, 0, 32768, 64},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"max_window_layers\": 0", 1, 0, 32768,
         4096}, /* Qwen2Config's window */
        {", \"model_type\": \"mistral\", \"attention_bias\": true", 0, 0, 2048, 4096}, /* Mistral's has none */
    };
    char json[512];
    loom_llama_config c, back;
    for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
        snprintf(json, sizeof json, "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                 "\"num_key_value_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40%s}", good[k].extra);
        io_write_raw(io_path("config.json"), json, strlen(json));
        assert_int_equal(loom_llama_config_load(io_path("config.json"), &c), LOOM_OK);
        assert_true(c.qkv_bias == good[k].qkv && c.o_bias == good[k].o && c.max_seq == good[k].max_seq);
        assert_int_equal(loom_llama_layer_window(&c, 0), good[k].window);
        back = saved_and_loaded(&c);
        assert_true(back.qkv_bias == c.qkv_bias && back.o_bias == c.o_bias && loom_llama_config_same_model(&c, &back));
        assert_true(loom_llama_config_same_weights(&c, &back));
        int qwen = saved_text_has("\"model_type\": \"qwen2\""), mistral = saved_text_has("MistralForCausalLM");
        assert_int_equal(qwen, c.qkv_bias && !c.o_bias);
        assert_int_equal(mistral, !qwen && c.sliding_window > 0); /* LLaMA's with a window */
        assert_true(qwen || mistral ? !saved_text_has("attention_bias") /* Qwen 2's q, k, v have them, Mistral's none */
                                    : saved_text_has(c.o_bias ? "\"attention_bias\": true" : "\"attention_bias\": false"));
    }
    back.qkv_bias = 1;
    assert_false(loom_llama_config_same_weights(&c, &back)); /* the biases are weights */
    /* heads of their own size: kept, saved and loaded back; dim / heads is no head_dim of its own */
    const char *hd = "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                     "\"head_dim\": 12, \"intermediate_size\": 24, \"vocab_size\": 40}";
    c = config_of(hd);
    assert_true(c.head_dim == 12 && loom_llama_head_dim(&c) == 12);
    back = saved_and_loaded(&c);
    assert_true(back.head_dim == 12 && loom_llama_config_same_weights(&c, &back));
    back.head_dim = 0;
    assert_false(loom_llama_config_same_weights(&c, &back));
    const char *hd8 = "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                      "\"head_dim\": 8, \"intermediate_size\": 24, \"vocab_size\": 40}";
    c = config_of(hd8);
    assert_int_equal(c.head_dim, 0);
    /* Qwen 3's: q/k norms, LLaMA's attention_bias, Qwen3Config's head_dim (128) and kv heads (32) when left
     * out; saved as Qwen 3's, head_dim and all (even when it is dim / heads: Qwen3Config's default is not) */
    const char *q3 = "{\"model_type\": \"qwen3\", \"hidden_size\": 512, \"num_hidden_layers\": 1, "
                     "\"num_attention_heads\": 32, \"intermediate_size\": 24, \"vocab_size\": 40, "
                     "\"attention_bias\": true}";
    c = config_of(q3);
    assert_true(c.qk_norm && c.qkv_bias && c.o_bias && loom_llama_head_dim(&c) == 128 && c.n_kv_heads == 32 &&
                c.max_seq == 32768);
    c.head_dim = 0; /* 512 / 32 */
    back = saved_and_loaded(&c);
    assert_true(saved_text_has("\"model_type\": \"qwen3\"") && saved_text_has("Qwen3ForCausalLM") &&
                saved_text_has("\"head_dim\": 16") && saved_text_has("\"attention_bias\": true"));
    assert_true(back.qk_norm && loom_llama_config_same_weights(&c, &back));
    back.qk_norm = 0;
    assert_false(loom_llama_config_same_weights(&c, &back));
    c.o_bias = 0; /* q/k norms with Qwen 2's biases: no layout */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("no Hugging Face layout");
    /* Qwen2Config's kv heads when the file leaves them out: 32; null: as many as the heads */
    const char *q32 = "{\"model_type\": \"qwen2\", \"hidden_size\": 128, \"num_hidden_layers\": 1, "
                      "\"num_attention_heads\": 32, \"intermediate_size\": 24, \"vocab_size\": 40}";
    c = config_of(q32);
    assert_int_equal(c.n_kv_heads, 32);
    const char *qnull = "{\"model_type\": \"qwen2\", \"hidden_size\": 128, \"num_hidden_layers\": 1, "
                        "\"num_attention_heads\": 16, \"num_key_value_heads\": null, \"intermediate_size\": 24, "
                        "\"vocab_size\": 40}";
    c = config_of(qnull);
    assert_int_equal(c.n_kv_heads, 16);
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"mlp_bias\": true", "mlp_bias = true is not supported"},
        {", \"attention_bias\": 1", "attention_bias must be true or false"},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": \"yes\"", "use_sliding_window must be true or false"},
        {", \"model_type\": \"qwen3_moe\"", "model_type \"qwen3_moe\" is not a LLaMA model"},
        {", \"attention_dropout\": 1.5", "attention_dropout must be a number in [0, 1)"},
        {", \"head_dim\": 0", "head_dim must be a positive integer"},
        {", \"head_dim\": 7", "head_dim 7 must be even"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_config_refused(bad[k].extra, bad[k].msg);
    memset(&c, 0, sizeof c);
    c.dim = 16; c.n_layers = 1; c.n_heads = 2; c.n_kv_heads = 1; c.ffn_dim = 24; c.vocab_size = 40;
    c.max_seq = 8; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f; c.o_bias = 1;
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("a bias on o needs biases on q, k and v");
}

/* Gemma's model: model_type "gemma" gives norms of 1 + weight, embeddings
 * scaled by sqrt(dim) (rounded to the compute dtype), the tanh GELU (which
 * Gemma 1.0's files call hidden_act "gelu"; hidden_activation first where
 * given), and GemmaConfig's defaults (heads of 256, 16 kv heads, 8192
 * positions, tied); saved as Gemma's class and read back the same; fresh
 * weights put its norms at 0. A LLaMA with the tanh GELU keeps LLaMA's
 * layout. Other activations and layouts that do not exist are refused. */
static void test_gemma_config(void **state) {
    (void)state;
    const char *g10 = "{\"model_type\": \"gemma\", \"hidden_size\": 3072, \"num_hidden_layers\": 1, "
                      "\"num_attention_heads\": 16, \"intermediate_size\": 24, \"vocab_size\": 40, "
                      "\"hidden_act\": \"gelu\"}";
    loom_llama_config c = config_of(g10), back;
    assert_true(c.norm_unit_offset && c.scale_embeddings && c.act == LOOM_ACT_GELU_TANH && c.tie_embeddings);
    assert_true(loom_llama_head_dim(&c) == 256 && c.n_kv_heads == 16 && c.max_seq == 8192);
    assert_true(loom_llama_embed_scale(&c, LOOM_BF16) == 55.5f);              /* sqrt(3072) = 55.43 in bf16 */
    assert_true(loom_llama_embed_scale(&c, LOOM_F32) == (float)sqrt(3072.0)); /* and in fp32 */
    c.scale_embeddings = 0;
    assert_true(loom_llama_embed_scale(&c, LOOM_F32) == 1.0f);
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID); /* one of the two alone */
    IO_ASSERT_MSG("come together");
    c.scale_embeddings = 1;
    back = saved_and_loaded(&c);
    assert_true(saved_text_has("GemmaForCausalLM") && saved_text_has("\"model_type\": \"gemma\"") &&
                saved_text_has("\"hidden_activation\": \"gelu_pytorch_tanh\"") && saved_text_has("\"head_dim\": 256"));
    assert_true(back.norm_unit_offset && back.scale_embeddings && back.act == LOOM_ACT_GELU_TANH &&
                loom_llama_config_same_weights(&c, &back) && back.max_seq == c.max_seq);
    static const struct { const char *extra; loom_activation act; } acts[] = {
        {", \"model_type\": \"gemma\", \"hidden_act\": \"gelu\", \"hidden_activation\": \"gelu_pytorch_tanh\"",
         LOOM_ACT_GELU_TANH}, /* Gemma 1.1's */
        {", \"model_type\": \"gemma\", \"hidden_activation\": null", LOOM_ACT_GELU_TANH},
        {", \"model_type\": \"gemma\", \"hidden_act\": \"gelu\", \"hidden_activation\": \"silu\"", LOOM_ACT_SILU},
        {", \"model_type\": \"gemma\", \"hidden_act\": \"silu\"", LOOM_ACT_SILU},
        {", \"hidden_act\": \"gelu_pytorch_tanh\"", LOOM_ACT_GELU_TANH},
        {", \"hidden_act\": \"gelu_new\"", LOOM_ACT_GELU_TANH},
        {", \"hidden_act\": \"silu\"", LOOM_ACT_SILU},
    };
    char json[512];
    for (size_t k = 0; k < sizeof acts / sizeof acts[0]; k++) {
        snprintf(json, sizeof json, "{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                 "\"num_key_value_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40%s}", acts[k].extra);
        c = config_of(json);
        assert_int_equal(c.act, acts[k].act);
        back = saved_and_loaded(&c);
        assert_true(back.act == c.act && back.norm_unit_offset == c.norm_unit_offset);
        assert_true(saved_text_has(c.norm_unit_offset ? "GemmaForCausalLM" : "LlamaForCausalLM"));
        assert_true(saved_text_has(c.act == LOOM_ACT_SILU ? "\"hidden_act\": \"silu\""
                                                          : "\"hidden_act\": \"gelu_pytorch_tanh\""));
    }
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"hidden_act\": \"gelu\"", "hidden_act \"gelu\" is not supported"}, /* the exact GELU */
        {", \"hidden_act\": 3", "hidden_act \"?\" is not supported"},
        {", \"model_type\": \"gemma\", \"hidden_activation\": \"relu\"", "hidden_activation \"relu\" is not supported"},
        {", \"model_type\": \"gemma3n_text\"", "model_type \"gemma3n_text\" is not a LLaMA model"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_config_refused(bad[k].extra, bad[k].msg);
    c = config_of("{\"model_type\": \"gemma\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                  "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 8, \"intermediate_size\": 24, "
                  "\"vocab_size\": 40}");
    c.qk_norm = 1; /* Gemma's layout has no q/k norms */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("Gemma's model has no q/k norms");
    c.qk_norm = 0;
    loom_llama *m;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    loom_llama_init_weights(m, 3);
    for (int i = 0; i < m->n_params; i++) { /* norms all 0 (1 + w is 1); matrices drawn */
        const float *w = loom_param_master(m->params[i]);
        int norm = m->params[i]->tensor->ndim == 1, zeros = 0;
        for (int64_t k = 0; k < loom_param_numel(m->params[i]); k++) zeros += w[k] == 0.0f;
        assert_true(norm ? zeros == loom_param_numel(m->params[i]) : zeros == 0);
    }
    loom_llama_free(m);
}

/* Gemma 2's model: Gemma's flags with its norms of the blocks' outputs,
 * softcaps (Gemma2Config's 50 and 30 when left out; null, none) and
 * query_pre_attn_scalar (256, the scores' scale its -0.5th power), its
 * window of 4096 on every other block, hidden_activation alone; saved as
 * Gemma2ForCausalLM and read back the same; parameters named as its files
 * name them; bad numbers and layouts refused. */
static void test_gemma2_config(void **state) {
    (void)state;
    const char *g = "{\"model_type\": \"gemma2\", \"hidden_size\": 16, \"num_hidden_layers\": 3, "
                    "\"num_attention_heads\": 8, \"head_dim\": 8, \"intermediate_size\": 24, "
                    "\"vocab_size\": 40, \"hidden_act\": \"silu\"}";
    loom_llama_config c = config_of(g), back;
    assert_true(c.post_norms && c.norm_unit_offset && c.scale_embeddings && c.act == LOOM_ACT_GELU_TANH &&
                c.tie_embeddings && c.max_seq == 8192 && c.n_kv_heads == 4); /* Gemma2Config's 4 kv heads */
    assert_true(loom_llama_layer_window(&c, 0) == 4096 && loom_llama_layer_window(&c, 1) == 0 &&
                loom_llama_layer_window(&c, 2) == 4096); /* the even blocks slide */
    assert_true(c.attn_softcap == 50.0f && c.final_softcap == 30.0f && c.query_pre_attn_scalar == 256.0f &&
                loom_llama_attn_scale(&c) == 0.0625f);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("Gemma2ForCausalLM") &&
                saved_text_has("\"attn_logit_softcapping\": 50") && saved_text_has("\"query_pre_attn_scalar\": 256") &&
                saved_text_has("\"sliding_window\": 4096"));
    c.attn_softcap = 0.0f; /* none: null, read back as none */
    back = saved_and_loaded(&c);
    assert_true(saved_text_has("\"attn_logit_softcapping\": null") && back.attn_softcap == 0.0f);
    loom_llama *m;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    assert_string_equal(m->layers[0].attn_post_norm->name, "model.layers.0.post_attention_layernorm.weight");
    assert_string_equal(m->layers[0].mlp_norm->name, "model.layers.0.pre_feedforward_layernorm.weight");
    assert_string_equal(m->layers[0].mlp_post_norm->name, "model.layers.0.post_feedforward_layernorm.weight");
    loom_llama_free(m);
    assert_config_refused(", \"model_type\": \"gemma2\", \"attn_logit_softcapping\": -1",
                          "attn_logit_softcapping must be a positive number or null");
    assert_config_refused(", \"model_type\": \"gemma2\", \"query_pre_attn_scalar\": null",
                          "query_pre_attn_scalar must be a positive number");
    c.fused_proj = 1; /* with Phi-3's files */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("come together with Gemma's norms");
    c.fused_proj = 0;
    c.norm_unit_offset = c.scale_embeddings = 0; /* its norms without Gemma's */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("come together with Gemma's norms");
}

/* Gemma 3's text model: Gemma 2's with q/k norms (offsets from 1), no
 * softcaps, Gemma3TextConfig's defaults (1e6 and 10000 as its global and
 * local RoPE bases, 4 kv heads, 131072 positions, a window of 4096 on every
 * block but every 6th); sliding_window_pattern (its older files) or
 * layer_types give the blocks; the windowed blocks rotate with the local
 * base; saved as Gemma3ForCausalLM with both and read back the same; its
 * multimodal "gemma3" files, and a Gemma 3 without a window, refused by name. */
static void test_gemma3_config(void **state) {
    (void)state;
    const char *g = "{\"model_type\": \"gemma3_text\", \"hidden_size\": 16, \"num_hidden_layers\": 7, "
                    "\"num_attention_heads\": 8, \"head_dim\": 8, \"intermediate_size\": 24, \"vocab_size\": 40}";
    loom_llama_config c = config_of(g), back;
    assert_true(c.post_norms && c.qk_norm && c.norm_unit_offset && c.scale_embeddings && c.act == LOOM_ACT_GELU_TANH &&
                c.tie_embeddings && c.max_seq == 131072 && c.n_kv_heads == 4 && c.rope_theta == 1e6f &&
                c.rope_local_theta == 10000.0f && c.attn_softcap == 0.0f && c.final_softcap == 0.0f &&
                loom_llama_attn_scale(&c) == 0.0625f);
    for (int l = 0; l < 7; l++) {
        loom_rope_freqs r = loom_llama_layer_rope(&c, l);
        assert_int_equal(loom_llama_layer_window(&c, l), l == 5 ? 0 : 4096); /* the 6th block is global */
        assert_true(r.theta == (l == 5 ? 1e6f : 10000.0f));
    }
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("Gemma3ForCausalLM") &&
                saved_text_has("\"gemma3_text\"") && saved_text_has("\"sliding_window_pattern\": 6") &&
                saved_text_has("\"rope_local_base_freq\": 10000") && saved_text_has("\"attn_logit_softcapping\": null") &&
                saved_text_has("\"full_attention\""));
    back.rope_local_theta = 20000.0f; /* another local base: another model */
    assert_false(loom_llama_config_same_model(&c, &back));
    char json[768];
    snprintf(json, sizeof json, "%.*s, \"sliding_window\": 5, \"sliding_window_pattern\": 3, \"rope_scaling\": "
             "{\"rope_type\": \"linear\", \"factor\": 8.0}, \"rope_local_base_freq\": 5000.0}", (int)strlen(g) - 1, g);
    c = config_of(json);
    assert_true(loom_llama_layer_window(&c, 1) == 5 && loom_llama_layer_window(&c, 2) == 0 && c.rope_local_theta == 5000.0f);
    assert_true(loom_llama_layer_rope(&c, 2).type == LOOM_ROPE_LINEAR && loom_llama_layer_rope(&c, 1).type == LOOM_ROPE_DEFAULT);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back));
    c = config_of("{\"model_type\": \"gemma3_text\", \"hidden_size\": 16, \"num_hidden_layers\": 3, "
                  "\"num_attention_heads\": 8, \"head_dim\": 8, \"intermediate_size\": 24, \"vocab_size\": 40, "
                  "\"layer_types\": [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]}");
    assert_true(c.window_global_interval == 2 && loom_llama_layer_window(&c, 2) == 4096 &&
                loom_llama_layer_window(&c, 1) == 0);
    /* transformers v5's file: rope_parameters per layer type, the local base in the sliding blocks' entry */
    snprintf(json, sizeof json, "%.*s, \"rope_parameters\": {\"full_attention\": {\"rope_type\": \"linear\", "
             "\"factor\": 8.0, \"rope_theta\": 1000000.0}, \"sliding_attention\": {\"rope_type\": \"default\", "
             "\"rope_theta\": 5000.0}}}", (int)strlen(g) - 1, g);
    c = config_of(json);
    assert_true(c.rope_theta == 1e6f && c.rope_type == LOOM_ROPE_LINEAR && c.rope_factor == 8.0f &&
                c.rope_local_theta == 5000.0f);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"rope_local_base_freq\": 5000"));
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"model_type\": \"gemma3_text\", \"head_dim\": 8, \"num_key_value_heads\": 2, \"sliding_window\": null",
         "Gemma 3's, whose model (Gemma 2's with q/k norms) needs"},
        {", \"model_type\": \"gemma3_text\", \"head_dim\": 8, \"num_key_value_heads\": 2, \"sliding_window_pattern\": 0",
         "sliding_window_pattern must be a positive integer"},
        {", \"model_type\": \"gemma3_text\", \"head_dim\": 8, \"num_key_value_heads\": 2, \"rope_local_base_freq\": -1",
         "rope_local_base_freq must be a positive number"},
        {", \"model_type\": \"gemma3_text\", \"head_dim\": 8, \"num_key_value_heads\": 2, \"rope_local_base_freq\": 10000, "
         "\"rope_parameters\": {\"sliding_attention\": {\"rope_type\": \"default\", \"rope_theta\": 20000}}",
         "sliding_attention rope_theta and rope_local_base_freq disagree"},
        {", \"model_type\": \"gemma3_text\", \"head_dim\": 8, \"num_key_value_heads\": 2, \"rope_parameters\": "
         "{\"sliding_attention\": {\"rope_type\": \"linear\", \"factor\": 2, \"rope_theta\": 10000}}",
         "sliding blocks take the default RoPE"},
        {", \"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\", \"rope_theta\": 10000}}",
         "per layer type are read for Gemma 3 only"},
        {", \"model_type\": \"gemma3_text\", \"head_dim\": 8, \"num_key_value_heads\": 2, "
         "\"use_bidirectional_attention\": true", "is not a causal language model"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_config_refused(bad[k].extra, bad[k].msg);
    c = config_of(g);
    c.qk_norm = 0; /* Gemma 2's with a local base */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("a local RoPE base");
}

/* A text model's tensor name as Gemma 3's multimodal files spell it: as the
 * published files (old), or as transformers' loaded model from 4.52 on. */
static void mm_name(int old, const char *name, char *out, size_t n) {
    if (old) snprintf(out, n, "language_model.%s", name);
    else if (!strncmp(name, "model.", 6)) snprintf(out, n, "model.language_model.%s", name + 6);
    else snprintf(out, n, "%s", name);
}

/* Directory dir as a Gemma 3 multimodal file of m: config.json's text_config
 * (text, a JSON object's members), m's weights under mm_name with a vision
 * tower's and a projector's tensors beside them, in one file or (sharded)
 * two mapped by an index. */
static void write_gemma3_mm(const loom_llama *m, const char *dir, const char *top, const char *text, int old,
                            int sharded) {
    char path[128], name[256], json[8192];
    mkdir(io_path(dir), 0755);
    int n = snprintf(json, sizeof json, "{\"architectures\": [\"Gemma3ForConditionalGeneration\"], \"model_type\": "
                     "\"gemma3\", \"mm_tokens_per_image\": 256%s, \"text_config\": {%s}, \"vision_config\": "
                     "{\"model_type\": \"siglip_vision_model\", \"hidden_size\": 1152}}", top, text);
    snprintf(path, sizeof path, "%s/config.json", dir);
    io_write_raw(io_path(path), json, (size_t)n);
    loom_safetensors_writer *w[2];
    for (int k = 0; k < 2; k++) assert_int_equal(loom_safetensors_writer_init(&w[k]), LOOM_OK);
    float vision[6] = {1, 2, 3, 4, 5, 6};
    int64_t vs[2] = {2, 3};
    assert_int_equal(loom_safetensors_writer_add(w[0], old ? "vision_tower.vision_model.post_layernorm.weight"
                                                           : "model.vision_tower.vision_model.post_layernorm.weight",
                                                 LOOM_SAFETENSORS_F32, vs, 2, vision), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w[sharded], old ? "multi_modal_projector.mm_input_projection_weight"
                                                                 : "model.multi_modal_projector.mm_input_projection_weight",
                                                 LOOM_SAFETENSORS_F32, vs, 2, vision), LOOM_OK);
    n = snprintf(json, sizeof json, "{\"weight_map\": {");
    for (int i = 0; i < m->n_params; i++) {
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        mm_name(old, m->params[i]->name, name, sizeof name);
        int k = sharded ? i % 2 : 0;
        assert_int_equal(loom_safetensors_writer_add(w[k], name, LOOM_SAFETENSORS_F32, fs, m->params[i]->tensor->ndim,
                                                     loom_param_master(m->params[i])), LOOM_OK);
        n += snprintf(json + n, sizeof json - (size_t)n, "%s\"%s\": \"part-%d.safetensors\"", i ? ", " : "", name, k);
    }
    n += snprintf(json + n, sizeof json - (size_t)n, "}}");
    assert_true((size_t)n < sizeof json);
    for (int k = 0; k < 1 + sharded; k++) {
        snprintf(path, sizeof path, sharded ? "%s/part-%d.safetensors" : "%s/model.safetensors", dir, k);
        assert_int_equal(loom_safetensors_writer_write(w[k], io_path(path)), LOOM_OK);
    }
    for (int k = 0; k < 2; k++) loom_safetensors_writer_free(w[k]);
    if (sharded) {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        io_write_raw(io_path(path), json, (size_t)n);
    }
}

/* Gemma 3's multimodal files (Gemma3ForConditionalGeneration): their
 * text_config is read as a gemma3_text file, Gemma3TextConfig's defaults
 * where it is silent, what transformers versions read differently refused;
 * their language model's weights load, under either name (the published
 * files' in one file, the loaded model's sharded), the vision tower's left
 * out: the same model, bit for bit, as the text model's own directory. A
 * PEFT adapter for such a base names its modules as the base's files do
 * (target_modules a pattern of the language model's under both names) and
 * loads back, the vision tower's adapters PEFT adds beside them passed
 * over. */
static void test_gemma3_multimodal(void **state) {
    (void)state;
    const char *t = "\"model_type\": \"gemma3_text\", \"hidden_size\": 16, \"num_hidden_layers\": 7, "
                    "\"head_dim\": 8, \"intermediate_size\": 24, \"vocab_size\": 40, \"sliding_window\": 3";
    char json[1024];
    snprintf(json, sizeof json, "{%s, \"num_attention_heads\": 8, \"num_key_value_heads\": 4}", t);
    loom_llama_config text = config_of(json), c;
    snprintf(json, sizeof json, "{\"model_type\": \"gemma3\", \"text_config\": {%s}, \"vision_config\": {}}", t);
    c = config_of(json); /* its heads: Gemma3TextConfig's 8 and 4 */
    assert_true(loom_llama_config_same_model(&c, &text) && c.n_heads == 8 && c.n_kv_heads == 4 && c.tie_embeddings);
    c = config_of("{\"model_type\": \"gemma3\"}"); /* no text_config: Gemma3TextConfig() */
    assert_true(c.dim == 2304 && c.n_layers == 26 && c.n_heads == 8 && c.n_kv_heads == 4 && c.head_dim == 256 &&
                c.ffn_dim == 9216 && c.vocab_size == 262208 && c.max_seq == 131072 && c.post_norms && c.qk_norm &&
                loom_llama_layer_window(&c, 0) == 4096 && loom_llama_layer_window(&c, 5) == 0);
    c = config_of("{\"model_type\": \"gemma3_text\", \"num_hidden_layers\": 2}"); /* a text file too */
    assert_true(c.dim == 2304 && c.n_layers == 2 && c.ffn_dim == 9216 && c.vocab_size == 262208);
    snprintf(json, sizeof json, "{\"model_type\": \"gemma3\", \"text_config\": {%s, \"tie_word_embeddings\": false}}", t);
    c = config_of(json);
    assert_false(c.tie_embeddings);
    snprintf(json, sizeof json, "{\"model_type\": \"gemma3\", \"tie_word_embeddings\": true, \"text_config\": {%s}}", t);
    c = config_of(json);
    assert_true(c.tie_embeddings);
    static const struct { const char *json, *msg; } bad[] = {
        {"{\"model_type\": \"gemma3\", \"text_config\": 3}", "text_config must be an object"},
        {"{\"model_type\": \"gemma3\", \"text_config\": {\"model_type\": \"llama\"}}",
         "text_config's model_type must be \"gemma3_text\""},
        {"{\"model_type\": \"gemma3\", \"tie_word_embeddings\": false, \"text_config\": {\"tie_word_embeddings\": true}}",
         "tie_word_embeddings differs from its text_config's"},
        /* transformers 4.x ties by text_config's (true), v5 by the file's */
        {"{\"model_type\": \"gemma3\", \"tie_word_embeddings\": false, \"text_config\": {}}",
         "tie_word_embeddings other than true outside text_config"},
        /* Gemma3ForConditionalGeneration applies none from transformers 4.52 on */
        {"{\"model_type\": \"gemma3\", \"text_config\": {\"final_logit_softcapping\": 30.0}}",
         "a final_logit_softcapping in a multimodal Gemma 3 file"},
        {"{\"model_type\": \"gemma3\", \"text_config\": {\"hidden_size\": 0}}", "\"hidden_size\" must be a positive"},
        {"{\"model_type\": \"llama\", \"num_hidden_layers\": 2}", "missing field \"hidden_size\""}, /* required there */
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_refused_with(bad[k].json, "", bad[k].msg);

    /* the weights: tied (old names, one file; new names, sharded), and untied (lm_head's own name in each) */
    loom_precision p = {LOOM_F32, 0};
    for (int untied = 0; untied <= 1; untied++) {
        loom_llama_config tc = text;
        tc.tie_embeddings = !untied;
        loom_llama *m, *want;
        assert_int_equal(loom_llama_new(&tc, p, &m), LOOM_OK);
        loom_llama_init_weights(m, 21 + (uint64_t)untied);
        assert_int_equal(loom_model_dir_save(m, LOOM_F32, NULL, io_path("g3text")), LOOM_OK);
        assert_int_equal(loom_model_dir_load(io_path("g3text"), p, &want), LOOM_OK);
        for (int old = 0; old <= 1; old++) {
            char dir[32], members[512], name[256], key[320];
            snprintf(dir, sizeof dir, "g3mm-%d-%d", untied, old);
            snprintf(members, sizeof members, "%s, \"num_attention_heads\": 8%s", t,
                     untied ? ", \"tie_word_embeddings\": false" : "");
            write_gemma3_mm(m, dir, untied ? "" : ", \"tie_word_embeddings\": true", members, old, !old);
            loom_llama *got;
            assert_int_equal(loom_model_dir_load(io_path(dir), p, &got), LOOM_OK);
            assert_true(loom_llama_config_same_model(&got->cfg, &want->cfg) && got->n_params == want->n_params);
            for (int i = 0; i < want->n_params; i++)
                assert_true(tu_bits_equal(loom_param_master(got->params[i]), loom_param_master(want->params[i]),
                                          (size_t)loom_param_numel(want->params[i]) * sizeof(float),
                                          want->params[i]->name));
            /* saved again: a text model (Gemma3ForCausalLM), the vision tower not written */
            assert_int_equal(loom_model_dir_save(got, LOOM_F32, NULL, io_path("g3again")), LOOM_OK);
            loom_safetensors *sf;
            assert_int_equal(loom_safetensors_open(io_path("g3again/model.safetensors"), &sf), LOOM_OK);
            assert_true(loom_safetensors_has(sf, "model.embed_tokens.weight") &&
                        loom_safetensors_count(sf) == (size_t)want->n_params);
            loom_safetensors_close(sf);
            if (untied) { /* an adapter for this base: its names (the new ones: a sharded base) */
                loom_lora_config lc = {.rank = 2, .alpha = 4.0f, .targets = (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_DOWN)};
                assert_int_equal(loom_llama_add_lora(got, &lc, 3), LOOM_OK);
                for (int i = got->n_base; i < got->n_params; i++)
                    tu_fill_uniform(loom_param_master(got->params[i]), (size_t)loom_param_numel(got->params[i]), -1, 1,
                                    70 + (uint64_t)i);
                assert_int_equal(loom_lora_save_peft(got, io_path("g3adapter"), io_path(dir)), LOOM_OK);
                assert_int_equal(loom_safetensors_open(io_path("g3adapter/adapter_model.safetensors"), &sf), LOOM_OK);
                mm_name(old, "model.layers.6.mlp.down_proj.lora_B.weight", name, sizeof name);
                snprintf(key, sizeof key, "base_model.model.%s", name);
                assert_true(loom_safetensors_has(sf, key));
                /* what PEFT adds beside them from a list of names: the vision tower's q_proj, no part of the text */
                size_t n_t = loom_safetensors_count(sf);
                loom_safetensors_writer *w;
                assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
                for (size_t k = 0; k < n_t; k++) {
                    loom_safetensors_tensor x;
                    assert_int_equal(loom_safetensors_at(sf, k, &x), LOOM_OK);
                    assert_int_equal(loom_safetensors_writer_add(w, x.name, x.dtype, x.shape, x.ndim, x.data), LOOM_OK);
                }
                float va[6] = {1, 2, 3, 4, 5, 6};
                int64_t vs[2] = {2, 3};
                assert_int_equal(loom_safetensors_writer_add(w, old ? "base_model.model.vision_tower.vision_model.encoder."
                                                                      "layers.0.self_attn.q_proj.lora_A.weight"
                                                                    : "base_model.model.model.vision_tower.vision_model."
                                                                      "encoder.layers.0.self_attn.q_proj.lora_A.weight",
                                                             LOOM_SAFETENSORS_F32, vs, 2, va), LOOM_OK);
                assert_int_equal(loom_safetensors_writer_write(w, io_path("g3adapter/adapter_model.safetensors")), LOOM_OK);
                loom_safetensors_writer_free(w);
                loom_safetensors_close(sf); /* after the write: w took its tensors' data from it */
                size_t n;
                char *cfg = (char *)io_read_raw(io_path("g3adapter/adapter_config.json"), &n);
                assert_non_null(strstr(cfg, "\"target_modules\": \"(language_model\\\\.model|model\\\\.language_model)\\\\."
                                            "layers\\\\.[0-9]+\\\\.(self_attn|mlp)\\\\.(q_proj|down_proj)\""));
                free(cfg);
                loom_llama *back;
                assert_int_equal(loom_model_dir_load(io_path(dir), p, &back), LOOM_OK);
                assert_int_equal(loom_lora_load_peft(back, io_path("g3adapter")), LOOM_OK);
                assert_true(back->n_params == got->n_params && back->lora.targets == lc.targets);
                for (int i = 0; i < got->n_params; i++)
                    assert_true(tu_bits_equal(loom_param_master(back->params[i]), loom_param_master(got->params[i]),
                                              (size_t)loom_param_numel(got->params[i]) * sizeof(float),
                                              got->params[i]->name));
                loom_llama_free(back);
            }
            loom_llama_free(got);
        }
        loom_llama_free(want);
        loom_llama_free(m);
    }
}

/* Granite's model: its four multipliers read (GraniteConfig's 1 where left
 * out, the attention's scale too), saved as Granite's class and read back
 * the same; a LLaMA file's are not read; what is not a positive number is
 * refused by name, as are layouts that do not exist. */
static void test_granite_config(void **state) {
    (void)state;
    const char *g = "{\"model_type\": \"granite\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                    "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40, "
                    "\"embedding_multiplier\": 12.0, \"residual_multiplier\": 0.22, \"attention_multiplier\": 0.015625, "
                    "\"logits_scaling\": 8.0}";
    loom_llama_config c = config_of(g), back;
    assert_true(c.embedding_multiplier == 12.0f && c.residual_multiplier == 0.22f &&
                c.attention_multiplier == 0.015625f && c.logits_scaling == 8.0f);
    assert_true(loom_llama_attn_scale(&c) == 0.015625f && loom_llama_has_multipliers(&c));
    back = saved_and_loaded(&c);
    assert_true(saved_text_has("GraniteForCausalLM") && saved_text_has("\"model_type\": \"granite\""));
    assert_true(back.embedding_multiplier == c.embedding_multiplier && back.residual_multiplier == c.residual_multiplier &&
                back.attention_multiplier == c.attention_multiplier && back.logits_scaling == c.logits_scaling);
    c = config_of("{\"model_type\": \"granite\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                  "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40}");
    assert_true(c.embedding_multiplier == 1.0f && c.residual_multiplier == 1.0f && c.attention_multiplier == 1.0f &&
                c.logits_scaling == 1.0f && loom_llama_attn_scale(&c) == 1.0f); /* GraniteConfig's, not 1/sqrt(8) */
    c = config_of("{\"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                  "\"intermediate_size\": 24, \"vocab_size\": 40, \"attention_multiplier\": 3.0}");
    assert_true(!loom_llama_has_multipliers(&c) && loom_llama_attn_scale(&c) == 1.0f / sqrtf(8.0f));
    c.residual_multiplier = 0.5f; /* one of them set by the library: Granite's class, the others written as 1 */
    back = saved_and_loaded(&c);
    assert_true(saved_text_has("GraniteForCausalLM") && back.residual_multiplier == 0.5f &&
                back.embedding_multiplier == 1.0f && back.logits_scaling == 1.0f &&
                back.attention_multiplier == 1.0f / sqrtf(8.0f));
    c.qk_norm = 1;
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("Granite's multipliers with");
    c.qk_norm = 0;
    c.logits_scaling = -1.0f;
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("must be finite and positive");
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"model_type\": \"granite\", \"embedding_multiplier\": 0", "embedding_multiplier must be a positive number"},
        {", \"model_type\": \"granite\", \"residual_multiplier\": \"1\"", "residual_multiplier must be a positive number"},
        {", \"model_type\": \"granite\", \"attention_multiplier\": -0.5", "attention_multiplier must be a positive number"},
        {", \"model_type\": \"granite\", \"logits_scaling\": 1e300", "logits_scaling must be a positive number"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_config_refused(bad[k].extra, bad[k].msg);
}

/* Phi-3's longrope: the short factors and the attention factor Hugging Face
 * computes from the contexts (or the file's), the file's whole context,
 * the long factors for a forward past the original one (a LLaMA file's
 * context capped at the original instead); saved as Phi-3.5's files have it and read back the same
 * (with a sliding window, Phi-3-mini's 2047, too); "su" is its old name; wrong
 * counts, missing fields and bad numbers refused by name. */
static void test_longrope_config(void **state) {
    (void)state;
    const char *head = "{\"model_type\": \"phi3\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                       "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40, "
                       "\"max_position_embeddings\": 131072, \"original_max_position_embeddings\": 4096";
    char json[1024];
    snprintf(json, sizeof json, "%s, \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1.0, 1.5, 2.0, 3.0], "
             "\"long_factor\": [1.0, 4.0, 16.0, 64.0]}}", head);
    loom_llama_config c = config_of(json), back;
    assert_true(c.rope_type == LOOM_ROPE_LONGROPE && c.rope_n_ext == 4 && c.max_seq == 131072 &&
                c.rope_original_max_pos == 4096 && c.rope_factor == 32.0f);
    assert_true(c.rope_attention_factor == (float)sqrt(1.0 + log(32.0) / log(4096.0)));
    assert_true(c.rope_short[3] == 3.0f && c.rope_long[3] == 64.0f);
    loom_rope_freqs r = loom_llama_rope(&c);
    assert_true(r.type == LOOM_ROPE_LONGROPE && r.n_ext == 4 && r.ext[1] == 1.5f && r.attention_factor == c.rope_attention_factor);
    /* a forward over positions up to the original context rotates with the short factors, one past it with the long */
    loom_rope_freqs within = loom_llama_layer_rope_at(&c, 0, 4096), past = loom_llama_layer_rope_at(&c, 0, 4097);
    assert_memory_equal(&within, &r, sizeof r);
    assert_true(past.ext[0] == 1.0f && past.ext[1] == 4.0f && past.ext[3] == 64.0f && past.n_ext == 4 &&
                past.attention_factor == r.attention_factor);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back));
    assert_true(saved_text_has("\"max_position_embeddings\": 131072") &&
                saved_text_has("\"original_max_position_embeddings\": 4096") && saved_text_has("\"longrope\"") &&
                !saved_text_has("attention_factor") && saved_text_has("\"sliding_window\": null"));
    back.rope_long[2] = 15.0f; /* the long factors are part of the model's file */
    assert_false(loom_llama_config_same_rope(&c, &back));
    snprintf(json, sizeof json, "%s, \"sliding_window\": 2047, \"rope_scaling\": {\"type\": \"su\", "
             "\"short_factor\": [1, 1, 1, 1], \"long_factor\": [2, 2, 2, 2], \"attention_factor\": 1.5}}", head);
    c = config_of(json);
    assert_true(c.rope_type == LOOM_ROPE_LONGROPE && c.rope_attention_factor == 1.5f && c.max_seq == 131072 &&
                c.sliding_window == 2047 && loom_llama_layer_window(&c, 0) == 2047);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"attention_factor\": 1.5") &&
                saved_text_has("\"sliding_window\": 2047"));
    /* transformers v5's re-save of an "su" file (rope_type longrope beside it); Phi3Config's original context
     * (4096) when the file gives none; a context under the original saved as the file's context */
    const char *v5su = "{\"model_type\": \"phi3\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                       "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40, "
                       "\"max_position_embeddings\": 2048, \"rope_scaling\": {\"type\": \"su\", \"rope_type\": "
                       "\"longrope\", \"short_factor\": [1, 1, 1, 1], \"long_factor\": [2, 2, 2, 2]}}";
    c = config_of(v5su);
    assert_true(c.rope_type == LOOM_ROPE_LONGROPE && c.rope_original_max_pos == 4096 && c.max_seq == 2048 &&
                c.rope_attention_factor == 1.0f);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"sliding_window\": null") &&
                saved_text_has("\"max_position_embeddings\": 2048"));
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 1], \"long_factor\": [1, 1, 1]}}",
         "longrope has 3 short and 3 long factors; a rotary part of 8 needs 4"},
        {", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 1, 1], \"long_factor\": [1, 1, 1, 1], "
         "\"original_max_position_embeddings\": 8192}}", "is not the file's (4096), which Phi-3 reads"},
        {", \"head_dim\": 16, \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 1, 1, 1, 1, 1, 1], "
         "\"long_factor\": [1, 1, 1, 1, 1, 1, 1, 1]}}", "longrope on a Phi-3 model with a head_dim of its own"},
        {", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 1, 1]}}", "needs \"long_factor\""},
        {", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 0, 1], \"long_factor\": [1, 1, 1, 1]}}",
         "factors are positive numbers"},
        {", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 1, 1], \"long_factor\": [1, 1, 1, 1], "
         "\"attention_factor\": -1}}", "attention_factor must be a positive number"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_refused_with(head, bad[k].extra, bad[k].msg);
    assert_config_refused(", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 1, 1, 1], "
                          "\"long_factor\": [1, 1, 1, 1]}", "needs original_max_position_embeddings");
    /* a LLaMA file's longrope: its context stops at the original one */
    c = config_of("{\"model_type\": \"llama\", \"hidden_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                  "\"intermediate_size\": 24, \"vocab_size\": 40, \"max_position_embeddings\": 256, \"rope_scaling\": "
                  "{\"type\": \"longrope\", \"short_factor\": [1, 1, 1, 1], \"long_factor\": [2, 2, 2, 2], "
                  "\"original_max_position_embeddings\": 64}}");
    assert_true(c.rope_type == LOOM_ROPE_LONGROPE && c.rope_original_max_pos == 64 && c.max_seq == 64);
    assert_config_refused(", \"model_type\": \"qwen2\", \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": "
                          "[1, 1, 1, 1], \"long_factor\": [1, 1, 1, 1], \"original_max_position_embeddings\": 64}",
                          "longrope is read for Phi-3 and LLaMA models only");
}

/* Phi-4-mini's rotary part of each head: partial_rotary_factor (at the
 * top, or in v5's rope_parameters, which must agree), int(head size x
 * factor) of each head rotating, longrope's factors counted over it; saved
 * and read back the same; another rotary part is another RoPE; other
 * models' refused (their classes turn the whole head). */
static void test_partial_rotary_config(void **state) {
    (void)state;
    const char *head = "{\"model_type\": \"phi3\", \"hidden_size\": 64, \"num_hidden_layers\": 1, "
                       "\"num_attention_heads\": 4, \"intermediate_size\": 24, \"vocab_size\": 40, "
                       "\"max_position_embeddings\": 256, \"original_max_position_embeddings\": 32";
    char json[1024];
    snprintf(json, sizeof json, "%s, \"partial_rotary_factor\": 0.75, \"tie_word_embeddings\": true, \"rope_scaling\": "
             "{\"type\": \"longrope\", \"short_factor\": [1, 1.5, 2, 2.5, 3, 3.5], \"long_factor\": [1, 2, 4, 8, 16, 32]}}",
             head);
    loom_llama_config c = config_of(json), back;
    assert_true(c.partial_rotary_factor == 0.75f && loom_llama_rotary_dim(&c) == 12 && c.rope_n_ext == 6);
    loom_rope_freqs r = loom_llama_rope(&c);
    assert_true(r.rotary_dim == 12 && r.n_ext == 6);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"partial_rotary_factor\": 0.75"));
    back.partial_rotary_factor = 0.5f; /* 8 of 16: another RoPE */
    assert_false(loom_llama_config_same_rope(&c, &back));
    snprintf(json, sizeof json, "%s, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, "
             "\"partial_rotary_factor\": 0.5}}", head); /* transformers v5 */
    c = config_of(json);
    assert_int_equal(loom_llama_rotary_dim(&c), 8);
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"partial_rotary_factor\": 0.75, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, "
         "\"partial_rotary_factor\": 0.5}}", "the two partial_rotary_factor fields disagree"},
        {", \"partial_rotary_factor\": 0.75, \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": "
         "[1, 1, 1, 1, 1, 1, 1, 1], \"long_factor\": [1, 1, 1, 1, 1, 1, 1, 1]}}", "a rotary part of 12 needs 6"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_refused_with(head, bad[k].extra, bad[k].msg);
    assert_config_refused(", \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, "
                          "\"partial_rotary_factor\": 0.5}", "is read for Phi-3 models only");
    assert_config_refused(", \"partial_rotary_factor\": 0.5", "is read for Phi-3 models only");
    assert_refused_with(head, ", \"partial_rotary_factor\": 1.0, \"rope_parameters\": {\"rope_type\": \"default\", "
                        "\"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.75}}", "fields disagree");
    snprintf(json, sizeof json, "%s, \"head_dim\": 40, \"partial_rotary_factor\": 0.9}", head);
    c = config_of(json); /* Python's int(40 * 0.9) is 36; the float 0.9 times 40 is 35.99999 */
    assert_int_equal(loom_llama_rotary_dim(&c), 36);
    c = config_of("{\"hidden_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"intermediate_size\": 24, "
                  "\"vocab_size\": 40}");
    c.partial_rotary_factor = 0.5f; /* LLaMA's class turns the whole head */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("partial_rotary_factor 0.5 is Phi-3's");
}

/* YaRN as Hugging Face reads it (and dynamic NTK, the default frequencies
 * within the file's context): Qwen 2.5's form (factor and the original
 * context; betas 32 and 1, truncated, attention factor 0.1 ln 4 + 1), the
 * context the file's; DeepSeek's mscales (their ratio); the factor from the
 * contexts when left out; transformers v5's rope_parameters; saved with
 * every parameter and read back the same; bad values refused by name. */
static void test_yarn_config(void **state) {
    (void)state;
    const char *head = "{\"model_type\": \"qwen2\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                       "\"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"intermediate_size\": 24, "
                       "\"vocab_size\": 40, \"max_position_embeddings\": 32768";
    char json[768];
    snprintf(json, sizeof json, "%s, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, "
             "\"original_max_position_embeddings\": 32768}}", head);
    loom_llama_config c = config_of(json), back;
    assert_true(c.rope_type == LOOM_ROPE_YARN && c.rope_factor == 4.0f && c.rope_original_max_pos == 32768 &&
                c.rope_beta_fast == 32.0f && c.rope_beta_slow == 1.0f && c.rope_truncate && c.max_seq == 32768);
    assert_true(c.rope_attention_factor == (float)(0.1 * log(4.0) + 1.0));
    loom_rope_freqs r = loom_llama_rope(&c);
    assert_true(r.type == LOOM_ROPE_YARN && r.attention_factor == c.rope_attention_factor && r.truncate == 1 &&
                r.beta_fast == 32.0f && r.original_max_pos == 32768);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"yarn\"") &&
                saved_text_has("\"beta_fast\": 32") && saved_text_has("\"truncate\": true"));
    back.rope_beta_slow = 2.0f; /* another correction range: another RoPE */
    assert_false(loom_llama_config_same_rope(&c, &back));
    back = c;
    back.rope_truncate = 0;
    assert_false(loom_llama_config_same_rope(&c, &back));
    /* DeepSeek's: the attention factor is the ratio of the two mscales' (1 when equal); not truncated */
    snprintf(json, sizeof json, "%s, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 40, \"mscale\": 0.707, "
             "\"mscale_all_dim\": 0.707, \"original_max_position_embeddings\": 4096, \"beta_fast\": 32, "
             "\"beta_slow\": 1, \"truncate\": false}}", head);
    c = config_of(json);
    assert_true(c.rope_attention_factor == 1.0f && !c.rope_truncate && c.rope_factor == 40.0f);
    snprintf(json, sizeof json, "%s, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4, \"truncate\": null}}", head);
    assert_false(config_of(json).rope_truncate); /* Hugging Face's .get("truncate", True) is None: false */
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"truncate\": false"));
    snprintf(json, sizeof json, "%s, \"rope_scaling\": {\"type\": \"yarn\", \"mscale\": 2.0, \"mscale_all_dim\": 1.0, "
             "\"original_max_position_embeddings\": 8192}}", head); /* the factor from the contexts: 4 */
    c = config_of(json);
    assert_true(c.rope_factor == 4.0f &&
                c.rope_attention_factor == (float)((0.2 * log(4.0) + 1.0) / (0.1 * log(4.0) + 1.0)));
    snprintf(json, sizeof json, "%s, \"rope_parameters\": {\"rope_theta\": 1000000.0, \"rope_type\": \"yarn\", "
             "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}}", head); /* transformers v5 */
    c = config_of(json);
    assert_true(c.rope_type == LOOM_ROPE_YARN && c.rope_theta == 1e6f && c.rope_factor == 4.0f);
    /* dynamic NTK: the default frequencies up to the file's context, where Hugging Face's are the same */
    snprintf(json, sizeof json, "%s, \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}", head);
    c = config_of(json);
    assert_true(c.rope_type == LOOM_ROPE_DYNAMIC && c.rope_factor == 2.0f && c.max_seq == 32768);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"dynamic\""));
    float fd[4], f0[4];
    loom_rope_freqs rd = loom_llama_rope(&c), r0 = {.theta = c.rope_theta};
    rope_inv_freq(&rd, 8, fd);
    rope_inv_freq(&r0, 8, f0);
    assert_memory_equal(fd, f0, sizeof fd);
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0, \"original_max_position_embeddings\": 4096}",
         "\"dynamic\" with an original context other than max_position_embeddings"},
        {", \"rope_scaling\": {\"type\": \"dynamic\"}", "\"dynamic\" needs \"factor\""},
        {", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": -4}", "yarn's factor must be a positive number"},
        {", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4, \"beta_fast\": \"x\"}",
         "yarn's beta_fast must be a positive number"},
        {", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4, \"truncate\": 1}", "yarn's truncate must be true or false"},
        {", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 10.5}",
         "original_max_position_embeddings must be a whole number"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_config_refused(bad[k].extra, bad[k].msg);
}

/* Sliding windows and the blocks they apply to: Qwen 2's from
 * max_window_layers on (only with use_sliding_window), a layer_types list
 * for any family, each saved as its class says it and read back the same;
 * a window on other blocks is another model; lists of other patterns,
 * and windows a class cannot say, refused by name. */
static void test_window_config(void **state) {
    (void)state;
    const char *head = "{\"hidden_size\": 16, \"num_hidden_layers\": 3, \"num_attention_heads\": 2, "
                       "\"num_key_value_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40";
    char json[768];
    snprintf(json, sizeof json, "%s, \"model_type\": \"qwen2\", \"use_sliding_window\": true, "
             "\"sliding_window\": 64, \"max_window_layers\": 1}", head);
    loom_llama_config c = config_of(json), back;
    assert_true(loom_llama_layer_window(&c, 0) == 0 && loom_llama_layer_window(&c, 1) == 64 &&
                loom_llama_layer_window(&c, 2) == 64);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"use_sliding_window\": true") &&
                saved_text_has("\"max_window_layers\": 1") && saved_text_has("\"sliding_window\": 64"));
    back.window_from = 2; /* the window on other blocks: another model, the same weights */
    assert_false(loom_llama_config_same_model(&c, &back));
    assert_true(loom_llama_config_same_weights(&c, &back));
    back = c;
    back.sliding_window = 65;
    assert_false(loom_llama_config_same_model(&c, &back));
    /* layer_types, for Qwen's (over max_window_layers) and Gemma 2's */
    snprintf(json, sizeof json, "%s, \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"sliding_window\": 8, "
             "\"layer_types\": [\"full_attention\", \"full_attention\", \"sliding_attention\"]}", head);
    c = config_of(json);
    assert_true(c.window_from == 2 && loom_llama_layer_window(&c, 1) == 0 && loom_llama_layer_window(&c, 2) == 8);
    snprintf(json, sizeof json, "%s, \"model_type\": \"gemma2\", \"head_dim\": 8, \"sliding_window\": 8, "
             "\"layer_types\": [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]}", head);
    c = config_of(json);
    assert_true(c.window_from == 0 && c.window_global_interval == 2 && loom_llama_layer_window(&c, 1) == 0 &&
                loom_llama_layer_window(&c, 2) == 8);
    /* MistralConfig reads no layer_types (every block slides), LlamaConfig no sliding_window (none does) */
    snprintf(json, sizeof json, "%s, \"model_type\": \"mistral\", \"sliding_window\": 8, \"layer_types\": "
             "[\"full_attention\", \"full_attention\", \"full_attention\"]}", head);
    c = config_of(json);
    assert_true(loom_llama_layer_window(&c, 0) == 8 && loom_llama_layer_window(&c, 2) == 8);
    snprintf(json, sizeof json, "%s, \"sliding_window\": 8, \"use_sliding_window\": true}", head);
    c = config_of(json);
    assert_true(c.sliding_window == 0 && c.window_from == 0);
    back = saved_and_loaded(&c);
    assert_true(saved_text_has("LlamaForCausalLM") && loom_llama_config_same_model(&c, &back));
    /* Gemma 2 without a window: Hugging Face's model needs a number, so the context's, and every block full */
    snprintf(json, sizeof json, "%s, \"model_type\": \"gemma2\", \"head_dim\": 8, \"sliding_window\": null}", head);
    c = config_of(json);
    assert_int_equal(c.sliding_window, 0);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("\"sliding_window\": 8192") &&
                saved_text_has("\"full_attention\"") && !saved_text_has("\"sliding_attention\""));
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"model_type\": \"gemma2\", \"head_dim\": 8, \"layer_types\": [\"sliding_attention\", "
         "\"full_attention\", \"full_attention\"]}", "block 2 breaks it"},
        {", \"model_type\": \"gemma2\", \"head_dim\": 8, \"layer_types\": [\"sliding_attention\", \"local\", "
         "\"full_attention\"]}", "layer_types[1] must be"},
        {", \"model_type\": \"gemma2\", \"head_dim\": 8, \"layer_types\": [\"sliding_attention\"]}",
         "one entry a block (3)"},
        /* windows the class cannot say */
        {", \"model_type\": \"gemma2\", \"head_dim\": 8, \"layer_types\": [\"sliding_attention\", "
         "\"sliding_attention\", \"sliding_attention\"]}", "Gemma 2's is on every other block from the first"},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"layer_types\": [\"sliding_attention\", "
         "\"full_attention\", \"sliding_attention\"]}", "Qwen's are on every block from"},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"max_window_layers\": -1}",
         "max_window_layers must be a non-negative integer"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_refused_with(head, bad[k].extra, bad[k].msg);
    snprintf(json, sizeof json, "%s, \"model_type\": \"mistral\"}", head);
    c = config_of(json);
    c.window_from = 1; /* Mistral's class slides every block */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("Mistral's and Phi-3's are on every block");
    snprintf(json, sizeof json, "%s, \"model_type\": \"gemma\", \"head_dim\": 8, \"sliding_window\": 8}", head);
    c = config_of(json); /* GemmaConfig reads no window */
    assert_int_equal(c.sliding_window, 0);
    c.sliding_window = 8; /* Gemma's class has no window */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("Gemma's and Granite's have none");
    snprintf(json, sizeof json, "%s, \"model_type\": \"smollm3\", \"no_rope_layer_interval\": 2}", head);
    c = config_of(json);
    c.sliding_window = 8; /* SmolLM3's class puts it on the NoPE blocks */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("SmolLM3's is on its NoPE blocks");
    snprintf(json, sizeof json, "%s, \"attention_bias\": true}", head);
    c = config_of(json);
    c.sliding_window = 8; /* LLaMA's with a window is Mistral's, which has no attention_bias */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("has no attention_bias");
    c.o_bias = c.qkv_bias = 0;
    c.sliding_window = -1;
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    c.sliding_window = 0;
    c.window_from = 1; /* blocks of a window there is not */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("the last two need a window");
}

/* SmolLM3's model: its NoPE blocks from no_rope_layers (0 at every N-th
 * block) or no_rope_layer_interval (4 by default), SmolLM3Config's other
 * defaults (4 kv heads, 32768 positions, rope_theta 2e6, tied, a window
 * only with use_sliding_window); saved as SmolLM3's class with its list and
 * read back the same; a list that is not every N-th block, or too short,
 * refused by name. */
static void test_smollm3_config(void **state) {
    (void)state;
    const char *head = "{\"model_type\": \"smollm3\", \"hidden_size\": 16, \"num_hidden_layers\": 8, "
                       "\"num_attention_heads\": 4, \"intermediate_size\": 24, \"vocab_size\": 40";
    char json[512];
    snprintf(json, sizeof json, "%s, \"sliding_window\": 64, \"no_rope_layers\": [1, 1, 1, 0, 1, 1, 1, 0, 1, 1]}", head);
    loom_llama_config c = config_of(json), back;
    assert_true(c.nope_interval == 4 && c.n_kv_heads == 4 && c.max_seq == 32768 && c.rope_theta == 2e6f &&
                c.tie_embeddings);
    for (int l = 0; l < 8; l++) assert_int_equal(loom_llama_layer_has_rope(&c, l), l != 3 && l != 7);
    back = saved_and_loaded(&c);
    assert_true(loom_llama_config_same_model(&c, &back) && saved_text_has("SmolLM3ForCausalLM") &&
                saved_text_has("\"no_rope_layer_interval\": 4"));
    snprintf(json, sizeof json, "%s}", head); /* SmolLM3Config's list: every 4th */
    assert_int_equal(config_of(json).nope_interval, 4);
    snprintf(json, sizeof json, "%s, \"no_rope_layer_interval\": 2}", head);
    assert_int_equal(config_of(json).nope_interval, 2);
    snprintf(json, sizeof json, "%s, \"no_rope_layers\": [true, false, true, false, 1, 0, true, false]}", head);
    assert_int_equal(config_of(json).nope_interval, 2); /* booleans as Hugging Face takes them */
    snprintf(json, sizeof json, "%s, \"no_rope_layers\": [1, 1, 1, 1, 1, 1, 1, 1]}", head); /* RoPE everywhere */
    c = config_of(json);
    assert_int_equal(c.nope_interval, 0);
    snprintf(json, sizeof json, "%s, \"sliding_window\": 64, \"use_sliding_window\": true}", head);
    io_write_raw(io_path("config.json"), json, strlen(json)); /* SmolLM3's window, on its NoPE blocks */
    assert_int_equal(loom_llama_config_load(io_path("config.json"), &c), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("SmolLM3's sliding window (on its NoPE blocks) is not computed");
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"no_rope_layers\": [1, 0, 1, 1, 1, 1, 1, 1]}", "block 3 breaks it"},
        {", \"no_rope_layers\": [1, 1, 2, 1, 1, 1, 1, 1]}", "block 2 breaks it"},
        {", \"no_rope_layers\": [true, true, true, false, true, true, false, false]}", "block 6 breaks it"},
        {", \"no_rope_layers\": [1, 1, 1, 0]}", "one entry a block (8)"},
        {", \"no_rope_layer_interval\": 0}", "no_rope_layer_interval must be a positive integer"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_refused_with(head, bad[k].extra, bad[k].msg);
    c.nope_interval = 2;
    c.fused_proj = 1; /* NoPE blocks in Phi-3's files: no layout */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("SmolLM3's NoPE blocks");
}

/* loom_llama_config_same_model: a copy is the same model; each field that
 * changes the math, changed alone, is not; Granite's multipliers compare
 * by what they do (0, none, is 1; the scale's 0 is 1/sqrt(head size)). */
static void test_same_model(void **state) {
    (void)state;
    loom_llama_config a = config_of("{\"model_type\": \"granite\", \"hidden_size\": 16, \"num_hidden_layers\": 1, "
                                    "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 40, "
                                    "\"residual_multiplier\": 0.5}");
    loom_llama_config b = a;
    assert_true(loom_llama_config_same_model(&a, &b));
    for (int f = 0; f < 17; f++) {
        b = a;
        switch (f) {
        case 0: b.embedding_multiplier = 2.0f; break;
        case 1: b.residual_multiplier = 0.25f; break;
        case 2: b.attention_multiplier = 0.5f; break;
        case 3: b.logits_scaling = 10.0f; break;
        case 4: b.act = LOOM_ACT_GELU_TANH; break;
        case 5: b.scale_embeddings = 1; break;
        case 6: b.norm_unit_offset = 1; break;
        case 7: b.norm_eps = 1e-3f; break;
        case 8: b.rope_theta = 500000.0f; break;
        case 9: b.max_seq = 64; break;
        case 10: b.attention_dropout = 0.1f; break;
        case 11: b.nope_interval = 2; break;
        case 12: b.attn_softcap = 50.0f; break;
        case 13: b.final_softcap = 30.0f; break;
        case 14: b.post_norms = 1; break;
        case 15: b.attention_multiplier = 0.0f; b.query_pre_attn_scalar = 4.0f; break; /* a scale of 0.5, not 1 */
        default: b.fused_proj = 1; break;
        }
        if (loom_llama_config_same_model(&a, &b)) fail_msg("field %d changed alone: still the same model", f);
    }
    b = a;
    b.embedding_multiplier = b.logits_scaling = 0.0f; /* none: 1 */
    b.attention_multiplier = 0.0f;                   /* 1/sqrt(8), not Granite's 1 */
    assert_false(loom_llama_config_same_model(&a, &b));
    a.attention_multiplier = 1.0f / sqrtf(8.0f);
    assert_true(loom_llama_config_same_model(&a, &b));
}

/* Phi-3's model: its config (Phi3Config's eps 1e-5 and 4096 positions
 * when left out, no attention biases whatever the file says) read and
 * saved as Phi-3's; its weights written as its files hold them (each
 * layer's q, k, v rows in one qkv_proj, gate and up in one gate_up_proj,
 * no tensor of the parts) and read back bit for bit, from one file and
 * from shards; what loom does not compute refused by name; LoRA adapters
 * of the fused parts have no PEFT layout, o's alone do. */
static void test_phi3_layout(void **state) {
    (void)state;
    loom_llama_config c = config_of("{\"model_type\": \"phi3\", \"hidden_size\": 16, \"num_hidden_layers\": 2, "
                                    "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
                                    "\"intermediate_size\": 24, \"vocab_size\": 40, \"attention_bias\": true, "
                                    "\"resid_pdrop\": 0.0, \"partial_rotary_factor\": 1.0}");
    assert_true(c.fused_proj && !c.qkv_bias && c.norm_eps == 1e-5f && c.max_seq == 4096);
    loom_llama_config back = saved_and_loaded(&c);
    assert_true(saved_text_has("Phi3ForCausalLM") && saved_text_has("\"model_type\": \"phi3\"") &&
                !saved_text_has("attention_bias") && saved_text_has("\"pad_token_id\": null"));
    assert_true(back.fused_proj && loom_llama_config_same_model(&c, &back));
    back.fused_proj = 0; /* another file layout: the weights of one do not load into the other */
    assert_false(loom_llama_config_same_weights(&c, &back));
    static const struct { const char *extra, *msg; } bad[] = {
        {", \"model_type\": \"phi3\", \"partial_rotary_factor\": 1.5", "partial_rotary_factor must be a number in (0, 1]"},
        {", \"model_type\": \"phi3\", \"partial_rotary_factor\": 0.1", "must leave an even rotary part of 2 or more (0)"},
        {", \"model_type\": \"phi3\", \"resid_pdrop\": 0.1", "resid_pdrop other than 0"},
        {", \"model_type\": \"phi3\", \"embd_pdrop\": 0.1", "embd_pdrop other than 0"},
        {", \"model_type\": \"phi3\", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4}",
         "rope_scaling \"yarn\" on a Phi-3 model"},
        {", \"model_type\": \"phi3\", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 4}",
         "rope_scaling \"linear\" on a Phi-3 model"},
        {", \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.75}",
         "rope_parameters's partial_rotary_factor other than 1"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_config_refused(bad[k].extra, bad[k].msg);
    c.max_seq = 8;
    c.qkv_bias = c.o_bias = 1;
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("Phi-3's fused projections with");
    c.qkv_bias = 0; /* o's alone too */
    assert_int_equal(loom_llama_config_validate(&c), LOOM_ERR_INVALID);
    c.o_bias = 0;

    loom_llama *m, *got;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    loom_llama_init_weights(m, 11);
    assert_int_equal(loom_model_dir_save(m, LOOM_F32, NULL, io_path("phi3")), LOOM_OK);
    loom_safetensors *sf;
    assert_int_equal(loom_safetensors_open(io_path("phi3/model.safetensors"), &sf), LOOM_OK);
    for (int l = 0; l < 2; l++) {
        const loom_llama_layer *y = &m->layers[l];
        loom_param *qkv[3] = {y->wq, y->wk, y->wv}, *gu[2] = {y->w_gate, y->w_up};
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.self_attn.q_proj.weight", l);
        assert_false(loom_safetensors_has(sf, name));
        float fused[48 * 16];
        snprintf(name, sizeof name, "model.layers.%d.self_attn.qkv_proj.weight", l);
        int64_t qkv_shape[2] = {16 + 8 + 8, 16}, gu_shape[2] = {48, 16};
        assert_int_equal(loom_safetensors_read(sf, name, LOOM_F32, qkv_shape, 2, fused), LOOM_OK);
        for (int k = 0, row = 0; k < 3; row += (int)qkv[k]->tensor->shape[0], k++)
            assert_true(tu_bits_equal(fused + row * 16, loom_param_master(qkv[k]),
                                      (size_t)loom_param_numel(qkv[k]) * sizeof(float), "qkv_proj's rows"));
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate_up_proj.weight", l);
        assert_int_equal(loom_safetensors_read(sf, name, LOOM_F32, gu_shape, 2, fused), LOOM_OK);
        for (int k = 0; k < 2; k++)
            assert_true(tu_bits_equal(fused + k * 24 * 16, loom_param_master(gu[k]), 24 * 16 * sizeof(float),
                                      "gate_up_proj's rows"));
    }
    /* the same tensors in two shards, mapped by an index */
    char index[4096];
    size_t len = (size_t)snprintf(index, sizeof index, "{\"weight_map\": {");
    loom_safetensors_writer *w[2];
    for (int k = 0; k < 2; k++) assert_int_equal(loom_safetensors_writer_init(&w[k]), LOOM_OK);
    for (size_t i = 0; i < loom_safetensors_count(sf); i++) {
        loom_safetensors_tensor t;
        assert_int_equal(loom_safetensors_at(sf, i, &t), LOOM_OK);
        assert_int_equal(loom_safetensors_writer_add(w[i % 2], t.name, t.dtype, t.shape, t.ndim, t.data), LOOM_OK);
        len += (size_t)snprintf(index + len, sizeof index - len, "%s\"%s\": \"part-%zu.safetensors\"", i ? ", " : "",
                                t.name, i % 2);
    }
    snprintf(index + len, sizeof index - len, "}}");
    assert_int_equal(mkdir(io_path("phi3-sharded"), 0755), 0);
    assert_int_equal(loom_safetensors_writer_write(w[0], io_path("phi3-sharded/part-0.safetensors")), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_write(w[1], io_path("phi3-sharded/part-1.safetensors")), LOOM_OK);
    for (int k = 0; k < 2; k++) loom_safetensors_writer_free(w[k]);
    loom_safetensors_close(sf);
    io_write_raw(io_path("phi3-sharded/model.safetensors.index.json"), index, strlen(index));
    assert_int_equal(loom_llama_config_save(&c, LOOM_F32, io_path("phi3-sharded/config.json")), LOOM_OK);
    const char *dirs[2] = {"phi3", "phi3-sharded"};
    for (int d = 0; d < 2; d++) {
        assert_int_equal(loom_model_dir_load(io_path(dirs[d]), p, &got), LOOM_OK);
        assert_true(got->cfg.fused_proj);
        for (int i = 0; i < m->n_params; i++)
            assert_true(tu_bits_equal(loom_param_master(got->params[i]), loom_param_master(m->params[i]),
                                      (size_t)loom_param_numel(m->params[i]) * sizeof(float), m->params[i]->name));
        loom_llama_free(got);
    }
    loom_lora_config lc = {.rank = 2, .alpha = 4.0f, .targets = 1u << LOOM_LORA_V | 1u << LOOM_LORA_O};
    assert_int_equal(loom_llama_add_lora(m, &lc, 1), LOOM_OK);
    assert_true(loom_lora_peft_unwritable(m));
    assert_int_equal(loom_lora_save_peft(m, io_path("phi3-adapter"), NULL), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("fused qkv_proj and gate_up_proj");
    loom_llama_free(m);
    c.fused_proj = 1;
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    lc.targets = 1u << LOOM_LORA_O | 1u << LOOM_LORA_DOWN; /* linears Phi-3 has as they are */
    assert_int_equal(loom_llama_add_lora(m, &lc, 1), LOOM_OK);
    assert_false(loom_lora_peft_unwritable(m));
    assert_int_equal(loom_lora_save_peft(m, io_path("phi3-adapter"), NULL), LOOM_OK);
    loom_llama_free(m);
    /* loaded into a Phi-3 model: o's and down's adapters load; adapters of the fused parts, or of the fused
     * modules themselves (PEFT's), are refused by name */
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    assert_int_equal(loom_lora_load_peft(m, io_path("phi3-adapter")), LOOM_OK);
    loom_llama_free(m);
    char cfg_path[4200];
    snprintf(cfg_path, sizeof cfg_path, "%s/adapter_config.json", io_path("phi3-adapter"));
    static const struct { const char *targets, *msg; } fused[] = {
        {"[\"q_proj\", \"o_proj\"]", "a Phi-3 model fuses"},
        {"[\"qkv_proj\", \"o_proj\"]", "adapts Phi-3's fused module as one"},
    };
    for (int k = 0; k < 2; k++) {
        char text[512];
        snprintf(text, sizeof text, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": %s}",
                 fused[k].targets);
        io_write_raw(cfg_path, text, strlen(text));
        assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
        assert_int_equal(loom_lora_load_peft(m, io_path("phi3-adapter")), LOOM_ERR_UNSUPPORTED);
        IO_ASSERT_MSG(fused[k].msg);
        loom_llama_free(m);
    }
}

/* A DoRA adapter round-trips as PEFT saves one: use_dora in the config,
 * each linear's magnitudes a vector (base_model.model.<module>.
 * lora_magnitude_vector) beside A and B; loaded into the base model, the
 * same values and logits. */
static void test_peft_dora(void **state) {
    (void)state;
    loom_llama *m = model(5), *back = model(5);
    loom_lora_config lc = {.rank = 2, .alpha = 3.0f, .targets = (1u << LOOM_LORA_Q) | (1u << LOOM_LORA_DOWN),
                           .dora = 1};
    assert_int_equal(loom_llama_add_lora(m, &lc, 9), LOOM_OK);
    assert_int_equal(m->n_params - m->n_base, 3 * 2 * m->cfg.n_layers);
    for (int i = m->n_base; i < m->n_params; i++) { /* B nonzero, m moved */
        size_t n = (size_t)loom_param_numel(m->params[i]);
        float *v = loom_param_master(m->params[i]);
        if (strstr(m->params[i]->name, "lora_magnitude_vector"))
            for (size_t k = 0; k < n; k++) v[k] *= 0.75f + 0.01f * (float)k;
        else
            tu_fill_uniform(v, n, -1, 1, 70 + (uint64_t)i);
        loom_param_sync_from_master(m->params[i]);
    }
    assert_int_equal(loom_lora_save_peft(m, io_path("dora"), NULL), LOOM_OK);
    char p[512];
    snprintf(p, sizeof p, "%s/adapter_config.json", io_path("dora"));
    size_t n;
    unsigned char *raw = io_read_raw(p, &n);
    char *text = strndup((const char *)raw, n);
    assert_non_null(strstr(text, "\"use_dora\": true"));
    free(text);
    free(raw);
    loom_safetensors *sf;
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", io_path("dora"));
    assert_int_equal(loom_safetensors_open(p, &sf), LOOM_OK);
    loom_safetensors_tensor t;
    assert_int_equal(loom_safetensors_get(sf, "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector", &t),
                     LOOM_OK);
    assert_true(t.ndim == 1 && t.shape[0] == m->cfg.dim);
    loom_safetensors_close(sf);
    assert_int_equal(loom_lora_load_peft(back, io_path("dora")), LOOM_OK);
    assert_true(back->lora.dora == 1 && back->n_params == m->n_params);
    for (int i = 0; i < m->n_params; i++)
        assert_memory_equal(loom_param_master(m->params[i]), loom_param_master(back->params[i]),
                            (size_t)loom_param_numel(m->params[i]) * sizeof(float));
    int32_t tok[6] = {1, 5, 2, 7, 3, 4};
    loom_tensor *la = NULL, *lb = NULL;
    loom_no_grad_enter();
    assert_int_equal(loom_llama_forward(m, tok, NULL, 1, 6, NULL, &la), LOOM_OK);
    assert_int_equal(loom_llama_forward(back, tok, NULL, 1, 6, NULL, &lb), LOOM_OK);
    loom_no_grad_exit();
    size_t nl = (size_t)loom_tensor_numel(la);
    float *a = malloc(nl * sizeof *a), *b = malloc(nl * sizeof *b);
    loom_tensor_read_f32(la, a);
    loom_tensor_read_f32(lb, b);
    assert_memory_equal(a, b, nl * sizeof *a); /* the same logits */
    free(a);
    free(b);
    loom_tensor_release(la);
    loom_tensor_release(lb);
    loom_llama_free(back);
    loom_llama_free(m);
}

/* generation_config.json's eos_token_id, one id or a list; none without
 * the file; refusals by name; a model takes a directory's file (the model
 * keeping what it had when the file is refused), its model directories and
 * checkpoints carry it byte for byte, and a model without one removes a
 * stale one where it saves. */
static void test_generation_config(void **state) {
    (void)state;
    int32_t ids[LOOM_EOS_IDS_MAX];
    int n = -1;
    assert_int_equal(loom_mkdir_p(io_path("gc")), LOOM_OK);
    assert_int_equal(loom_model_dir_eos_ids(io_path("gc"), ids, LOOM_EOS_IDS_MAX, &n), LOOM_OK);
    assert_int_equal(n, 0);
    char gc[512], gc2[512];
    snprintf(gc, sizeof gc, "%s/" LOOM_GENERATION_CONFIG, io_path("gc"));
    snprintf(gc2, sizeof gc2, "%s/" LOOM_GENERATION_CONFIG, io_path("gc2"));
    static const struct { const char *json; int n; int32_t first, last; } good[] = {
        {"{\"eos_token_id\": 7}", 1, 7, 7},
        {"{\"bos_token_id\": 1, \"eos_token_id\": [128001, 128008, 128009], \"do_sample\": true}", 3, 128001, 128009},
        {"{\"eos_token_id\": null}", 0, 0, 0},
        {"{\"temperature\": 0.6}", 0, 0, 0},
    };
    for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
        io_write_raw(gc, good[k].json, strlen(good[k].json));
        assert_int_equal(loom_model_dir_eos_ids(io_path("gc"), ids, LOOM_EOS_IDS_MAX, &n), LOOM_OK);
        assert_int_equal(n, good[k].n);
        if (n) assert_true(ids[0] == good[k].first && ids[n - 1] == good[k].last);
    }
    /* the sampling it asks for, as Hugging Face's generate reads it: greedy unless do_sample, else its
     * temperature, top_p, top_k (1, 1, 50 where it says none); the flags given (`given`) stay */
    static const struct { const char *json; unsigned given, from; float t, p; int k; } samp[] = {
        {"{\"eos_token_id\": 7}", 0u, 9u, 0.0f, 0.5f, 3},
        {"{\"do_sample\": false, \"temperature\": 0.6, \"top_p\": 0}", 0u, 9u, 0.0f, 0.5f, 3}, /* unused: unchecked */
        {"{\"do_sample\": true, \"temperature\": 0.6, \"top_p\": 0.9}", 0u, 7u, 0.6f, 0.9f, 50},
        {"{\"do_sample\": true, \"top_k\": 20}", 0u, 7u, 1.0f, 1.0f, 20},
        {"{\"do_sample\": true, \"temperature\": 0.6, \"top_p\": 0.9, \"top_k\": 20}", 7u, 0u, 2.0f, 0.5f, 3},
        {"{\"do_sample\": false, \"top_p\": 0.8, \"top_k\": 20}", 1u, 6u, 2.0f, 0.8f, 20}, /* --temperature samples */
        {"{\"do_sample\": true, \"top_p\": 0.8}", 1u | 4u, 2u, 2.0f, 0.8f, 3},
        {"{\"do_sample\": true, \"temperature\": 0.6}", 0u | 2u, 5u, 0.6f, 0.5f, 50},
        {"{\"repetition_penalty\": 1.25}", 0u, 25u, 0.0f, 0.5f, 3}, /* greedy or not */
        {"{\"repetition_penalty\": 1.25}", 16u, 9u, 0.0f, 0.5f, 3},   /* the flag's stays */
        {"{\"do_sample\": true, \"min_p\": 0.05}", 0u, 39u, 1.0f, 1.0f, 50},
        {"{\"do_sample\": true, \"min_p\": 0.05}", 32u, 7u, 1.0f, 1.0f, 50}, /* the flag's stays */
        {"{\"min_p\": 7}", 0u, 9u, 0.0f, 0.5f, 3},                             /* greedy: not applied, not read */
    };
    for (size_t k = 0; k < sizeof samp / sizeof samp[0]; k++) {
        io_write_raw(gc, samp[k].json, strlen(samp[k].json));
        loom_sampler s = {2.0f, 0.5f, 1, 0, 3, 0.0f, 0.0f};
        unsigned from = 99;
        assert_int_equal(loom_model_dir_sampler(io_path("gc"), samp[k].given, &s, &from), LOOM_OK);
        assert_true(from == samp[k].from && s.temperature == samp[k].t && s.top_p == samp[k].p && s.top_k == samp[k].k);
        assert_true(s.repetition_penalty == (from & 16u ? 1.25f : 0.0f));
        assert_true(s.min_p == (from & 32u ? 0.05f : 0.0f));
    }
    static const struct { const char *json, *msg; } samp_bad[] = {
        {"{\"do_sample\": \"yes\"}", "do_sample must be true or false"},
        {"{\"do_sample\": true, \"temperature\": -1}", "temperature must be a number from 0"},
        {"{\"do_sample\": true, \"top_p\": 0}", "top_p must be a number in (0, 1]"},
        {"{\"do_sample\": true, \"top_p\": 1e-50}", "top_p must be a number in (0, 1] (as an fp32)"},
        {"{\"do_sample\": true, \"top_k\": 2.5}", "top_k must be an integer from 0"},
        {"{\"repetition_penalty\": 0}", "repetition_penalty must be a positive number"},
        {"{\"do_sample\": true, \"min_p\": 1.5}", "min_p must be a number in [0, 1]"},
        {"{\"do_sample\": true, \"min_p\": \"0.1\"}", "min_p must be a number in [0, 1]"},
    };
    for (size_t k = 0; k < sizeof samp_bad / sizeof samp_bad[0]; k++) {
        io_write_raw(gc, samp_bad[k].json, strlen(samp_bad[k].json));
        loom_sampler s = {2.0f, 0.5f, 1, 0, 3, 0.0f, 0.0f};
        unsigned from;
        assert_int_equal(loom_model_dir_sampler(io_path("gc"), 0u, &s, &from), LOOM_ERR_FORMAT);
        IO_ASSERT_MSG(samp_bad[k].msg);
    }
    loom_llama *m = model(3);
    io_write_raw(gc, good[1].json, strlen(good[1].json));
    assert_int_equal(loom_model_dir_load_generation_config(m, io_path("gc")), LOOM_OK);
    static const struct { const char *json, *msg; } bad[] = {
        {"{\"eos_token_id\": \"</s>\"}", "eos_token_id must be a token id"},
        {"{\"eos_token_id\": [2, -1]}", "eos_token_id must be a token id"},
        {"{\"eos_token_id\": 2.5}", "eos_token_id must be a token id"},
        {"{\"eos_token_id\": [1, 2, 3]}", "lists 3 ids, more than 2"},
        {"[2]", "expected a JSON object"},
        {"{\"eos_token_id\": ", "invalid JSON"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        io_write_raw(gc, bad[k].json, strlen(bad[k].json));
        assert_int_equal(loom_model_dir_eos_ids(io_path("gc"), ids, 2, &n), LOOM_ERR_FORMAT);
        assert_int_equal(n, 0);
        IO_ASSERT_MSG(bad[k].msg);
        /* and a model does not take it, keeping what it had */
        assert_int_equal(loom_model_dir_load_generation_config(m, io_path("gc")),
                         k == 3 ? LOOM_OK : LOOM_ERR_FORMAT); /* 3 ids are within the model's bound */
        if (k == 3) { /* back to good[1] */
            io_write_raw(gc, good[1].json, strlen(good[1].json));
            assert_int_equal(loom_model_dir_load_generation_config(m, io_path("gc")), LOOM_OK);
        }
    }
    /* saved with the model, byte for byte; loaded with it again */
    assert_int_equal(loom_model_dir_save(m, LOOM_F32, NULL, io_path("gc2")), LOOM_OK);
    size_t na;
    unsigned char *a = io_read_raw(gc2, &na);
    assert_true(na == strlen(good[1].json) && memcmp(a, good[1].json, na) == 0);
    free(a);
    loom_llama *back;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_model_dir_load(io_path("gc2"), p, &back), LOOM_OK);
    assert_true(back->generation_config_len == strlen(good[1].json) &&
                memcmp(back->generation_config, good[1].json, back->generation_config_len) == 0);
    /* and by a checkpoint, which a resumed run takes it from */
    loom_train_state ts = {.loss_scale = 1.0f};
    float *mm[16] = {0};
    assert_true(m->n_params <= 16);
    for (int i = 0; i < m->n_params; i++) mm[i] = calloc((size_t)loom_param_numel(m->params[i]), sizeof(float));
    char ck[512];
    snprintf(ck, sizeof ck, "%s/ckpt/" LOOM_GENERATION_CONFIG, io_path("gc"));
    assert_int_equal(loom_checkpoint_save(io_path("gc/ckpt"), m, mm, mm, 0, &ts, NULL), LOOM_OK);
    for (int i = 0; i < m->n_params; i++) free(mm[i]);
    a = io_read_raw(ck, &na);
    assert_true(na == strlen(good[1].json) && memcmp(a, good[1].json, na) == 0);
    free(a);
    /* a directory without one: the model then has none, and its save removes a stale one */
    assert_int_equal(remove(gc), 0);
    loom_sampler s0 = {2.0f, 0.5f, 1, 0, 3, 0.0f, 0.0f};
    unsigned from0 = 9;
    assert_int_equal(loom_model_dir_sampler(io_path("gc"), 0u, &s0, &from0), LOOM_OK); /* none: as the caller has it */
    assert_true(from0 == 0 && s0.temperature == 2.0f && s0.top_p == 0.5f && s0.top_k == 3);
    assert_int_equal(loom_model_dir_load_generation_config(back, io_path("gc")), LOOM_OK);
    assert_null(back->generation_config);
    assert_int_equal(loom_model_dir_save(back, LOOM_F32, NULL, io_path("gc2")), LOOM_OK);
    struct stat sb;
    assert_int_not_equal(stat(gc2, &sb), 0); /* stale: removed */
    loom_llama_free(back);
    loom_llama_free(m);
}

static void test_gguf_refusals(void **state) {
    (void)state;
    loom_llama *m = model(4); /* vocabulary 40 */
    const char *text = "the cat sat on the mat; the dog sat on the log.";
    loom_tokenizer *tok;
    assert_int_equal(loom_tokenizer_train(&text, NULL, 1, 270, &tok), LOOM_OK);
    char path[4096];
    snprintf(path, sizeof path, "%s", io_path("m.gguf")); /* io_path's buffer is reused */
    struct stat sb;
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, NULL, path), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("needs the model's tokenizer");
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, path), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("but the model only 40");
    assert_int_equal(loom_llama_save_gguf(m, (loom_gguf_type)77, tok, path), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("is not fp32, fp16, bf16 or q8_0");
    assert_int_not_equal(stat(path, &sb), 0);
    loom_llama_free(m);

    loom_llama_config c;
    memset(&c, 0, sizeof c);
    c.dim = 16; c.n_layers = 1; c.n_heads = 2; c.n_kv_heads = 1; c.ffn_dim = 24;
    c.vocab_size = loom_tokenizer_vocab_size(tok) + 3; c.max_seq = 8; c.rope_theta = 10000.0f; c.norm_eps = 1e-5f;
    loom_precision p = {LOOM_F32, 0};
    assert_int_equal(loom_llama_new(&c, p, &m), LOOM_OK);
    loom_llama_init_weights(m, 5);
    /* A write that fails (a full disk): nothing is left. */
    io_test_inject_failure(IO_FAIL_WRITE, 0, ENOSPC);
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_BF16, tok, path), LOOM_ERR_IO);
    io_test_inject_failure(IO_FAIL_NONE, 0, 0);
    IO_ASSERT_MSG("m.gguf");
    assert_int_not_equal(stat(path, &sb), 0);
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_BF16, tok, path), LOOM_OK);
    /* RoPE scaling, which llama.cpp takes in its own form: refused by name. */
    m->cfg.rope_type = LOOM_ROPE_LINEAR;
    m->cfg.rope_factor = 2.0f;
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("rope_scaling");
    m->cfg.rope_type = LOOM_ROPE_DEFAULT;
    m->cfg.qkv_bias = 1; /* and the attention's biases (a model with them: the flag is what export reads) */
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("attention biases");
    m->cfg.qkv_bias = 0;
    m->cfg.head_dim = 16;
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("head_dim");
    m->cfg.head_dim = 0;
    m->cfg.qk_norm = 1;
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("q/k norms");
    m->cfg.qk_norm = 0;
    m->cfg.norm_unit_offset = m->cfg.scale_embeddings = 1; /* Gemma's model */
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("Gemma's architecture");
    m->cfg.norm_unit_offset = m->cfg.scale_embeddings = 0;
    m->cfg.act = LOOM_ACT_GELU_TANH;
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("a GELU MLP");
    m->cfg.act = LOOM_ACT_SILU;
    m->cfg.logits_scaling = 8.0f; /* Granite's */
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("Granite's multipliers");
    m->cfg.logits_scaling = 0.0f;
    m->cfg.fused_proj = 1; /* Phi-3's files */
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("Phi-3's fused projections");
    m->cfg.fused_proj = 0;
    m->cfg.post_norms = 1; /* Gemma 2's (the flag is what export reads) */
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("Gemma 2's or 3's architecture");
    m->cfg.post_norms = 0;
    m->cfg.nope_interval = 4; /* SmolLM3's */
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, tok, io_path("scaled.gguf")), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("SmolLM3's NoPE blocks");
    m->cfg.nope_interval = 0;
    /* Tokenizers llama.cpp cannot load: two ids spelling "abc", no end of text. */
    const char *dup = "{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":261,"
                      "\"merges\":[[97,98],[256,99],[98,99],[97,258]],\"special\":{\"<|endoftext|>\":260}}";
    const char *no_eot = "{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":257,\"merges\":[[97,98]]}";
    const char *const bad[2] = {dup, no_eot}, *const why[2] = {"tokens 257 and 259 have the same bytes (abc)",
                                                                 "has no <|endoftext|> token"};
    for (int k = 0; k < 2; k++) {
        io_write_raw(io_path("bad-tok.json"), bad[k], strlen(bad[k]));
        loom_tokenizer *bt;
        assert_int_equal(loom_tokenizer_load(io_path("bad-tok.json"), &bt), LOOM_OK);
        assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_F32, bt, io_path("bad.gguf")), LOOM_ERR_INVALID);
        IO_ASSERT_MSG(why[k]);
        assert_int_not_equal(stat(io_path("bad.gguf"), &sb), 0);
        loom_tokenizer_free(bt);
    }
    /* A NaN weight is named, and nothing is written. */
    float *w = loom_param_master(m->layers[0].wv);
    w[3] = NAN;
    assert_int_equal(loom_llama_save_gguf(m, LOOM_GGUF_Q8_0, tok, io_path("nan.gguf")), LOOM_ERR_FORMAT);
    IO_ASSERT_MSG("model.layers.0.self_attn.v_proj.weight");
    assert_int_not_equal(stat(io_path("nan.gguf"), &sb), 0);
    size_t n;
    unsigned char *f = io_read_raw(path, &n);
    assert_true(n > 64 && memcmp(f, "GGUF", 4) == 0 && f[4] == 3);
    free(f);
    loom_tokenizer_free(tok);
    loom_llama_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_failed_save_keeps_old_directory),
        cmocka_unit_test(test_sharded_directory),
        cmocka_unit_test(test_checkpoint_refuses_bad_loss_scale),
        cmocka_unit_test(test_lora_checkpoint),
        cmocka_unit_test(test_lora_checkpoint_bf16),
        cmocka_unit_test(test_peft_adapter),
        cmocka_unit_test(test_rope_scaling_config),
        cmocka_unit_test(test_peft_dora),
        cmocka_unit_test(test_generation_config),
        cmocka_unit_test(test_bias_config),
        cmocka_unit_test(test_gemma_config),
        cmocka_unit_test(test_gemma2_config),
        cmocka_unit_test(test_granite_config),
        cmocka_unit_test(test_phi3_layout),
        cmocka_unit_test(test_same_model),
        cmocka_unit_test(test_longrope_config),
        cmocka_unit_test(test_window_config),
        cmocka_unit_test(test_yarn_config),
        cmocka_unit_test(test_partial_rotary_config),
        cmocka_unit_test(test_gemma3_config),
        cmocka_unit_test(test_gemma3_multimodal),
        cmocka_unit_test(test_smollm3_config),
        cmocka_unit_test(test_gguf_refusals),
    };
    return cmocka_run_group_tests(tests, io_scratch_setup, io_scratch_teardown);
}
