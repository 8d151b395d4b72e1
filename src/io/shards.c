/*
 * shards.c — llm.c token shards: a 1024-byte header of 256 int32 (magic,
 * version, token count, then zeros) followed by uint16 (magic 20240520,
 * version 1) or uint32 (magic 20240801, version 7) tokens.
 *
 * Owns: writing shards (atomically) and opening them with a check of the
 * header against the file size. Must never: hand out a token beyond the
 * count the header states, or accept a file whose size disagrees with it.
 */
#include "io/io_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct loom_shard {
    char *path;
    io_mapped file;
    size_t count;
    int token_bytes; /* 2 or 4 */
};

loom_status loom_shard_write(const char *path, const int32_t *tokens, size_t n, int vocab_size) {
    if (!path) return loom_error(LOOM_ERR_INVALID, "loom_shard_write: path is NULL");
    if (vocab_size <= 0)
        return loom_error(LOOM_ERR_INVALID, "shard '%s': vocab_size %d must be positive", path, vocab_size);
    if (n > INT32_MAX)
        return loom_error(LOOM_ERR_INVALID, "shard '%s': %zu tokens do not fit the int32 count in the "
                          "header; split them into several shards", path, n);
    if (n > 0 && !tokens) return loom_error(LOOM_ERR_INVALID, "shard '%s': tokens is NULL", path);
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab_size)
            return loom_error(LOOM_ERR_INVALID, "shard '%s': the token at index %zu is %d, outside the vocabulary "
                              "[0, %d)", path, i, (int)tokens[i], vocab_size);
    int wide = vocab_size > 65536;
    int32_t header[256] = {0};
    header[0] = wide ? LOOM_SHARD_MAGIC_U32 : LOOM_SHARD_MAGIC_U16;
    header[1] = wide ? LOOM_SHARD_VERSION_U32 : LOOM_SHARD_VERSION_U16;
    header[2] = (int32_t)n;
    loom_atomic_file *f;
    LOOM_TRY(loom_atomic_file_open(path, &f));
    loom_status s = loom_atomic_file_write(f, header, sizeof header);
    /* Convert in blocks so memory stays small whatever n is. */
    enum { BLOCK = 8192 };
    uint32_t buf[BLOCK];
    for (size_t i = 0; s == LOOM_OK && i < n; i += BLOCK) {
        size_t m = n - i < BLOCK ? n - i : BLOCK;
        if (wide) {
            for (size_t j = 0; j < m; j++) buf[j] = (uint32_t)tokens[i + j];
            s = loom_atomic_file_write(f, buf, m * 4);
        } else {
            uint16_t *b16 = (uint16_t *)buf;
            for (size_t j = 0; j < m; j++) b16[j] = (uint16_t)tokens[i + j];
            s = loom_atomic_file_write(f, b16, m * 2);
        }
    }
    if (s != LOOM_OK) {
        loom_atomic_file_abort(f);
        return s;
    }
    LOOM_TRY(loom_atomic_file_commit(f));
    /* A loss mask of the shard this one replaces would mask other tokens. */
    char mask[4200];
    if (loom_mask_path(path, mask, sizeof mask) == LOOM_OK && unlink(mask) != 0 && errno != ENOENT)
        return loom_error(LOOM_ERR_IO, "cannot remove %s, the loss mask of the shard %s replaced: %s", mask, path,
                          strerror(errno));
    return LOOM_OK;
}

static loom_status bad(const char *path, const char *what) {
    return loom_error(LOOM_ERR_FORMAT, "token shard '%s' is not a valid shard: %s; token shards are made "
                      "from text with `loom tokenize --in FILE... --out DIR` (or llm.c's data scripts)", path, what);
}

static loom_status validate(loom_shard *s) {
    char what[256];
    if (s->file.size < LOOM_SHARD_HEADER_BYTES) {
        snprintf(what, sizeof what, "it is %zu bytes, shorter than the %d-byte header (truncated?)",
                 s->file.size, LOOM_SHARD_HEADER_BYTES);
        return bad(s->path, what);
    }
    int32_t h[3];
    memcpy(h, s->file.data, sizeof h);
    if (h[0] == LOOM_SHARD_MAGIC_U16 && h[1] == LOOM_SHARD_VERSION_U16) s->token_bytes = 2;
    else if (h[0] == LOOM_SHARD_MAGIC_U32 && h[1] == LOOM_SHARD_VERSION_U32) s->token_bytes = 4;
    else if (h[0] == LOOM_SHARD_MAGIC_U16 || h[0] == LOOM_SHARD_MAGIC_U32) {
        snprintf(what, sizeof what, "magic %d with unsupported version %d (expected %d)", (int)h[0],
                 (int)h[1], h[0] == LOOM_SHARD_MAGIC_U16 ? LOOM_SHARD_VERSION_U16 : LOOM_SHARD_VERSION_U32);
        return bad(s->path, what);
    } else {
        snprintf(what, sizeof what, "bad magic %d (expected %d or %d): not an llm.c token shard",
                 (int)h[0], LOOM_SHARD_MAGIC_U16, LOOM_SHARD_MAGIC_U32);
        return bad(s->path, what);
    }
    if (h[2] < 0) {
        snprintf(what, sizeof what, "negative token count %d in the header", (int)h[2]);
        return bad(s->path, what);
    }
    size_t expect = LOOM_SHARD_HEADER_BYTES + (size_t)h[2] * (size_t)s->token_bytes;
    if (s->file.size != expect) {
        snprintf(what, sizeof what, "the header says %d tokens of %d bytes (%zu bytes in all) but the "
                 "file is %zu bytes (%s)", (int)h[2], s->token_bytes, expect, s->file.size,
                 s->file.size < expect ? "truncated?" : "trailing data?");
        return bad(s->path, what);
    }
    s->count = (size_t)h[2];
    return LOOM_OK;
}

loom_status loom_shard_open(const char *path, loom_shard **out) {
    *out = NULL;
    if (!path) return loom_error(LOOM_ERR_INVALID, "loom_shard_open: path is NULL");
    loom_shard *s = calloc(1, sizeof *s);
    if (s) s->path = strdup(path);
    if (!s || !s->path) {
        free(s);
        return loom_error(LOOM_ERR_NOMEM, "out of memory opening '%s'", path);
    }
    loom_status st = io_map_file(path, "token shard", &s->file);
    if (st == LOOM_OK) st = validate(s);
    if (st != LOOM_OK) {
        loom_shard_close(s);
        return st;
    }
    *out = s;
    return LOOM_OK;
}

void loom_shard_close(loom_shard *s) {
    if (!s) return;
    io_unmap_file(&s->file);
    free(s->path);
    free(s);
}

size_t loom_shard_count(const loom_shard *s) { return s ? s->count : 0; }

int loom_shard_token_bytes(const loom_shard *s) { return s ? s->token_bytes : 0; }

loom_status loom_shard_read(const loom_shard *s, size_t start, size_t n, int32_t *dst) {
    if (start > s->count || n > s->count - start)
        return loom_error(LOOM_ERR_INVALID, "shard '%s': tokens [%zu, %zu) requested but it holds %zu",
                          s->path, start, start + n, s->count);
    const unsigned char *p = s->file.data + LOOM_SHARD_HEADER_BYTES;
    if (s->token_bytes == 2) {
        for (size_t i = 0; i < n; i++) {
            uint16_t t;
            memcpy(&t, p + 2 * (start + i), 2);
            dst[i] = t;
        }
        return LOOM_OK;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t t;
        memcpy(&t, p + 4 * (start + i), 4);
        if (t > INT32_MAX)
            return loom_error(LOOM_ERR_FORMAT, "shard '%s': the token at position %zu is %u, beyond any vocabulary; "
                              "the file is corrupt", s->path, start + i, t);
        dst[i] = (int32_t)t;
    }
    return LOOM_OK;
}

void io_shard_drop(const loom_shard *s, size_t first, size_t end) {
    if (!s || end > s->count || first >= end) return;
    const unsigned char *tokens = s->file.data + LOOM_SHARD_HEADER_BYTES;
    io_mapped_drop_to(&s->file, tokens + first * (size_t)s->token_bytes, tokens + end * (size_t)s->token_bytes);
}

/* ------------------------------------------------------------ loss masks */

struct loom_mask {
    io_mapped file;
    size_t count;
};

loom_status loom_mask_path(const char *shard_path, char *out, size_t cap) {
    size_t n = strlen(shard_path);
    if (n < 4 || strcmp(shard_path + n - 4, ".bin") != 0)
        return loom_error(LOOM_ERR_INVALID, "shard '%s' does not end in .bin, so it has no loss mask path",
                          shard_path);
    if (n + 2 > cap) return loom_error(LOOM_ERR_INVALID, "path too long: %s", shard_path);
    snprintf(out, cap, "%.*s.mask", (int)(n - 4), shard_path);
    return LOOM_OK;
}

loom_status loom_mask_write(const char *path, const uint8_t *mask, size_t n) {
    if (!path || (n > 0 && !mask)) return loom_error(LOOM_ERR_INVALID, "loom_mask_write: NULL path or mask");
    if (n > INT32_MAX)
        return loom_error(LOOM_ERR_INVALID, "loss mask '%s': %zu bytes do not fit the int32 count", path, n);
    for (size_t i = 0; i < n; i++)
        if (mask[i] > 1)
            return loom_error(LOOM_ERR_INVALID, "loss mask '%s': byte %zu is %d, not 0 or 1", path, i, mask[i]);
    int32_t header[256] = {LOOM_MASK_MAGIC, LOOM_MASK_VERSION, (int32_t)n};
    loom_atomic_file *f;
    LOOM_TRY(loom_atomic_file_open(path, &f));
    loom_status s = loom_atomic_file_write(f, header, sizeof header);
    if (s == LOOM_OK) s = loom_atomic_file_write(f, mask, n);
    if (s != LOOM_OK) {
        loom_atomic_file_abort(f);
        return s;
    }
    return loom_atomic_file_commit(f);
}

loom_status loom_mask_open(const char *path, loom_mask **out) {
    *out = NULL;
    loom_mask *m = calloc(1, sizeof *m);
    if (!m) return loom_error(LOOM_ERR_NOMEM, "out of memory opening '%s'", path);
    loom_status st = io_map_file(path, "loss mask", &m->file);
    int32_t h[3] = {0};
    if (st == LOOM_OK && m->file.size >= LOOM_SHARD_HEADER_BYTES) memcpy(h, m->file.data, sizeof h);
    if (st == LOOM_OK && (m->file.size < LOOM_SHARD_HEADER_BYTES || h[0] != LOOM_MASK_MAGIC ||
                          h[1] != LOOM_MASK_VERSION || h[2] < 0 ||
                          m->file.size != LOOM_SHARD_HEADER_BYTES + (size_t)h[2]))
        st = loom_error(LOOM_ERR_FORMAT, "loss mask '%s' is not valid: %zu bytes, header magic %d version %d count "
                        "%d (want magic %d, version %d, and %d bytes of header then one per token); make it again "
                        "with loom tokenize", path, m->file.size, (int)h[0], (int)h[1], (int)h[2], LOOM_MASK_MAGIC,
                        LOOM_MASK_VERSION, LOOM_SHARD_HEADER_BYTES);
    if (st != LOOM_OK) {
        loom_mask_close(m);
        return st;
    }
    m->count = (size_t)h[2];
    *out = m;
    return LOOM_OK;
}

void loom_mask_close(loom_mask *m) {
    if (!m) return;
    io_unmap_file(&m->file);
    free(m);
}

size_t loom_mask_count(const loom_mask *m) { return m ? m->count : 0; }

const uint8_t *loom_mask_bytes(const loom_mask *m) { return m->file.data + LOOM_SHARD_HEADER_BYTES; }

void io_mask_drop(const loom_mask *m, size_t first, size_t end) {
    if (!m || end > m->count || first >= end) return;
    io_mapped_drop_to(&m->file, m->file.data + LOOM_SHARD_HEADER_BYTES + first,
                      m->file.data + LOOM_SHARD_HEADER_BYTES + end);
}
