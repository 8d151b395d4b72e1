/*
 * fuzz_safetensors.c — loom_safetensors_open on any bytes: a file it
 * accepts must then give every tensor, every metadata entry and every
 * tensor's values (read as fp32) without a fault; one it refuses must
 * refuse with a status.
 */
#include "fuzz_util.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_set_threads(1);
    fuzz_write("st", data, size);
    loom_safetensors *st;
    if (loom_safetensors_open(fuzz_path("st"), &st) != LOOM_OK) return 0;
    for (size_t i = 0; i < loom_safetensors_count(st); i++) {
        loom_safetensors_tensor t;
        if (loom_safetensors_at(st, i, &t) != LOOM_OK) abort(); /* i < count must work */
        if (t.n_elements > (1u << 20)) continue;
        float *dst = malloc(t.n_elements * sizeof *dst + 1);
        if (dst) (void)loom_safetensors_read(st, t.name, LOOM_F32, NULL, 0, dst);
        free(dst);
    }
    for (size_t i = 0; i < loom_safetensors_metadata_count(st); i++) {
        const char *k, *v;
        if (loom_safetensors_metadata_at(st, i, &k, &v) != LOOM_OK || !k || !v) abort();
        if (loom_safetensors_metadata(st, k) == NULL) abort(); /* a listed key is found */
    }
    loom_safetensors_close(st);
    return 0;
}
