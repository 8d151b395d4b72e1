/*
 * maps.c — the two small hash maps behind the tokenizer: uint64 -> int64
 * (token pairs) and byte strings -> dense index (pre-split chunks).
 *
 * Owns: open addressing with linear probing, power-of-two capacities, load
 * factor at most 1/2. Must never: report success after a failed allocation
 * (callers turn NULL / -1 into LOOM_ERR_NOMEM).
 */
#include "io/io_internal.h"

#include <stdlib.h>
#include <string.h>

#define EMPTY_KEY UINT64_MAX

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* ------------------------------------------------------------ u64 -> i64 */

void io_u64map_free(io_u64map *m) {
    free(m->keys);
    free(m->values);
    memset(m, 0, sizeof *m);
}

int64_t *io_u64map_find(const io_u64map *m, uint64_t key) {
    if (m->cap == 0) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == key) return &m->values[i];
        if (m->keys[i] == EMPTY_KEY) return NULL;
    }
}

static int u64map_grow(io_u64map *m) {
    size_t cap = m->cap ? 2 * m->cap : 64;
    uint64_t *keys = malloc(cap * sizeof *keys);
    int64_t *values = malloc(cap * sizeof *values);
    if (!keys || !values) {
        free(keys);
        free(values);
        return 0;
    }
    memset(keys, 0xff, cap * sizeof *keys);
    for (size_t j = 0; j < m->cap; j++) {
        if (m->keys[j] == EMPTY_KEY) continue;
        size_t i = mix64(m->keys[j]) & (cap - 1);
        while (keys[i] != EMPTY_KEY) i = (i + 1) & (cap - 1);
        keys[i] = m->keys[j];
        values[i] = m->values[j];
    }
    free(m->keys);
    free(m->values);
    m->keys = keys;
    m->values = values;
    m->cap = cap;
    return 1;
}

int64_t *io_u64map_upsert(io_u64map *m, uint64_t key, int64_t init, int *inserted) {
    if (inserted) *inserted = 0;
    if (2 * (m->n + 1) > m->cap && !u64map_grow(m)) return NULL;
    size_t mask = m->cap - 1;
    size_t i = mix64(key) & mask;
    while (m->keys[i] != key && m->keys[i] != EMPTY_KEY) i = (i + 1) & mask;
    if (m->keys[i] == EMPTY_KEY) {
        m->keys[i] = key;
        m->values[i] = init;
        m->n++;
        if (inserted) *inserted = 1;
    }
    return &m->values[i];
}

/* ----------------------------------------------------- bytes -> index */

static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0xff51afd7ed558ccdULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = mix64(h ^ w);
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    return mix64(h ^ w ^ 0x5bd1e995u);
}

void io_bytesmap_free(io_bytesmap *m) {
    free(m->slots);
    free(m->hashes);
    free(m->key_off);
    free(m->key_len);
    free(m->arena);
    memset(m, 0, sizeof *m);
}

void io_bytesmap_clear(io_bytesmap *m) {
    if (m->slots) memset(m->slots, 0, m->cap * sizeof *m->slots);
    m->n = 0;
    m->arena_len = 0;
}

static int64_t probe(const io_bytesmap *m, const void *key, size_t len, uint64_t h, size_t *slot) {
    size_t mask = m->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        int32_t e = m->slots[i];
        if (e == 0) {
            *slot = i;
            return -1;
        }
        e--;
        if (m->hashes[e] == h && m->key_len[e] == len && !memcmp(m->arena + m->key_off[e], key, len))
            return e;
    }
}

int64_t io_bytesmap_find(const io_bytesmap *m, const void *key, size_t len) {
    if (m->cap == 0) return -1;
    size_t slot;
    return probe(m, key, len, hash_bytes(key, len), &slot);
}

static int bytesmap_rehash(io_bytesmap *m) {
    size_t cap = m->cap ? 2 * m->cap : 1024;
    int32_t *slots = calloc(cap, sizeof *slots);
    if (!slots) return 0;
    for (size_t e = 0; e < m->n; e++) {
        size_t i = m->hashes[e] & (cap - 1);
        while (slots[i]) i = (i + 1) & (cap - 1);
        slots[i] = (int32_t)(e + 1);
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    return 1;
}

static int reserve(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return 0;
    *p = np;
    *cap = c;
    return 1;
}

int64_t io_bytesmap_insert(io_bytesmap *m, const void *key, size_t len, int *inserted) {
    *inserted = 0;
    if (m->n >= INT32_MAX - 1 || len > UINT32_MAX) return -1;
    if (2 * (m->n + 1) > m->cap && !bytesmap_rehash(m)) return -1;
    uint64_t h = hash_bytes(key, len);
    size_t slot;
    int64_t e = probe(m, key, len, h, &slot);
    if (e >= 0) return e;
    size_t ecap = m->entries_cap;
    if (m->n + 1 > ecap) {
        size_t c1 = ecap, c2 = ecap, c3 = ecap;
        if (!reserve((void **)&m->hashes, &c1, m->n + 1, sizeof *m->hashes) ||
            !reserve((void **)&m->key_off, &c2, m->n + 1, sizeof *m->key_off) ||
            !reserve((void **)&m->key_len, &c3, m->n + 1, sizeof *m->key_len))
            return -1;
        /* Only adopt the new capacity once all three arrays have it. */
        m->entries_cap = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    }
    if (!reserve((void **)&m->arena, &m->arena_cap, m->arena_len + len + 1, 1)) return -1;
    e = (int64_t)m->n++;
    memcpy(m->arena + m->arena_len, key, len);
    m->hashes[e] = h;
    m->key_off[e] = m->arena_len;
    m->key_len[e] = (uint32_t)len;
    m->arena_len += len;
    m->slots[slot] = (int32_t)(e + 1);
    *inserted = 1;
    return e;
}
