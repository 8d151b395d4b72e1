/*
 * fuzz_normalize.c — Unicode's normal forms (a Hugging Face normalizer's
 * NFC, NFD, NFKC, NFKD steps) on any bytes: the result grows by at most
 * BPE_FORM_GROWTH, normalizing it again changes nothing, and on valid UTF-8
 * it is what utf8proc makes of the whole text at once (loom cuts the text
 * before each ASCII character, which must never change a normal form).
 */
#include "fuzz_util.h"
#include "io/io_internal.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    static const utf8proc_option_t whole[] = {
        [BPE_NFC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE,
        [BPE_NFD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE,
        [BPE_NFKC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
        [BPE_NFKD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT,
    };
    int valid = 1;
    for (size_t i = 0; i < size && valid;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate(data + i, (utf8proc_ssize_t)(size - i), &cp);
        if (k <= 0) valid = 0;
        else i += (size_t)k;
    }
    for (enum bpe_form f = BPE_NFC; f <= BPE_NFKD; f++) {
        size_t n = 0, again_n = 0;
        unsigned char *out = bpe_unicode_form(data, size, f, &n);
        if (!out) abort();
        if (n > BPE_FORM_GROWTH(f) * size) abort();
        unsigned char *again = bpe_unicode_form(out, n, f, &again_n);
        if (!again || again_n != n || memcmp(again, out, n)) abort(); /* a normal form is its own */
        free(again);
        if (valid && size) {
            utf8proc_uint8_t *ref = NULL;
            utf8proc_ssize_t m = utf8proc_map(data, (utf8proc_ssize_t)size, &ref, whole[f]);
            if (m < 0 || (size_t)m != n || memcmp(ref, out, n)) abort();
            free(ref);
        }
        free(out);
    }
    return 0;
}
