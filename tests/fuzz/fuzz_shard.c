/*
 * fuzz_shard.c — loom_shard_open (llm.c's token shards) and loom_mask_open
 * (their loss masks) on any bytes: a shard it accepts reads its tokens (all,
 * or the first 65536) with a status, never a fault; a mask it accepts has
 * exactly header + count bytes, all readable.
 */
#include "fuzz_util.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write("shard", data, size);
    loom_mask *m;
    if (loom_mask_open(fuzz_path("shard"), &m) == LOOM_OK) {
        if (LOOM_SHARD_HEADER_BYTES + loom_mask_count(m) != size) abort();
        static volatile unsigned sink; /* every byte read, not optimised away */
        for (size_t i = 0; i < loom_mask_count(m); i++) sink += loom_mask_bytes(m)[i];
        (void)sink;
        loom_mask_close(m);
    }
    loom_shard *s;
    if (loom_shard_open(fuzz_path("shard"), &s) != LOOM_OK) return 0;
    size_t n = loom_shard_count(s);
    if (n > 65536) n = 65536;
    int32_t *dst = malloc(n * sizeof *dst + 1);
    if (dst) (void)loom_shard_read(s, 0, n, dst);
    free(dst);
    loom_shard_close(s);
    return 0;
}
