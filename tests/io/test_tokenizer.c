/*
 * test_tokenizer.c — the byte-level BPE tokenizer: training against a naive
 * reference trainer (same merges, same tie-breaking), compression, exact
 * round trips of arbitrary bytes, save/load, and corrupt files.
 */
#include "io_test.h"

#include <jansson.h>
#include <time.h>

#include "io/io_internal.h"

static uint32_t rnd(uint64_t seed, uint64_t i) {
    uint32_t r[4];
    loom_philox4x32(seed, i, r);
    return r[0];
}

/* Pseudo-English: words of 1-4 syllables, Zipf-like frequencies over
 * `n_words` distinct words, punctuation, numbers, newlines and indentation.
 * Returns a malloc'd string of exactly n bytes. */
static char *gen_words(uint64_t seed, size_t n, uint32_t n_words) {
    static const char *syl[] = {"the", "an", "ing", "er", "qu", "ick", "lo", "ra", "st", "on", "el",
                                "ma", "ti", "ve", "pro", "con", "ed", "ly", "x", "ou"};
    char *s = malloc(n + 96);
    size_t len = 0;
    for (uint64_t i = 0; len < n; i++) {
        uint32_t r = rnd(seed, i);
        uint32_t w = (uint32_t)((uint64_t)(r % n_words) * (r % n_words) / n_words); /* skewed to small w */
        int k = 1 + (int)(rnd(1234, w) % 4);
        for (int j = 0; j < k; j++) len += (size_t)snprintf(s + len, 8, "%s", syl[rnd(4321, (uint64_t)w * 8 + (uint64_t)j) % 20]);
        const char *sep = (r >> 20) % 13 == 0 ? ". " : (r >> 20) % 17 == 0 ? ",\n    " : " ";
        if ((r >> 24) % 29 == 0) len += (size_t)snprintf(s + len, 16, " %u", r % 1000);
        len += (size_t)snprintf(s + len, 16, "%s", sep);
    }
    s[n] = '\0';
    return s;
}

static char *gen_text(uint64_t seed, size_t n) { return gen_words(seed, n, 300); }

/* ------------------------------------------------------- naive reference */

/* Reference BPE trainer: recount all pairs every round, full scans. Writes
 * up to `target` merges; returns how many, and in *n_ids the length of the
 * text in tokens after the last merge. */
static int naive_train(const unsigned char *text, size_t len, int target, int32_t *merges, size_t *n_ids) {
    int V = 256 + target;
    int32_t **wids = NULL;
    int *wlen = NULL;
    int64_t *wfreq = NULL;
    int nw = 0;
    for (size_t pos = 0; pos < len;) {
        size_t n = bpe_chunk_len(text + pos, len - pos);
        int found = -1;
        for (int w = 0; w < nw && found < 0; w++) {
            if ((size_t)wlen[w] != n) continue;
            int same = 1;
            for (size_t i = 0; i < n && same; i++) same = wids[w][i] == text[pos + i];
            if (same) found = w;
        }
        if (found < 0) {
            wids = realloc(wids, (size_t)(nw + 1) * sizeof *wids);
            wlen = realloc(wlen, (size_t)(nw + 1) * sizeof *wlen);
            wfreq = realloc(wfreq, (size_t)(nw + 1) * sizeof *wfreq);
            wids[nw] = malloc(n * sizeof(int32_t));
            for (size_t i = 0; i < n; i++) wids[nw][i] = text[pos + i];
            wlen[nw] = (int)n;
            wfreq[nw] = 0;
            found = nw++;
        }
        wfreq[found]++;
        pos += n;
    }
    int64_t *count = malloc((size_t)V * (size_t)V * sizeof *count);
    int r = 0;
    for (; r < target; r++) {
        memset(count, 0, (size_t)V * (size_t)V * sizeof *count);
        for (int w = 0; w < nw; w++)
            for (int i = 0; i + 1 < wlen[w]; i++) count[(size_t)wids[w][i] * (size_t)V + (size_t)wids[w][i + 1]] += wfreq[w];
        int64_t best = 0;
        int ba = -1, bb = -1;
        for (int a = 0; a < V; a++)
            for (int b = 0; b < V; b++)
                if (count[(size_t)a * (size_t)V + (size_t)b] > best) { best = count[(size_t)a * (size_t)V + (size_t)b]; ba = a; bb = b; }
        if (best == 0) break;
        merges[2 * r] = ba;
        merges[2 * r + 1] = bb;
        for (int w = 0; w < nw; w++) {
            int m = 0;
            for (int i = 0; i < wlen[w];) {
                if (i + 1 < wlen[w] && wids[w][i] == ba && wids[w][i + 1] == bb) { wids[w][m++] = 256 + r; i += 2; }
                else wids[w][m++] = wids[w][i++];
            }
            wlen[w] = m;
        }
    }
    *n_ids = 0;
    for (int w = 0; w < nw; w++) *n_ids += (size_t)wlen[w] * (size_t)wfreq[w];
    for (int w = 0; w < nw; w++) free(wids[w]);
    free(wids); free(wlen); free(wfreq); free(count);
    return r;
}

/* The merges of a tokenizer, read back from its saved JSON. */
static int saved_merges(const loom_tokenizer *tok, const char *name, int32_t *merges, int cap) {
    const char *path = io_path(name);
    assert_int_equal(loom_tokenizer_save(tok, path), LOOM_OK);
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    assert_non_null(root);
    json_t *m = json_object_get(root, "merges");
    int n = (int)json_array_size(m);
    assert_true(n <= cap);
    for (int r = 0; r < n; r++) {
        merges[2 * r] = (int32_t)json_integer_value(json_array_get(json_array_get(m, (size_t)r), 0));
        merges[2 * r + 1] = (int32_t)json_integer_value(json_array_get(json_array_get(m, (size_t)r), 1));
    }
    json_decref(root);
    return n;
}

static size_t encode_count(loom_tokenizer *tok, const char *s, size_t n) {
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    size_t m;
    assert_int_equal(loom_tokenizer_encode(tok, s, n, ids, n, &m), LOOM_OK);
    free(ids);
    return m;
}

static void compare_with_naive(const char *text, size_t len, int target) {
    loom_tokenizer *tok;
    assert_int_equal(loom_tokenizer_train(&text, &len, 1, 257 + target, &tok), LOOM_OK);
    int32_t *want = malloc((size_t)target * 2 * sizeof *want), *got = malloc((size_t)target * 2 * sizeof *got);
    size_t n_ids;
    int nw = naive_train((const unsigned char *)text, len, target, want, &n_ids);
    int ng = saved_merges(tok, "cmp.json", got, target);
    assert_int_equal(ng, nw);
    assert_int_equal(loom_tokenizer_num_merges(tok), nw);
    assert_int_equal(loom_tokenizer_vocab_size(tok), 257 + nw);
    for (int r = 0; r < nw; r++) {
        if (got[2 * r] != want[2 * r] || got[2 * r + 1] != want[2 * r + 1])
            fail_msg("merge %d: got [%d, %d], reference [%d, %d]", r, got[2 * r], got[2 * r + 1], want[2 * r], want[2 * r + 1]);
    }
    /* Encoding by merge rank reproduces the trainer's final segmentation. */
    assert_int_equal(encode_count(tok, text, len), n_ids);
    free(want);
    free(got);
    loom_tokenizer_free(tok);
}

static void test_train_matches_reference(void **state) {
    (void)state;
    char *text = gen_text(1, 30000);
    compare_with_naive(text, 30000, 200);
    free(text);
    /* Random bytes: many ties, NULs, invalid UTF-8. */
    unsigned char bytes[3000];
    for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (unsigned char)(rnd(2, i) % 7 == 0 ? 'a' : rnd(3, i));
    compare_with_naive((const char *)bytes, sizeof bytes, 120);
    /* Runs of one byte exercise overlapping pairs (a, a). */
    char runs[2000];
    for (size_t i = 0; i < sizeof runs; i++) runs[i] = "aaaaab  aaa\n\n\n\tzzzzzzzzz"[rnd(4, i / 5) % 25];
    compare_with_naive(runs, sizeof runs, 60);
    /* A text with fewer pairs than asked for stops early. */
    compare_with_naive("ab ab ab", 8, 50);
}


static void test_compression(void **state) {
    (void)state;
    const size_t n = 200000;
    char *train = gen_text(10, n), *held = gen_text(11, n);
    /* Two pieces split at a chunk boundary of the whole text. */
    size_t cut = 0;
    while (cut < n / 2) cut += bpe_chunk_len((const unsigned char *)train + cut, n - cut);
    const char *texts[2] = {train, train + cut};
    size_t lens[2] = {cut, n - cut};
    loom_tokenizer *small, *large;
    clock_t c0 = clock();
    assert_int_equal(loom_tokenizer_train(texts, lens, 2, 300, &small), LOOM_OK);
    assert_int_equal(loom_tokenizer_train(texts, lens, 2, 1024, &large), LOOM_OK);
    fprintf(stderr, "trained twice on 200 kB in %.2f s\n", (double)(clock() - c0) / CLOCKS_PER_SEC);
    size_t m_small = encode_count(small, held, n), m_large = encode_count(large, held, n);
    fprintf(stderr, "held-out %zu bytes -> %zu ids (vocab 300), %zu ids (vocab 1024)\n", n, m_small, m_large);
    /* More merges compress unseen text from the same source further, and
     * the large vocabulary beats two bytes per id. */
    assert_true(m_small < n);
    assert_true(m_large < m_small);
    assert_true(m_large < n / 2);
    /* The same chunks in one piece train the same merges, byte for byte. */
    const char *one[1] = {train};
    size_t one_len[1] = {n};
    loom_tokenizer *again;
    assert_int_equal(loom_tokenizer_train(one, one_len, 1, 1024, &again), LOOM_OK);
    assert_int_equal(loom_tokenizer_save(large, io_path("large.json")), LOOM_OK);
    assert_int_equal(loom_tokenizer_save(again, io_path("again.json")), LOOM_OK);
    size_t la, lb;
    unsigned char *fa = io_read_raw(io_path("large.json"), &la), *fb = io_read_raw(io_path("again.json"), &lb);
    assert_int_equal(la, lb);
    assert_memory_equal(fa, fb, la);
    free(fa);
    free(fb);
    loom_tokenizer_free(again);
    loom_tokenizer_free(small);
    loom_tokenizer_free(large);
    free(train);
    free(held);
}

/* decode(encode(s)) == s, with ids in range and never the special token. */
static void check_round_trip(loom_tokenizer *tok, const unsigned char *s, size_t n) {
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    unsigned char *back = malloc(n + 1);
    size_t m, nb;
    assert_int_equal(loom_tokenizer_encode(tok, s, n, ids, n, &m), LOOM_OK);
    assert_true(m <= n);
    for (size_t i = 0; i < m; i++) {
        assert_true(ids[i] >= 0 && ids[i] < loom_tokenizer_vocab_size(tok));
        assert_true(ids[i] != loom_tokenizer_eot(tok));
    }
    assert_int_equal(loom_tokenizer_decode(tok, ids, m, NULL, 0, &nb), LOOM_OK);
    assert_int_equal(nb, n);
    assert_int_equal(loom_tokenizer_decode(tok, ids, m, back, n, &nb), LOOM_OK);
    assert_int_equal(nb, n);
    if (n) assert_memory_equal(back, s, n);
    free(ids);
    free(back);
}

static void test_round_trip_any_bytes(void **state) {
    (void)state;
    char *text = gen_text(20, 50000);
    size_t tl = 50000;
    loom_tokenizer *tok;
    assert_int_equal(loom_tokenizer_train((const char *const *)&text, &tl, 1, 800, &tok), LOOM_OK);
    check_round_trip(tok, (const unsigned char *)"", 0);
    check_round_trip(tok, (const unsigned char *)"a", 1);
    check_round_trip(tok, (const unsigned char *)"\0\0\0", 3);
    static const char invalid_utf8[] = "\xff\xfe\xc3(\xe2\x82 caf\xc3\xa9";
    check_round_trip(tok, (const unsigned char *)invalid_utf8, sizeof invalid_utf8 - 1);
    check_round_trip(tok, (const unsigned char *)text, tl);
    unsigned char buf[5000];
    for (int trial = 0; trial < 200; trial++) {
        size_t n = rnd(30, (uint64_t)trial) % sizeof buf;
        int mode = trial % 4;
        for (size_t i = 0; i < n; i++) {
            uint32_t r = rnd(31 + (uint64_t)trial, i);
            buf[i] = mode == 0 ? (unsigned char)r                         /* any byte */
                   : mode == 1 ? (unsigned char)" \n\tabc\0\x80"[r % 8]  /* small alphabet */
                   : mode == 2 ? (unsigned char)(i < n / 2 ? 'q' : ' ')  /* runs > 128 bytes */
                   : (unsigned char)text[r % tl];
        }
        check_round_trip(tok, buf, n);
    }
    /* The end-of-text token: the last id, decoded as its name, never encoded. */
    int eot = loom_tokenizer_eot(tok);
    assert_int_equal(eot, loom_tokenizer_vocab_size(tok) - 1);
    const char *b;
    size_t bl;
    assert_int_equal(loom_tokenizer_token_bytes(tok, eot, &b, &bl), LOOM_OK);
    assert_int_equal(bl, strlen(LOOM_TOKENIZER_EOT));
    assert_memory_equal(b, LOOM_TOKENIZER_EOT, bl);
    check_round_trip(tok, (const unsigned char *)LOOM_TOKENIZER_EOT, strlen(LOOM_TOKENIZER_EOT));
    /* Every token's bytes are its two parts' bytes (checked for all ids). */
    for (int id = 0; id < loom_tokenizer_vocab_size(tok) - 1; id++) {
        assert_int_equal(loom_tokenizer_token_bytes(tok, id, &b, &bl), LOOM_OK);
        int32_t ids[256];
        size_t m;
        assert_int_equal(loom_tokenizer_encode(tok, b, bl, ids, 256, &m), LOOM_OK);
        assert_true(m >= 1);
    }
    /* Argument errors. */
    int32_t ids[4];
    size_t m;
    assert_int_equal(loom_tokenizer_encode(tok, "hello world and more", 20, ids, 1, &m), LOOM_ERR_INVALID);
    assert_true(m > 1);
    IO_ASSERT_MSG("at least");
    int32_t bad[2] = {65, loom_tokenizer_vocab_size(tok)};
    char out[8];
    assert_int_equal(loom_tokenizer_decode(tok, bad, 2, out, 8, &m), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("id 1 is");
    bad[1] = eot;
    assert_int_equal(loom_tokenizer_decode(tok, bad, 2, out, 4, &m), LOOM_ERR_INVALID);
    assert_int_equal(m, 1 + strlen(LOOM_TOKENIZER_EOT));
    assert_int_equal(loom_tokenizer_token_bytes(tok, -1, &b, &bl), LOOM_ERR_INVALID);
    loom_tokenizer *t2;
    const char *one = "x";
    assert_int_equal(loom_tokenizer_train(&one, NULL, 1, 256, &t2), LOOM_ERR_INVALID);
    assert_null(t2);
    loom_tokenizer_free(tok);
    free(text);
}

static void test_save_load(void **state) {
    (void)state;
    char *text = gen_text(40, 60000);
    size_t tl = 60000;
    loom_tokenizer *tok, *back;
    assert_int_equal(loom_tokenizer_train((const char *const *)&text, &tl, 1, 700, &tok), LOOM_OK);
    const char *path = io_path("tok.json");
    assert_int_equal(loom_tokenizer_save(tok, path), LOOM_OK);
    assert_int_equal(loom_tokenizer_load(path, &back), LOOM_OK);
    assert_int_equal(loom_tokenizer_vocab_size(back), loom_tokenizer_vocab_size(tok));
    assert_int_equal(loom_tokenizer_eot(back), loom_tokenizer_eot(tok));
    char *held = gen_text(41, 20000);
    int32_t *a = malloc(20000 * sizeof *a), *b = malloc(20000 * sizeof *b);
    size_t na, nb;
    assert_int_equal(loom_tokenizer_encode(tok, held, 20000, a, 20000, &na), LOOM_OK);
    assert_int_equal(loom_tokenizer_encode(back, held, 20000, b, 20000, &nb), LOOM_OK);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
    /* Each merge's parts spell its token; no merge past the last. */
    for (int r = 0; r < loom_tokenizer_num_merges(back); r++) {
        int32_t x, y;
        const char *bx, *by, *bm;
        size_t lx, ly, lm;
        assert_int_equal(loom_tokenizer_merge(back, r, &x, &y), LOOM_OK);
        assert_true(x < 256 + r && y < 256 + r);
        assert_int_equal(loom_tokenizer_token_bytes(back, x, &bx, &lx), LOOM_OK);
        assert_int_equal(loom_tokenizer_token_bytes(back, y, &by, &ly), LOOM_OK);
        assert_int_equal(loom_tokenizer_token_bytes(back, 256 + r, &bm, &lm), LOOM_OK);
        assert_int_equal(lm, lx + ly);
        assert_memory_equal(bm, bx, lx);
        assert_memory_equal(bm + lx, by, ly);
    }
    int32_t x, y;
    assert_int_equal(loom_tokenizer_merge(back, loom_tokenizer_num_merges(back), &x, &y), LOOM_ERR_INVALID);
    assert_int_equal(loom_tokenizer_merge(back, -1, &x, &y), LOOM_ERR_INVALID);
    /* Saving the loaded tokenizer reproduces the file. */
    assert_int_equal(loom_tokenizer_save(back, io_path("tok2.json")), LOOM_OK);
    size_t l1, l2;
    unsigned char *f1 = io_read_raw(path, &l1), *f2 = io_read_raw(io_path("tok2.json"), &l2);
    assert_int_equal(l1, l2);
    assert_memory_equal(f1, f2, l1);
    /* Every truncation of the file is refused. */
    for (size_t cut = 0; cut < l1; cut += 1 + cut / 8) {
        io_write_raw(io_path("cut.json"), f1, cut);
        loom_tokenizer *t;
        assert_int_equal(loom_tokenizer_load(io_path("cut.json"), &t), LOOM_ERR_FORMAT);
        assert_null(t);
        IO_ASSERT_MSG("cut.json");
    }
    free(f1); free(f2); free(a); free(b); free(held); free(text);
    loom_tokenizer_free(back);
    loom_tokenizer_free(tok);
}

static void expect_bad_file(const char *json, const char *part) {
    const char *path = io_path("bad-tok.json");
    io_write_raw(path, json, strlen(json));
    loom_tokenizer *t = (loom_tokenizer *)0x1;
    assert_int_equal(loom_tokenizer_load(path, &t), LOOM_ERR_FORMAT);
    assert_null(t);
    IO_ASSERT_MSG(part);
    IO_ASSERT_MSG("bad-tok.json");
}

static void test_corrupt_files(void **state) {
    (void)state;
    /* The baseline loads, so each case below fails for its one defect. */
    const char *ok = "{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":258,\"merges\":[[97,98],[256,99]]}";
    io_write_raw(io_path("ok-tok.json"), ok, strlen(ok));
    loom_tokenizer *t;
    assert_int_equal(loom_tokenizer_load(io_path("ok-tok.json"), &t), LOOM_OK);
    assert_int_equal(loom_tokenizer_eot(t), -1);
    int32_t ids[8];
    size_t m;
    assert_int_equal(loom_tokenizer_encode(t, "abcab", 5, ids, 8, &m), LOOM_OK);
    assert_int_equal(m, 2);
    assert_int_equal(ids[0], 257);
    assert_int_equal(ids[1], 256);
    loom_tokenizer_free(t);

    expect_bad_file("{\"type\":\"loom-bpe\",", "does not parse");
    expect_bad_file("", "does not parse");
    expect_bad_file("[1,2]", "not a JSON object");
    expect_bad_file("{\"type\":\"gpt2\",\"version\":1,\"vocab_size\":256,\"merges\":[]}", "\"type\"");
    /* A Hugging Face tokenizer.json (no "type", a "model" object) goes to its own reader (test_tokenizer_hf.c). */
    expect_bad_file("{\"version\":\"1.0\",\"model\":{\"type\":\"Unigram\",\"vocab\":{},\"merges\":[]}}",
                    "(Hugging Face format): its model is \"Unigram\"");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":2,\"vocab_size\":256,\"merges\":[]}", "\"version\"");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"merges\":[]}", "\"vocab_size\"");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":256,\"merges\":{}}", "\"merges\"");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":258,\"merges\":[[97,98],[256,257]]}",
                    "merge 1 is [256, 257]");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":257,\"merges\":[[-1,98]]}", "merge 0");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":257,\"merges\":[[97]]}", "merge 0");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":257,\"merges\":[[97,\"b\"]]}", "merge 0");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":258,\"merges\":[[97,98],[97,98]]}",
                    "repeats");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":300,\"merges\":[[97,98]]}", "vocab_size");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":258,\"merges\":[[97,98]],"
                    "\"special\":{\"<|endoftext|>\":5}}", "id 257");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":258,\"merges\":[[97,98]],"
                    "\"special\":{\"<|pad|>\":257}}", "unknown special");
    expect_bad_file("{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":257,\"vocab_size\":257,\"merges\":[]}",
                    "duplicate");
    /* A chain of self-merges builds a token longer than any chunk. */
    char chain[512] = "{\"type\":\"loom-bpe\",\"version\":1,\"vocab_size\":264,\"merges\":[[97,97]";
    for (int r = 1; r < 8; r++) snprintf(chain + strlen(chain), 64, ",[%d,%d]", 255 + r, 255 + r);
    strcat(chain, "]}");
    expect_bad_file(chain, "longer than any chunk");
    assert_int_equal(loom_tokenizer_load(io_path("absent.json"), &t), LOOM_ERR_IO);
    IO_ASSERT_MSG("absent.json");
}

/* The trainer must scale: 4096 tokens from 5 MB of text with many
 * distinct words, well under a minute (about a second normally). */
static void test_train_speed(void **state) {
    (void)state;
    const size_t n = 5u << 20;
    char *text = gen_words(50, n, 200000);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    loom_tokenizer *tok;
    assert_int_equal(loom_tokenizer_train((const char *const *)&text, &n, 1, 4096, &tok), LOOM_OK);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    size_t m = encode_count(tok, text, n);
    fprintf(stderr, "trained 4096 tokens on 5 MB in %.2f s; %.2f bytes per id\n", secs, (double)n / (double)m);
    assert_int_equal(loom_tokenizer_vocab_size(tok), 4096);
    assert_true(secs < 30.0);
    loom_tokenizer_free(tok);
    free(text);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_train_matches_reference),
        cmocka_unit_test(test_compression),
        cmocka_unit_test(test_round_trip_any_bytes),
        cmocka_unit_test(test_save_load),
        cmocka_unit_test(test_corrupt_files),
        cmocka_unit_test(test_train_speed),
    };
    return cmocka_run_group_tests(tests, io_scratch_setup, io_scratch_teardown);
}
