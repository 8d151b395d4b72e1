/*
 * file.c; whole-file reads, read-only mappings and atomic writes.
 *
 * Owns: the write-to-temporary / fsync / rename / fsync-directory protocol
 * every loom file writer goes through, and the failure-injection hook its
 * tests use. Must never: leave a temporary file behind after a failure, or
 * touch the target before the new content is durable on disk.
 */
#define _GNU_SOURCE
#include "io/io_internal.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------ failure injection */

static _Thread_local io_fail_point fail_point;
static _Thread_local int fail_skip, fail_errno;

void io_test_inject_failure(io_fail_point point, int skip, int err) {
    fail_point = point;
    fail_skip = skip;
    fail_errno = err;
}

/* 1 (with errno set) when an injected failure fires at `point`. */
static int injected(io_fail_point point) {
    if (fail_point != point) return 0;
    if (fail_skip-- > 0) return 0;
    fail_point = IO_FAIL_NONE;
    errno = fail_errno;
    return 1;
}

const char *io_write_hint(int err) {
    if (err == ENOSPC || err == EDQUOT || err == EFBIG)
        return "disk full? free some space or write elsewhere";
    if (err == EACCES || err == EPERM || err == EROFS)
        return "check that the directory is writable";
    if (err == ENOENT || err == ENOTDIR) return "check that the directory exists";
    return "check the disk and the path";
}

/* ---------------------------------------------------------------- reads */

/* Read until EOF into a growing buffer with one spare byte for a '\0'. */
static loom_status read_fd(int fd, const char *path, size_t hint, unsigned char **out, size_t *len) {
    size_t cap = hint + 1, n = 0;
    unsigned char *buf = malloc(cap + 1);
    if (!buf) return loom_error(LOOM_ERR_NOMEM, "out of memory reading '%s' (%zu bytes)", path, hint);
    for (;;) {
        if (n == cap) {
            unsigned char *nb = cap > SIZE_MAX / 2 - 1 ? NULL : realloc(buf, 2 * cap + 1);
            if (!nb) {
                free(buf);
                return loom_error(LOOM_ERR_NOMEM, "out of memory reading '%s'", path);
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            return loom_error(LOOM_ERR_IO, "cannot read '%s': %s", path, strerror(e));
        }
        if (r == 0) break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return LOOM_OK;
}

static loom_status open_regular(const char *path, const char *what, int *fd_out, struct stat *st) {
    /* Non-blocking, so a FIFO is refused below instead of waiting forever
     * for a writer; regular files read the same either way. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return loom_error(LOOM_ERR_IO, "cannot open %s '%s': %s", what, path, strerror(errno));
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return loom_error(LOOM_ERR_IO, "cannot read %s '%s': %s", what, path, strerror(e));
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return loom_error(LOOM_ERR_IO, "cannot read %s '%s': %s", what, path,
                          S_ISDIR(st->st_mode) ? "it is a directory" : "not a regular file");
    }
    *fd_out = fd;
    return LOOM_OK;
}

size_t io_dead_temporary(const char *name) {
    const char *t = strstr(name, ".tmp.");
    if (!t || t == name) return 0;
    char *end;
    long pid = strtol(t + 5, &end, 10);
    if (*end || pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) return 0;
    return (size_t)(t - name);
}

void io_remove_dead_temporaries(const char *dir, const char *const *names, int n_names) {
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        size_t base = io_dead_temporary(e->d_name);
        int ours = 0;
        for (int i = 0; i < n_names && base && !ours; i++)
            ours = strlen(names[i]) == base && !strncmp(e->d_name, names[i], base);
        if (!ours) continue;
        char path[4608];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path) unlink(path);
    }
    closedir(d);
}

loom_status loom_read_file(const char *path, void **data, size_t *len) {
    return io_read_file(path, "file", data, len);
}

loom_status io_read_file(const char *path, const char *what, void **data, size_t *len) {
    *data = NULL;
    *len = 0;
    if (!path) return loom_error(LOOM_ERR_INVALID, "loom_read_file: path is NULL");
    int fd;
    struct stat st;
    LOOM_TRY(open_regular(path, what, &fd, &st));
    unsigned char *buf;
    loom_status s = read_fd(fd, path, (size_t)st.st_size, &buf, len);
    close(fd);
    if (s == LOOM_OK) *data = buf;
    return s;
}

loom_status io_map_file(const char *path, const char *what, io_mapped *m) {
    memset(m, 0, sizeof *m);
    int fd;
    struct stat st;
    LOOM_TRY(open_regular(path, what, &fd, &st));
    size_t size = (size_t)st.st_size;
    if (size > 0) {
        void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p != MAP_FAILED) {
            close(fd);
            m->data = p;
            m->size = size;
            m->is_mmap = 1;
            return LOOM_OK;
        }
    }
    unsigned char *buf;
    loom_status s = read_fd(fd, path, size, &buf, &m->size);
    close(fd);
    if (s != LOOM_OK) return s;
    m->data = buf;
    return LOOM_OK;
}

void io_mapped_drop(const io_mapped *m, const void *p, size_t n) {
    if (!m->is_mmap || n == 0) return;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p, b = a + n;
    if (page == 0 || page & (page - 1)) return;
    a = (a + page - 1) & ~(page - 1); /* whole pages only: a neighbour's part may still be read */
    b &= ~(page - 1);
    if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED); /* advice: a failure leaves the pages */
}

void io_mapped_drop_to(const io_mapped *m, const void *p, const void *end) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p, b = (uintptr_t)end;
    if (!m->is_mmap || b <= a || page == 0 || page & (page - 1)) return;
    a &= ~(page - 1); /* a mapping starts on a page: this stays inside it */
    io_mapped_drop(m, (const void *)a, b - a);
}

void io_unmap_file(io_mapped *m) {
    if (m->is_mmap) munmap((void *)m->data, m->size);
    else free((void *)m->data);
    memset(m, 0, sizeof *m);
}

/* --------------------------------------------------------- atomic writes */

#define WBUF_BYTES (1u << 16)

struct loom_atomic_file {
    char *path, *tmp;
    int fd;
    loom_status failed;  /* first error, sticky */
    char message[3 * 4096 + 512]; /* its message, repeated by commit */
    size_t nbuf;
    unsigned char buf[WBUF_BYTES];
};

static loom_status fail(loom_atomic_file *f, loom_status st, const char *doing, int err) {
    if (f->failed == LOOM_OK) {
        /* The reason first: a long path must not push it out of the message. */
        snprintf(f->message, sizeof f->message,
                 "%s: %s; cannot write '%s' (%s temporary '%s'); '%s' was left unchanged",
                 strerror(err), io_write_hint(err), f->path, doing, f->tmp, f->path);
        f->failed = st;
    }
    return loom_error(f->failed, "%s", f->message);
}

loom_status loom_atomic_file_open(const char *path, loom_atomic_file **out) {
    *out = NULL;
    if (!path || !*path) return loom_error(LOOM_ERR_INVALID, "atomic write: empty path");
    loom_atomic_file *f = calloc(1, sizeof *f);
    size_t n = strlen(path);
    if (f) f->path = strdup(path);
    if (f) f->tmp = malloc(n + 32);
    if (!f || !f->path || !f->tmp) {
        if (f) { free(f->path); free(f->tmp); }
        free(f);
        return loom_error(LOOM_ERR_NOMEM, "out of memory opening '%s' for writing", path);
    }
    snprintf(f->tmp, n + 32, "%s.tmp.%ld", path, (long)getpid());
    f->fd = injected(IO_FAIL_OPEN) ? -1
            : open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        int e = errno;
        loom_status s = fail(f, LOOM_ERR_IO, "creating", e);
        free(f->path);
        free(f->tmp);
        free(f);
        return s;
    }
    *out = f;
    return LOOM_OK;
}

static loom_status write_all(loom_atomic_file *f, const unsigned char *p, size_t n) {
    while (n > 0) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : n;
        ssize_t w = injected(IO_FAIL_WRITE) ? -1 : write(f->fd, p, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return fail(f, LOOM_ERR_IO, "writing", w == 0 ? ENOSPC : errno);
        p += w;
        n -= (size_t)w;
    }
    return LOOM_OK;
}

static loom_status flush_buffer(loom_atomic_file *f) {
    size_t n = f->nbuf;
    f->nbuf = 0;
    return write_all(f, f->buf, n);
}

loom_status loom_atomic_file_write(loom_atomic_file *f, const void *data, size_t n) {
    if (!f) return loom_error(LOOM_ERR_INVALID, "atomic write: NULL handle");
    if (f->failed != LOOM_OK) return loom_error(f->failed, "%s", f->message);
    if (n > 0 && !data) return loom_error(LOOM_ERR_INVALID, "atomic write to '%s': NULL data", f->path);
    if (f->nbuf + n <= WBUF_BYTES) {
        if (n) memcpy(f->buf + f->nbuf, data, n);
        f->nbuf += n;
        return LOOM_OK;
    }
    LOOM_TRY(flush_buffer(f));
    if (n <= WBUF_BYTES / 2) {
        memcpy(f->buf, data, n);
        f->nbuf = n;
        return LOOM_OK;
    }
    return write_all(f, data, n);
}

static void release(loom_atomic_file *f) {
    free(f->path);
    free(f->tmp);
    free(f);
}

void loom_atomic_file_abort(loom_atomic_file *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    unlink(f->tmp);
    release(f);
}

int io_fsync_parent(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir = slash == path ? strdup("/") : slash ? strndup(path, (size_t)(slash - path)) : strdup(".");
    if (!dir) return ENOMEM;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(dir);
    if (fd < 0) return errno;
    int r = fsync(fd) == 0 ? 0 : errno;
    close(fd);
    /* Some file systems cannot fsync a directory; the rename has happened. */
    return (r == EINVAL || r == ENOTSUP) ? 0 : r;
}

loom_status loom_file_remove_durable(const char *path) {
    if (unlink(path) != 0 && errno != ENOENT)
        return loom_error(LOOM_ERR_IO, "cannot remove %s: %s", path, strerror(errno));
    int r = io_fsync_parent(path);
    if (r) return loom_error(LOOM_ERR_IO, "cannot sync the directory of %s: %s", path, strerror(r));
    return LOOM_OK;
}

loom_status loom_atomic_file_commit(loom_atomic_file *f) {
    if (!f) return loom_error(LOOM_ERR_INVALID, "atomic commit: NULL handle");
    loom_status s = f->failed;
    if (s == LOOM_OK) s = flush_buffer(f);
    if (s == LOOM_OK && (injected(IO_FAIL_FSYNC) || fsync(f->fd) != 0))
        s = fail(f, LOOM_ERR_IO, "syncing", errno);
    if (s == LOOM_OK) {
        int r = close(f->fd);
        f->fd = -1;
        if (r != 0) s = fail(f, LOOM_ERR_IO, "closing", errno);
    }
    if (s == LOOM_OK && (injected(IO_FAIL_RENAME) || rename(f->tmp, f->path) != 0))
        s = fail(f, LOOM_ERR_IO, "renaming", errno);
    if (s != LOOM_OK) {
        loom_error(s, "%s", f->message);
        loom_atomic_file_abort(f);
        return s;
    }
    int e = io_fsync_parent(f->path);
    if (e != 0)
        s = loom_error(LOOM_ERR_IO, "wrote '%s' but could not sync its directory: %s; %s",
                       f->path, strerror(e), io_write_hint(e));
    release(f);
    return s;
}

loom_status loom_file_write_atomic(const char *path, const void *data, size_t n) {
    loom_atomic_file *f;
    LOOM_TRY(loom_atomic_file_open(path, &f));
    loom_status s = loom_atomic_file_write(f, data, n);
    if (s != LOOM_OK) {
        loom_atomic_file_abort(f);
        return s;
    }
    return loom_atomic_file_commit(f);
}

loom_status loom_file_copy_atomic(const char *from, const char *to) {
    void *data;
    size_t len;
    LOOM_TRY(loom_read_file(from, &data, &len));
    loom_status st = loom_file_write_atomic(to, data, len);
    free(data);
    return st;
}
