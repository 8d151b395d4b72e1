/*
 * test_model_dir.c — replacing a model directory is all or nothing: a save
 * that fails at any file (weights, config, tokenizer) leaves every old file
 * byte for byte and no staged file behind; a save that succeeds replaces
 * all of them (and removes a tokenizer.json the new model does not have),
 * and the directory loads back as the saved model.
 */
#include "io_test.h"

#include <errno.h>

#include "io/io_internal.h"
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_failed_save_keeps_old_directory),
    };
    return cmocka_run_group_tests(tests, io_scratch_setup, io_scratch_teardown);
}
