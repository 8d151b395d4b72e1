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

/* Write the input to `path`; a failure stops the run (an input the parser
 * never saw must not count as one that passed). */
static inline void fuzz_write_file(const char *path, const uint8_t *data, size_t size) {
    FILE *f = fopen(path, "wb");
    size_t w = f && size ? fwrite(data, 1, size, f) : 0;
    if (!f || fclose(f) != 0 || w != size) {
        fprintf(stderr, "fuzz: cannot write %s (is /dev/shm a writable tmpfs?)\n", path);
        abort();
    }
}

/* Write the input to fuzz_path(what). */
static inline void fuzz_write(const char *what, const uint8_t *data, size_t size) {
    fuzz_write_file(fuzz_path(what), data, size);
}

#endif
