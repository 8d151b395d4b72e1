/*
 * fuzz_util.h — shared by the libFuzzer harnesses (tests/fuzz/fuzz_*.c):
 * loom's parsers read files, so each input is written to a file of this
 * process's own in /dev/shm (tmpfs: no disk) and the parser opens that.
 * Built only with -DLOOM_FUZZ=ON and clang (scripts/fuzz.sh).
 */
#ifndef LOOM_FUZZ_UTIL_H
#define LOOM_FUZZ_UTIL_H

#include "loom/loom.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static char fuzz_path_[256];
static void fuzz_path_remove(void) { unlink(fuzz_path_); }

/* The file this process's inputs go to, named after `what`; removed when
 * the process exits. */
static inline const char *fuzz_path(const char *what) {
    if (!fuzz_path_[0]) {
        snprintf(fuzz_path_, sizeof fuzz_path_, "/dev/shm/loom-fuzz-%ld-%s", (long)getpid(), what);
        atexit(fuzz_path_remove);
    }
    return fuzz_path_;
}

/* Write the input to fuzz_path(what); 0 on success. */
static inline int fuzz_write(const char *what, const uint8_t *data, size_t size) {
    FILE *f = fopen(fuzz_path(what), "wb");
    if (!f) return -1;
    size_t w = size ? fwrite(data, 1, size, f) : 0;
    return fclose(f) != 0 || w != size;
}

#endif
