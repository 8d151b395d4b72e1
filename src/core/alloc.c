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

/* Under AddressSanitizer, a block's bytes past `requested` and a cached
 * block's whole body are poisoned, so overruns into the class's slack and
 * use after loom_free are reported even though the cache keeps the memory. */
#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define ALIGN 64
/* Classes: 256 B (index 0), then 2^k * {1, 1.25, 1.5, 1.75} for 2^k >= 256
 * (index 4(k - 8) + s). The largest k is the top bit of size_t, so this is
 * every class a size_t can name: each class holds blocks of one size only. */
#define SIZE_BITS ((int)(sizeof(size_t) * 8))
#define N_CLASSES (4 * (SIZE_BITS - 8))
/* A request its own class cannot serve may take a cached block up to this
 * many classes larger: fewer blocks held in the cache overall, so a lower
 * peak RSS, for at most 75% slack while the block is in use. */
#define SPARE_CLASSES 2

typedef struct block_header {
    struct block_header *next_free; /* link while cached */
    size_t class_bytes;             /* usable bytes of this block */
    size_t requested;               /* bytes the caller asked for */
    int cls;                        /* size class index */
    int category;
    char pad[ALIGN - 2 * sizeof(size_t) - sizeof(void *) - 2 * sizeof(int)];
} block_header;

_Static_assert(sizeof(block_header) == ALIGN, "block header must keep 64-byte alignment");

/* The largest block whose header + body still fits in a size_t. */
#define MAX_CLASS_BYTES (SIZE_MAX - sizeof(block_header) - (ALIGN - 1))

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static block_header *free_lists[N_CLASSES];
static loom_mem_stats stats;

/* Smallest class >= bytes; -1 when there is none (the block would not fit in
 * the address space, so the request can only fail). */
static int size_class(size_t bytes, size_t *class_bytes) {
    if (bytes <= 256) { *class_bytes = 256; return 0; }
    if (bytes > MAX_CLASS_BYTES) return -1;
    int k = 63 - __builtin_clzll((unsigned long long)bytes); /* 2^k <= bytes */
    size_t base = (size_t)1 << k, quarter = base >> 2;
    for (int s = 0; s <= 4; s++) {
        if ((size_t)s * quarter > MAX_CLASS_BYTES - base) return -1; /* base + s*quarter overflows */
        size_t c = base + (size_t)s * quarter;
        if (c >= bytes) {
            int idx = s < 4 ? (k - 8) * 4 + s : (k + 1 - 8) * 4; /* 2^(k+1): next power's s = 0 */
            LOOM_ASSERT(idx >= 0 && idx < N_CLASSES);
            *class_bytes = c;
            return idx;
        }
    }
    LOOM_ASSERT(0);
    return -1;
}

/* Under `lock`. */
static void account(int cat, size_t bytes, int add) {
    if (add) {
        stats.current[cat] += bytes;
        stats.current_total += bytes;
    } else {
        stats.current[cat] -= bytes;
        stats.current_total -= bytes;
    }
    if (stats.current[cat] > stats.peak[cat]) stats.peak[cat] = stats.current[cat];
    if (stats.current_total > stats.peak_total) stats.peak_total = stats.current_total;
}

static void *out_of_memory(size_t bytes, loom_mem_category cat) {
    loom_error(LOOM_ERR_NOMEM, "out of memory allocating %zu bytes for %s", bytes,
               loom_mem_category_name(cat));
    return NULL;
}

void *loom_alloc(size_t bytes, loom_mem_category cat) {
    if ((unsigned)cat >= LOOM_MEM_N_CATEGORIES) cat = LOOM_MEM_WORKSPACE;
    size_t cb;
    int cls = size_class(bytes ? bytes : 1, &cb);
    if (cls < 0) return out_of_memory(bytes, cat);
    pthread_mutex_lock(&lock);
    /* Every block in a class has the class's size: take the first, else one
     * of the next SPARE_CLASSES classes up (at most 1.75x the size) before
     * going to the system. The block keeps its class and goes back to it. */
    block_header *h = NULL;
    for (int c = cls; c < N_CLASSES && c <= cls + SPARE_CLASSES && !h; c++) {
        h = free_lists[c];
        if (h) {
            LOOM_ASSERT(h->cls == c && h->class_bytes >= cb);
            free_lists[c] = h->next_free;
            stats.cached -= h->class_bytes;
        }
    }
    if (!h) {
        stats.n_malloc++;
        pthread_mutex_unlock(&lock);
        /* cb <= MAX_CLASS_BYTES, so neither the rounding nor the sum overflows. */
        h = aligned_alloc(ALIGN, sizeof(block_header) + ((cb + ALIGN - 1) / ALIGN) * ALIGN);
        if (!h) return out_of_memory(bytes, cat);
        h->class_bytes = cb;
        h->cls = cls;
        pthread_mutex_lock(&lock);
    }
    h->next_free = NULL;
    h->requested = bytes;
    h->category = (int)cat;
    stats.n_alloc++;
    account(cat, bytes, 1);
    pthread_mutex_unlock(&lock);
    char *body = (char *)h + sizeof(block_header);
    UNPOISON(body, bytes);
    POISON(body + bytes, h->class_bytes - bytes);
    return body;
}

void *loom_alloc_zeroed(size_t bytes, loom_mem_category cat) {
    void *p = loom_alloc(bytes, cat);
    if (p) memset(p, 0, bytes);
    return p;
}

void loom_free(void *p) {
    if (!p) return;
    block_header *h = (block_header *)((char *)p - sizeof(block_header));
    POISON(p, h->class_bytes); /* before it is shared through the cache */
    pthread_mutex_lock(&lock);
    account(h->category, h->requested, 0);
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
            UNPOISON((char *)h + sizeof(block_header), h->class_bytes);
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
