/*
 * replay_main.c — a main for the libFuzzer harnesses without libFuzzer: it
 * runs LLVMFuzzerTestOneInput on every file named on the command line (a
 * directory: every file in it). ctest runs each harness this way over its
 * corpus in tests/fuzz/corpus/ with the ordinary compiler (and under the
 * sanitizers in their build), so the harnesses build and every input once
 * found stays a regression test; scripts/fuzz.sh links the same harnesses
 * with libFuzzer to search for new inputs.
 */
#include "loom/loom.h"

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* A harness's one-time setup, as libFuzzer calls it, when it has one. */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

/* Run one file; 0 if it could be read whole. */
static int run_file(const char *path) {
    void *buf;
    size_t n;
    if (loom_read_file(path, &buf, &n) != LOOM_OK) return -1;
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    int files = 0;
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) { fprintf(stderr, "replay: cannot read %s\n", argv[i]); return 1; }
        if (!S_ISDIR(sb.st_mode)) {
            if (run_file(argv[i]) != 0) { fprintf(stderr, "replay: cannot read %s\n", argv[i]); return 1; }
            files++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d) { fprintf(stderr, "replay: cannot list %s\n", argv[i]); return 1; }
        for (struct dirent *e; (e = readdir(d));) {
            char path[4096];
            struct stat es;
            if (e->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "%s/%s", argv[i], e->d_name);
            if (stat(path, &es) != 0 || !S_ISREG(es.st_mode)) continue; /* inputs are files */
            if (run_file(path) != 0) { fprintf(stderr, "replay: cannot read %s\n", path); closedir(d); return 1; }
            files++;
        }
        closedir(d);
    }
    if (files == 0) {
        fprintf(stderr, "replay: no inputs found\n");
        return 1;
    }
    printf("replay: %d inputs, no fault\n", files);
    return 0;
}
