/*
 * tensor.c — tensor construction, refcounting, views and copies.
 * Owns: the lifetime of tensors and storages. Must never: free a storage a
 * view still uses, or know anything about autograd beyond dropping the
 * producer reference (an opaque loom_object).
 */
#include "loom/tensor.h"

#include <stdio.h>
#include <stdlib.h>

static int check_shape(int ndim, const int64_t *shape) {
    if (ndim < 0 || ndim > LOOM_MAX_DIMS) {
        loom_error(LOOM_ERR_INVALID, "tensor: %d dimensions requested, at most %d supported", ndim,
                   LOOM_MAX_DIMS);
        return 0;
    }
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            loom_error(LOOM_ERR_INVALID, "tensor: dimension %d has negative size %lld", i,
                       (long long)shape[i]);
            return 0;
        }
    }
    return 1;
}

static void set_contiguous_strides(loom_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        t->stride[i] = s;
        s *= t->shape[i];
    }
}

static loom_tensor *tensor_header(loom_dtype dt, int ndim, const int64_t *shape) {
    loom_tensor *t = calloc(1, sizeof *t);
    if (!t) {
        loom_error(LOOM_ERR_NOMEM, "tensor: out of memory for a tensor header");
        return NULL;
    }
    t->dtype = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    set_contiguous_strides(t);
    t->refcount = 1;
    return t;
}

loom_tensor *loom_tensor_new(loom_dtype dt, int ndim, const int64_t *shape, loom_mem_category cat) {
    if (!loom_dtype_valid(dt)) {
        loom_error(LOOM_ERR_INVALID, "tensor: unknown dtype %d (fp32, bf16 or fp16)", (int)dt);
        return NULL;
    }
    if (!check_shape(ndim, shape)) return NULL;
    loom_tensor *t = tensor_header(dt, ndim, shape);
    if (!t) return NULL;
    size_t bytes = loom_tensor_nbytes(t);
    t->storage = calloc(1, sizeof *t->storage);
    if (t->storage) t->storage->data = loom_alloc(bytes, cat);
    if (!t->storage || !t->storage->data) {
        free(t->storage);
        free(t);
        loom_error(LOOM_ERR_NOMEM, "tensor: out of memory allocating %zu bytes", bytes);
        return NULL;
    }
    t->storage->bytes = bytes;
    t->storage->refcount = 1;
    t->storage->category = cat;
    return t;
}

loom_tensor *loom_tensor_zeros(loom_dtype dt, int ndim, const int64_t *shape, loom_mem_category cat) {
    loom_tensor *t = loom_tensor_new(dt, ndim, shape, cat);
    if (t) memset(loom_tensor_data(t), 0, loom_tensor_nbytes(t));
    return t;
}

loom_tensor *loom_tensor_from_f32(const float *src, loom_dtype dt, int ndim, const int64_t *shape,
                                  loom_mem_category cat) {
    loom_tensor *t = loom_tensor_new(dt, ndim, shape, cat);
    if (t) loom_convert(loom_tensor_data(t), dt, src, LOOM_F32, (size_t)loom_tensor_numel(t));
    return t;
}

loom_tensor *loom_tensor_new_1d(loom_dtype dt, int64_t d0, loom_mem_category cat) {
    return loom_tensor_new(dt, 1, &d0, cat);
}

loom_tensor *loom_tensor_new_2d(loom_dtype dt, int64_t d0, int64_t d1, loom_mem_category cat) {
    int64_t s[2] = {d0, d1};
    return loom_tensor_new(dt, 2, s, cat);
}

loom_tensor *loom_tensor_retain(loom_tensor *t) {
    if (t) __atomic_add_fetch(&t->refcount, 1, __ATOMIC_RELAXED);
    return t;
}

static void storage_release(loom_storage *s) {
    if (s && __atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) == 0) {
        loom_free(s->data);
        free(s);
    }
}

void loom_tensor_release(loom_tensor *t) {
    if (!t || __atomic_sub_fetch(&t->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
    storage_release(t->storage);
    if (t->node) loom_object_release((loom_object *)t->node);
    loom_tensor_release(t->grad);
    free(t);
}

int loom_tensor_writable_in_place(const loom_tensor *t) {
    return t->refcount == 1 && t->storage->refcount == 1 && !t->param && loom_tensor_is_contiguous(t);
}

int loom_tensor_is_contiguous(const loom_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

int loom_tensor_same_shape(const loom_tensor *a, const loom_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

const char *loom_tensor_describe(const loom_tensor *t, char *buf, size_t n) {
    int k = snprintf(buf, n, "(");
    for (int i = 0; i < t->ndim && k < (int)n; i++)
        k += snprintf(buf + k, n - (size_t)k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (k < (int)n) snprintf(buf + k, n - (size_t)k, ") %s", loom_dtype_name(t->dtype));
    return buf;
}

/* A header sharing t's storage (the caller sets shape/strides). */
static loom_tensor *share(loom_tensor *t) {
    loom_tensor *v = tensor_header(t->dtype, t->ndim, t->shape);
    if (!v) return NULL;
    memcpy(v->stride, t->stride, sizeof v->stride);
    v->offset = t->offset;
    v->storage = t->storage;
    __atomic_add_fetch(&t->storage->refcount, 1, __ATOMIC_RELAXED);
    return v;
}

loom_tensor *loom_tensor_view(loom_tensor *t, int ndim, const int64_t *shape) {
    if (!check_shape(ndim, shape)) return NULL;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    char d[96];
    if (n != loom_tensor_numel(t))
        return loom_error(LOOM_ERR_INVALID, "view: cannot view %s as %d dims with %lld elements",
                          loom_tensor_describe(t, d, sizeof d), ndim, (long long)n), NULL;
    if (!loom_tensor_is_contiguous(t))
        return loom_error(LOOM_ERR_INVALID, "view: tensor %s is not contiguous; call loom_tensor_contiguous first",
                          loom_tensor_describe(t, d, sizeof d)), NULL;
    loom_tensor *v = share(t);
    if (!v) return NULL;
    v->ndim = ndim;
    for (int i = 0; i < ndim; i++) v->shape[i] = shape[i];
    set_contiguous_strides(v);
    return v;
}

loom_tensor *loom_tensor_permute(loom_tensor *t, const int *perm) {
    int seen[LOOM_MAX_DIMS] = {0};
    for (int i = 0; i < t->ndim; i++) {
        if (perm[i] < 0 || perm[i] >= t->ndim || seen[perm[i]]++)
            return loom_error(LOOM_ERR_INVALID, "permute: argument is not a permutation of %d dimensions",
                              t->ndim), NULL;
    }
    loom_tensor *v = share(t);
    if (!v) return NULL;
    for (int i = 0; i < t->ndim; i++) {
        v->shape[i] = t->shape[perm[i]];
        v->stride[i] = t->stride[perm[i]];
    }
    return v;
}

loom_tensor *loom_tensor_transpose(loom_tensor *t, int d0, int d1) {
    if (d0 < 0 || d1 < 0 || d0 >= t->ndim || d1 >= t->ndim)
        return loom_error(LOOM_ERR_INVALID, "transpose: dimensions %d, %d out of range for %d dims", d0, d1,
                          t->ndim), NULL;
    int perm[LOOM_MAX_DIMS] = {0, 1, 2, 3};
    perm[d0] = d1;
    perm[d1] = d0;
    return loom_tensor_permute(t, perm);
}

loom_tensor *loom_tensor_slice(loom_tensor *t, int dim, int64_t start, int64_t end) {
    if (dim < 0 || dim >= t->ndim || start < 0 || end < start || end > t->shape[dim])
        return loom_error(LOOM_ERR_INVALID, "slice: [%lld, %lld) of dimension %d (size %lld) is out of range",
                          (long long)start, (long long)end, dim,
                          dim >= 0 && dim < t->ndim ? (long long)t->shape[dim] : -1LL), NULL;
    loom_tensor *v = share(t);
    if (!v) return NULL;
    v->shape[dim] = end - start;
    v->offset = t->offset + (size_t)(start * t->stride[dim]);
    return v;
}

/* Visit every element of t in row-major logical order. */
static void strided_copy(const loom_tensor *t, void *dst, loom_dtype dst_dt) {
    int64_t sh[LOOM_MAX_DIMS] = {1, 1, 1, 1}, st[LOOM_MAX_DIMS] = {0, 0, 0, 0};
    int pad = LOOM_MAX_DIMS - t->ndim;
    for (int i = 0; i < t->ndim; i++) {
        sh[pad + i] = t->shape[i];
        st[pad + i] = t->stride[i];
    }
    const void *src = t->storage->data;
    size_t k = 0;
    for (int64_t a = 0; a < sh[0]; a++)
        for (int64_t b = 0; b < sh[1]; b++)
            for (int64_t c = 0; c < sh[2]; c++)
                for (int64_t d = 0; d < sh[3]; d++) {
                    size_t idx = t->offset + (size_t)(a * st[0] + b * st[1] + c * st[2] + d * st[3]);
                    loom_store(dst, k++, dst_dt, loom_load(src, idx, t->dtype));
                }
}

loom_tensor *loom_tensor_to(loom_tensor *t, loom_dtype dt, loom_mem_category cat) {
    loom_tensor *c = loom_tensor_new(dt, t->ndim, t->shape, cat);
    if (!c) return NULL;
    if (loom_tensor_is_contiguous(t))
        loom_convert(loom_tensor_data(c), dt, loom_tensor_data(t), t->dtype, (size_t)loom_tensor_numel(t));
    else
        strided_copy(t, loom_tensor_data(c), dt);
    return c;
}

loom_tensor *loom_tensor_contiguous(loom_tensor *t, loom_mem_category cat) {
    if (loom_tensor_is_contiguous(t)) return loom_tensor_retain(t);
    return loom_tensor_to(t, t->dtype, cat);
}

loom_tensor *loom_tensor_detach(loom_tensor *t) { return share(t); }

void loom_tensor_read_f32(const loom_tensor *t, float *dst) {
    if (loom_tensor_is_contiguous(t))
        loom_convert(dst, LOOM_F32, loom_tensor_data(t), t->dtype, (size_t)loom_tensor_numel(t));
    else
        strided_copy(t, dst, LOOM_F32);
}

void loom_tensor_write_f32(loom_tensor *t, const float *src) {
    LOOM_ASSERT(loom_tensor_is_contiguous(t));
    loom_convert(loom_tensor_data(t), t->dtype, src, LOOM_F32, (size_t)loom_tensor_numel(t));
}
