/*
 * tokenizer.c — the BPE tokenizer: pre-splitting, encoding (merges applied
 * by rank, with a per-chunk cache), decoding, and loom's JSON file format.
 * Training lives in bpe_train.c, Hugging Face files in tokenizer_hf.c (their
 * encoding is here: added tokens, expressions, normalizer, merge queue).
 *
 * loom's ids: 0..255 are bytes, 256 + r is merge r, then "<|endoftext|>"
 * (if any) as the last id; a Hugging Face file's are its own. Owns: the
 * token byte table and the merge-rank map. Must never: emit a special token
 * from text, lose or alter a byte (decode of encode is the identity for
 * every byte string, but for what a SentencePiece-style normalizer does), or
 * trust a loaded file.
 */
#include "io/io_internal.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define CACHE_MAX_IDS (1u << 20) /* cleared when it holds more than this */

/* ------------------------------------------------------------ pre-split */

enum { C_LETTER, C_DIGIT, C_SPACE, C_OTHER };

static int byte_class(unsigned char c) {
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return C_LETTER;
    if (c >= 0x80) return C_LETTER; /* UTF-8 multi-byte sequences stay with letters */
    if (c >= '0' && c <= '9') return C_DIGIT;
    if (c == ' ' || (c >= '\t' && c <= '\r')) return C_SPACE;
    return C_OTHER;
}

size_t bpe_chunk_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    size_t lim = n < BPE_MAX_CHUNK ? n : BPE_MAX_CHUNK;
    int c = byte_class(s[0]);
    size_t i = 1;
    if (c == C_SPACE) {
        /* " word": a single space joins the run after it. */
        if (s[0] == ' ' && n > 1 && byte_class(s[1]) != C_SPACE) {
            c = byte_class(s[1]);
            i = 2;
        } else {
            while (i < lim && byte_class(s[i]) == C_SPACE) i++;
            /* Leave a final space to lead the next word, as GPT-2 does. */
            if (i < n && i > 1 && s[i - 1] == ' ' && byte_class(s[i]) != C_SPACE) i--;
            return i;
        }
    }
    while (i < lim && byte_class(s[i]) == c) i++;
    return i;
}

/* ---------------------------------------------------------------- build */

void loom_tokenizer_free(loom_tokenizer *tok) {
    if (!tok) return;
    free(tok->merges);
    free(tok->merged);
    free(tok->tok_off);
    free(tok->arena);
    free(tok->special);
    io_u64map_free(&tok->ranks);
    for (int i = 0; i < tok->n_splits; i++) {
        pcre2_match_data_free(tok->match[i]);
        pcre2_code_free(tok->splits[i]);
    }
    io_bytesmap_free(&tok->whole);
    free(tok->whole_id);
    for (int i = 0; i < tok->n_norm; i++) {
        free(tok->norm[i].a);
        free(tok->norm[i].b);
    }
    for (int i = 0; i < tok->n_added; i++) free(tok->added[i].bytes);
    free(tok->added);
    io_bytesmap_free(&tok->cache);
    free(tok->cache_ids);
    free(tok->cache_start);
    free(tok);
}

loom_tokenizer *bpe_tokenizer_alloc(int vocab_size, int n_merges) {
    loom_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return NULL;
    tok->vocab_size = vocab_size;
    tok->n_merges = n_merges;
    tok->eot = tok->bos = -1;
    tok->merges = malloc(((size_t)n_merges * 2 + 1) * sizeof *tok->merges);
    tok->merged = malloc(((size_t)n_merges + 1) * sizeof *tok->merged);
    tok->tok_off = calloc((size_t)vocab_size + 1, sizeof *tok->tok_off);
    tok->special = calloc((size_t)vocab_size + 1, 1);
    if (!tok->merges || !tok->merged || !tok->tok_off || !tok->special) {
        loom_tokenizer_free(tok);
        return NULL;
    }
    return tok;
}

void bpe_byte_chars_init(bpe_byte_chars *bc) {
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        unsigned cp = printable ? (unsigned)b : 256u + (unsigned)extra++;
        if (cp < 0x80) {
            bc->s[b][0] = (char)cp;
            bc->len[b] = 1;
        } else {
            bc->s[b][0] = (char)(0xC0 | (cp >> 6));
            bc->s[b][1] = (char)(0x80 | (cp & 0x3F));
            bc->len[b] = 2;
        }
    }
}

static inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

loom_status bpe_tokenizer_build(const int32_t *merges, int n_merges, int with_eot, loom_tokenizer **out) {
    *out = NULL;
    int vocab = 256 + n_merges + (with_eot ? 1 : 0);
    loom_tokenizer *tok = bpe_tokenizer_alloc(vocab, n_merges);
    size_t v = (size_t)vocab;
    size_t *len = tok ? malloc(v * sizeof *len) : NULL;
    if (len) {
        tok->eot = tok->bos = with_eot ? vocab - 1 : -1;
        if (with_eot) tok->special[tok->eot] = 1;
        for (int i = 0; i < 256; i++) tok->byte_id[i] = i;
        /* Lengths, then offsets as their prefix sums. Token lengths are at
         * most BPE_MAX_CHUNK (checked on load), so nothing overflows. */
        for (int i = 0; i < 256; i++) len[i] = 1;
        for (int r = 0; r < n_merges; r++) len[256 + r] = len[merges[2 * r]] + len[merges[2 * r + 1]];
        if (with_eot) len[tok->eot] = strlen(LOOM_TOKENIZER_EOT);
        for (size_t i = 0; i < v; i++) tok->tok_off[i + 1] = tok->tok_off[i] + len[i];
        tok->arena = malloc(tok->tok_off[v] + 1);
    }
    if (!tok || !len || !tok->arena) {
        free(len);
        loom_tokenizer_free(tok);
        return loom_error(LOOM_ERR_NOMEM, "out of memory building a tokenizer of %zu tokens", v);
    }
    memcpy(tok->merges, merges, (size_t)n_merges * 2 * sizeof *merges);
    for (int i = 0; i < 256; i++) tok->arena[i] = (char)i;
    /* A merge's parts have smaller ids, so their bytes are already in place. */
    for (int r = 0; r < n_merges; r++) {
        int32_t a = merges[2 * r], b = merges[2 * r + 1];
        char *dst = tok->arena + tok->tok_off[256 + r];
        tok->merged[r] = 256 + r;
        memcpy(dst, tok->arena + tok->tok_off[a], len[a]);
        memcpy(dst + len[a], tok->arena + tok->tok_off[b], len[b]);
        if (!io_u64map_upsert(&tok->ranks, pair_key(a, b), r, NULL)) {
            free(len);
            loom_tokenizer_free(tok);
            return loom_error(LOOM_ERR_NOMEM, "out of memory building a tokenizer of %zu tokens", v);
        }
    }
    if (with_eot) memcpy(tok->arena + tok->tok_off[tok->eot], LOOM_TOKENIZER_EOT, len[tok->eot]);
    free(len);
    *out = tok;
    return LOOM_OK;
}

int loom_tokenizer_vocab_size(const loom_tokenizer *tok) { return tok ? tok->vocab_size : 0; }
int loom_tokenizer_num_merges(const loom_tokenizer *tok) { return tok ? tok->n_merges : 0; }
int loom_tokenizer_eot(const loom_tokenizer *tok) { return tok ? tok->eot : -1; }
int loom_tokenizer_bos(const loom_tokenizer *tok) { return tok ? tok->bos : -1; }
int loom_tokenizer_is_special(const loom_tokenizer *tok, int32_t id) {
    return tok && id >= 0 && id < tok->vocab_size && tok->special[id];
}

/* --------------------------------------------------------------- encode */

/* Hugging Face's order of merges: the lowest-ranked adjacent pair, the
 * leftmost among equals, one at a time (a queue of candidate pairs by rank,
 * then position; a candidate whose pair has changed is skipped), in
 * O(n log n) where a whole document may be one piece (SentencePiece-style
 * files). ids[0..n) becomes the result; returns its length, or SIZE_MAX when
 * out of memory. */
typedef struct bpe_cand { uint32_t rank, pos; } bpe_cand;

static int cand_less(bpe_cand x, bpe_cand y) { return x.rank < y.rank || (x.rank == y.rank && x.pos < y.pos); }

static void cand_push(bpe_cand *h, size_t *n, bpe_cand c) {
    size_t i = (*n)++;
    for (; i > 0 && cand_less(c, h[(i - 1) / 2]); i = (i - 1) / 2) h[i] = h[(i - 1) / 2];
    h[i] = c;
}

static bpe_cand cand_pop(bpe_cand *h, size_t *n) {
    bpe_cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && cand_less(h[c + 1], h[c])) c++;
        if (!cand_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

static int64_t pair_rank(const loom_tokenizer *tok, int32_t a, int32_t b) {
    const int64_t *r = io_u64map_find(&tok->ranks, pair_key(a, b));
    return r ? *r : -1;
}

static size_t bpe_queue(const loom_tokenizer *tok, int32_t *ids, size_t n) {
    if (n < 2) return n;
    uint32_t *next = malloc(n * sizeof *next), *prev = malloc(n * sizeof *prev);
    bpe_cand *heap = malloc(3 * n * sizeof *heap); /* n - 1 pairs, then at most 2 per merge */
    if (!next || !prev || !heap) {
        free(next);
        free(prev);
        free(heap);
        return SIZE_MAX;
    }
    const uint32_t none = UINT32_MAX;
    size_t nh = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = i + 1 < n ? (uint32_t)(i + 1) : none;
        prev[i] = i ? (uint32_t)(i - 1) : none;
        int64_t r = i + 1 < n ? pair_rank(tok, ids[i], ids[i + 1]) : -1;
        if (r >= 0) cand_push(heap, &nh, (bpe_cand){(uint32_t)r, (uint32_t)i});
    }
    while (nh) {
        bpe_cand c = cand_pop(heap, &nh);
        uint32_t j = next[c.pos];
        /* dead (merged into its left neighbour: prev points past it), or its pair changed */
        if (j == none || ids[c.pos] < 0 || pair_rank(tok, ids[c.pos], ids[j]) != (int64_t)c.rank) continue;
        ids[c.pos] = tok->merged[c.rank];
        ids[j] = -1; /* dead */
        next[c.pos] = next[j];
        if (next[j] != none) prev[next[j]] = c.pos;
        int64_t r;
        if (prev[c.pos] != none && (r = pair_rank(tok, ids[prev[c.pos]], ids[c.pos])) >= 0)
            cand_push(heap, &nh, (bpe_cand){(uint32_t)r, prev[c.pos]});
        if (next[c.pos] != none && (r = pair_rank(tok, ids[c.pos], ids[next[c.pos]])) >= 0)
            cand_push(heap, &nh, (bpe_cand){(uint32_t)r, c.pos});
    }
    size_t m = 0;
    for (uint32_t i = 0; i != none; i = next[i]) ids[m++] = ids[i];
    free(next);
    free(prev);
    free(heap);
    return m;
}

/* BPE on one chunk, ids with room for n; returns the number of ids, or
 * SIZE_MAX when out of memory. loom's own tokenizers merge the
 * lowest-ranked pair, every occurrence left to right, at a time (GPT-2's
 * encoder; chunks are short); Hugging Face ones in bpe_queue's order, the
 * same for any merge list a trainer makes. */
static size_t bpe_chunk(const loom_tokenizer *tok, const unsigned char *s, size_t n, int32_t *ids) {
    if (tok->ignore_merges) { /* the vocabulary spells the whole piece */
        int64_t e = io_bytesmap_find(&tok->whole, s, n);
        if (e >= 0) {
            ids[0] = tok->whole_id[e];
            return 1;
        }
    }
    for (size_t i = 0; i < n; i++) ids[i] = tok->byte_id[s[i]];
    if (tok->hf) return bpe_queue(tok, ids, n);
    size_t m = n;
    while (m >= 2) {
        int64_t best = INT64_MAX;
        for (size_t i = 0; i + 1 < m; i++) {
            const int64_t *r = io_u64map_find(&tok->ranks, pair_key(ids[i], ids[i + 1]));
            if (r && *r < best) best = *r;
        }
        if (best == INT64_MAX) break;
        int32_t a = tok->merges[2 * best], b = tok->merges[2 * best + 1], id = tok->merged[best];
        size_t j = 0;
        for (size_t i = 0; i < m;) {
            if (i + 1 < m && ids[i] == a && ids[i + 1] == b) {
                ids[j++] = id;
                i += 2;
            } else {
                ids[j++] = ids[i++];
            }
        }
        m = j;
    }
    return m;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return 0;
    *p = np;
    *cap = c;
    return 1;
}

/* The ids of one chunk, from the cache or computed and cached. */
static loom_status chunk_ids(loom_tokenizer *tok, const unsigned char *s, size_t n, const int32_t **ids,
                             size_t *m) {
    int64_t e = io_bytesmap_find(&tok->cache, s, n);
    if (e < 0) {
        if (n >= UINT32_MAX)
            return loom_error(LOOM_ERR_INVALID, "tokenizer: a piece of %zu bytes is more than loom encodes (4 GiB)", n);
        int32_t stack[BPE_MAX_CHUNK], *tmp = n <= BPE_MAX_CHUNK ? stack : malloc(n * sizeof *tmp);
        if (!tmp) return loom_error(LOOM_ERR_NOMEM, "out of memory encoding a %zu-byte piece", n);
        size_t k = bpe_chunk(tok, s, n, tmp);
        if (k == SIZE_MAX) {
            if (tmp != stack) free(tmp);
            return loom_error(LOOM_ERR_NOMEM, "out of memory encoding a %zu-byte piece", n);
        }
        size_t used = tok->cache.n ? tok->cache_start[tok->cache.n] : 0;
        if (used + k > CACHE_MAX_IDS) {
            io_bytesmap_clear(&tok->cache);
            used = 0;
        }
        int inserted;
        if (!grow((void **)&tok->cache_ids, &tok->cache_ids_cap, used + k, sizeof(int32_t)) ||
            !grow((void **)&tok->cache_start, &tok->cache_start_cap, tok->cache.n + 2, sizeof(size_t)) ||
            (e = io_bytesmap_insert(&tok->cache, s, n, &inserted)) < 0) {
            if (tmp != stack) free(tmp);
            return loom_error(LOOM_ERR_NOMEM, "out of memory in the tokenizer's cache");
        }
        tok->cache_start[e] = used;
        memcpy(tok->cache_ids + used, tmp, k * sizeof *tmp);
        tok->cache_start[e + 1] = used + k;
        if (tmp != stack) free(tmp);
    }
    *ids = tok->cache_ids + tok->cache_start[e];
    *m = tok->cache_start[e + 1] - tok->cache_start[e];
    return LOOM_OK;
}

/* The ids of s[0..n) go to out (room for capacity; *count counts them all). */
typedef struct enc_out {
    int32_t *ids;
    size_t capacity, count;
    int cont;     /* the text continues another: no Prepend step on its first piece */
    int at_start; /* nothing of the text is encoded yet (Metaspace's "first") */
} enc_out;

/* Append k ids (counted all, stored while there is room). */
static void emit_ids(enc_out *o, const int32_t *ids, size_t k) {
    for (size_t i = 0; i < k; i++, o->count++)
        if (o->count < o->capacity) o->ids[o->count] = ids[i];
}

static loom_status emit_chunk(loom_tokenizer *tok, const unsigned char *s, size_t n, enc_out *o) {
    const int32_t *ids;
    size_t m;
    LOOM_TRY(chunk_ids(tok, s, n, &ids, &m));
    emit_ids(o, ids, m);
    return LOOM_OK;
}

/* Hugging Face pre-tokenization: split s[0..n) by regular expression `level`
 * (each match and each gap between matches a piece), each piece by the next,
 * and the pieces of the last are chunks. Invalid UTF-8 is never matched, so
 * it lands in the gaps: no byte is lost. */
static loom_status emit_split(loom_tokenizer *tok, int level, const unsigned char *s, size_t n, enc_out *o) {
    if (level == tok->n_splits) return n ? emit_chunk(tok, s, n, o) : LOOM_OK;
    pcre2_code *re = tok->splits[level];
    pcre2_match_data *md = tok->match[level];
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(re, s, n, pos, PCRE2_NOTEMPTY, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return loom_error(LOOM_ERR_INVALID, "tokenizer: its pre-tokenizer's expression failed: %s", (char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        LOOM_TRY(emit_split(tok, level + 1, s + pos, ov[0] - pos, o));   /* the gap */
        LOOM_TRY(emit_split(tok, level + 1, s + ov[0], ov[1] - ov[0], o)); /* the match */
        pos = ov[1];
    }
    return emit_split(tok, level + 1, s + pos, n - pos, o);
}

/* Length of the UTF-8 character at s[0..n) (1 for a byte that does not
 * start a valid one: it stands alone). */
static size_t utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t k = c < 0x80 ? 1 : (c >> 5) == 6 && c >= 0xC2 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 && c <= 0xF4 ? 4 : 1;
    if (k > n) return 1;
    for (size_t i = 1; i < k; i++)
        if ((s[i] & 0xC0) != 0x80) return 1;
    if (k == 3 && ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] >= 0xA0))) return 1; /* overlong, surrogate */
    if (k == 4 && ((c == 0xF0 && s[1] < 0x90) || (c == 0xF4 && s[1] >= 0x90))) return 1;  /* overlong, > U+10FFFF */
    return k;
}

/* SentencePiece-style: normalize (each step in turn), then the whole text is
 * one piece of characters (unknown ones as their bytes' tokens), merged in
 * Hugging Face's order. */
static size_t sat_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }
static size_t sat_mul(size_t a, size_t b) { return b && a > SIZE_MAX / b ? SIZE_MAX : a * b; }

/* At most the bytes the normalizer makes of len bytes (saturating): each
 * replaced pattern, at least one byte, becomes at most its replacement; a
 * normal form grows text by at most BPE_FORM_GROWTH. */
static size_t norm_cap(const loom_tokenizer *tok, size_t len) {
    size_t cap = len;
    for (int i = 0; i < tok->n_norm; i++) {
        const struct bpe_norm *nm = &tok->norm[i];
        cap = nm->form ? sat_mul(cap, BPE_FORM_GROWTH(nm->form))
              : nm->prepend ? sat_add(cap, nm->na) : sat_mul(cap, nm->nb > 1 ? nm->nb : 1);
    }
    return cap;
}

size_t loom_tokenizer_max_ids(const loom_tokenizer *tok, size_t len) {
    if (!tok || !tok->hf) return len; /* at most one id per byte */
    /* at most one per normalized byte; the pieces between added tokens (at
     * most len + 1) are normalized apart, each with what the normalizer adds
     * to nothing (norm_cap(0)) */
    size_t ids = sat_add(norm_cap(tok, len), tok->n_added ? sat_mul(len, norm_cap(tok, 0)) : 0);
    /* Metaspace: each byte may become the replacement, and each piece (at
     * most len + 1) may get one in front */
    return tok->meta ? sat_add(sat_mul(ids, tok->meta_rep_len), sat_mul(len + 1, tok->meta_rep_len)) : ids;
}

/* Append n bytes to a growing buffer; 0 when out of memory. */
static int put(unsigned char **b, size_t *len, size_t *cap, const unsigned char *src, size_t n) {
    if (!grow((void **)b, cap, *len + n, 1)) return 0;
    memcpy(*b + *len, src, n);
    *len += n;
    return 1;
}

/* A cut before an ASCII character never changes a normal form: it is a
 * starter (nothing is reordered across it) and no canonical composition
 * takes it second. So ASCII followed by ASCII is copied as it is, and
 * utf8proc normalizes each stretch from an ASCII character followed by
 * other text (or from other text) to the next ASCII character, or to a byte
 * that is not UTF-8 (Hugging Face's library never meets those: its text is
 * a Rust String; here they are kept, and cut the text as ASCII does). */
unsigned char *bpe_unicode_form(const unsigned char *s, size_t n, enum bpe_form form, size_t *out) {
    static const utf8proc_option_t opts[] = {
        [BPE_NFC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE,
        [BPE_NFD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE,
        [BPE_NFKC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
        [BPE_NFKD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT,
    };
    size_t len = 0, cap = 0;
    unsigned char *b = NULL;
    if (!grow((void **)&b, &cap, n ? n : 1, 1)) return NULL;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && s[j] < 0x80 && (j + 1 == n || s[j + 1] < 0x80)) j++;
        if (j > i) { /* ASCII before ASCII (or the end): its own normal form */
            if (!put(&b, &len, &cap, s + i, j - i)) goto nomem;
            i = j;
            continue;
        }
        /* ASCII before other bytes, or other bytes: UTF-8 characters up to the next ASCII */
        utf8proc_int32_t cp;
        utf8proc_ssize_t k;
        j += s[i] < 0x80;
        while (j < n && s[j] >= 0x80 && (k = utf8proc_iterate(s + j, (utf8proc_ssize_t)(n - j), &cp)) > 0)
            j += (size_t)k;
        if (j - i <= 1) { /* a byte that is not UTF-8, or ASCII before one: kept */
            if (!put(&b, &len, &cap, s + i, 1)) goto nomem;
            i++;
            continue;
        }
        utf8proc_uint8_t *d = NULL;
        utf8proc_ssize_t m = utf8proc_map(s + i, (utf8proc_ssize_t)(j - i), &d, opts[form]);
        int ok = m >= 0 && put(&b, &len, &cap, d, (size_t)m);
        free(d);
        if (!ok) goto nomem;
        i = j;
    }
    *out = len;
    return b;
nomem:
    free(b);
    return NULL;
}

unsigned char *bpe_normalize(const loom_tokenizer *tok, const unsigned char *s, size_t n, int cont, size_t *out) {
    unsigned char *cur = malloc(n ? n : 1);
    if (!cur) return NULL;
    memcpy(cur, s, n);
    for (int i = 0; i < tok->n_norm; i++) {
        const struct bpe_norm *nm = &tok->norm[i];
        size_t m = n, hits = 0;
        if (nm->form) {
            unsigned char *next = bpe_unicode_form(cur, n, nm->form, &m);
            free(cur);
            if (!next) return NULL;
            cur = next;
            n = m;
            continue;
        }
        if (nm->prepend) {
            if (!n || cont) continue; /* nothing to prepend to; a continuation is not a start */
            m = n + nm->na;
        } else {
            for (size_t j = 0; j + nm->na <= n;)
                if (!memcmp(cur + j, nm->a, nm->na)) { hits++; j += nm->na; } else j++;
            if (!hits) continue;
            m = sat_add(n - hits * nm->na, sat_mul(hits, nm->nb)); /* the hits fit in n */
        }
        unsigned char *next = m < SIZE_MAX ? malloc(m ? m : 1) : NULL;
        if (!next) {
            free(cur);
            return NULL;
        }
        if (nm->prepend) {
            memcpy(next, nm->a, nm->na);
            memcpy(next + nm->na, cur, n);
        } else {
            size_t k = 0;
            for (size_t j = 0; j < n;) {
                if (j + nm->na <= n && !memcmp(cur + j, nm->a, nm->na)) {
                    memcpy(next + k, nm->b, nm->nb);
                    k += nm->nb;
                    j += nm->na;
                } else {
                    next[k++] = cur[j++];
                }
            }
        }
        free(cur);
        cur = next;
        n = m;
    }
    *out = n;
    return cur;
}

/* Hugging Face's added tokens that are not special, which it finds in text
 * before anything else: the longest one of kind `normalized` (matched on
 * the raw text, or on the normalizer's output) starting at s[0..n), or -1. */
static int added_at(const loom_tokenizer *tok, const unsigned char *s, size_t n, int normalized) {
    int best = -1;
    if (!tok->added_first[s[0]]) return -1;
    for (int i = 0; i < tok->n_added; i++) {
        const struct bpe_added *t = &tok->added[i];
        if (t->normalized == normalized && t->len <= n && (best < 0 || t->len > tok->added[best].len) &&
            !memcmp(s, t->bytes, t->len))
            best = i;
    }
    return best;
}

typedef loom_status (*piece_fn)(loom_tokenizer *tok, const unsigned char *s, size_t n, enc_out *o);

/* s[0..n) split at the added tokens of kind `normalized` (leftmost, longest):
 * each token's id goes out as it is, each piece between them to piece(). */
static loom_status split_added(loom_tokenizer *tok, const unsigned char *s, size_t n, int normalized, enc_out *o,
                               piece_fn piece) {
    size_t start = 0;
    for (size_t i = 0; tok->n_added && i < n;) {
        int t = added_at(tok, s + i, n - i, normalized);
        if (t < 0) {
            i++;
            continue;
        }
        if (i > start) LOOM_TRY(piece(tok, s + start, i - start, o));
        emit_ids(o, &tok->added[t].id, 1);
        o->cont = o->at_start = 0;
        i += tok->added[t].len;
        start = i;
    }
    return n > start ? piece(tok, s + start, n - start, o) : LOOM_OK;
}

/* SentencePiece-style, one piece of normalized text: its characters (unknown
 * ones as their bytes' tokens), merged in Hugging Face's order. */
static loom_status sp_piece(loom_tokenizer *tok, const unsigned char *a, size_t n, enc_out *o) {
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!ids) return loom_error(LOOM_ERR_NOMEM, "out of memory encoding %zu bytes", n);
    /* An unknown character (a byte of it without a token) waits, as in
     * Hugging Face, until the next character the vocabulary holds or the end
     * (characters given as bytes go out before it); with fuse_unk a run of
     * them is one. */
    size_t k = 0;
    int pending = 0;
    for (size_t j = 0; j < n;) {
        size_t c = utf8_len(a + j, n - j);
        int64_t e = io_bytesmap_find(&tok->whole, a + j, c);
        int known = 1;
        for (size_t i = 0; e < 0 && i < c; i++) known &= tok->byte_id[a[j + i]] >= 0;
        if (e >= 0) {
            if (pending) ids[k++] = tok->unk;
            pending = 0;
            ids[k++] = tok->whole_id[e];
        } else if (known) {
            for (size_t i = 0; i < c; i++) ids[k++] = tok->byte_id[a[j + i]]; /* byte fallback */
        } else {
            if (pending && !tok->fuse_unk) ids[k++] = tok->unk;
            pending = 1;
        }
        j += c;
    }
    if (pending) ids[k++] = tok->unk;
    loom_status st = LOOM_OK;
    if ((k = bpe_queue(tok, ids, k)) == SIZE_MAX)
        st = loom_error(LOOM_ERR_NOMEM, "out of memory encoding %zu bytes", n);
    if (st == LOOM_OK) emit_ids(o, ids, k);
    free(ids);
    return st;
}

/* Metaspace, on one piece between normalized added tokens: spaces become
 * the replacement, which goes first unless the piece starts with it (when
 * the scheme says so for this piece), then with split each replacement
 * starts a piece of its own (Hugging Face's MergedWithNext). */
static loom_status meta_piece(loom_tokenizer *tok, const unsigned char *s, size_t n, enc_out *o) {
    const char *rep = tok->meta_rep;
    size_t r = tok->meta_rep_len, cap = sat_add(sat_mul(n, r), r);
    unsigned char *b = malloc(cap ? cap : 1);
    if (!b) return loom_error(LOOM_ERR_NOMEM, "out of memory encoding %zu bytes", n);
    size_t m = 0;
    int first = o->at_start;
    o->at_start = 0;
    int starts = n && (s[0] == ' ' || (n >= r && !memcmp(s, rep, r)));
    if (!starts && (tok->meta == META_ALWAYS || (tok->meta == META_FIRST && first))) {
        memcpy(b, rep, r);
        m = r;
    }
    for (size_t j = 0; j < n; j++) {
        if (s[j] == ' ') {
            memcpy(b + m, rep, r);
            m += r;
        } else {
            b[m++] = s[j];
        }
    }
    loom_status st = LOOM_OK;
    size_t start = 0;
    for (size_t j = 1; tok->meta_split && st == LOOM_OK && j + r <= m; j++)
        if (!memcmp(b + j, rep, r)) {
            st = sp_piece(tok, b + start, j - start, o);
            start = j;
        }
    if (st == LOOM_OK && m > start) st = sp_piece(tok, b + start, m - start, o);
    free(b);
    return st;
}

/* SentencePiece-style, one piece of text between added tokens: normalize it
 * (each step in turn), then the normalized added tokens split it. */
static loom_status sp_segment(loom_tokenizer *tok, const unsigned char *text, size_t len, enc_out *o) {
    int cont = o->cont;
    o->cont = 0;
    size_t n = 0;
    unsigned char *a = bpe_normalize(tok, text, len, cont, &n);
    if (!a) return loom_error(LOOM_ERR_NOMEM, "out of memory normalizing %zu bytes", len);
    loom_status st = n >= UINT32_MAX ? loom_error(LOOM_ERR_INVALID, "tokenizer: a text of %zu bytes is one piece "
                                                  "for this tokenizer, more than loom encodes (4 GiB)", n)
                                     : split_added(tok, a, n, 1, o, tok->meta ? meta_piece : sp_piece);
    free(a);
    return st;
}

static loom_status split_top(loom_tokenizer *tok, const unsigned char *s, size_t n, enc_out *o) {
    return emit_split(tok, 0, s, n, o);
}

/* Byte-level, one piece of text between added tokens: normalized (its
 * normalizer has Unicode normal forms only, if any), then split by the
 * normalized added tokens. */
static loom_status bl_segment(loom_tokenizer *tok, const unsigned char *s, size_t n, enc_out *o) {
    if (!tok->n_norm) return split_added(tok, s, n, 1, o, split_top);
    size_t m = 0;
    unsigned char *a = bpe_normalize(tok, s, n, 0, &m);
    if (!a) return loom_error(LOOM_ERR_NOMEM, "out of memory normalizing %zu bytes", n);
    loom_status st = split_added(tok, a, m, 1, o, split_top);
    free(a);
    return st;
}

static loom_status encode(loom_tokenizer *tok, const void *text, size_t len, int32_t *out, size_t capacity,
                          size_t *n_out, int cont) {
    *n_out = 0;
    if (!tok || (len && !text))
        return loom_error(LOOM_ERR_INVALID, "loom_tokenizer_encode: NULL tokenizer or text");
    const unsigned char *s = text;
    enc_out o = {out, capacity, 0, cont, !cont};
    if (tok->hf) {
        LOOM_TRY(split_added(tok, s, len, 0, &o, tok->sp ? sp_segment : bl_segment));
    } else {
        for (size_t pos = 0; pos < len;) {
            size_t n = bpe_chunk_len(s + pos, len - pos);
            LOOM_TRY(emit_chunk(tok, s + pos, n, &o));
            pos += n;
        }
    }
    *n_out = o.count;
    if (o.count > capacity)
        return loom_error(LOOM_ERR_INVALID, "tokenizer: %zu bytes encode to %zu ids but the output holds "
                          "%zu; pass a buffer of at least %zu ids", len, o.count, capacity, o.count);
    return LOOM_OK;
}

loom_status loom_tokenizer_encode(loom_tokenizer *tok, const void *text, size_t len, int32_t *out,
                                  size_t capacity, size_t *n_out) {
    return encode(tok, text, len, out, capacity, n_out, 0);
}

loom_status loom_tokenizer_encode_more(loom_tokenizer *tok, const void *text, size_t len, int32_t *out,
                                       size_t capacity, size_t *n_out) {
    return encode(tok, text, len, out, capacity, n_out, 1);
}

/* --------------------------------------------------------------- decode */

loom_status loom_tokenizer_token_bytes(const loom_tokenizer *tok, int32_t id, const char **bytes,
                                       size_t *len) {
    if (id < 0 || id >= tok->vocab_size)
        return loom_error(LOOM_ERR_INVALID, "token id %d is outside the vocabulary [0, %d)", (int)id,
                          tok->vocab_size);
    *bytes = tok->arena + tok->tok_off[id];
    *len = tok->tok_off[id + 1] - tok->tok_off[id];
    return LOOM_OK;
}

int32_t loom_tokenizer_find(const loom_tokenizer *tok, const void *bytes, size_t len) {
    int32_t found = -1;
    for (int32_t id = 0; tok && id < tok->vocab_size; id++) {
        size_t n = tok->tok_off[id + 1] - tok->tok_off[id];
        if (n != len || memcmp(tok->arena + tok->tok_off[id], bytes, len)) continue;
        if (tok->special[id]) return id; /* a special token's name first */
        if (found < 0) found = id;
    }
    return found;
}

loom_status loom_tokenizer_merge(const loom_tokenizer *tok, int r, int32_t *a, int32_t *b) {
    if (r < 0 || r >= tok->n_merges)
        return loom_error(LOOM_ERR_INVALID, "merge %d is outside the tokenizer's %d merges", r, tok->n_merges);
    *a = tok->merges[2 * r];
    *b = tok->merges[2 * r + 1];
    return LOOM_OK;
}

loom_status loom_tokenizer_decode(const loom_tokenizer *tok, const int32_t *ids, size_t n, void *out,
                                  size_t capacity, size_t *n_out) {
    *n_out = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->vocab_size)
            return loom_error(LOOM_ERR_INVALID, "decode: id %zu is %d, outside the vocabulary [0, %d); was "
                              "it produced by another tokenizer?", i, (int)ids[i], tok->vocab_size);
        size_t l = tok->tok_off[ids[i] + 1] - tok->tok_off[ids[i]];
        if (out && total + l <= capacity) memcpy((char *)out + total, tok->arena + tok->tok_off[ids[i]], l);
        total += l;
    }
    *n_out = total;
    if (out && total > capacity)
        return loom_error(LOOM_ERR_INVALID, "decode: %zu ids give %zu bytes but the output holds %zu",
                          n, total, capacity);
    return LOOM_OK;
}

/* ------------------------------------------------------------ save/load */

loom_status loom_tokenizer_save(const loom_tokenizer *tok, const char *path) {
    if (!tok || !path) return loom_error(LOOM_ERR_INVALID, "loom_tokenizer_save: NULL tokenizer or path");
    if (tok->hf)
        return loom_error(LOOM_ERR_INVALID, "loom_tokenizer_save: a Hugging Face tokenizer is kept in its own "
                          "file: copy that file instead of saving it as a loom tokenizer ('%s')", path);
    json_t *root = json_object(), *merges = json_array(), *special = json_object();
    int ok = root && merges && special;
    for (int r = 0; ok && r < tok->n_merges; r++)
        ok = json_array_append_new(merges, json_pack("[ii]", (int)tok->merges[2 * r],
                                                     (int)tok->merges[2 * r + 1])) == 0;
    if (ok && tok->eot >= 0) ok = json_object_set_new(special, LOOM_TOKENIZER_EOT, json_integer(tok->eot)) == 0;
    ok = ok && json_object_set_new(root, "type", json_string("loom-bpe")) == 0 &&
         json_object_set_new(root, "version", json_integer(1)) == 0 &&
         json_object_set_new(root, "vocab_size", json_integer(tok->vocab_size)) == 0;
    ok = ok && json_object_set(root, "merges", merges) == 0 && json_object_set(root, "special", special) == 0;
    char *text = ok ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(merges);
    json_decref(special);
    json_decref(root);
    if (!text) return loom_error(LOOM_ERR_NOMEM, "out of memory saving tokenizer '%s'", path);
    loom_status s = loom_file_write_atomic(path, text, strlen(text));
    free(text);
    return s;
}

static loom_status load_bad(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static loom_status load_bad(const char *path, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return loom_error(LOOM_ERR_FORMAT, "tokenizer file '%s' is invalid: %s; re-train the tokenizer "
                      "or restore a good copy", path, what);
}

/* Validate the parsed JSON; on success *merges (malloc'd) holds the pairs. */
static loom_status parse_tokenizer(const char *path, json_t *root, int32_t **merges_out, int *n_out,
                                   int *with_eot) {
    if (!json_is_object(root)) return load_bad(path, "the top level is not a JSON object");
    json_t *type = json_object_get(root, "type"), *version = json_object_get(root, "version");
    json_t *vocab = json_object_get(root, "vocab_size"), *merges = json_object_get(root, "merges");
    json_t *special = json_object_get(root, "special");
    if (!json_is_string(type) || strcmp(json_string_value(type), "loom-bpe"))
        return load_bad(path, "\"type\" is not \"loom-bpe\"");
    if (!json_is_integer(version) || json_integer_value(version) != 1)
        return load_bad(path, "\"version\" is not 1 (this loom reads version 1)");
    if (!json_is_integer(vocab)) return load_bad(path, "\"vocab_size\" is missing or not an integer");
    if (!json_is_array(merges)) return load_bad(path, "\"merges\" is missing or not an array");
    size_t n = json_array_size(merges);
    if (n > (1u << 24)) return load_bad(path, "%zu merges is more than loom supports (2^24)", n);
    int32_t *m = malloc((2 * n + 1) * sizeof *m);
    size_t *len = malloc((256 + n) * sizeof *len);
    io_u64map seen = {0};
    loom_status s = (m && len) ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", path);
    for (size_t i = 0; i < 256 && s == LOOM_OK; i++) len[i] = 1;
    for (size_t r = 0; r < n && s == LOOM_OK; r++) {
        json_t *pair = json_array_get(merges, r);
        json_t *a = json_array_get(pair, 0), *b = json_array_get(pair, 1);
        if (!json_is_array(pair) || json_array_size(pair) != 2 || !json_is_integer(a) || !json_is_integer(b)) {
            s = load_bad(path, "merge %zu is not a pair of integer ids [a, b]", r);
            break;
        }
        json_int_t ia = json_integer_value(a), ib = json_integer_value(b);
        if (ia < 0 || ib < 0 || ia >= (json_int_t)(256 + r) || ib >= (json_int_t)(256 + r)) {
            s = load_bad(path, "merge %zu is [%lld, %lld] but may only use ids below %zu (the bytes and "
                         "earlier merges)", r, (long long)ia, (long long)ib, 256 + r);
            break;
        }
        m[2 * r] = (int32_t)ia;
        m[2 * r + 1] = (int32_t)ib;
        len[256 + r] = len[ia] + len[ib];
        if (len[256 + r] > BPE_MAX_CHUNK) {
            s = load_bad(path, "merge %zu makes a %zu-byte token, longer than any chunk (%d bytes)", r,
                         len[256 + r], BPE_MAX_CHUNK);
            break;
        }
        int inserted;
        if (!io_u64map_upsert(&seen, pair_key(m[2 * r], m[2 * r + 1]), (int64_t)r, &inserted))
            s = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", path);
        else if (!inserted)
            s = load_bad(path, "merge %zu repeats the pair [%d, %d] of merge %lld", r, (int)m[2 * r],
                         (int)m[2 * r + 1], (long long)*io_u64map_find(&seen, pair_key(m[2 * r], m[2 * r + 1])));
    }
    io_u64map_free(&seen);
    free(len);
    *with_eot = 0;
    if (s == LOOM_OK && special && !json_is_object(special)) s = load_bad(path, "\"special\" is not an object");
    const char *key;
    json_t *v;
    if (s == LOOM_OK && special) {
        json_object_foreach(special, key, v) {
            if (strcmp(key, LOOM_TOKENIZER_EOT)) {
                s = load_bad(path, "unknown special token \"%s\" (only \"%s\" is supported)", key,
                             LOOM_TOKENIZER_EOT);
                break;
            }
            if (!json_is_integer(v) || json_integer_value(v) != (json_int_t)(256 + n)) {
                s = load_bad(path, "special token \"%s\" must have id %zu (right after the merges)", key, 256 + n);
                break;
            }
            *with_eot = 1;
        }
    }
    if (s == LOOM_OK && json_integer_value(vocab) != (json_int_t)(256 + n + (size_t)*with_eot))
        s = load_bad(path, "\"vocab_size\" is %lld but 256 bytes + %zu merges + %d special tokens make %zu",
                     (long long)json_integer_value(vocab), n, *with_eot, 256 + n + (size_t)*with_eot);
    if (s != LOOM_OK) {
        free(m);
        return s;
    }
    *merges_out = m;
    *n_out = (int)n;
    return LOOM_OK;
}

loom_status loom_tokenizer_load(const char *path, loom_tokenizer **out) {
    *out = NULL;
    if (!path) return loom_error(LOOM_ERR_INVALID, "loom_tokenizer_load: path is NULL");
    void *data;
    size_t len;
    LOOM_TRY(loom_read_file(path, &data, &len));
    json_error_t jerr;
    json_t *root = json_loadb(data, len, JSON_REJECT_DUPLICATES, &jerr);
    free(data);
    if (!root && strstr(jerr.text, "NUL byte in object key"))
        return loom_error(LOOM_ERR_UNSUPPORTED, "tokenizer file '%s' has a NUL character in an object key (line %d, "
                          "column %d: a token \"\\u0000\"), which loom's JSON parser (jansson) does not read", path,
                          jerr.line, jerr.column);
    if (!root)
        return load_bad(path, "the JSON does not parse (line %d, column %d: %s)", jerr.line, jerr.column,
                        jerr.text);
    if (json_is_object(root) && !json_object_get(root, "type") && json_is_object(json_object_get(root, "model"))) {
        loom_status s = bpe_tokenizer_load_hf(path, root, out); /* a Hugging Face tokenizer.json */
        json_decref(root);
        return s;
    }
    int32_t *merges = NULL;
    int n = 0, with_eot = 0;
    loom_status s = parse_tokenizer(path, root, &merges, &n, &with_eot);
    json_decref(root);
    if (s == LOOM_OK) s = bpe_tokenizer_build(merges, n, with_eot, out);
    free(merges);
    return s;
}
