/*
 * fuzz_encode.c — a trained byte-level BPE tokenizer on any text: encoding
 * takes at most one id per byte, decoding gives the text back byte for byte,
 * and a second encoding gives the same ids (the cache changes nothing).
 */
#include "fuzz_util.h"

#include <stdlib.h>
#include <string.h>

static loom_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    static const char *const texts[] = {
        "the theory of the thing that the others thought through, then thawed",
        "\xc3\xa9t\xc3\xa9 \xe2\x82\xac 12345 12345 aaaa aaaa \n\n\t\t  spaces   and tabs",
    };
    if (loom_tokenizer_train(texts, NULL, 2, 300, &tok) != LOOM_OK) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    int32_t *ids = malloc((size + 1) * sizeof *ids), *again = malloc((size + 1) * sizeof *again);
    char *back = malloc(size + 1);
    size_t n = 0, n2 = 0, len = 0;
    if (!ids || !again || !back) abort();
    if (loom_tokenizer_encode(tok, data, size, ids, size + 1, &n) != LOOM_OK || n > size) abort();
    if (loom_tokenizer_decode(tok, ids, n, back, size + 1, &len) != LOOM_OK || len != size ||
        (size && memcmp(back, data, size) != 0))
        abort();
    if (loom_tokenizer_encode(tok, data, size, again, size + 1, &n2) != LOOM_OK || n2 != n ||
        (n && memcmp(ids, again, n * sizeof *ids) != 0))
        abort();
    free(ids);
    free(again);
    free(back);
    return 0;
}
