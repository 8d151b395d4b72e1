/*
 * safetensors_write.c — the safetensors writer: collects (name, dtype,
 * shape, borrowed data or a function that fills it) entries and metadata,
 * then writes the header (JSON, space-padded to a multiple of 8 bytes) and
 * the tensors in the order given, through the atomic file writer; filled
 * tensors pass through one buffer, the size of the largest, one at a time.
 *
 * Must never: copy tensor data (it is borrowed until write returns), or
 * write a file the reader would reject.
 */
#include "io/io_internal.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    char *name;
    loom_safetensors_dtype dtype;
    int ndim;
    int64_t shape[LOOM_SAFETENSORS_MAX_DIMS];
    size_t n_bytes;
    const void *data;
    loom_safetensors_fill_fn fill; /* or NULL: data is borrowed */
    void *fill_user;
} entry;

struct loom_safetensors_writer {
    entry *entries;
    size_t n, cap;
    char **meta_keys, **meta_values;
    size_t n_meta, meta_cap;
};

loom_status loom_safetensors_writer_init(loom_safetensors_writer **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return loom_error(LOOM_ERR_NOMEM, "out of memory creating a safetensors writer");
    return LOOM_OK;
}

void loom_safetensors_writer_free(loom_safetensors_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) free(w->entries[i].name);
    for (size_t i = 0; i < w->n_meta; i++) {
        free(w->meta_keys[i]);
        free(w->meta_values[i]);
    }
    free(w->entries);
    free(w->meta_keys);
    free(w->meta_values);
    free(w);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? 2 * *cap : 16;
    void *np = realloc(*p, c * elem);
    if (!np) return 0;
    *p = np;
    *cap = c;
    return 1;
}

static loom_status add_entry(loom_safetensors_writer *w, const char *name, loom_safetensors_dtype dtype,
                             const int64_t *shape, int ndim, const void *data, loom_safetensors_fill_fn fill,
                             void *fill_user) {
    if (!w || !name || !*name)
        return loom_error(LOOM_ERR_INVALID, "safetensors writer: a tensor needs a non-empty name");
    if (!strcmp(name, "__metadata__"))
        return loom_error(LOOM_ERR_INVALID, "safetensors writer: \"__metadata__\" is reserved, not a "
                          "tensor name; use loom_safetensors_writer_set_metadata");
    if ((unsigned)dtype >= LOOM_SAFETENSORS_N_DTYPES)
        return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" has unknown dtype %d",
                          name, (int)dtype);
    if (ndim < 0 || ndim > LOOM_SAFETENSORS_MAX_DIMS || (ndim > 0 && !shape))
        return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" has %d dimensions; "
                          "give 0..%d with a shape array", name, ndim, LOOM_SAFETENSORS_MAX_DIMS);
    for (size_t i = 0; i < w->n; i++)
        if (!strcmp(w->entries[i].name, name))
            return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" was added twice", name);
    entry e = {0};
    e.dtype = dtype;
    e.ndim = ndim;
    size_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" has negative "
                              "dimension %d (%lld)", name, d, (long long)shape[d]);
        e.shape[d] = shape[d];
        if (shape[d] != 0 && n > SIZE_MAX / 8 / (uint64_t)shape[d])
            return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" is too large", name);
        n *= (size_t)shape[d];
    }
    e.n_bytes = n * loom_safetensors_dtype_size(dtype);
    if (e.n_bytes > 0 && !data && !fill)
        return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" has NULL data", name);
    e.data = data;
    e.fill = fill;
    e.fill_user = fill_user;
    e.name = strdup(name);
    if (!e.name || !grow((void **)&w->entries, &w->cap, w->n + 1, sizeof *w->entries)) {
        free(e.name);
        return loom_error(LOOM_ERR_NOMEM, "out of memory adding tensor \"%s\"", name);
    }
    w->entries[w->n++] = e;
    return LOOM_OK;
}

loom_status loom_safetensors_writer_add(loom_safetensors_writer *w, const char *name,
                                        loom_safetensors_dtype dtype, const int64_t *shape,
                                        int ndim, const void *data) {
    return add_entry(w, name, dtype, shape, ndim, data, NULL, NULL);
}

loom_status loom_safetensors_writer_add_fill(loom_safetensors_writer *w, const char *name,
                                             loom_safetensors_dtype dtype, const int64_t *shape, int ndim,
                                             loom_safetensors_fill_fn fill, void *user) {
    if (!fill) return loom_error(LOOM_ERR_INVALID, "safetensors writer: tensor \"%s\" has no fill function",
                                 name ? name : "");
    return add_entry(w, name, dtype, shape, ndim, NULL, fill, user);
}

loom_status loom_safetensors_writer_set_metadata(loom_safetensors_writer *w, const char *key,
                                                 const char *value) {
    if (!w || !key || !value)
        return loom_error(LOOM_ERR_INVALID, "safetensors writer: metadata key and value must not be NULL");
    char *v = strdup(value);
    if (!v) return loom_error(LOOM_ERR_NOMEM, "out of memory setting metadata \"%s\"", key);
    for (size_t i = 0; i < w->n_meta; i++) {
        if (!strcmp(w->meta_keys[i], key)) {
            free(w->meta_values[i]);
            w->meta_values[i] = v;
            return LOOM_OK;
        }
    }
    size_t cap = w->meta_cap;
    char *k = strdup(key);
    if (!k || !grow((void **)&w->meta_keys, &cap, w->n_meta + 1, sizeof(char *)) ||
        !grow((void **)&w->meta_values, &w->meta_cap, w->n_meta + 1, sizeof(char *))) {
        free(k);
        free(v);
        return loom_error(LOOM_ERR_NOMEM, "out of memory setting metadata \"%s\"", key);
    }
    w->meta_keys[w->n_meta] = k;
    w->meta_values[w->n_meta++] = v;
    return LOOM_OK;
}

/* The header JSON text (malloc'd), "__metadata__" first, tensors in order. */
static char *header_json(const loom_safetensors_writer *w) {
    json_t *root = json_object();
    int ok = root != NULL;
    if (ok && w->n_meta) {
        json_t *meta = json_object();
        ok = meta && json_object_set_new(root, "__metadata__", meta) == 0;
        for (size_t i = 0; ok && i < w->n_meta; i++)
            ok = json_object_set_new(meta, w->meta_keys[i], json_string(w->meta_values[i])) == 0;
    }
    size_t offset = 0;
    for (size_t i = 0; ok && i < w->n; i++) {
        const entry *e = &w->entries[i];
        json_t *t = json_object(), *shape = json_array(), *offs = json_array();
        /* set_new steals its value even on failure; later appends go to
         * objects already owned by root, so nothing leaks on any path. */
        if (json_object_set_new(root, e->name, t) != 0 ||
            json_object_set_new(t, "dtype", json_string(loom_safetensors_dtype_name(e->dtype))) != 0) {
            json_decref(shape);
            json_decref(offs);
            ok = 0;
            break;
        }
        if (json_object_set_new(t, "shape", shape) != 0) {
            json_decref(offs);
            ok = 0;
            break;
        }
        ok = json_object_set_new(t, "data_offsets", offs) == 0;
        for (int d = 0; ok && d < e->ndim; d++)
            ok = json_array_append_new(shape, json_integer((json_int_t)e->shape[d])) == 0;
        ok = ok && json_array_append_new(offs, json_integer((json_int_t)offset)) == 0 &&
             json_array_append_new(offs, json_integer((json_int_t)(offset + e->n_bytes))) == 0;
        offset += e->n_bytes;
    }
    char *text = ok ? json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(root);
    return text;
}

loom_status loom_safetensors_writer_write(loom_safetensors_writer *w, const char *path) {
    if (!w || !path) return loom_error(LOOM_ERR_INVALID, "safetensors writer: NULL writer or path");
    char *json = header_json(w);
    if (!json) return loom_error(LOOM_ERR_NOMEM, "out of memory building the header of '%s'", path);
    size_t len = strlen(json);
    /* 8 (length) + padded header keeps the data 8-byte aligned. */
    size_t padded = (len + 7) / 8 * 8;
    uint64_t hlen = padded;
    static const char spaces[8] = "        ";
    size_t widest = 0; /* the buffer filled tensors pass through */
    for (size_t i = 0; i < w->n; i++)
        if (w->entries[i].fill && w->entries[i].n_bytes > widest) widest = w->entries[i].n_bytes;
    void *buf = widest ? malloc(widest) : NULL;
    loom_status s = widest && !buf ? loom_error(LOOM_ERR_NOMEM, "out of memory writing '%s'", path) : LOOM_OK;
    loom_atomic_file *f = NULL;
    if (s == LOOM_OK) s = loom_atomic_file_open(path, &f);
    if (s == LOOM_OK) s = loom_atomic_file_write(f, &hlen, 8);
    if (s == LOOM_OK) s = loom_atomic_file_write(f, json, len);
    if (s == LOOM_OK) s = loom_atomic_file_write(f, spaces, padded - len);
    for (size_t i = 0; s == LOOM_OK && i < w->n; i++) {
        const entry *e = &w->entries[i];
        if (e->fill && e->n_bytes) s = e->fill(e->fill_user, buf, e->n_bytes);
        if (s == LOOM_OK) s = loom_atomic_file_write(f, e->fill ? buf : e->data, e->n_bytes);
    }
    free(buf);
    free(json);
    if (s == LOOM_OK) return loom_atomic_file_commit(f);
    if (f) loom_atomic_file_abort(f);
    return s;
}
