/*
 * test_tokenizer_hf.c — Hugging Face tokenizer.json (byte-level BPE) read by
 * loom_tokenizer_load: ids as the file gives them (here the bytes' ids are
 * reversed, so nothing works by loom's own layout), merges by rank,
 * ignore_merges, begin- and end-of-text tokens, special tokens, bytes that
 * are not UTF-8, pieces longer than loom's own chunks, and every refusal by
 * name. (tests/python/hf_tokenizer_check.py checks the encoding against an
 * independent encoder on real text.)
 */
#include "io_test.h"

#include <jansson.h>

/* GPT-2's spelling of byte b, as UTF-8. */
static void spell(int b, char out[3]) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int extra = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) extra++;
    unsigned cp = printable ? (unsigned)b : 256u + (unsigned)extra;
    memset(out, 0, 3);
    if (cp < 0x80) out[0] = (char)cp;
    else { out[0] = (char)(0xC0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3F)); }
}

/* Byte b has id 255 - b; "ab" 256, "abc" 257, "aa" 258, <|endoftext|> 259. */
static json_t *base_file(void) {
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char s[3];
        spell(b, s);
        json_object_set_new(vocab, s, json_integer(255 - b));
    }
    json_object_set_new(vocab, "ab", json_integer(256));
    json_object_set_new(vocab, "abc", json_integer(257));
    json_object_set_new(vocab, "aa", json_integer(258));
    json_t *root = json_pack("{s:s, s:n, s:{s:s, s:b, s:b}, s:{s:s}, s:[{s:i, s:s, s:b}]}", "version", "1.0",
                             "normalizer", "pre_tokenizer", "type", "ByteLevel", "add_prefix_space", 0,
                             "use_regex", 1, "decoder", "type", "ByteLevel", "added_tokens", "id", 259,
                             "content", "<|endoftext|>", "special", 1);
    json_t *model = json_pack("{s:s, s:o, s:[s, s, s], s:n, s:b}", "type", "BPE", "vocab", vocab, "merges",
                              "a b", "ab c", "a a", "dropout", "byte_fallback", 0);
    json_object_set_new(root, "model", model);
    return root;
}

static loom_status load_json(json_t *root, loom_tokenizer **tok) {
    const char *path = io_path("hf-tok.json");
    assert_int_equal(json_dump_file(root, path, 0), 0);
    json_decref(root);
    return loom_tokenizer_load(path, tok);
}

static size_t enc(loom_tokenizer *t, const char *s, size_t n, int32_t *ids) {
    size_t m = 0;
    assert_int_equal(loom_tokenizer_encode(t, s, n, ids, n + 1, &m), LOOM_OK);
    return m;
}

static void test_ids_and_merges(void **state) {
    (void)state;
    loom_tokenizer *t;
    assert_int_equal(load_json(base_file(), &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_vocab_size(t), 260);
    assert_int_equal(loom_tokenizer_num_merges(t), 3);
    assert_int_equal(loom_tokenizer_eot(t), 259);
    assert_int_equal(loom_tokenizer_bos(t), 259); /* no template: GPT-2's convention */
    assert_true(loom_tokenizer_is_special(t, 259));
    assert_false(loom_tokenizer_is_special(t, 257));
    int32_t ids[600];
    /* "abc" | " abd" | "aaa": merges by rank, the bytes' reversed ids */
    size_t m = enc(t, "abc abdaaa", 10, ids);
    int32_t want[] = {257, 255 - ' ', 256, 255 - 'd', 258, 255 - 'a'};
    assert_int_equal(m, 6);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want[i]);
    int32_t a, b;
    assert_int_equal(loom_tokenizer_merge(t, 1, &a, &b), LOOM_OK);
    assert_int_equal(a, 256);
    assert_int_equal(b, 255 - 'c');
    /* decode: bytes, and a special token's content */
    int32_t in[] = {257, 259, 255 - 0xff};
    char out[32];
    assert_int_equal(loom_tokenizer_decode(t, in, 3, out, sizeof out, &m), LOOM_OK);
    assert_int_equal(m, 3 + 13 + 1);
    assert_memory_equal(out, "abc<|endoftext|>\xff", m);
    /* text cannot make the special token */
    m = enc(t, "<|endoftext|>", 13, ids);
    for (size_t i = 0; i < m; i++) assert_int_not_equal(ids[i], 259);
    /* not UTF-8, and a 300-byte piece (past loom's own 128-byte chunks): exact round trips */
    char s[400];
    memcpy(s, "\xff\xfe ab \xc3 z\x80", 10);
    memset(s + 10, 'a', 300);
    m = enc(t, s, 310, ids);
    assert_int_equal(ids[m - 1], 258); /* 300 a: 150 "aa" at the end */
    assert_int_equal(ids[m - 150], 258);
    size_t n = 0;
    char back[400];
    assert_int_equal(loom_tokenizer_decode(t, ids, m, back, sizeof back, &n), LOOM_OK);
    assert_int_equal(n, 310);
    assert_memory_equal(back, s, 310);
    /* kept in its own file: never saved as a loom tokenizer */
    assert_int_equal(loom_tokenizer_save(t, io_path("x.json")), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("copy that file");
    loom_tokenizer_free(t);
}

static void test_template_and_ignore_merges(void **state) {
    (void)state;
    json_t *root = base_file();
    json_t *model = json_object_get(root, "model");
    json_object_set_new(json_object_get(model, "vocab"), "abca", json_integer(260)); /* no merge makes it */
    json_object_set_new(model, "ignore_merges", json_true());
    json_t *added = json_object_get(root, "added_tokens");
    json_object_set_new(json_array_get(added, 0), "content", json_string("<|reserved_0|>"));
    json_array_append_new(added, json_pack("{s:i, s:s, s:b}", "id", 261, "content", "<|begin_of_text|>", "special", 1));
    json_array_append_new(added, json_pack("{s:i, s:s, s:b}", "id", 262, "content", "<|end_of_text|>", "special", 1));
    json_array_append_new(added, json_pack("{s:i, s:s, s:b}", "id", 263, "content", "<pad>", "special", 0));
    /* Llama 3's layout: a Split expression, then ByteLevel without its own */
    json_object_set_new(root, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b}]}", "type", "Sequence",
                                  "pretokenizers", "type", "Split", "pattern", "Regex", "[a-z]+|\\s+", "behavior",
                                  "Isolated", "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "use_regex", 0));
    json_object_set_new(root, "post_processor",
                        json_pack("{s:s, s:[{s:s}, {s:s, s:[{s:{s:s}}, {s:{s:s}}], s:{s:{s:[i]}}}]}", "type",
                                  "Sequence", "processors", "type", "ByteLevel", "type", "TemplateProcessing",
                                  "single", "SpecialToken", "id", "<|begin_of_text|>", "Sequence", "id", "A",
                                  "special_tokens", "<|begin_of_text|>", "ids", 261));
    loom_tokenizer *t;
    assert_int_equal(load_json(root, &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_bos(t), 261);
    assert_int_equal(loom_tokenizer_eot(t), 262); /* no <|endoftext|>: <|end_of_text|> */
    assert_true(loom_tokenizer_is_special(t, 263)); /* an added token is never made from text */
    int32_t ids[16];
    /* "abca" is whole in the vocabulary: one id; "abcab" is not: merges */
    size_t m = enc(t, "abca abcab", 10, ids);
    int32_t want[] = {260, 255 - ' ', 257, 256};
    assert_int_equal(m, 4);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want[i]);
    loom_tokenizer_free(t);
}

/* Without a template, the token <|begin_of_text|> begins a text (Llama 3's
 * first tokenizer.json has no template); another name does not. */
static void test_bos_without_template(void **state) {
    (void)state;
    for (int named = 0; named < 2; named++) {
        json_t *root = base_file();
        json_array_append_new(json_object_get(root, "added_tokens"),
                              json_pack("{s:i, s:s, s:b}", "id", 260, "content",
                                        named ? "<|begin_of_text|>" : "<|begin|>", "special", 1));
        loom_tokenizer *t;
        assert_int_equal(load_json(root, &t), LOOM_OK);
        assert_int_equal(loom_tokenizer_bos(t), named ? 260 : 259);
        assert_int_equal(loom_tokenizer_eot(t), 259);
        loom_tokenizer_free(t);
    }
}

/* The base file with a Split on `pattern` before its ByteLevel. */
static json_t *split_file(const char *pattern, const char *behavior) {
    json_t *r = base_file();
    json_object_set_new(r, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}]}", "type", "Sequence", "pretokenizers",
                                  "type", "Split", "pattern", "Regex", pattern, "behavior", behavior, "type",
                                  "ByteLevel"));
    return r;
}

/* One defect each; the message names it. */
static void refused(json_t *root, const char *part) {
    loom_tokenizer *t = (loom_tokenizer *)0x1;
    assert_int_equal(load_json(root, &t), LOOM_ERR_FORMAT);
    assert_null(t);
    IO_ASSERT_MSG(part);
    IO_ASSERT_MSG("hf-tok.json");
}

/* Layouts of real files: unused ids (GPT-4's), special tokens in the
 * vocabulary as written (DeepSeek's), an empty normalizer Sequence, a Split
 * that keeps its matches and removes the rest (converted tiktoken files). */
static void test_real_file_layouts(void **state) {
    (void)state;
    json_t *root = base_file();
    json_t *vocab = json_object_get(json_object_get(root, "model"), "vocab");
    json_object_set_new(vocab, "<\xef\xbd\x9c" "end" "\xef\xbd\x9c>", json_integer(262));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b}", "id", 262, "content", "<\xef\xbd\x9c" "end" "\xef\xbd\x9c>",
                                    "special", 1));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b}", "id", 270, "content", "<|unused|>", "special", 1));
    json_object_set_new(root, "normalizer", json_pack("{s:s, s:[]}", "type", "Sequence", "normalizers"));
    json_object_set_new(root, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b}]}", "type", "Sequence",
                                  "pretokenizers", "type", "Split", "pattern", "Regex", "[a-z]+", "behavior",
                                  "Removed", "invert", 1, "type", "ByteLevel", "use_regex", 0));
    loom_tokenizer *t;
    assert_int_equal(load_json(root, &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_vocab_size(t), 271);
    const char *bytes;
    size_t n;
    assert_int_equal(loom_tokenizer_token_bytes(t, 262, &bytes, &n), LOOM_OK); /* as written */
    assert_int_equal(n, 11);
    assert_memory_equal(bytes, "<\xef\xbd\x9c" "end" "\xef\xbd\x9c>", 11);
    assert_true(loom_tokenizer_is_special(t, 262));
    for (int32_t id = 263; id < 270; id++) { /* no token: empty, special */
        assert_int_equal(loom_tokenizer_token_bytes(t, id, &bytes, &n), LOOM_OK);
        assert_int_equal(n, 0);
        assert_true(loom_tokenizer_is_special(t, id));
    }
    /* the matches are pieces, and so is the rest (kept, not removed): "abc" | " " | "ab" | "!\xff" */
    int32_t ids[16];
    size_t m = enc(t, "abc ab!\xff", 8, ids);
    int32_t want[] = {257, 255 - ' ', 256, 255 - '!', 255 - 0xff};
    assert_int_equal(m, 5);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want[i]);
    loom_tokenizer_free(t);
    /* a normalizer Sequence that does something is refused */
    root = base_file();
    json_object_set_new(root, "normalizer", json_pack("{s:s, s:[{s:s}]}", "type", "Sequence", "normalizers", "type", "NFC"));
    refused(root, "normalizer (\"Sequence\")");
}

static void test_refusals(void **state) {
    (void)state;
    json_t *r;
    r = base_file();
    json_object_set_new(r, "normalizer", json_pack("{s:s}", "type", "NFC"));
    refused(r, "normalizer (\"NFC\")");
    r = base_file();
    json_object_set_new(json_object_get(r, "model"), "byte_fallback", json_true());
    refused(r, "SentencePiece-style");
    r = base_file();
    json_object_set_new(json_object_get(r, "model"), "type", json_string("WordPiece"));
    refused(r, "\"WordPiece\"");
    r = base_file();
    json_object_set_new(json_object_get(r, "model"), "continuing_subword_prefix", json_string("##"));
    refused(r, "word affixes");
    r = base_file();
    json_object_set_new(json_object_get(r, "pre_tokenizer"), "add_prefix_space", json_true());
    refused(r, "prefix space");
    r = base_file();
    json_object_set_new(r, "pre_tokenizer", json_pack("{s:s}", "type", "Metaspace"));
    refused(r, "\"Metaspace\"");
    refused(split_file("x", "Removed"), "behavior");
    refused(split_file("(", "Isolated"), "does not compile");
    r = base_file();
    json_object_set_new(json_object_get(r, "pre_tokenizer"), "use_regex", json_false());
    refused(r, "does not split the text");
    r = base_file();
    json_object_del(r, "pre_tokenizer");
    refused(r, "no pre-tokenizer");
    r = base_file();
    json_object_set_new(r, "decoder", json_pack("{s:s}", "type", "Metaspace"));
    refused(r, "decoder");
    r = base_file();
    json_object_set_new(json_object_get(json_object_get(r, "model"), "vocab"), "\xe2\x96\x81" "a", json_integer(260));
    refused(r, "byte alphabet");
    r = base_file();
    json_object_set_new(json_object_get(json_object_get(r, "model"), "vocab"), "zz", json_integer(256));
    refused(r, "the same id 256");
    r = base_file();
    json_object_del(json_object_get(json_object_get(r, "model"), "vocab"), "A");
    json_object_set_new(json_object_get(json_object_get(r, "model"), "vocab"), "zz", json_integer(255 - 'A'));
    refused(r, "byte 0x41 (\"A\") is not in the vocabulary");
    r = base_file();
    json_array_append_new(json_object_get(json_object_get(r, "model"), "merges"), json_string("b c"));
    refused(r, "merge 3 (\"b\" + \"c\")");
    r = base_file();
    json_array_append_new(json_object_get(json_object_get(r, "model"), "merges"), json_string("a b"));
    refused(r, "merge 3 repeats merge 0");
    r = base_file();
    json_array_append_new(json_object_get(json_object_get(r, "model"), "merges"), json_string("ab"));
    refused(r, "merge 3 is not");
    r = base_file();
    json_array_append_new(json_object_get(r, "added_tokens"), json_pack("{s:i, s:s}", "id", 256, "content", "<x>"));
    refused(r, "added token \"<x>\" has id 256");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ids_and_merges),
        cmocka_unit_test(test_template_and_ignore_merges),
        cmocka_unit_test(test_bos_without_template),
        cmocka_unit_test(test_real_file_layouts),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, io_scratch_setup, io_scratch_teardown);
}
