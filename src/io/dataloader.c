/*
 * dataloader.c — sequential (B, T) batches from llm.c token shards, with an
 * exactly restorable position and data-parallel rank slicing.
 *
 * A step consumes B*T*W tokens of the current shard (W ranks); rank r reads
 * the span [offset + r*B*T, offset + (r+1)*B*T + 1). The position is
 * normalised after every step so it always names a step that fits, which
 * makes a saved position mean the same thing on every rank and after a
 * restart. A shard with a loss mask beside it (NAME.mask) gets target -1
 * where the mask is 0. The pages of a mapped shard behind the position are
 * handed back as it moves, so resident memory does not grow with the
 * shard. Owns: shard discovery (directory, glob or file), the
 * position. Must never: return a token >= vocab_size, or advance on a
 * failed step.
 */
#define _GNU_SOURCE
#include "io/io_internal.h"

#include <dirent.h>
#include <fnmatch.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct loom_dataloader {
    loom_dataloader_options opt;
    char **paths;
    size_t *counts;    /* tokens per shard */
    size_t n_shards;
    size_t step;       /* B*T*W tokens consumed per step */
    size_t span;       /* B*T+1 tokens read per rank */
    loom_dataloader_position pos;
    loom_shard *current; /* the open shard, index current_index */
    loom_mask *current_mask; /* its loss mask, when it has one */
    size_t current_index;
    size_t dropped;    /* the open shard's tokens below this were handed back (io_shard_drop) */
    unsigned char *has_mask; /* per shard: a NAME.mask beside it */
    size_t n_masked;
    int32_t *buf;      /* (B*T+1) */
};

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static loom_status add_path(loom_dataloader *dl, const char *path, size_t *cap) {
    if (dl->n_shards == *cap) {
        size_t c = *cap ? 2 * *cap : 16;
        char **np = realloc(dl->paths, c * sizeof *np);
        if (!np) return loom_error(LOOM_ERR_NOMEM, "out of memory listing shards");
        dl->paths = np;
        *cap = c;
    }
    dl->paths[dl->n_shards] = strdup(path);
    if (!dl->paths[dl->n_shards]) return loom_error(LOOM_ERR_NOMEM, "out of memory listing shards");
    dl->n_shards++;
    return LOOM_OK;
}

/* Fill dl->paths (sorted) from a directory, a glob pattern or one file. */
static loom_status find_shards(loom_dataloader *dl, const char *source, const char *split) {
    size_t cap = 0;
    struct stat sb;
    if (stat(source, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        if (!split || !*split)
            return loom_error(LOOM_ERR_INVALID, "data source '%s' is a directory: set the split "
                              "(\"train\" or \"val\") to choose its *<split>*.bin files", source);
        char pattern[256];
        snprintf(pattern, sizeof pattern, "*%s*.bin", split);
        DIR *d = opendir(source);
        if (!d) return loom_error(LOOM_ERR_IO, "cannot list data directory '%s'", source);
        loom_status s = LOOM_OK;
        for (struct dirent *e; s == LOOM_OK && (e = readdir(d));) {
            if (fnmatch(pattern, e->d_name, 0) != 0) continue;
            size_t len = strlen(source) + strlen(e->d_name) + 2;
            char *p = malloc(len);
            if (!p) s = loom_error(LOOM_ERR_NOMEM, "out of memory listing shards");
            else {
                snprintf(p, len, "%s/%s", source, e->d_name);
                s = add_path(dl, p, &cap);
                free(p);
            }
        }
        closedir(d);
        LOOM_TRY(s);
        if (dl->n_shards == 0)
            return loom_error(LOOM_ERR_INVALID, "no shards matching '%s' in data directory '%s'; "
                              "token shards are made from text with `loom tokenize --in FILE... --out DIR`", pattern, source);
    } else if (stat(source, &sb) == 0) {
        LOOM_TRY(add_path(dl, source, &cap));
    } else {
        glob_t g;
        int r = glob(source, 0, NULL, &g);
        if (r == GLOB_NOMATCH || (r == 0 && g.gl_pathc == 0)) {
            if (r == 0) globfree(&g);
            return loom_error(LOOM_ERR_INVALID, "no token shards match '%s'; check the path (a "
                              "directory, a glob such as DIR/train_*.bin, or a file)", source);
        }
        if (r != 0) {
            globfree(&g);
            return loom_error(LOOM_ERR_IO, "cannot expand the shard pattern '%s'", source);
        }
        loom_status s = LOOM_OK;
        for (size_t i = 0; s == LOOM_OK && i < g.gl_pathc; i++) s = add_path(dl, g.gl_pathv[i], &cap);
        globfree(&g);
        LOOM_TRY(s);
    }
    qsort(dl->paths, dl->n_shards, sizeof *dl->paths, cmp_str);
    /* A directory a crashed tokenize left half-written: each directory once
     * (sorted paths keep a directory's shards together). */
    char marker[4352] = "";
    for (size_t i = 0; i < dl->n_shards; i++) {
        const char *slash = strrchr(dl->paths[i], '/');
        int dir_len = slash ? (int)(slash - dl->paths[i] + 1) : 0;
        if (i > 0 && !strncmp(marker, dl->paths[i], (size_t)dir_len) &&
            !strcmp(marker + dir_len, LOOM_SHARDS_INCOMPLETE))
            continue; /* this directory was checked */
        snprintf(marker, sizeof marker, "%.*s%s", dir_len, dl->paths[i], LOOM_SHARDS_INCOMPLETE);
        if (stat(marker, &sb) == 0)
            return loom_error(LOOM_ERR_STATE, "%s exists: a `loom tokenize` into that directory did not finish, "
                              "so its shards and tokenizer may belong to two runs; run the tokenize again",
                              marker);
    }
    return LOOM_OK;
}

/* Move pos forward to the first place at or after it where a whole step
 * fits (next shard, wrapping to the next epoch). */
static void normalise(loom_dataloader *dl, loom_dataloader_position *pos) {
    for (;;) {
        if (pos->shard < dl->n_shards && pos->offset <= dl->counts[pos->shard] &&
            dl->counts[pos->shard] - pos->offset >= dl->step + 1)
            return;
        pos->offset = 0;
        if (++pos->shard >= dl->n_shards) {
            pos->shard = 0;
            pos->epoch++;
        }
    }
}

/* Shard i's loss mask, if it has one: checked against the shard's count;
 * kept in *out when out is not NULL (else closed), noted in has_mask. */
static loom_status open_mask(loom_dataloader *dl, size_t i, loom_mask **out) {
    char path[4200];
    struct stat sb;
    if (out) *out = NULL;
    if (loom_mask_path(dl->paths[i], path, sizeof path) != LOOM_OK || stat(path, &sb) != 0) {
        if (dl->has_mask[i])
            return loom_error(LOOM_ERR_IO, "the loss mask of '%s' went away while training: restore it, or "
                              "tokenize the data again and start over", dl->paths[i]);
        return LOOM_OK; /* no mask: every token counts */
    }
    loom_mask *m;
    LOOM_TRY(loom_mask_open(path, &m));
    if (loom_mask_count(m) != dl->counts[i]) {
        loom_status st = loom_error(LOOM_ERR_FORMAT, "loss mask '%s' covers %zu tokens but its shard '%s' holds %zu: "
                                    "they are of two tokenize runs; make the data again", path, loom_mask_count(m),
                                    dl->paths[i], dl->counts[i]);
        loom_mask_close(m);
        return st;
    }
    if (!dl->has_mask[i]) dl->n_masked++;
    dl->has_mask[i] = 1;
    if (out) *out = m;
    else loom_mask_close(m);
    return LOOM_OK;
}

static loom_status check_options(const loom_dataloader_options *o) {
    if (o->batch_size < 1 || o->seq_len < 1)
        return loom_error(LOOM_ERR_INVALID, "data loader: batch size %d and sequence length %d must be "
                          ">= 1", o->batch_size, o->seq_len);
    if (o->world_size < 1 || o->rank < 0 || o->rank >= o->world_size)
        return loom_error(LOOM_ERR_INVALID, "data loader: rank %d is not in [0, world size %d)", o->rank,
                          o->world_size);
    if (o->vocab_size < 1)
        return loom_error(LOOM_ERR_INVALID, "data loader: vocab_size %d must be positive", o->vocab_size);
    uint64_t bt = (uint64_t)o->batch_size * (uint64_t)o->seq_len;
    if (bt > ((uint64_t)1 << 40) / (uint64_t)o->world_size)
        return loom_error(LOOM_ERR_INVALID, "data loader: B*T*world_size is too large");
    return LOOM_OK;
}

loom_status loom_dataloader_open(const char *source, const loom_dataloader_options *opt,
                                 loom_dataloader **out) {
    *out = NULL;
    if (!source || !opt) return loom_error(LOOM_ERR_INVALID, "data loader: NULL source or options");
    LOOM_TRY(check_options(opt));
    loom_dataloader *dl = calloc(1, sizeof *dl);
    if (!dl) return loom_error(LOOM_ERR_NOMEM, "out of memory opening the data loader");
    dl->opt = *opt;
    dl->opt.split = NULL; /* used only here; the caller owns the string */
    size_t bt = (size_t)opt->batch_size * (size_t)opt->seq_len;
    dl->step = bt * (size_t)opt->world_size;
    dl->span = bt + 1;
    loom_status s = find_shards(dl, source, opt->split);
    if (s == LOOM_OK) {
        dl->counts = calloc(dl->n_shards, sizeof *dl->counts);
        if (!dl->counts) s = loom_error(LOOM_ERR_NOMEM, "out of memory opening the data loader");
    }
    if (s == LOOM_OK && !(dl->has_mask = calloc(dl->n_shards, 1)))
        s = loom_error(LOOM_ERR_NOMEM, "out of memory opening the data loader");
    size_t longest = 0;
    for (size_t i = 0; s == LOOM_OK && i < dl->n_shards; i++) {
        loom_shard *sh;
        s = loom_shard_open(dl->paths[i], &sh);
        if (s != LOOM_OK) break;
        dl->counts[i] = loom_shard_count(sh);
        if (dl->counts[i] > longest) longest = dl->counts[i];
        loom_shard_close(sh);
        s = open_mask(dl, i, NULL);
    }
    if (s == LOOM_OK && longest < dl->step + 1)
        s = loom_error(LOOM_ERR_INVALID, "data loader: one step needs B*T*world_size+1 = %zu tokens but "
                       "the longest of the %zu shards ('%s'...) holds %zu; use a smaller batch or sequence "
                       "length, or more data", dl->step + 1, dl->n_shards, dl->paths[0], longest);
    /* The batch buffer only after that check: a batch larger than the data
     * is a usage error, not an out-of-memory one. */
    if (s == LOOM_OK && !(dl->buf = malloc(dl->span * sizeof *dl->buf)))
        s = loom_error(LOOM_ERR_NOMEM, "out of memory opening the data loader");
    if (s != LOOM_OK) {
        loom_dataloader_close(dl);
        return s;
    }
    normalise(dl, &dl->pos);
    *out = dl;
    return LOOM_OK;
}

void loom_dataloader_close(loom_dataloader *dl) {
    if (!dl) return;
    loom_shard_close(dl->current);
    loom_mask_close(dl->current_mask);
    free(dl->has_mask);
    for (size_t i = 0; i < dl->n_shards; i++) free(dl->paths[i]);
    free(dl->paths);
    free(dl->counts);
    free(dl->buf);
    free(dl);
}

loom_status loom_dataloader_next(loom_dataloader *dl, int32_t *inputs, int32_t *targets) {
    if (!dl || !inputs || !targets) return loom_error(LOOM_ERR_INVALID, "data loader: NULL argument");
    if (!dl->current || dl->current_index != dl->pos.shard) {
        loom_shard_close(dl->current);
        loom_mask_close(dl->current_mask);
        dl->current = NULL;
        dl->current_mask = NULL;
        LOOM_TRY(loom_shard_open(dl->paths[dl->pos.shard], &dl->current));
        dl->current_index = (size_t)dl->pos.shard;
        dl->dropped = 0;
        loom_status st = LOOM_OK;
        if (loom_shard_count(dl->current) != dl->counts[dl->pos.shard])
            st = loom_error(LOOM_ERR_IO, "token shard '%s' changed while training (%zu tokens, was %zu)",
                            dl->paths[dl->pos.shard], loom_shard_count(dl->current), dl->counts[dl->pos.shard]);
        if (st == LOOM_OK && dl->has_mask[dl->pos.shard]) st = open_mask(dl, (size_t)dl->pos.shard, &dl->current_mask);
        if (st != LOOM_OK) {
            loom_shard_close(dl->current); /* not current: the next call checks it again */
            dl->current = NULL;
            return st;
        }
    }
    size_t bt = dl->span - 1;
    size_t start = (size_t)dl->pos.offset + (size_t)dl->opt.rank * bt;
    LOOM_TRY(loom_shard_read(dl->current, start, dl->span, dl->buf));
    if (start > dl->dropped) { /* what this rank has read before start: RSS stays flat through a large shard */
        io_shard_drop(dl->current, dl->dropped, start);
        io_mask_drop(dl->current_mask, dl->dropped, start);
    }
    dl->dropped = start;
    for (size_t i = 0; i < dl->span; i++) {
        if (dl->buf[i] >= dl->opt.vocab_size)
            return loom_error(LOOM_ERR_FORMAT, "token shard '%s': the token at position %zu is %d, not below the "
                              "model's vocab_size %d: the model is too small for the tokenizer the data was made "
                              "with (or the data mixes tokenizers)", dl->paths[dl->pos.shard], start + i,
                              (int)dl->buf[i], dl->opt.vocab_size);
    }
    if (dl->current_mask) { /* the mask of each target: byte start + 1 + i */
        const uint8_t *mk = loom_mask_bytes(dl->current_mask) + start + 1;
        for (size_t i = 0; i < bt; i++)
            if (mk[i] > 1) {
                char mpath[4200];
                loom_mask_path(dl->paths[dl->pos.shard], mpath, sizeof mpath);
                return loom_error(LOOM_ERR_FORMAT, "loss mask '%s': the byte of token %zu (file offset %zu) is %d, "
                                  "not 0 or 1; make the data again with loom tokenize", mpath, start + 1 + i,
                                  LOOM_SHARD_HEADER_BYTES + start + 1 + i, mk[i]);
            }
    }
    memcpy(inputs, dl->buf, bt * sizeof *inputs);
    memcpy(targets, dl->buf + 1, bt * sizeof *targets);
    if (dl->current_mask) {
        const uint8_t *mk = loom_mask_bytes(dl->current_mask) + start + 1;
        for (size_t i = 0; i < bt; i++)
            if (!mk[i]) targets[i] = -1;
    }
    dl->pos.offset += dl->step;
    normalise(dl, &dl->pos);
    return LOOM_OK;
}

void loom_dataloader_get_position(const loom_dataloader *dl, loom_dataloader_position *pos) {
    *pos = dl->pos;
}

loom_status loom_dataloader_set_position(loom_dataloader *dl, const loom_dataloader_position *pos) {
    if (pos->shard >= dl->n_shards)
        return loom_error(LOOM_ERR_INVALID, "data position names shard %llu but there are %zu shards; "
                          "resume with the same data", (unsigned long long)pos->shard, dl->n_shards);
    size_t count = dl->counts[pos->shard];
    if (pos->offset > count)
        return loom_error(LOOM_ERR_INVALID, "data position offset %llu is past the end of shard '%s' (%zu tokens); "
                          "resume with the same data", (unsigned long long)pos->offset, dl->paths[pos->shard], count);
    /* A position saved with a smaller step (batch, sequence or world size)
     * may not leave a whole step of this one: go on where one fits, as a
     * step that ran off the shard's end would. */
    dl->pos = *pos;
    normalise(dl, &dl->pos);
    return LOOM_OK;
}

loom_status loom_dataloader_reset(loom_dataloader *dl) {
    memset(&dl->pos, 0, sizeof dl->pos);
    normalise(dl, &dl->pos);
    return LOOM_OK;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* FNV-1a over whole tokens (a word at a time: 4 times fewer steps than
 * bytes). */
static uint64_t fnv1a_tokens(uint64_t h, const int32_t *t, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ (uint32_t)t[i]) * 1099511628211ull;
    return h;
}

enum { FP_SPANS = 64, FP_SPAN = 64, FP_CHUNK = 65536 };

/* Where sampled span k of a shard of count tokens starts, and its length:
 * FP_SPANS spans of FP_SPAN tokens, evenly spread, the first at the start
 * and the last at the end (they overlap in shards under 4096 tokens). */
static size_t span_start(size_t count, size_t k, size_t *len) {
    *len = count < FP_SPAN ? count : FP_SPAN;
    return k * (count - *len) / (FP_SPANS - 1);
}

/* Every token of a shard, read in chunks through buf (FP_CHUNK tokens), or
 * with buf NULL the FP_SPANS sampled spans. */
static loom_status hash_shard(const loom_shard *sh, size_t count, int32_t *buf, uint64_t *h) {
    if (!buf) {
        int32_t span[FP_SPAN];
        for (size_t k = 0; count > 0 && k < FP_SPANS; k++) {
            size_t len, at = span_start(count, k, &len);
            LOOM_TRY(loom_shard_read(sh, at, len, span));
            *h = fnv1a_tokens(*h, span, len);
        }
        return LOOM_OK;
    }
    for (size_t at = 0; at < count; at += FP_CHUNK) {
        size_t n = count - at < FP_CHUNK ? count - at : FP_CHUNK;
        LOOM_TRY(loom_shard_read(sh, at, n, buf));
        io_shard_drop(sh, at, at + n); /* hashed: a large shard's pages are not all held at once */
        *h = fnv1a_tokens(*h, buf, n);
    }
    return LOOM_OK;
}

/* Shard i's loss mask: all of it, or its bytes in the spans the tokens are
 * sampled in. (Data without masks hashes as it did before masks.) */
static loom_status hash_mask(const loom_dataloader *dl, size_t i, int full, uint64_t *h) {
    loom_mask *m;
    char path[4200];
    LOOM_TRY(loom_mask_path(dl->paths[i], path, sizeof path));
    LOOM_TRY(loom_mask_open(path, &m));
    const uint8_t *b = loom_mask_bytes(m);
    size_t count = loom_mask_count(m);
    *h = fnv1a(*h, "mask", 4);
    for (size_t at = 0; full && at < count; at += FP_CHUNK) {
        size_t n = count - at < FP_CHUNK ? count - at : FP_CHUNK;
        *h = fnv1a(*h, b + at, n); /* the same hash as all the bytes at once */
        io_mask_drop(m, at, at + n);
    }
    for (size_t k = 0; !full && count > 0 && k < FP_SPANS; k++) {
        size_t len, at = span_start(count, k, &len);
        *h = fnv1a(*h, b + at, len);
    }
    loom_mask_close(m);
    return LOOM_OK;
}

loom_status dataloader_fingerprint_budget(const loom_dataloader *dl, size_t full_tokens, uint64_t *out) {
    uint64_t h = fnv1a(14695981039346656037ull, &dl->n_shards, sizeof dl->n_shards);
    int32_t *buf = full_tokens ? malloc(FP_CHUNK * sizeof *buf) : NULL;
    if (full_tokens && !buf) return loom_error(LOOM_ERR_NOMEM, "out of memory for the data fingerprint");
    size_t hashed = 0; /* tokens hashed in full so far */
    loom_status st = LOOM_OK;
    for (size_t i = 0; st == LOOM_OK && i < dl->n_shards; i++) {
        loom_shard *sh;
        if ((st = loom_shard_open(dl->paths[i], &sh)) != LOOM_OK) break;
        size_t count = loom_shard_count(sh);
        h = fnv1a(h, &count, sizeof count);
        int full = count <= full_tokens - hashed;
        if (full) hashed += count;
        st = hash_shard(sh, count, full ? buf : NULL, &h);
        loom_shard_close(sh);
        if (st == LOOM_OK && dl->has_mask[i]) st = hash_mask(dl, i, full, &h);
    }
    free(buf);
    if (st == LOOM_OK) *out = h;
    return st;
}

loom_status loom_dataloader_fingerprint(const loom_dataloader *dl, uint64_t *out) {
    return dataloader_fingerprint_budget(dl, LOOM_FINGERPRINT_FULL_TOKENS, out);
}

size_t loom_dataloader_num_shards(const loom_dataloader *dl) { return dl ? dl->n_shards : 0; }

size_t loom_dataloader_num_masked(const loom_dataloader *dl) { return dl ? dl->n_masked : 0; }

const char *loom_dataloader_shard_path(const loom_dataloader *dl, size_t i) {
    return dl && i < dl->n_shards ? dl->paths[i] : NULL;
}
