/*
 * loom/tensor.h — tensors: a dtype, up to 4 dimensions with strides, a
 * refcounted storage and an offset.
 *
 * Ownership: every function that returns a loom_tensor* returns a new
 * reference (refcount +1) unless it says "borrowed". Release each reference
 * with loom_tensor_release. Views (reshape, transpose, permute, slice) share
 * the storage; the storage is freed when its last tensor is released.
 *
 * A tensor produced by a recorded op knows its autograd node; a parameter's
 * tensor knows its parameter (loom_tensor_param). That parameter pointer is
 * the identity the autograd engine and the recompute machinery never replace.
 */
#ifndef LOOM_TENSOR_H
#define LOOM_TENSOR_H

#include "loom/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_MAX_DIMS 4

typedef struct loom_tensor loom_tensor;
typedef struct loom_param loom_param;
typedef struct loom_node loom_node;

/* A refcounted object with its own destructor. Autograd nodes begin with
 * one, so a tensor can hold its producer without core knowing what a node
 * is. */
typedef struct loom_object {
    int refcount;
    void (*destroy)(struct loom_object *self);
} loom_object;
static inline void loom_object_retain(loom_object *o) { if (o) __atomic_add_fetch(&o->refcount, 1, __ATOMIC_RELAXED); }
static inline void loom_object_release(loom_object *o) {
    if (o && __atomic_sub_fetch(&o->refcount, 1, __ATOMIC_ACQ_REL) == 0) o->destroy(o);
}

typedef struct loom_storage {
    void *data;
    size_t bytes;
    int refcount;
    loom_mem_category category;
} loom_storage;

struct loom_tensor {
    loom_dtype dtype;
    int ndim;
    int64_t shape[LOOM_MAX_DIMS];
    int64_t stride[LOOM_MAX_DIMS]; /* in elements */
    size_t offset;                 /* in elements, into storage */
    loom_storage *storage;
    int refcount;
    /* autograd */
    loom_node *node;     /* producer node (a reference; begins with loom_object), NULL for leaves */
    int out_index;       /* which output of `node` this is */
    loom_param *param;   /* non-NULL: this is a parameter's compute copy */
    int requires_grad;   /* a leaf that collects its gradient in `grad` */
    loom_tensor *grad;   /* a leaf's accumulated gradient (owned) */
};

/* A new contiguous tensor of the given shape, uninitialised (or zeroed),
 * accounted under `cat`. Returns NULL and sets the error on failure (bad
 * shape, out of memory). */
loom_tensor *loom_tensor_new(loom_dtype dt, int ndim, const int64_t *shape, loom_mem_category cat);
loom_tensor *loom_tensor_zeros(loom_dtype dt, int ndim, const int64_t *shape, loom_mem_category cat);
/* A new tensor holding a copy of n floats converted to dt. */
loom_tensor *loom_tensor_from_f32(const float *src, loom_dtype dt, int ndim, const int64_t *shape,
                                  loom_mem_category cat);
/* Convenience shapes. */
loom_tensor *loom_tensor_new_1d(loom_dtype dt, int64_t d0, loom_mem_category cat);
loom_tensor *loom_tensor_new_2d(loom_dtype dt, int64_t d0, int64_t d1, loom_mem_category cat);

loom_tensor *loom_tensor_retain(loom_tensor *t);
/* Drops one reference; frees the tensor (and its storage, when no other
 * view holds it) at zero. NULL is ignored. */
void loom_tensor_release(loom_tensor *t);

static inline int64_t loom_tensor_numel(const loom_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}
static inline size_t loom_tensor_nbytes(const loom_tensor *t) {
    return (size_t)loom_tensor_numel(t) * loom_dtype_size(t->dtype);
}
/* Pointer to element 0 (borrowed). */
static inline void *loom_tensor_data(const loom_tensor *t) {
    return (char *)t->storage->data + t->offset * loom_dtype_size(t->dtype);
}
int loom_tensor_is_contiguous(const loom_tensor *t);
/* Whether t's memory may be overwritten in place: t holds the only
 * reference to its storage and is its only holder, is contiguous and is not
 * a parameter's tensor (no other tensor, view or gradient slot sees it). */
int loom_tensor_writable_in_place(const loom_tensor *t);
int loom_tensor_same_shape(const loom_tensor *a, const loom_tensor *b);
/* "(2, 3, 4) bf16" into buf; returns buf. */
const char *loom_tensor_describe(const loom_tensor *t, char *buf, size_t n);

/* Views sharing storage. They are not recorded for autograd (use the ops in
 * loom/ops.h, e.g. loom_reshape, for differentiable versions). On bad
 * arguments they return NULL and set the error. */
loom_tensor *loom_tensor_view(loom_tensor *t, int ndim, const int64_t *shape); /* t contiguous */
loom_tensor *loom_tensor_transpose(loom_tensor *t, int d0, int d1);
loom_tensor *loom_tensor_permute(loom_tensor *t, const int *perm);
loom_tensor *loom_tensor_slice(loom_tensor *t, int dim, int64_t start, int64_t end);
/* A contiguous tensor with t's values: t itself (retained) when already
 * contiguous, else a copy. */
loom_tensor *loom_tensor_contiguous(loom_tensor *t, loom_mem_category cat);
/* A contiguous copy converted to dtype dt (not recorded). */
loom_tensor *loom_tensor_to(loom_tensor *t, loom_dtype dt, loom_mem_category cat);
/* A tensor sharing t's storage with no autograd history (not a parameter). */
loom_tensor *loom_tensor_detach(loom_tensor *t);

/* Copy all values out as floats into dst (numel floats); handles strides. */
void loom_tensor_read_f32(const loom_tensor *t, float *dst);
/* Overwrite all values from floats (converted to t's dtype). */
void loom_tensor_write_f32(loom_tensor *t, const float *src);
/* Element i of a contiguous tensor as float. */
static inline float loom_tensor_get(const loom_tensor *t, int64_t i) {
    return loom_load(loom_tensor_data(t), (size_t)i, t->dtype);
}

/* The parameter this tensor is the compute copy of, or NULL (borrowed). */
static inline loom_param *loom_tensor_param(const loom_tensor *t) { return t ? t->param : NULL; }

#ifdef __cplusplus
}
#endif
#endif
