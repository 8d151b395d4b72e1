/*
 * fuzz_tokenizer.c — loom_tokenizer_load on any bytes: a tokenizer it
 * accepts must encode text within loom_tokenizer_max_ids, decode what it
 * encoded (back to that text, unless a normalizer changed it), and give every token's bytes without a fault.
 */
#include "fuzz_util.h"
#include "io/io_internal.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_set_threads(1);
    fuzz_write("tok", data, size);
    loom_tokenizer *tok;
    if (loom_tokenizer_load(fuzz_path("tok"), &tok) != LOOM_OK) return 0;
    static const char text[] = "The quick brown fox, 12 times: \xc3\xa9te\xcc\x81 \xef\xb7\xba!\n\tend";
    size_t max = loom_tokenizer_max_ids(tok, sizeof text - 1), n = 0;
    int32_t *ids = max < (1u << 24) ? malloc((max + 1) * sizeof *ids) : NULL;
    loom_status st = ids ? loom_tokenizer_encode(tok, text, sizeof text - 1, ids, max, &n) : LOOM_ERR_NOMEM;
    if (st == LOOM_OK) {
        size_t len = 0;
        if (n > max || loom_tokenizer_decode(tok, ids, n, NULL, 0, &len) != LOOM_OK) abort(); /* every id decodes */
        char *back = malloc(len + 1);
        if (back && loom_tokenizer_decode(tok, ids, n, back, len, &len) != LOOM_OK) abort();
        if (back && !tok->sp && !tok->n_norm && (len != sizeof text - 1 || memcmp(back, text, len) != 0))
            abort(); /* byte-level BPE round-trips every text (unless a normalizer changed it first) */
        free(back);
    } else if (st != LOOM_ERR_NOMEM) {
        abort(); /* a tokenizer that loaded encodes any text within max_ids */
    }
    free(ids);
    int vocab = loom_tokenizer_vocab_size(tok);
    for (int32_t id = 0; id < vocab && id < 70000; id++) {
        const char *bytes;
        size_t nb;
        if (loom_tokenizer_token_bytes(tok, id, &bytes, &nb) == LOOM_OK && nb && !bytes) abort();
    }
    loom_tokenizer_free(tok);
    return 0;
}
