/*
 * safetensors.c — the safetensors reader: 8-byte little-endian header length
 * N, N bytes of JSON {name: {dtype, shape, data_offsets}, "__metadata__":
 * {str: str}}, then the byte buffer the offsets index.
 *
 * Owns: validation of everything in the file before any tensor is handed
 * out, name lookup, and conversion to loom's compute dtypes. Must never:
 * read outside the mapping, trust a size it has not checked, or abort on a
 * corrupt file (every problem is LOOM_ERR_FORMAT naming file and tensor).
 */
#include "io/io_internal.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Headers above this are refused (as the reference implementation does). */
#define MAX_HEADER_BYTES ((uint64_t)100 << 20)

static const struct {
    const char *name;
    size_t size;
} dtype_info[LOOM_SAFETENSORS_N_DTYPES] = {
    [LOOM_SAFETENSORS_BOOL] = {"BOOL", 1}, [LOOM_SAFETENSORS_U8] = {"U8", 1},
    [LOOM_SAFETENSORS_I8] = {"I8", 1},     [LOOM_SAFETENSORS_U16] = {"U16", 2},
    [LOOM_SAFETENSORS_I16] = {"I16", 2},   [LOOM_SAFETENSORS_U32] = {"U32", 4},
    [LOOM_SAFETENSORS_I32] = {"I32", 4},   [LOOM_SAFETENSORS_U64] = {"U64", 8},
    [LOOM_SAFETENSORS_I64] = {"I64", 8},   [LOOM_SAFETENSORS_F16] = {"F16", 2},
    [LOOM_SAFETENSORS_BF16] = {"BF16", 2}, [LOOM_SAFETENSORS_F32] = {"F32", 4},
    [LOOM_SAFETENSORS_F64] = {"F64", 8},   [LOOM_SAFETENSORS_F8_E4M3] = {"F8_E4M3", 1},
    [LOOM_SAFETENSORS_F8_E5M2] = {"F8_E5M2", 1},
};

const char *loom_safetensors_dtype_name(loom_safetensors_dtype dt) {
    return (unsigned)dt < LOOM_SAFETENSORS_N_DTYPES ? dtype_info[dt].name : "?";
}

size_t loom_safetensors_dtype_size(loom_safetensors_dtype dt) {
    return (unsigned)dt < LOOM_SAFETENSORS_N_DTYPES ? dtype_info[dt].size : 0;
}

loom_safetensors_dtype loom_safetensors_dtype_of(loom_dtype dt) {
    switch (dt) {
    case LOOM_BF16: return LOOM_SAFETENSORS_BF16;
    case LOOM_F16: return LOOM_SAFETENSORS_F16;
    default: return LOOM_SAFETENSORS_F32;
    }
}

struct loom_safetensors {
    char *path;
    io_mapped file;
    json_t *root;                     /* names and metadata point into it */
    loom_safetensors_tensor *tensors; /* in data order */
    size_t n;
    const loom_safetensors_tensor **by_name; /* sorted by name */
    const char **meta_keys, **meta_values;
    size_t n_meta;
};

/* ------------------------------------------------------------ validation */

#define BAD(st, ...) (format_error((st)->path, __VA_ARGS__))

static loom_status format_error(const char *path, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static loom_status format_error(const char *path, const char *fmt, ...) {
    char what[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return loom_error(LOOM_ERR_FORMAT,
                      "safetensors file '%s' is corrupt: %s; it was damaged or cut short: write it again, or "
                      "use another copy (for a checkpoint, resume from an earlier one)", path, what);
}

static int parse_dtype(const char *s, loom_safetensors_dtype *out) {
    for (int i = 0; i < LOOM_SAFETENSORS_N_DTYPES; i++) {
        if (!strcmp(s, dtype_info[i].name)) {
            *out = (loom_safetensors_dtype)i;
            return 1;
        }
    }
    return 0;
}

static loom_status parse_metadata(loom_safetensors *st, json_t *meta) {
    if (json_is_null(meta)) return LOOM_OK; /* what writers of "no metadata" may emit */
    if (!json_is_object(meta)) return BAD(st, "\"__metadata__\" is not a JSON object");
    size_t n = json_object_size(meta);
    st->meta_keys = calloc(n + 1, sizeof *st->meta_keys);
    st->meta_values = calloc(n + 1, sizeof *st->meta_values);
    if (!st->meta_keys || !st->meta_values)
        return loom_error(LOOM_ERR_NOMEM, "out of memory reading '%s'", st->path);
    const char *key;
    json_t *v;
    json_object_foreach(meta, key, v) {
        if (!json_is_string(v))
            return BAD(st, "__metadata__ entry \"%s\" is not a string (safetensors metadata maps strings "
                           "to strings)", key);
        st->meta_keys[st->n_meta] = key;
        st->meta_values[st->n_meta++] = json_string_value(v);
    }
    return LOOM_OK;
}

/* Non-negative JSON integer, or -1. */
static int64_t json_count(const json_t *v) {
    if (!json_is_integer(v)) return -1;
    json_int_t x = json_integer_value(v);
    return x < 0 ? -1 : (int64_t)x;
}

static loom_status parse_tensor(loom_safetensors *st, const char *name, json_t *entry,
                                uint64_t buffer_bytes, loom_safetensors_tensor *t, uint64_t *begin) {
    memset(t, 0, sizeof *t);
    t->name = name;
    if (!json_is_object(entry)) return BAD(st, "tensor \"%s\": its entry is not a JSON object", name);
    json_t *dtype = json_object_get(entry, "dtype"), *shape = json_object_get(entry, "shape");
    json_t *offsets = json_object_get(entry, "data_offsets");
    if (!json_is_string(dtype)) return BAD(st, "tensor \"%s\": \"dtype\" is missing or not a string", name);
    if (!parse_dtype(json_string_value(dtype), &t->dtype))
        return BAD(st, "tensor \"%s\": unknown dtype \"%s\" (known: F64 F32 F16 BF16 I64 I32 I16 I8 "
                       "U64 U32 U16 U8 BOOL F8_E4M3 F8_E5M2)", name, json_string_value(dtype));
    if (!json_is_array(shape)) return BAD(st, "tensor \"%s\": \"shape\" is missing or not an array", name);
    if (json_array_size(shape) > LOOM_SAFETENSORS_MAX_DIMS)
        return BAD(st, "tensor \"%s\": %zu dimensions, loom reads at most %d", name,
                   json_array_size(shape), LOOM_SAFETENSORS_MAX_DIMS);
    t->ndim = (int)json_array_size(shape);
    uint64_t n = 1;
    for (int d = 0; d < t->ndim; d++) {
        int64_t dim = json_count(json_array_get(shape, (size_t)d));
        if (dim < 0) return BAD(st, "tensor \"%s\": shape[%d] is not a non-negative integer", name, d);
        t->shape[d] = dim;
        if (dim != 0 && n > UINT64_MAX / (uint64_t)dim)
            return BAD(st, "tensor \"%s\": the shape's element count overflows", name);
        n *= (uint64_t)dim;
    }
    if (!json_is_array(offsets) || json_array_size(offsets) != 2)
        return BAD(st, "tensor \"%s\": \"data_offsets\" is missing or not [begin, end]", name);
    int64_t b = json_count(json_array_get(offsets, 0)), e = json_count(json_array_get(offsets, 1));
    if (b < 0 || e < 0) return BAD(st, "tensor \"%s\": data_offsets are not non-negative integers", name);
    if (b > e) return BAD(st, "tensor \"%s\": data_offsets [%lld, %lld] end before they begin", name,
                          (long long)b, (long long)e);
    if ((uint64_t)e > buffer_bytes)
        return BAD(st, "tensor \"%s\": data_offsets [%lld, %lld] run past the %llu-byte data buffer "
                       "(truncated file?)", name, (long long)b, (long long)e,
                   (unsigned long long)buffer_bytes);
    size_t esize = dtype_info[t->dtype].size;
    if (n > UINT64_MAX / esize)
        return BAD(st, "tensor \"%s\": %s shape with %llu elements is larger than any file can hold", name,
                   dtype_info[t->dtype].name, (unsigned long long)n);
    if (n * esize != (uint64_t)(e - b))
        return BAD(st, "tensor \"%s\": %s shape with %llu elements needs %llu bytes but data_offsets "
                       "[%lld, %lld] span %lld", name, dtype_info[t->dtype].name,
                   (unsigned long long)n, (unsigned long long)(n * esize), (long long)b,
                   (long long)e, (long long)(e - b));
    t->n_elements = (size_t)n;
    t->n_bytes = (size_t)(e - b);
    *begin = (uint64_t)b;
    return LOOM_OK;
}

typedef struct span { uint64_t begin, end; size_t index; } span;

/* By (begin, end): an empty tensor sits before a non-empty one that starts
 * at the same offset, as in the reference implementation. */
static int cmp_span(const void *x, const void *y) {
    const span *a = x, *b = y;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return a->index < b->index ? -1 : a->index > b->index;
}

static int cmp_name(const void *x, const void *y) {
    const loom_safetensors_tensor *const *a = x, *const *b = y;
    return strcmp((*a)->name, (*b)->name);
}

static loom_status parse(loom_safetensors *st) {
    const unsigned char *p = st->file.data;
    size_t size = st->file.size;
    if (size < 8)
        return BAD(st, "the file is %zu bytes, too short for the 8-byte header length", size);
    uint64_t hlen;
    memcpy(&hlen, p, 8);
    if (hlen > size - 8)
        return BAD(st, "the header length %llu exceeds the %zu bytes after it (truncated, or not a "
                       "safetensors file)", (unsigned long long)hlen, size - 8);
    if (hlen > MAX_HEADER_BYTES)
        return BAD(st, "the header length %llu is above the 100 MiB limit", (unsigned long long)hlen);
    uint64_t buffer_bytes = size - 8 - hlen;
    json_error_t jerr;
    st->root = json_loadb((const char *)p + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!st->root)
        return BAD(st, "the JSON header does not parse (line %d, column %d: %s)", jerr.line,
                   jerr.column, jerr.text);
    if (!json_is_object(st->root)) return BAD(st, "the JSON header is not an object");
    size_t n_keys = json_object_size(st->root);
    st->tensors = calloc(n_keys + 1, sizeof *st->tensors);
    span *spans = calloc(n_keys + 1, sizeof *spans);
    st->by_name = calloc(n_keys + 1, sizeof *st->by_name);
    if (!st->tensors || !spans || !st->by_name) {
        free(spans);
        return loom_error(LOOM_ERR_NOMEM, "out of memory reading '%s'", st->path);
    }
    const char *key;
    json_t *v;
    loom_status s = LOOM_OK;
    json_object_foreach(st->root, key, v) {
        if (!strcmp(key, "__metadata__")) s = parse_metadata(st, v);
        else {
            s = parse_tensor(st, key, v, buffer_bytes, &st->tensors[st->n], &spans[st->n].begin);
            spans[st->n].index = st->n;
            spans[st->n].end = spans[st->n].begin + st->tensors[st->n].n_bytes;
            st->n++;
        }
        if (s != LOOM_OK) break;
    }
    /* The tensors must tile the buffer exactly: no overlap, no gap, no tail. */
    qsort(spans, st->n, sizeof *spans, cmp_span);
    uint64_t expect = 0;
    for (size_t i = 0; s == LOOM_OK && i < st->n; i++) {
        const loom_safetensors_tensor *t = &st->tensors[spans[i].index];
        if (spans[i].begin < expect)
            s = BAD(st, "tensor \"%s\" (data_offsets begin %llu) overlaps the tensor before it, "
                        "which ends at %llu", t->name, (unsigned long long)spans[i].begin,
                    (unsigned long long)expect);
        else if (spans[i].begin > expect)
            s = BAD(st, "a gap of %llu bytes before tensor \"%s\" (data_offsets begin %llu, the "
                        "previous tensor ends at %llu)", (unsigned long long)(spans[i].begin - expect),
                    t->name, (unsigned long long)spans[i].begin, (unsigned long long)expect);
        expect = spans[i].begin + t->n_bytes;
    }
    if (s == LOOM_OK && expect != buffer_bytes)
        s = BAD(st, "the tensors cover %llu bytes of data but the file holds %llu after the header "
                    "(trailing bytes)", (unsigned long long)expect, (unsigned long long)buffer_bytes);
    if (s == LOOM_OK) {
        /* Reorder into data order and point at the bytes. */
        loom_safetensors_tensor *sorted = calloc(st->n + 1, sizeof *sorted);
        if (!sorted) s = loom_error(LOOM_ERR_NOMEM, "out of memory reading '%s'", st->path);
        for (size_t i = 0; sorted && i < st->n; i++) {
            sorted[i] = st->tensors[spans[i].index];
            sorted[i].data = p + 8 + hlen + spans[i].begin;
        }
        if (sorted) {
            free(st->tensors);
            st->tensors = sorted;
            for (size_t i = 0; i < st->n; i++) st->by_name[i] = &st->tensors[i];
            qsort(st->by_name, st->n, sizeof *st->by_name, cmp_name);
        }
    }
    free(spans);
    return s;
}

/* ------------------------------------------------------------------ API */

loom_status loom_safetensors_open(const char *path, loom_safetensors **out) {
    *out = NULL;
    if (!path) return loom_error(LOOM_ERR_INVALID, "loom_safetensors_open: path is NULL");
    loom_safetensors *st = calloc(1, sizeof *st);
    if (st) st->path = strdup(path);
    if (!st || !st->path) {
        free(st);
        return loom_error(LOOM_ERR_NOMEM, "out of memory opening '%s'", path);
    }
    loom_status s = io_map_file(path, "safetensors file", &st->file);
    if (s == LOOM_OK) s = parse(st);
    if (s != LOOM_OK) {
        loom_safetensors_close(st);
        return s;
    }
    *out = st;
    return LOOM_OK;
}

void loom_safetensors_close(loom_safetensors *st) {
    if (!st) return;
    io_unmap_file(&st->file);
    json_decref(st->root);
    free(st->tensors);
    free(st->by_name);
    free(st->meta_keys);
    free(st->meta_values);
    free(st->path);
    free(st);
}

size_t loom_safetensors_count(const loom_safetensors *st) { return st ? st->n : 0; }

loom_status loom_safetensors_at(const loom_safetensors *st, size_t i, loom_safetensors_tensor *out) {
    if (i >= st->n)
        return loom_error(LOOM_ERR_INVALID, "tensor index %zu out of range: '%s' holds %zu tensors", i,
                          st->path, st->n);
    *out = st->tensors[i];
    return LOOM_OK;
}

static const loom_safetensors_tensor *find(const loom_safetensors *st, const char *name) {
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->by_name[mid]->name, name);
        if (c == 0) return st->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

int loom_safetensors_has(const loom_safetensors *st, const char *name) {
    return st && name && find(st, name) != NULL;
}

loom_status loom_safetensors_get(const loom_safetensors *st, const char *name,
                                 loom_safetensors_tensor *out) {
    const loom_safetensors_tensor *t = name ? find(st, name) : NULL;
    if (!t)
        return loom_error(LOOM_ERR_INVALID, "no tensor named \"%s\" in '%s' (it holds %zu tensors%s%s%s); "
                          "check the name or the model config", name ? name : "(null)", st->path, st->n,
                          st->n ? ", e.g. \"" : "", st->n ? st->tensors[0].name : "", st->n ? "\"" : "");
    *out = *t;
    return LOOM_OK;
}

static void shape_str(char *buf, size_t cap, const int64_t *shape, int ndim) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && k < cap; d++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* Element i of a little-endian buffer of any non-FP8 type, as a double
 * (memcpy: the data may be unaligned). */
static double load_any(const unsigned char *p, size_t i, loom_safetensors_dtype dt) {
    size_t sz = dtype_info[dt].size;
    uint64_t raw = 0;
    memcpy(&raw, p + i * sz, sz);
    switch (dt) {
    case LOOM_SAFETENSORS_BOOL: return raw != 0;
    case LOOM_SAFETENSORS_U8: case LOOM_SAFETENSORS_U16:
    case LOOM_SAFETENSORS_U32: case LOOM_SAFETENSORS_U64: return (double)raw;
    case LOOM_SAFETENSORS_I8: return (int8_t)raw;
    case LOOM_SAFETENSORS_I16: return (int16_t)raw;
    case LOOM_SAFETENSORS_I32: return (int32_t)raw;
    case LOOM_SAFETENSORS_I64: return (double)(int64_t)raw;
    case LOOM_SAFETENSORS_F16: return loom_f16_to_f32((uint16_t)raw);
    case LOOM_SAFETENSORS_BF16: return loom_bf16_to_f32((uint16_t)raw);
    case LOOM_SAFETENSORS_F32: return loom_bits_f32((uint32_t)raw);
    case LOOM_SAFETENSORS_F64: { double d; memcpy(&d, &raw, 8); return d; }
    default: return 0.0;
    }
}

/* Elements e0 .. e0 + n of t into dst (dt), converted; their pages handed back. */
static loom_status read_range(const loom_safetensors *st, const loom_safetensors_tensor *t, const char *name,
                              loom_dtype dt, size_t e0, size_t n, void *dst) {
    if (t->dtype == LOOM_SAFETENSORS_F8_E4M3 || t->dtype == LOOM_SAFETENSORS_F8_E5M2)
        return loom_error(LOOM_ERR_UNSUPPORTED, "tensor \"%s\" in '%s' is %s, which loom cannot convert; "
                          "convert the file to F32/BF16/F16", name, st->path, dtype_info[t->dtype].name);
    if (n == 0) return LOOM_OK;
    if (!dst) return loom_error(LOOM_ERR_INVALID, "loom_safetensors_read(\"%s\"): dst is NULL", name);
    size_t sz = dtype_info[t->dtype].size;
    const unsigned char *src = (const unsigned char *)t->data + e0 * sz;
    int same_kind = (t->dtype == LOOM_SAFETENSORS_F32 && dt == LOOM_F32) ||
                    (t->dtype == LOOM_SAFETENSORS_BF16 && dt == LOOM_BF16) ||
                    (t->dtype == LOOM_SAFETENSORS_F16 && dt == LOOM_F16);
    if (same_kind) {
        memcpy(dst, src, n * sz);
    } else if ((t->dtype == LOOM_SAFETENSORS_F32 || t->dtype == LOOM_SAFETENSORS_BF16 ||
                t->dtype == LOOM_SAFETENSORS_F16) && ((uintptr_t)src % 4) == 0) {
        loom_dtype from = t->dtype == LOOM_SAFETENSORS_F32 ? LOOM_F32
                          : t->dtype == LOOM_SAFETENSORS_BF16 ? LOOM_BF16 : LOOM_F16;
        loom_convert(dst, dt, src, from, n);
    } else {
        for (size_t i = 0; i < n; i++) {
            double v = load_any(src, i, t->dtype);
            /* f64 -> f32 first; values beyond float range become +-Inf. */
            loom_store(dst, i, dt, (float)v);
        }
    }
    io_mapped_drop(&st->file, src, n * sz); /* copied out: a large file's reader keeps one copy */
    return LOOM_OK;
}

/* Whether t has shape (ndim, shape); else the error naming both. */
static loom_status check_shape(const loom_safetensors *st, const loom_safetensors_tensor *t, const char *name,
                               const int64_t *shape, int ndim) {
    int same = ndim == t->ndim;
    for (int d = 0; same && d < ndim; d++) same = shape[d] == t->shape[d];
    if (same) return LOOM_OK;
    char want[160], have[160];
    shape_str(want, sizeof want, shape, ndim < 0 ? 0 : ndim > 8 ? 8 : ndim);
    shape_str(have, sizeof have, t->shape, t->ndim);
    return loom_error(LOOM_ERR_INVALID, "tensor \"%s\" in '%s' has shape %s but %s was expected; "
                      "the file does not match the model config", name, st->path, have, want);
}

loom_status loom_safetensors_read(const loom_safetensors *st, const char *name, loom_dtype dt,
                                  const int64_t *shape, int ndim, void *dst) {
    loom_safetensors_tensor t;
    LOOM_TRY(loom_safetensors_get(st, name, &t));
    if (shape) LOOM_TRY(check_shape(st, &t, name, shape, ndim));
    return read_range(st, &t, name, dt, 0, t.n_elements, dst);
}

loom_status loom_safetensors_read_rows(const loom_safetensors *st, const char *name, loom_dtype dt, int64_t rows,
                                       int64_t cols, int64_t row0, int64_t n_rows, void *dst) {
    loom_safetensors_tensor t;
    LOOM_TRY(loom_safetensors_get(st, name, &t));
    int64_t shape[2] = {rows, cols};
    LOOM_TRY(check_shape(st, &t, name, shape, 2));
    if (row0 < 0 || n_rows < 0 || row0 > rows - n_rows)
        return loom_error(LOOM_ERR_INVALID, "rows %lld .. %lld of tensor \"%s\" in '%s', which has %lld",
                          (long long)row0, (long long)(row0 + n_rows), name, st->path, (long long)rows);
    return read_range(st, &t, name, dt, (size_t)(row0 * cols), (size_t)(n_rows * cols), dst);
}

const char *loom_safetensors_metadata(const loom_safetensors *st, const char *key) {
    for (size_t i = 0; st && key && i < st->n_meta; i++)
        if (!strcmp(st->meta_keys[i], key)) return st->meta_values[i];
    return NULL;
}

size_t loom_safetensors_metadata_count(const loom_safetensors *st) { return st ? st->n_meta : 0; }

loom_status loom_safetensors_metadata_at(const loom_safetensors *st, size_t i, const char **key,
                                         const char **value) {
    if (i >= st->n_meta)
        return loom_error(LOOM_ERR_INVALID, "metadata index %zu out of range: '%s' has %zu entries", i,
                          st->path, st->n_meta);
    *key = st->meta_keys[i];
    *value = st->meta_values[i];
    return LOOM_OK;
}
