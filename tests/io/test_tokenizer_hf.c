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

#include "io/io_internal.h"

#include <jansson.h>
#include <utf8proc.h>

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
    int32_t more[8]; /* without a normalizer a continuation encodes as any text */
    assert_int_equal(loom_tokenizer_encode_more(t, "abc abdaaa", 10, more, 8, &m), LOOM_OK);
    assert_int_equal(m, 6);
    assert_memory_equal(more, want, sizeof want);
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
    /* a token by its text: a special token's name, merged bytes, nothing */
    assert_int_equal(loom_tokenizer_find(t, "<|endoftext|>", 13), 259);
    assert_int_equal(loom_tokenizer_find(t, "abc", 3), 257);
    assert_int_equal(loom_tokenizer_find(t, "zzz", 3), -1);
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
    assert_false(loom_tokenizer_is_special(t, 263)); /* not special: text makes it, as in Hugging Face */
    int32_t ids[16];
    size_t k = enc(t, "b<pad>a", 7, ids);
    assert_int_equal(k, 3);
    assert_int_equal(ids[1], 263);
    /* "abca" is whole in the vocabulary: one id; "abcab" is not: merges */
    size_t m = enc(t, "abca abcab", 10, ids);
    int32_t want[] = {260, 255 - ' ', 257, 256};
    assert_int_equal(m, 4);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want[i]);
    loom_tokenizer_free(t);
}

/* Without a template, the token <|begin_of_text|> begins a text (Llama 3's
 * first tokenizer.json has no template); another name does not; nor does
 * it when a template puts nothing first, or names an id out of range. */
static void test_bos_without_template(void **state) {
    (void)state;
    json_t *templates[] = {json_pack("{s:s, s:[{s:{s:s}}, {s:{s:s}}]}", "type", "TemplateProcessing", "single",
                                     "Sequence", "id", "A", "SpecialToken", "id", "<|endoftext|>"),
                           json_pack("{s:s, s:[{s:{s:s}}, {s:{s:s}}], s:{s:{s:[I]}}}", "type", "TemplateProcessing",
                                     "single", "SpecialToken", "id", "<q>", "Sequence", "id", "A", "special_tokens",
                                     "<q>", "ids", (json_int_t)4294967361)};
    for (int k = 0; k < 2; k++) {
        json_t *root = base_file();
        json_array_append_new(json_object_get(root, "added_tokens"),
                              json_pack("{s:i, s:s, s:b}", "id", 260, "content", "<|begin_of_text|>", "special", 1));
        json_object_set_new(root, "post_processor", templates[k]);
        loom_tokenizer *t;
        assert_int_equal(load_json(root, &t), LOOM_OK);
        assert_int_equal(loom_tokenizer_bos(t), 259); /* the end-of-text token, as GPT-2 */
        loom_tokenizer_free(t);
    }
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
    /* Gemma's names: <bos>, <eos> */
    json_t *root = base_file();
    json_object_set_new(json_array_get(json_object_get(root, "added_tokens"), 0), "content", json_string("<eos>"));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b}", "id", 260, "content", "<bos>", "special", 1));
    loom_tokenizer *g;
    assert_int_equal(load_json(root, &g), LOOM_OK);
    assert_int_equal(loom_tokenizer_bos(g), 260);
    assert_int_equal(loom_tokenizer_eot(g), 259);
    loom_tokenizer_free(g);
}

/* Hugging Face's order of merges, which differs from GPT-2's (every
 * occurrence of the best pair at once) when a merge list ranks a pair of a
 * merged token before the merge that makes it: "abab" with "ab a" ranked
 * before "a b" is "aba" "b" (one "a b", then "ab a"), not "ab" "ab". */
static void test_merge_order(void **state) {
    (void)state;
    json_t *root = base_file();
    json_t *model = json_object_get(root, "model");
    json_object_set_new(json_object_get(model, "vocab"), "aba", json_integer(260));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b}", "id", 261, "content", "<x>", "special", 1));
    json_object_set_new(model, "merges", json_pack("[s, s]", "ab a", "a b"));
    loom_tokenizer *t;
    assert_int_equal(load_json(root, &t), LOOM_OK);
    int32_t ids[8];
    size_t m = enc(t, "abab", 4, ids);
    assert_int_equal(m, 2);
    assert_int_equal(ids[0], 260);
    assert_int_equal(ids[1], 255 - 'b');
    loom_tokenizer_free(t);
}

/* SentencePiece-style (Llama 2's layout): <0xXX> byte tokens, "\xe2\x96\x81"
 * (U+2581) for spaces, a normalizer that prepends it and replaces spaces by
 * it, no pre-tokenizer. <unk> 0, <s> 1, </s> 2, <0x00>.. 3.., then
 * "\xe2\x96\x81" 259, "a" 260, "b" 261, "\xe2\x96\x81a" 262, "ab" 263,
 * "\xe2\x96\x81ab" 264, "\xc3\xa9" 265. */
#define SP_ "\xe2\x96\x81"
static json_t *sp_file(void) {
    json_t *vocab = json_pack("{s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i}", "<unk>", 0, "<s>", 1, "</s>", 2,
                              SP_, 259, "a", 260, "b", 261, SP_ "a", 262, "ab", 263, SP_ "ab", 264, "\xc3\xa9", 265);
    for (int b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        json_object_set_new(vocab, s, json_integer(3 + b));
    }
    json_t *root = json_pack("{s:[{s:s, s:s}, {s:s, s:{s:s}, s:s}], s:n, s:[{s:i, s:s, s:b}, {s:i, s:s, s:b}, "
                             "{s:i, s:s, s:b}]}",
                             "normalizer", "type", "Prepend", "prepend", SP_, "type", "Replace", "pattern", "String",
                             " ", "content", SP_, "pre_tokenizer", "added_tokens", "id", 0, "content", "<unk>",
                             "special", 1, "id", 1, "content", "<s>", "special", 1, "id", 2, "content", "</s>",
                             "special", 1);
    json_t *norm = json_object_get(root, "normalizer");
    json_object_set_new(root, "normalizer", json_pack("{s:s, s:O}", "type", "Sequence", "normalizers", norm));
    json_object_set_new(root, "model",
                        json_pack("{s:s, s:o, s:[s, s, s], s:b, s:s, s:b}", "type", "BPE", "vocab", vocab, "merges",
                                  SP_ " a", "a b", SP_ "a b", "byte_fallback", 1, "unk_token", "<unk>", "fuse_unk", 1));
    return root;
}

static void test_sentencepiece_style(void **state) {
    (void)state;
    loom_tokenizer *t;
    assert_int_equal(load_json(sp_file(), &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_vocab_size(t), 266);
    assert_int_equal(loom_tokenizer_bos(t), 1); /* <s> */
    assert_int_equal(loom_tokenizer_eot(t), 2); /* </s> */
    /* "ab ab\xc3\xa9" "b" -> "\u2581ab\u2581ab\u00e9b": two "\u2581ab", "\u00e9" as a token, "b" */
    int32_t ids[32];
    size_t m = 0;
    assert_true(loom_tokenizer_max_ids(t, 8) >= 8 + 3);
    assert_int_equal(loom_tokenizer_encode(t, "ab ab\xc3\xa9" "b", 8, ids, 32, &m), LOOM_OK);
    int32_t want[] = {264, 264, 265, 261};
    assert_int_equal(m, 4);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want[i]);
    /* characters without a token fall back to their bytes' tokens, bytes that are not UTF-8 too */
    assert_int_equal(loom_tokenizer_encode(t, "z\xe6\x97\xa5\xff", 5, ids, 32, &m), LOOM_OK);
    int32_t want2[] = {259, 3 + 'z', 3 + 0xe6, 3 + 0x97, 3 + 0xa5, 3 + 0xff};
    assert_int_equal(m, 6);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want2[i]);
    /* decode: U+2581 is a space, <0xXX> its byte */
    char out[32];
    assert_int_equal(loom_tokenizer_decode(t, ids, m, out, sizeof out, &m), LOOM_OK);
    assert_int_equal(m, 6);
    assert_memory_equal(out, " z\xe6\x97\xa5\xff", 6);
    /* a continuation (a completion after its prompt) gets no prefix; the start of a text does */
    assert_int_equal(loom_tokenizer_encode_more(t, "ab ab", 5, ids, 32, &m), LOOM_OK);
    assert_int_equal(m, 2);
    assert_int_equal(ids[0], 263);
    assert_int_equal(ids[1], 264);
    /* an empty text is no ids (nothing to prepend to) */
    assert_int_equal(loom_tokenizer_encode(t, "", 0, ids, 32, &m), LOOM_OK);
    assert_int_equal(m, 0);
    loom_tokenizer_free(t);

    /* without some byte tokens, a character none stands for is <unk>, consecutive ones one */
    json_t *root = sp_file();
    json_t *vocab = json_object_get(json_object_get(root, "model"), "vocab");
    json_object_del(vocab, "<0xE6>");
    json_object_set_new(vocab, "zz", json_integer(3 + 0xe6));
    assert_int_equal(load_json(root, &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_encode(t, "\xe6\x97\xa5\xe6\x97\xa5" "a", 7, ids, 32, &m), LOOM_OK);
    int32_t want3[] = {259, 0, 260};
    assert_int_equal(m, 3);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want3[i]);
    /* an unknown character waits for the next one the vocabulary holds: bytes given for "\u00fc" go first */
    assert_int_equal(loom_tokenizer_encode(t, "\xe6\x97\xa5\xc3\xbc" "a", 6, ids, 32, &m), LOOM_OK);
    int32_t want4[] = {259, 3 + 0xc3, 3 + 0xbc, 0, 260};
    assert_int_equal(m, 5);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], want4[i]);
    loom_tokenizer_free(t);
}

/* One defect each; the message names it. */
static void refused(json_t *root, const char *part) {
    loom_tokenizer *t = (loom_tokenizer *)0x1;
    assert_int_equal(load_json(root, &t), LOOM_ERR_FORMAT);
    assert_null(t);
    IO_ASSERT_MSG(part);
    IO_ASSERT_MSG("hf-tok.json");
}

/* The Metaspace layout (transformers' legacy=False conversions): no
 * normalizer, a pre-tokenizer that makes spaces U+2581, puts one first
 * unless the text starts with it (scheme "first": the text's first piece
 * only; "never"), and with split starts a piece at each. */
static json_t *meta_file(const char *scheme, int split) {
    json_t *root = sp_file();
    json_object_set_new(root, "normalizer", json_null());
    json_object_set_new(root, "pre_tokenizer", json_pack("{s:s, s:s, s:s, s:b}", "type", "Metaspace", "replacement", SP_,
                                                         "prepend_scheme", scheme, "split", split));
    return root;
}

static void test_metaspace(void **state) {
    (void)state;
    json_t *root = meta_file("first", 0);
    loom_tokenizer *t;
    assert_int_equal(load_json(root, &t), LOOM_OK);
    int32_t ids[32];
    size_t m = 0;
    assert_int_equal(loom_tokenizer_encode(t, "ab ab", 5, ids, 32, &m), LOOM_OK);
    assert_int_equal(m, 2);
    assert_true(ids[0] == 264 && ids[1] == 264);
    assert_int_equal(loom_tokenizer_encode(t, " ab", 3, ids, 32, &m), LOOM_OK); /* starts with one: none added */
    assert_int_equal(m, 1);
    assert_int_equal(ids[0], 264);
    assert_int_equal(loom_tokenizer_encode_more(t, "ab ab", 5, ids, 32, &m), LOOM_OK); /* not the text's start */
    assert_int_equal(m, 2);
    assert_true(ids[0] == 263 && ids[1] == 264);
    assert_true(loom_tokenizer_max_ids(t, 5) >= 2);
    loom_tokenizer_free(t);

    /* split: a merge across a U+2581 ("b\u2581", ranked first) is not made */
    for (int split = 0; split < 2; split++) {
        root = meta_file("always", split);
        json_t *model = json_object_get(root, "model");
        json_object_set_new(json_object_get(model, "vocab"), "b" SP_, json_integer(266));
        json_array_insert_new(json_object_get(model, "merges"), 0, json_string("b " SP_));
        assert_int_equal(load_json(root, &t), LOOM_OK);
        assert_int_equal(loom_tokenizer_encode(t, "ab ab", 5, ids, 32, &m), LOOM_OK);
        if (split) { /* "\u2581ab" "\u2581ab" */
            assert_int_equal(m, 2);
            assert_true(ids[0] == 264 && ids[1] == 264);
        } else { /* "b\u2581" first: "\u2581a" "b\u2581" "ab" */
            assert_int_equal(m, 3);
            assert_true(ids[0] == 262 && ids[1] == 266 && ids[2] == 263);
        }
        loom_tokenizer_free(t);
    }

    root = meta_file("never", 0); /* nothing put first */
    assert_int_equal(load_json(root, &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_encode(t, "ab", 2, ids, 32, &m), LOOM_OK);
    assert_int_equal(m, 1);
    assert_int_equal(ids[0], 263);
    loom_tokenizer_free(t);

    refused(meta_file("sometimes", 0), "Metaspace pre-tokenizer is not one loom reads");
}

/* Added tokens that are not special, as Hugging Face finds them: those not
 * normalized in the raw text first, then the normalized ones in each piece
 * of normalized text, as their normalized content (Llama 2's normalizer
 * makes "<t>" "\u2581<t>"). */
static void test_added_tokens_in_text(void **state) {
    (void)state;
    /* byte-level: "bc" (raw) before "ab" (normalized) in "abc" */
    json_t *root = base_file();
    json_object_set_new(json_object_get(json_object_get(root, "model"), "vocab"), "bc", json_integer(260));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b, s:b}", "id", 256, "content", "ab", "special", 0, "normalized", 1));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b, s:b}", "id", 260, "content", "bc", "special", 0, "normalized", 0));
    loom_tokenizer *t;
    assert_int_equal(load_json(root, &t), LOOM_OK);
    int32_t ids[32];
    size_t m = enc(t, "abc", 3, ids);
    assert_int_equal(m, 2);
    assert_int_equal(ids[0], 255 - 'a');
    assert_int_equal(ids[1], 260);
    loom_tokenizer_free(t);
    /* SentencePiece-style: "<t>" normalized is matched as "\u2581<t>" */
    root = sp_file();
    json_object_set_new(json_object_get(json_object_get(root, "model"), "vocab"), "<t>", json_integer(266));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b, s:b}", "id", 266, "content", "<t>", "special", 0, "normalized", 1));
    assert_int_equal(load_json(root, &t), LOOM_OK);
    m = 0;
    assert_int_equal(loom_tokenizer_encode(t, "<t>", 3, ids, 32, &m), LOOM_OK);
    assert_int_equal(m, 1);
    assert_int_equal(ids[0], 266);
    assert_int_equal(loom_tokenizer_encode(t, " <t>", 4, ids, 32, &m), LOOM_OK); /* "\u2581\u2581<t>" */
    assert_int_equal(m, 2);
    assert_int_equal(ids[0], 259);
    assert_int_equal(ids[1], 266);
    assert_int_equal(loom_tokenizer_encode(t, "a<t>", 4, ids, 32, &m), LOOM_OK); /* no "\u2581<t>" in "\u2581a<t>" */
    int32_t want[] = {262, 3 + '<', 3 + 't', 3 + '>'};
    assert_int_equal(m, 4);
    assert_memory_equal(ids, want, sizeof want);
    loom_tokenizer_free(t);
}

/* The normalizer's edges: Prepend does nothing to nothing; what a
 * Prepend a later Replace grows to is within loom_tokenizer_max_ids, for
 * every piece between added tokens. */
static void test_normalizer_edges(void **state) {
    (void)state;
    json_t *root = sp_file();
    json_object_set_new(root, "normalizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s, s:s}]}", "type", "Sequence", "normalizers",
                                  "type", "Replace", "pattern", "String", " ", "content", "", "type", "Prepend",
                                  "prepend", SP_));
    loom_tokenizer *t;
    assert_int_equal(load_json(root, &t), LOOM_OK);
    int32_t ids[128];
    size_t m = 9;
    assert_int_equal(loom_tokenizer_encode(t, " ", 1, ids, 128, &m), LOOM_OK);
    assert_int_equal(m, 0);
    loom_tokenizer_free(t);

    root = sp_file();
    json_object_set_new(root, "normalizer",
                        json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:{s:s}, s:s}]}", "type", "Sequence", "normalizers",
                                  "type", "Prepend", "prepend", "xx", "type", "Replace", "pattern", "String", "x",
                                  "content", "yyyy"));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:i, s:s, s:b, s:b}", "id", 266, "content", "T", "special", 0, "normalized", 0));
    assert_int_equal(load_json(root, &t), LOOM_OK);
    size_t max = loom_tokenizer_max_ids(t, 7); /* (7 + 2) 4, and (0 + 2) 4 for each of 7 more pieces */
    assert_int_equal(max, 92);
    assert_int_equal(loom_tokenizer_encode(t, "xTxTxTx", 7, ids, max, &m), LOOM_OK); /* 4 x (8 + 4) y + 3 T */
    assert_int_equal(m, 51);
    loom_tokenizer_free(t);
}

/* Both texts' ids, which must be equal (t encodes a, u encodes b). */
static void same_ids(loom_tokenizer *t, const char *a, loom_tokenizer *u, const char *b) {
    int32_t x[256], y[256];
    size_t n = 0, m = 0;
    assert_int_equal(loom_tokenizer_encode(t, a, strlen(a), x, 256, &n), LOOM_OK);
    assert_int_equal(loom_tokenizer_encode(u, b, strlen(b), y, 256, &m), LOOM_OK);
    assert_int_equal(n, m);
    assert_memory_equal(x, y, n * sizeof *x);
}

/* The base file (or sp_file) with a normalizer of these steps. */
static json_t *with_norm(json_t *root, json_t *steps) {
    json_object_set_new(root, "normalizer", json_pack("{s:s, s:o}", "type", "Sequence", "normalizers", steps));
    return root;
}

/* Unicode's normal forms as normalizer steps (Qwen 2's NFC): the text is
 * normalized before it is split, so it encodes as its normal form does;
 * bytes that are not UTF-8 stay; normalized added tokens are found in the
 * normal form, by their content's normal form; the order of steps counts;
 * loom_tokenizer_max_ids holds what a form grows text to. */
static void test_unicode_forms(void **state) {
    (void)state;
    loom_tokenizer *plain, *nfc, *nfd, *nfkc, *nfkd;
    assert_int_equal(load_json(base_file(), &plain), LOOM_OK);
    json_t *r = base_file();
    json_object_set_new(r, "normalizer", json_pack("{s:s}", "type", "NFC"));
    assert_int_equal(load_json(r, &nfc), LOOM_OK);
    assert_int_equal(load_json(with_norm(base_file(), json_pack("[{s:s}]", "type", "NFD")), &nfd), LOOM_OK);
    assert_int_equal(load_json(with_norm(base_file(), json_pack("[{s:s}]", "type", "NFKC")), &nfkc), LOOM_OK);
    assert_int_equal(load_json(with_norm(base_file(), json_pack("[{s:s}]", "type", "NFKD")), &nfkd), LOOM_OK);
    /* e + U+0301, the Angstrom sign, Hangul jamo, q + U+0307 U+0323 (reordered), U+FB01 (fi), U+00B2 */
    const char *text = "cafe\xcc\x81 \xe2\x84\xab \xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 q\xcc\x87\xcc\xa3 \xef\xac\x81 x\xc2\xb2";
    same_ids(nfc, text, plain, "caf\xc3\xa9 \xc3\x85 \xea\xb0\x81 q\xcc\xa3\xcc\x87 \xef\xac\x81 x\xc2\xb2");
    same_ids(nfd, text, plain, "cafe\xcc\x81 A\xcc\x8a \xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 q\xcc\xa3\xcc\x87 \xef\xac\x81 x\xc2\xb2");
    same_ids(nfkc, text, plain, "caf\xc3\xa9 \xc3\x85 \xea\xb0\x81 q\xcc\xa3\xcc\x87 fi x2");
    same_ids(nfkd, text, plain, "cafe\xcc\x81 A\xcc\x8a \xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 q\xcc\xa3\xcc\x87 fi x2");
    /* bytes that are not UTF-8 are kept, and cut the text as ASCII does */
    same_ids(nfc, "\xff" "e\xcc\x81\xc3" "e\xcc\x81\xed\xa0\x80", plain, "\xff\xc3\xa9\xc3\xc3\xa9\xed\xa0\x80");
    same_ids(nfc, "", plain, "");
    /* a normalized added token's content is normalized, and found in normalized text; a raw one is not */
    loom_tokenizer_free(nfc);
    r = base_file();
    json_object_set_new(r, "normalizer", json_pack("{s:s}", "type", "NFC"));
    json_object_set_new(json_object_get(json_object_get(r, "model"), "vocab"), "e\xcc\x81<x>", json_integer(260));
    json_object_set_new(json_object_get(json_object_get(r, "model"), "vocab"), "e\xcc\x81<y>", json_integer(261));
    json_array_append_new(json_object_get(r, "added_tokens"), json_pack("{s:i, s:s, s:b, s:b}", "id", 260, "content",
                                                                         "e\xcc\x81<x>", "special", 0, "normalized", 1));
    json_array_append_new(json_object_get(r, "added_tokens"), json_pack("{s:i, s:s, s:b, s:b}", "id", 261, "content",
                                                                         "e\xcc\x81<y>", "special", 0, "normalized", 0));
    assert_int_equal(load_json(r, &nfc), LOOM_OK);
    int32_t ids[64];
    size_t m = 0;
    assert_int_equal(loom_tokenizer_encode(nfc, "\xc3\xa9<x>e\xcc\x81<x>", 11, ids, 64, &m), LOOM_OK);
    assert_int_equal(m, 2);
    assert_int_equal(ids[0], 260);
    assert_int_equal(ids[1], 260);
    assert_int_equal(loom_tokenizer_encode(nfc, "e\xcc\x81<y>\xc3\xa9<y>", 11, ids, 64, &m), LOOM_OK);
    assert_int_equal(ids[0], 261); /* the raw one as written only */
    assert_true(m > 2);
    /* U+FDFA grows elevenfold (3 bytes to 33) under NFKC, within max_ids */
    size_t max = loom_tokenizer_max_ids(nfkc, 3);
    assert_true(max >= 33);
    assert_int_equal(loom_tokenizer_encode(nfkc, "\xef\xb7\xba", 3, ids, max, &m), LOOM_OK);
    assert_int_equal(m, 33);
    loom_tokenizer_free(plain);
    loom_tokenizer_free(nfc);
    loom_tokenizer_free(nfd);
    loom_tokenizer_free(nfkc);
    loom_tokenizer_free(nfkd);

    /* SentencePiece-style: NFKC before the Replace makes U+00A0 a space and so "\u2581"; after it, a space */
    loom_tokenizer *before, *after;
    json_t *steps = json_pack("[{s:s}, {s:s, s:s}, {s:s, s:{s:s}, s:s}]", "type", "NFKC", "type", "Prepend", "prepend",
                              SP_, "type", "Replace", "pattern", "String", " ", "content", SP_);
    assert_int_equal(load_json(with_norm(sp_file(), steps), &before), LOOM_OK);
    steps = json_pack("[{s:s, s:s}, {s:s, s:{s:s}, s:s}, {s:s}]", "type", "Prepend", "prepend", SP_, "type", "Replace",
                      "pattern", "String", " ", "content", SP_, "type", "NFKC");
    assert_int_equal(load_json(with_norm(sp_file(), steps), &after), LOOM_OK);
    assert_int_equal(load_json(sp_file(), &plain), LOOM_OK);
    same_ids(before, "ab\xc2\xa0" "ab", plain, "ab ab");
    int32_t x[16], y[16];
    size_t n = 0;
    assert_int_equal(loom_tokenizer_encode(after, "ab\xc2\xa0" "ab", 6, x, 16, &n), LOOM_OK);
    assert_int_equal(loom_tokenizer_encode(plain, "ab ab", 5, y, 16, &m), LOOM_OK);
    assert_true(n != m || memcmp(x, y, n * sizeof *x)); /* " " is no token of its own here: bytes */
    assert_int_equal(x[0], 264);
    assert_int_equal(x[1], 3 + ' ');
    loom_tokenizer_free(before);
    loom_tokenizer_free(after);
    loom_tokenizer_free(plain);
}

/* BPE_FORM_GROWTH bounds every code point's normal forms (a string's is at
 * most the sum of its characters' decompositions), and is reached. */
static void test_unicode_form_growth(void **state) {
    (void)state;
    enum bpe_form forms[] = {BPE_NFC, BPE_NFD, BPE_NFKC, BPE_NFKD};
    for (int f = 0; f < 4; f++) {
        size_t worst_num = 0, worst_den = 1;
        for (utf8proc_int32_t cp = 0x80; cp <= 0x10FFFF; cp++) {
            if (cp >= 0xD800 && cp <= 0xDFFF) continue;
            unsigned char in[4];
            size_t n = (size_t)utf8proc_encode_char(cp, in), m = 0;
            /* the decomposed form bounds the composed one */
            unsigned char *out = bpe_unicode_form(in, n, forms[f] == BPE_NFC ? BPE_NFD : forms[f] == BPE_NFKC
                                                  ? BPE_NFKD : forms[f], &m);
            assert_non_null(out);
            free(out);
            assert_true(m <= BPE_FORM_GROWTH(forms[f]) * n);
            if (m * worst_den > worst_num * n) { worst_num = m; worst_den = n; }
        }
        assert_int_equal(worst_num, BPE_FORM_GROWTH(forms[f]) * worst_den);
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
    /* a normalizer Sequence with a step loom does not apply is refused */
    root = base_file();
    json_object_set_new(root, "normalizer", json_pack("{s:s, s:[{s:s}, {s:s}]}", "type", "Sequence", "normalizers",
                                                      "type", "NFC", "type", "Lowercase"));
    refused(root, "normalizer step \"Lowercase\"");
}

static void test_refusals(void **state) {
    (void)state;
    /* a NUL in a key (InternLM2's token "\u0000"): jansson cannot, and the message says so */
    const char *nul = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"\\u0000\": 0}, \"merges\": []}}";
    io_write_raw(io_path("nul.json"), nul, strlen(nul));
    loom_tokenizer *none = NULL;
    assert_int_equal(loom_tokenizer_load(io_path("nul.json"), &none), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("NUL character in an object key");
    json_t *r;
    r = base_file(); /* a byte-level file's normalizer has normal forms only */
    json_object_set_new(r, "normalizer", json_pack("{s:s, s:s}", "type", "Prepend", "prepend", "x"));
    refused(r, "normalizer step \"Prepend\" is not one loom applies (NFC, NFD, NFKC, NFKD; at most 8 steps)");
    r = base_file();
    json_object_set_new(r, "normalizer", json_pack("{s:s}", "type", "Sequence"));
    refused(r, "Sequence without \"normalizers\"");
    refused(with_norm(sp_file(), json_pack("[{s:s}, {s:s}, {s:s}, {s:s}, {s:s}, {s:s}, {s:s}, {s:s}, {s:s}]", "type",
                                           "NFC", "type", "NFC", "type", "NFC", "type", "NFC", "type", "NFC", "type",
                                           "NFC", "type", "NFC", "type", "NFC", "type", "NFD")),
            "normalizer step \"NFD\" is not one loom applies (NFC, NFD, NFKC, NFKD, Prepend, Replace");
    r = sp_file();
    json_object_set_new(r, "pre_tokenizer", json_pack("{s:s}", "type", "WhitespaceSplit"));
    refused(r, "SentencePiece-style BPE with a pre-tokenizer (\"WhitespaceSplit\")");
    r = sp_file(); /* a split on what the normalizer no longer leaves is read (Gemma's); on anything else not */
    json_object_set_new(r, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Split", "pattern", "String", " ",
                                                      "behavior", "MergedWithPrevious"));
    loom_tokenizer *t;
    assert_int_equal(load_json(r, &t), LOOM_OK);
    loom_tokenizer_free(t);
    r = sp_file();
    json_object_set_new(r, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Split", "pattern", "String", "a",
                                                      "behavior", "MergedWithPrevious"));
    refused(r, "SentencePiece-style BPE with a pre-tokenizer (\"Split\")");
    r = sp_file();
    json_object_set_new(r, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern", "String",
                                                      " ", "behavior", "Removed", "invert", 1));
    refused(r, "SentencePiece-style BPE with a pre-tokenizer (\"Split\")");
    r = sp_file();
    json_object_set_new(r, "normalizer", json_pack("{s:s}", "type", "Lowercase"));
    refused(r, "normalizer step \"Lowercase\"");
    /* Gemma's split is a no-op only if no later normal form can make the character again */
    r = with_norm(sp_file(), json_pack("[{s:s, s:{s:s}, s:s}, {s:s}]", "type", "Replace", "pattern", "String", " ",
                                       "content", SP_, "type", "NFKC"));
    json_object_set_new(r, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Split", "pattern", "String", " ",
                                                      "behavior", "MergedWithPrevious"));
    refused(r, "SentencePiece-style BPE with a pre-tokenizer (\"Split\")");
    r = sp_file();
    json_object_set_new(json_object_get(r, "model"), "unk_token", json_null());
    json_object_del(json_object_get(json_object_get(r, "model"), "vocab"), "<0x41>");
    json_object_set_new(json_object_get(json_object_get(r, "model"), "vocab"), "zz", json_integer(3 + 0x41));
    refused(r, "byte 0x41 (\"<0x41>\") is not in the vocabulary: a BPE with byte fallback and no unk_token");
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
    r = base_file(); /* text must never make a special token, not even through a merge */
    json_array_append_new(json_object_get(r, "added_tokens"),
                          json_pack("{s:i, s:s, s:b}", "id", 258, "content", "aa", "special", 1));
    refused(r, "merge 2 makes the special token \"aa\"");
    r = base_file();
    json_array_append_new(json_object_get(r, "added_tokens"),
                          json_pack("{s:i, s:s, s:b, s:b}", "id", 260, "content", "<t>", "special", 0, "lstrip", 1));
    refused(r, "strips spaces");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ids_and_merges),
        cmocka_unit_test(test_template_and_ignore_merges),
        cmocka_unit_test(test_bos_without_template),
        cmocka_unit_test(test_real_file_layouts),
        cmocka_unit_test(test_merge_order),
        cmocka_unit_test(test_sentencepiece_style),
        cmocka_unit_test(test_added_tokens_in_text),
        cmocka_unit_test(test_metaspace),
        cmocka_unit_test(test_normalizer_edges),
        cmocka_unit_test(test_unicode_forms),
        cmocka_unit_test(test_unicode_form_growth),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, io_scratch_setup, io_scratch_teardown);
}
