/*
 * fuzz_tokenizer.c — loom_tokenizer_load on any bytes: a tokenizer it
 * accepts must encode text, decode what it encoded back to that text, and
 * give every token's bytes without a fault.
 */
#include "fuzz_util.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_set_threads(1);
    fuzz_write("tok", data, size);
    loom_tokenizer *tok;
    if (loom_tokenizer_load(fuzz_path("tok"), &tok) != LOOM_OK) return 0;
    static const char text[] = "The quick brown fox, 12 times: \xc3\xa9t\xc3\xa9!\n\tend";
    int32_t ids[256];
    size_t n = 0;
    loom_status st = loom_tokenizer_encode(tok, text, sizeof text - 1, ids, 256, &n);
    if (st == LOOM_OK) {
        char back[512];
        size_t len = 0;
        if (n > sizeof text - 1 || loom_tokenizer_decode(tok, ids, n, back, sizeof back, &len) != LOOM_OK ||
            len != sizeof text - 1 || memcmp(back, text, len) != 0)
            abort(); /* len ids suffice, and byte-level BPE round-trips every text */
    } else if (st != LOOM_ERR_NOMEM) {
        abort(); /* a tokenizer that loaded encodes any text */
    }
    int vocab = loom_tokenizer_vocab_size(tok);
    for (int32_t id = 0; id < vocab && id < 70000; id++) {
        const char *bytes;
        size_t nb;
        if (loom_tokenizer_token_bytes(tok, id, &bytes, &nb) == LOOM_OK && nb && !bytes) abort();
    }
    loom_tokenizer_free(tok);
    return 0;
}
