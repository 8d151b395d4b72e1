/*
 * gemm_onednn.c — GEMM through oneDNN's matmul primitive, with a small cache
 * of created primitives.
 *
 * A primitive is fixed at creation by everything that shapes it (transposes
 * as strides, M, N, K, leading dimensions, dtypes, alpha as an output scale,
 * beta as a sum post-op, bias present or not), so all of those form the
 * cache key, with the OpenMP thread count: oneDNN sizes a primitive's
 * work split and scratchpad for the threads at creation (its own cache keys
 * on them too), so loom_set_threads between two calls gets a new one. The cache is set-associative (SETS x WAYS) with LRU eviction
 * inside a set; refusals are cached too, so a combination oneDNN cannot do
 * costs one attempt, not one per call.
 *
 * Concurrency: one mutex guards the table. Each entry also carries memory
 * objects, and the cache one stream and one scratchpad; these belong to a
 * single "fast" caller at a time. A caller that finds them taken (a GEMM
 * issued concurrently from another thread) makes its own for that call.
 * An entry in use is never evicted.
 *
 * Owns: the engine, the stream, the cached primitives, the shared scratchpad
 * (LOOM_MEM_WORKSPACE). Must never: abort on a oneDNN failure (every status
 * is checked and becomes a loom_error), or leave C half-written and then
 * hand the call to the fallback (refusals happen before execution only).
 */
#include "kernels/gemm_internal.h"

#if LOOM_HAVE_ONEDNN

#include <dnnl.h>
#include <dnnl_debug.h>
#include <omp.h>
#include <pthread.h>

#define SETS 16
#define WAYS 4

enum { ARG_SRC, ARG_WEIGHTS, ARG_BIAS, ARG_DST, ARG_SCRATCH, N_ARGS };
static const int arg_ids[N_ARGS] = {
    DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_BIAS, DNNL_ARG_DST, DNNL_ARG_SCRATCHPAD,
};

/* Every parameter that changes the primitive. All fields are 32-bit, so the
 * struct has no padding and compares with memcmp. */
typedef struct cache_key {
    uint32_t trans_a, trans_b, M, N, K, lda, ldb, ldc;
    uint32_t ab_dt, c_dt, bias_dt; /* bias_dt = ~0 when there is no bias */
    uint32_t alpha_bits, beta_bits;
    uint32_t threads;
} cache_key;

/* A created primitive with one memory object per argument (NULL if unused). */
typedef struct prepared {
    dnnl_primitive_t prim;
    dnnl_memory_t mem[N_ARGS];
    size_t scratch_bytes;
} prepared;

typedef struct cache_entry {
    int valid, rejected; /* rejected: oneDNN refused this key; prim is NULL */
    uint32_t hash;
    cache_key key;
    prepared p;
    int users;          /* calls executing with this entry right now */
    uint64_t last_use;
} cache_entry;

static struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;   /* set once by engine_init */
    dnnl_stream_t stream;
    int fast_busy;          /* the stream, scratch and entry memories are taken */
    void *scratch;          /* shared scratchpad for the fast caller */
    size_t scratch_cap;
    uint64_t tick;
    cache_entry set[SETS][WAYS];
} cache = { .lock = PTHREAD_MUTEX_INITIALIZER };

static pthread_once_t engine_once = PTHREAD_ONCE_INIT;
static int engine_ok;

static loom_status dnnl_fail(dnnl_status_t s, const char *what) {
    return loom_error(s == dnnl_out_of_memory ? LOOM_ERR_NOMEM : LOOM_ERR_UNSUPPORTED,
                      "gemm: oneDNN %s failed: %s; gemm_set_backend(GEMM_BACKEND_FALLBACK) "
                      "avoids oneDNN", what, dnnl_status2str(s));
}

static void engine_init(void) {
    if (dnnl_engine_get_count(dnnl_cpu) == 0) return;
    if (dnnl_engine_create(&cache.engine, dnnl_cpu, 0) != dnnl_success) return;
    if (dnnl_stream_create(&cache.stream, cache.engine, dnnl_stream_default_flags) != dnnl_success) {
        dnnl_engine_destroy(cache.engine);
        return;
    }
    engine_ok = 1;
}

int gemm_onednn_available(void) {
    pthread_once(&engine_once, engine_init);
    return engine_ok;
}

/* ------------------------------------------------------------ key, table */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void make_key(const gemm_args *g, cache_key *k, uint32_t *hash) {
    *k = (cache_key){
        .trans_a = (uint32_t)g->trans_a, .trans_b = (uint32_t)g->trans_b,
        .M = (uint32_t)g->M, .N = (uint32_t)g->N, .K = (uint32_t)g->K,
        .lda = (uint32_t)g->lda, .ldb = (uint32_t)g->ldb, .ldc = (uint32_t)g->ldc,
        .ab_dt = (uint32_t)g->ab_dt, .c_dt = (uint32_t)g->c_dt,
        .bias_dt = g->bias ? (uint32_t)g->bias_dt : ~0u,
        .alpha_bits = f32_bits(g->alpha), .beta_bits = f32_bits(g->beta),
        .threads = (uint32_t)omp_get_max_threads(),
    };
    const uint32_t *w = (const uint32_t *)k; /* FNV-1a over the words */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < sizeof *k / 4; i++) h = (h ^ w[i]) * 16777619u;
    /* The low bits of word-wise FNV depend only on the words' low bits, and
     * a model's sizes are mostly multiples of 16: without this final mix
     * (murmur3's) every dX GEMM of a step fell into one set, and a steady
     * step re-created 31-41 primitives. */
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    *hash = h;
}

static cache_entry *lookup(const cache_key *k, uint32_t h) {
    cache_entry *s = cache.set[h % SETS];
    for (int w = 0; w < WAYS; w++)
        if (s[w].valid && s[w].hash == h && !memcmp(&s[w].key, k, sizeof *k)) return &s[w];
    return NULL;
}

static void prepared_destroy(prepared *p) {
    for (int i = 0; i < N_ARGS; i++)
        if (p->mem[i]) dnnl_memory_destroy(p->mem[i]);
    if (p->prim) dnnl_primitive_destroy(p->prim);
    memset(p, 0, sizeof *p);
}

/* A free way of the set, or the least recently used idle one (emptied);
 * NULL when every way is in use. Called with the lock held. */
static cache_entry *victim(uint32_t h) {
    cache_entry *s = cache.set[h % SETS], *best = NULL;
    for (int w = 0; w < WAYS; w++) {
        if (!s[w].valid) return &s[w];
        if (s[w].users == 0 && (!best || s[w].last_use < best->last_use)) best = &s[w];
    }
    if (best) {
        prepared_destroy(&best->p);
        best->valid = 0;
    }
    return best;
}

/* ------------------------------------------------------- primitive build */

static dnnl_data_type_t dnnl_dt(loom_dtype dt) {
    return dt == LOOM_BF16 ? dnnl_bf16 : dt == LOOM_F16 ? dnnl_f16 : dnnl_f32;
}

/* Logical (rows, cols) matrix; stored transposed when trans. */
static dnnl_status_t matrix_md(dnnl_memory_desc_t *md, int rows, int cols, int ld, int trans,
                               loom_dtype dt) {
    dnnl_dims_t dims = { rows, cols };
    dnnl_dims_t strides = { trans ? 1 : ld, trans ? ld : 1 };
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_dt(dt), strides);
}

/* Attributes: user scratchpad, alpha as output scale, beta as sum post-op. */
static dnnl_status_t make_attr(const gemm_args *g, dnnl_primitive_attr_t *attr) {
    dnnl_status_t s = dnnl_primitive_attr_create(attr);
    if (s != dnnl_success) return s;
    s = dnnl_primitive_attr_set_scratchpad_mode(*attr, dnnl_scratchpad_mode_user);
    if (s == dnnl_success && g->alpha != 1.0f)
        s = dnnl_primitive_attr_set_output_scales(*attr, 1, 0, &g->alpha);
    if (s == dnnl_success && g->beta != 0.0f) {
        dnnl_post_ops_t po;
        s = dnnl_post_ops_create(&po);
        if (s != dnnl_success) return s;
        s = dnnl_post_ops_append_sum(po, g->beta);
        if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(*attr, po);
        dnnl_post_ops_destroy(po);
    }
    return s;
}

/* The primitive descriptor for g; any failure here is a refusal. */
static dnnl_status_t make_pd(const gemm_args *g, dnnl_primitive_desc_t *pd) {
    dnnl_memory_desc_t src, wei, bias, dst;
    dnnl_status_t s = matrix_md(&src, g->M, g->K, g->lda, g->trans_a, g->ab_dt); // (M, K)
    if (s == dnnl_success) s = matrix_md(&wei, g->K, g->N, g->ldb, g->trans_b, g->ab_dt); // (K, N)
    if (s == dnnl_success) s = matrix_md(&dst, g->M, g->N, g->ldc, 0, g->c_dt); // (M, N)
    if (s == dnnl_success && g->bias) s = matrix_md(&bias, 1, g->N, g->N, 0, g->bias_dt); // (1, N)
    if (s != dnnl_success) return s;
    dnnl_matmul_desc_t desc;
    s = dnnl_matmul_desc_init(&desc, &src, &wei, g->bias ? &bias : NULL, &dst);
    if (s != dnnl_success) return s;
    dnnl_primitive_attr_t attr = NULL;
    s = make_attr(g, &attr);
    if (s == dnnl_success) s = dnnl_primitive_desc_create(pd, &desc, attr, cache.engine, NULL);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return s;
}

/* Memory objects without buffers for each argument the primitive takes. */
static dnnl_status_t make_memories(const_dnnl_primitive_desc_t pd, prepared *p) {
    static const dnnl_query_t queries[N_ARGS] = {
        dnnl_query_src_md, dnnl_query_weights_md, dnnl_query_weights_md,
        dnnl_query_dst_md, dnnl_query_scratchpad_md,
    };
    for (int i = 0; i < N_ARGS; i++) {
        int index = i == ARG_BIAS ? 1 : 0; /* bias is weights #1 */
        const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(pd, queries[i], index);
        if (!md || md->ndims == 0 || dnnl_memory_desc_get_size(md) == 0) continue;
        if (i == ARG_SCRATCH) p->scratch_bytes = dnnl_memory_desc_get_size(md);
        dnnl_status_t s = dnnl_memory_create(&p->mem[i], md, cache.engine, DNNL_MEMORY_NONE);
        if (s != dnnl_success) return s;
    }
    return dnnl_success;
}

/* Create the primitive for g. LOOM_OK with *refused = 1 when oneDNN cannot
 * do it; an error only when memory ran out. */
static loom_status build(const gemm_args *g, prepared *p, int *refused) {
    memset(p, 0, sizeof *p);
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t s = make_pd(g, &pd);
    if (s == dnnl_success) s = dnnl_primitive_create(&p->prim, pd);
    if (s == dnnl_success) s = make_memories(pd, p);
    if (pd) dnnl_primitive_desc_destroy(pd);
    *refused = s != dnnl_success;
    if (s == dnnl_success) return LOOM_OK;
    prepared_destroy(p);
    return s == dnnl_out_of_memory ? dnnl_fail(s, "primitive creation") : LOOM_OK;
}

/* ------------------------------------------------------------ acquire */

/* A claim on a primitive for one call: a cache entry (users counted), or a
 * private primitive when the set was full of entries in use. */
typedef struct claim {
    cache_entry *e;
    prepared own;   /* used when e is NULL */
    int fast;       /* holds the shared stream, scratchpad and e's memories */
} claim;

/* Insert or reuse after a build done without the lock; lock held. */
static void settle(claim *c, const cache_key *k, uint32_t h, prepared *p, int refused) {
    cache_entry *e = lookup(k, h);
    if (e) { /* another thread built it meanwhile */
        prepared_destroy(p);
    } else if ((e = victim(h)) != NULL) {
        *e = (cache_entry){ .valid = 1, .rejected = refused, .hash = h, .key = *k, .p = *p };
    } else {
        c->own = *p;
    }
    if (refused) GEMM_COUNT(onednn_rejected);
    else GEMM_COUNT(onednn_created);
    c->e = e;
}

/* Find or create the primitive for g. *refused = 1: oneDNN cannot do it. */
static loom_status acquire(const gemm_args *g, claim *c, int *refused) {
    cache_key k;
    uint32_t h;
    make_key(g, &k, &h);
    memset(c, 0, sizeof *c);
    pthread_mutex_lock(&cache.lock);
    c->e = lookup(&k, h);
    if (c->e) {
        GEMM_COUNT(onednn_hits);
        *refused = c->e->rejected;
    } else {
        pthread_mutex_unlock(&cache.lock); /* creation is slow: build unlocked */
        prepared p;
        LOOM_TRY(build(g, &p, refused));
        pthread_mutex_lock(&cache.lock);
        settle(c, &k, h, &p, *refused);
        if (c->e) *refused = c->e->rejected;
    }
    if (!*refused && c->e) {
        c->e->users++;
        c->e->last_use = ++cache.tick;
    }
    if (!*refused && !cache.fast_busy) cache.fast_busy = c->fast = 1;
    pthread_mutex_unlock(&cache.lock);
    return LOOM_OK;
}

static void release(claim *c) {
    pthread_mutex_lock(&cache.lock);
    if (c->e) c->e->users--;
    if (c->fast) cache.fast_busy = 0;
    pthread_mutex_unlock(&cache.lock);
    if (!c->e) prepared_destroy(&c->own);
}

/* ------------------------------------------------------------ execute */

/* Buffers of one call, in ARG_* order. */
static void call_buffers(const gemm_args *g, void *scratch, void *buf[N_ARGS]) {
    buf[ARG_SRC] = (void *)(uintptr_t)g->A;
    buf[ARG_WEIGHTS] = (void *)(uintptr_t)g->B;
    buf[ARG_BIAS] = (void *)(uintptr_t)g->bias;
    buf[ARG_DST] = g->C;
    buf[ARG_SCRATCH] = scratch;
}

/* Point the memories at this call's buffers: the prepared ones when this
 * caller may use them, else fresh ones (destroyed by free_memories). */
static dnnl_status_t bind_memories(const prepared *p, int reuse, void *buf[N_ARGS],
                                   dnnl_memory_t mem[N_ARGS]) {
    dnnl_status_t s = dnnl_success;
    for (int i = 0; i < N_ARGS; i++) mem[i] = NULL;
    for (int i = 0; i < N_ARGS && s == dnnl_success; i++) {
        if (!p->mem[i]) continue;
        if (reuse) {
            mem[i] = p->mem[i];
            s = dnnl_memory_set_data_handle(mem[i], buf[i]);
            continue;
        }
        const dnnl_memory_desc_t *md;
        s = dnnl_memory_get_memory_desc(p->mem[i], &md);
        if (s == dnnl_success) s = dnnl_memory_create(&mem[i], md, cache.engine, buf[i]);
    }
    return s;
}

static void free_memories(int reused, dnnl_memory_t mem[N_ARGS]) {
    for (int i = 0; i < N_ARGS && !reused; i++)
        if (mem[i]) dnnl_memory_destroy(mem[i]);
}

/* The scratchpad: the shared one (grown as needed) for the fast caller. */
static void *get_scratch(const claim *c, size_t bytes) {
    if (bytes == 0) return NULL;
    if (!c->fast) return loom_alloc(bytes, LOOM_MEM_WORKSPACE);
    if (cache.scratch_cap < bytes) {
        loom_free(cache.scratch);
        cache.scratch_cap = 0;
        cache.scratch = loom_alloc(bytes, LOOM_MEM_WORKSPACE);
        if (cache.scratch) cache.scratch_cap = bytes;
    }
    return cache.scratch;
}

static loom_status execute(const claim *c, const gemm_args *g) {
    const prepared *p = c->e ? &c->e->p : &c->own;
    int reuse = c->fast || !c->e; /* a private primitive's memories are ours */
    void *scratch = get_scratch(c, p->scratch_bytes), *buf[N_ARGS];
    if (p->scratch_bytes && !scratch) return LOOM_ERR_NOMEM;
    call_buffers(g, scratch, buf);
    dnnl_memory_t mem[N_ARGS];
    dnnl_stream_t stream = cache.stream;
    dnnl_status_t s = bind_memories(p, reuse, buf, mem);
    if (s == dnnl_success && !c->fast)
        s = dnnl_stream_create(&stream, cache.engine, dnnl_stream_default_flags);
    if (s == dnnl_success) {
        dnnl_exec_arg_t args[N_ARGS];
        int n = 0;
        for (int i = 0; i < N_ARGS; i++)
            if (mem[i]) args[n++] = (dnnl_exec_arg_t){ arg_ids[i], mem[i] };
        s = dnnl_primitive_execute(p->prim, stream, n, args);
        if (s == dnnl_success) s = dnnl_stream_wait(stream);
    }
    if (!c->fast && stream != cache.stream) dnnl_stream_destroy(stream);
    if (!c->fast) loom_free(scratch);
    free_memories(reuse, mem);
    return s == dnnl_success ? LOOM_OK : dnnl_fail(s, "matmul execution");
}

loom_status gemm_onednn(const gemm_args *g, int *handled) {
    *handled = 0;
    /* oneDNN scales the bias with the output scale (alpha (A·B + bias)),
     * not the contract's alpha A·B + bias: leave that case to the fallback. */
    if (!gemm_onednn_available() || (g->bias && g->alpha != 1.0f)) return LOOM_OK;
    claim c;
    int refused = 0;
    loom_status st = acquire(g, &c, &refused);
    if (st != LOOM_OK || refused) {
        *handled = st != LOOM_OK;
        return st;
    }
    *handled = 1;
    GEMM_COUNT(onednn_calls);
    st = execute(&c, g);
    release(&c);
    return st;
}

void gemm_onednn_cache_clear(void) {
    if (!gemm_onednn_available()) return;
    pthread_mutex_lock(&cache.lock);
    for (int s = 0; s < SETS; s++) {
        for (int w = 0; w < WAYS; w++) {
            cache_entry *e = &cache.set[s][w];
            if (!e->valid || e->users) continue;
            prepared_destroy(&e->p);
            e->valid = 0;
        }
    }
    if (!cache.fast_busy) {
        loom_free(cache.scratch);
        cache.scratch = NULL;
        cache.scratch_cap = 0;
    }
    pthread_mutex_unlock(&cache.lock);
}

#else /* !LOOM_HAVE_ONEDNN */

int gemm_onednn_available(void) { return 0; }

loom_status gemm_onednn(const gemm_args *g, int *handled) {
    (void)g;
    *handled = 0;
    return LOOM_OK;
}

void gemm_onednn_cache_clear(void) {}

#endif
