/*
 * bpe_train.c — learning BPE merges from text.
 *
 * 1. Pre-split every text into chunks (bpe_chunk_len) and count each
 *    distinct chunk ("word") once, with its frequency.
 * 2. Count every adjacent pair over the words (weighted by frequency) and
 *    remember, per pair, the words it occurs in.
 * 3. Repeatedly take the most frequent pair (a max-heap with lazy entries;
 *    ties: smaller first id, then smaller second id), rewrite only the words
 *    that hold it, and adjust only the counts of pairs next to a merge site.
 * Cost per merge is proportional to the words that contain the merged pair,
 * not to the corpus. Must never: depend on hash-map order (the result is a
 * pure function of the texts and vocab_size).
 */
#include "io/io_internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct pair_rec {
    uint64_t key;    /* a << 32 | b */
    int64_t count;   /* sum of frequencies of its occurrences */
    int32_t *words;  /* words that held it when added (may be stale; no duplicates) */
    uint32_t n_words, cap_words;
    int32_t touched; /* last merge round that raised its count */
} pair_rec;

typedef struct heap_entry {
    int64_t count;
    uint64_t key;
    int32_t pair;
} heap_entry;

typedef struct trainer {
    /* words */
    int32_t *ids;       /* all words' ids, word w at ids[word_off[w] .. + word_len[w]] */
    size_t *word_off;
    int32_t *word_len;
    int64_t *freq;
    size_t n_words;
    /* pairs */
    io_u64map index;    /* key -> pair number */
    pair_rec *pairs;
    size_t n_pairs, cap_pairs;
    heap_entry *heap;
    size_t n_heap, cap_heap;
} trainer;

static inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return 0;
    *p = np;
    *cap = c;
    return 1;
}

/* ------------------------------------------------------------------ heap */

static inline int before(const heap_entry *x, const heap_entry *y) {
    return x->count > y->count || (x->count == y->count && x->key < y->key);
}

static int heap_push(trainer *t, int32_t p) {
    if (!grow((void **)&t->heap, &t->cap_heap, t->n_heap + 1, sizeof *t->heap)) return 0;
    heap_entry e = {t->pairs[p].count, t->pairs[p].key, p};
    size_t i = t->n_heap++;
    while (i > 0 && before(&e, &t->heap[(i - 1) / 2])) {
        t->heap[i] = t->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    t->heap[i] = e;
    return 1;
}

static heap_entry heap_pop(trainer *t) {
    heap_entry top = t->heap[0], last = t->heap[--t->n_heap];
    size_t i = 0, n = t->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&t->heap[c + 1], &t->heap[c])) c++;
        if (!before(&t->heap[c], &last)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (n > 0) t->heap[i] = last;
    return top;
}

/* ----------------------------------------------------------------- pairs */

/* The pair number of (a, b), created with count 0 if new; -1 on OOM. */
static int32_t pair_get(trainer *t, int32_t a, int32_t b) {
    int inserted;
    int64_t *slot = io_u64map_upsert(&t->index, pair_key(a, b), (int64_t)t->n_pairs, &inserted);
    if (!slot) return -1;
    if (!inserted) return (int32_t)*slot;
    if (!grow((void **)&t->pairs, &t->cap_pairs, t->n_pairs + 1, sizeof *t->pairs)) return -1;
    pair_rec *r = &t->pairs[t->n_pairs];
    memset(r, 0, sizeof *r);
    r->key = pair_key(a, b);
    r->touched = -1;
    return (int32_t)t->n_pairs++;
}

static int pair_add_word(pair_rec *r, int32_t w) {
    if (r->n_words && r->words[r->n_words - 1] == w) return 1;
    if (r->n_words == r->cap_words) {
        uint32_t c = r->cap_words ? 2 * r->cap_words : 4;
        int32_t *nw = realloc(r->words, c * sizeof *nw);
        if (!nw) return 0;
        r->words = nw;
        r->cap_words = c;
    }
    r->words[r->n_words++] = w;
    return 1;
}

static void trainer_free(trainer *t) {
    free(t->ids);
    free(t->word_off);
    free(t->word_len);
    free(t->freq);
    for (size_t i = 0; i < t->n_pairs; i++) free(t->pairs[i].words);
    free(t->pairs);
    free(t->heap);
    io_u64map_free(&t->index);
}

/* ----------------------------------------------------------------- setup */

static loom_status count_words(trainer *t, const char *const *texts, const size_t *lengths, size_t n_texts) {
    io_bytesmap chunks = {0};
    size_t cap_freq = 0;
    loom_status s = LOOM_OK;
    for (size_t k = 0; k < n_texts && s == LOOM_OK; k++) {
        const unsigned char *p = (const unsigned char *)texts[k];
        size_t len = lengths ? lengths[k] : strlen(texts[k]);
        for (size_t pos = 0; pos < len;) {
            size_t n = bpe_chunk_len(p + pos, len - pos);
            int inserted;
            int64_t e = io_bytesmap_insert(&chunks, p + pos, n, &inserted);
            if (e < 0 || !grow((void **)&t->freq, &cap_freq, (size_t)e + 1, sizeof *t->freq)) {
                s = loom_error(LOOM_ERR_NOMEM, "out of memory counting the training text");
                break;
            }
            if (inserted) t->freq[e] = 0;
            t->freq[e]++;
            pos += n;
        }
    }
    t->n_words = chunks.n;
    if (s == LOOM_OK) {
        t->ids = malloc((chunks.arena_len + 1) * sizeof *t->ids);
        t->word_off = malloc((t->n_words + 1) * sizeof *t->word_off);
        t->word_len = malloc((t->n_words + 1) * sizeof *t->word_len);
        if (!t->ids || !t->word_off || !t->word_len)
            s = loom_error(LOOM_ERR_NOMEM, "out of memory counting the training text");
    }
    for (size_t w = 0; s == LOOM_OK && w < t->n_words; w++) {
        t->word_off[w] = chunks.key_off[w];
        t->word_len[w] = (int32_t)chunks.key_len[w];
        for (uint32_t i = 0; i < chunks.key_len[w]; i++)
            t->ids[chunks.key_off[w] + i] = (unsigned char)chunks.arena[chunks.key_off[w] + i];
    }
    io_bytesmap_free(&chunks);
    return s;
}

static loom_status count_pairs(trainer *t) {
    for (size_t w = 0; w < t->n_words; w++) {
        const int32_t *ids = t->ids + t->word_off[w];
        for (int32_t i = 0; i + 1 < t->word_len[w]; i++) {
            int32_t p = pair_get(t, ids[i], ids[i + 1]);
            if (p < 0 || !pair_add_word(&t->pairs[p], (int32_t)w))
                return loom_error(LOOM_ERR_NOMEM, "out of memory counting pairs");
            t->pairs[p].count += t->freq[w];
        }
    }
    for (size_t p = 0; p < t->n_pairs; p++)
        if (!heap_push(t, (int32_t)p)) return loom_error(LOOM_ERR_NOMEM, "out of memory counting pairs");
    return LOOM_OK;
}

/* ----------------------------------------------------------------- merge */

/* The most frequent live pair, or -1 when none is left. */
static int32_t best_pair(trainer *t, loom_status *s) {
    while (t->n_heap > 0) {
        heap_entry e = heap_pop(t);
        int64_t cur = t->pairs[e.pair].count;
        if (cur == e.count && cur > 0) return e.pair;
        /* Stale: counts only fall after an entry is pushed; re-queue the
         * current count so the heap never under-reports a pair. */
        if (cur > 0 && !heap_push(t, e.pair)) {
            *s = loom_error(LOOM_ERR_NOMEM, "out of memory training the tokenizer");
            return -1;
        }
    }
    return -1;
}

/* Replace (a, b) by z in word w and adjust the neighbouring pair counts.
 * Pairs that increase (they contain z) are collected in touched[]. */
static loom_status merge_word(trainer *t, int32_t w, int32_t a, int32_t b, int32_t z, int32_t round,
                              int32_t **touched, size_t *n_touched, size_t *cap_touched) {
    int32_t *ids = t->ids + t->word_off[w];
    int32_t n = t->word_len[w];
    int64_t f = t->freq[w];
    unsigned char site[BPE_MAX_CHUNK]; /* 1 where an old id is part of a merge */
    int any = 0;
    memset(site, 0, (size_t)n);
    for (int32_t i = 0; i + 1 < n; i++) {
        if (ids[i] == a && ids[i + 1] == b) {
            site[i] = site[i + 1] = 1;
            any = 1;
            i++;
        }
    }
    if (!any) return LOOM_OK; /* a stale entry in the pair's word list */
    for (int32_t i = 0; i + 1 < n; i++) {
        if (!site[i] && !site[i + 1]) continue;
        int64_t *p = io_u64map_find(&t->index, pair_key(ids[i], ids[i + 1]));
        LOOM_ASSERT(p != NULL);
        t->pairs[*p].count -= f;
    }
    int32_t m = 0;
    for (int32_t i = 0; i < n;) {
        if (i + 1 < n && site[i] && site[i + 1] && ids[i] == a && ids[i + 1] == b) {
            ids[m++] = z;
            i += 2;
        } else {
            ids[m++] = ids[i++];
        }
    }
    t->word_len[w] = m;
    for (int32_t i = 0; i + 1 < m; i++) {
        if (ids[i] != z && ids[i + 1] != z) continue;
        int32_t p = pair_get(t, ids[i], ids[i + 1]);
        if (p < 0 || !pair_add_word(&t->pairs[p], w))
            return loom_error(LOOM_ERR_NOMEM, "out of memory training the tokenizer");
        t->pairs[p].count += f;
        if (t->pairs[p].touched != round) {
            t->pairs[p].touched = round;
            if (!grow((void **)touched, cap_touched, *n_touched + 1, sizeof **touched))
                return loom_error(LOOM_ERR_NOMEM, "out of memory training the tokenizer");
            (*touched)[(*n_touched)++] = p;
        }
    }
    return LOOM_OK;
}

static loom_status learn(trainer *t, int target, int32_t *merges, int *n_merges) {
    int32_t *touched = NULL;
    size_t n_touched = 0, cap_touched = 0;
    loom_status s = LOOM_OK;
    int r = 0;
    for (; r < target && s == LOOM_OK; r++) {
        int32_t p = best_pair(t, &s);
        if (p < 0) break;
        int32_t a = (int32_t)(t->pairs[p].key >> 32), b = (int32_t)(uint32_t)t->pairs[p].key;
        int32_t z = 256 + r;
        merges[2 * r] = a;
        merges[2 * r + 1] = b;
        /* Take the word list: merge_word may grow t->pairs (moving records). */
        int32_t *words = t->pairs[p].words;
        uint32_t n_words = t->pairs[p].n_words;
        t->pairs[p].words = NULL;
        t->pairs[p].n_words = t->pairs[p].cap_words = 0;
        n_touched = 0;
        for (uint32_t i = 0; i < n_words && s == LOOM_OK; i++)
            s = merge_word(t, words[i], a, b, z, r, &touched, &n_touched, &cap_touched);
        free(words);
        LOOM_ASSERT(s != LOOM_OK || t->pairs[p].count == 0);
        for (size_t i = 0; i < n_touched && s == LOOM_OK; i++)
            if (!heap_push(t, touched[i])) s = loom_error(LOOM_ERR_NOMEM, "out of memory training the tokenizer");
    }
    free(touched);
    *n_merges = r;
    return s;
}

loom_status loom_tokenizer_train(const char *const *texts, const size_t *lengths, size_t n_texts,
                                 int vocab_size, loom_tokenizer **out) {
    *out = NULL;
    if (vocab_size < 257 || vocab_size > (1 << 24))
        return loom_error(LOOM_ERR_INVALID, "tokenizer training: vocab_size %d must be in [257, 2^24] "
                          "(256 bytes + merges + 1 end-of-text token)", vocab_size);
    if (n_texts > 0 && !texts) return loom_error(LOOM_ERR_INVALID, "tokenizer training: texts is NULL");
    for (size_t k = 0; k < n_texts; k++)
        if (!texts[k] && (!lengths || lengths[k] > 0))
            return loom_error(LOOM_ERR_INVALID, "tokenizer training: text %zu is NULL", k);
    trainer t = {0};
    int target = vocab_size - 257, n_merges = 0;
    int32_t *merges = malloc(((size_t)target * 2 + 1) * sizeof *merges);
    loom_status s = merges ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "out of memory training the tokenizer");
    if (s == LOOM_OK) s = count_words(&t, texts, lengths, n_texts);
    if (s == LOOM_OK) s = count_pairs(&t);
    if (s == LOOM_OK) s = learn(&t, target, merges, &n_merges);
    trainer_free(&t);
    if (s == LOOM_OK) s = bpe_tokenizer_build(merges, n_merges, 1, out);
    free(merges);
    return s;
}
