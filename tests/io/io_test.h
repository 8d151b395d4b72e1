/*
 * io_test.h — helpers shared by the io tests (header-only, static): a
 * scratch directory under /tmp, raw file writes/reads, and assertions on
 * the last error message.
 */
#ifndef LOOM_IO_TEST_H
#define LOOM_IO_TEST_H

#define _GNU_SOURCE
#include <dirent.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"
#include "loom/io.h"

static char io_scratch[256];

/* cmocka group setup/teardown: a fresh mkdtemp directory per test file. */
static inline int io_scratch_setup(void **state) {
    (void)state;
    snprintf(io_scratch, sizeof io_scratch, "/tmp/loom-io-test-XXXXXX");
    return mkdtemp(io_scratch) ? 0 : -1;
}

static inline int io_rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

static inline int io_scratch_teardown(void **state) {
    (void)state;
    return nftw(io_scratch, io_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A path inside the scratch directory (static buffer, rotating 8 slots). */
static inline const char *io_path(const char *name) {
    static char bufs[8][512];
    static int k;
    char *b = bufs[k++ % 8];
    snprintf(b, 512, "%s/%s", io_scratch, name);
    return b;
}

/* The process's resident pages of mapped files, in KiB (/proc/self/status:
 * RssFile, plus RssShmem, where a file on tmpfs counts). */
static inline long io_rss_mapped_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    long kib = 0, v;
    int found = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "RssFile: %ld kB", &v) == 1 || sscanf(line, "RssShmem: %ld kB", &v) == 1) {
            kib += v;
            found++;
        }
    fclose(f);
    assert_true(found == 2);
    return kib;
}

static inline void io_write_raw(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Read a whole file (malloc'd) through stdio, independent of loom. */
static inline unsigned char *io_read_raw(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)len + 1);
    assert_int_equal(fread(b, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    b[len] = 0; /* so that text files read as strings */
    *n = (size_t)len;
    return b;
}

/* Number of entries in the scratch directory whose name contains `part`. */
static inline int io_count_files(const char *part) {
    DIR *d = opendir(io_scratch);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, part)) n++;
    closedir(d);
    return n;
}

/* Assert that the last error message contains `part`. */
#define IO_ASSERT_MSG(part)                                                            \
    do {                                                                               \
        if (!strstr(loom_last_error(), (part)))                                        \
            fail_msg("error message \"%s\" lacks \"%s\"", loom_last_error(), (part));  \
    } while (0)

#endif
