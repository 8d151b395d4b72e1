/*
 * alloc.c — the accounting, caching allocator.
 *
 * Owns: every byte loom allocates, counted by category (current and peak),
 * and a cache of freed blocks in size classes (four classes per power of
 * two, so at most 25% is wasted to rounding) so that a steady-state step is
 * served from the cache without calling malloc.
 * Must never: hand out a block twice, or lose the category of a block (a
 * header before each block records it).
 */
#include "loom/core.h"

#include <pthread.h>
#include <stdlib.h>

#define ALIGN 64
#define N_CLASSES 256

typedef struct block_header {
    struct block_header *next_free; /* link while cached */
    size_t class_bytes;             /* usable bytes of this block */
    size_t requested;               /* bytes the caller asked for */
    int cls;                        /* size class index */
    int category;
    char pad[ALIGN - 2 * sizeof(size_t) - sizeof(void *) - 2 * sizeof(int)];
} block_header;

_Static_assert(sizeof(block_header) == ALIGN, "block header must keep 64-byte alignment");

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static block_header *free_lists[N_CLASSES];
static loom_mem_stats stats;

/* Smallest class >= bytes: classes are 64 B … then {1, 1.25, 1.5, 1.75} x 2^k. */
static int size_class(size_t bytes, size_t *class_bytes) {
    if (bytes <= 256) { *class_bytes = 256; return 0; }
    int k = 63 - __builtin_clzll((unsigned long long)bytes); /* 2^k <= bytes */
    size_t base = (size_t)1 << k, quarter = base >> 2;
    for (int s = 0; s <= 4; s++) {
        size_t c = base + (size_t)s * quarter;
        if (c >= bytes) {
            int idx = (k - 8) * 4 + s;
            if (s == 4) idx = (k + 1 - 8) * 4;
            *class_bytes = c;
            return idx < N_CLASSES ? idx : N_CLASSES - 1;
        }
    }
    LOOM_ASSERT(0);
    return 0;
}

static void account(int cat, long long delta) {
    stats.current[cat] = (size_t)((long long)stats.current[cat] + delta);
    stats.current_total = (size_t)((long long)stats.current_total + delta);
    if (stats.current[cat] > stats.peak[cat]) stats.peak[cat] = stats.current[cat];
    if (stats.current_total > stats.peak_total) stats.peak_total = stats.current_total;
}

void *loom_alloc(size_t bytes, loom_mem_category cat) {
    if ((unsigned)cat >= LOOM_MEM_N_CATEGORIES) cat = LOOM_MEM_WORKSPACE;
    size_t cb;
    int cls = size_class(bytes ? bytes : 1, &cb);
    pthread_mutex_lock(&lock);
    block_header *h = NULL;
    /* The last class collects all huge blocks: reuse only an exact fit. */
    for (block_header **pp = &free_lists[cls]; *pp; pp = &(*pp)->next_free) {
        if ((*pp)->class_bytes >= bytes && (cls < N_CLASSES - 1 || (*pp)->class_bytes == cb)) {
            h = *pp;
            *pp = h->next_free;
            stats.cached -= h->class_bytes;
            break;
        }
    }
    if (!h) {
        stats.n_malloc++;
        pthread_mutex_unlock(&lock);
        h = aligned_alloc(ALIGN, sizeof(block_header) + ((cb + ALIGN - 1) / ALIGN) * ALIGN);
        if (!h) {
            loom_error(LOOM_ERR_NOMEM, "out of memory allocating %zu bytes for %s", bytes,
                       loom_mem_category_name(cat));
            return NULL;
        }
        h->class_bytes = cb;
        h->cls = cls;
        pthread_mutex_lock(&lock);
    }
    h->next_free = NULL;
    h->requested = bytes;
    h->category = (int)cat;
    stats.n_alloc++;
    account(cat, (long long)bytes);
    pthread_mutex_unlock(&lock);
    return (char *)h + sizeof(block_header);
}

void *loom_alloc_zeroed(size_t bytes, loom_mem_category cat) {
    void *p = loom_alloc(bytes, cat);
    if (p) memset(p, 0, bytes);
    return p;
}

void loom_free(void *p) {
    if (!p) return;
    block_header *h = (block_header *)((char *)p - sizeof(block_header));
    pthread_mutex_lock(&lock);
    account(h->category, -(long long)h->requested);
    h->next_free = free_lists[h->cls];
    free_lists[h->cls] = h;
    stats.cached += h->class_bytes;
    pthread_mutex_unlock(&lock);
}

void loom_mem_get_stats(loom_mem_stats *out) {
    pthread_mutex_lock(&lock);
    *out = stats;
    pthread_mutex_unlock(&lock);
}

void loom_mem_reset_peak(void) {
    pthread_mutex_lock(&lock);
    for (int c = 0; c < LOOM_MEM_N_CATEGORIES; c++) stats.peak[c] = stats.current[c];
    stats.peak_total = stats.current_total;
    pthread_mutex_unlock(&lock);
}

void loom_mem_trim(void) {
    pthread_mutex_lock(&lock);
    for (int c = 0; c < N_CLASSES; c++) {
        while (free_lists[c]) {
            block_header *h = free_lists[c];
            free_lists[c] = h->next_free;
            free(h);
        }
    }
    stats.cached = 0;
    pthread_mutex_unlock(&lock);
}

const char *loom_mem_category_name(loom_mem_category cat) {
    static const char *names[] = {"parameters", "gradients", "optimizer", "activations", "workspace"};
    return (unsigned)cat < LOOM_MEM_N_CATEGORIES ? names[cat] : "?";
}
