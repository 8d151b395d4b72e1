/*
 * test_tensor.c — tensors: construction, refcounted storage shared by views,
 * reshape / transpose / permute / slice against index arithmetic, contiguous
 * copies, dtype conversion, bad arguments.
 */
#include "testutil.h"

#include <string.h>

#include "loom/tensor.h"

static loom_tensor *iota(int ndim, const int64_t *shape) {
    loom_tensor *t = loom_tensor_new(LOOM_F32, ndim, shape, LOOM_MEM_ACTIVATIONS);
    assert_non_null(t);
    float *d = loom_tensor_data(t);
    for (int64_t i = 0; i < loom_tensor_numel(t); i++) d[i] = (float)i;
    return t;
}

static void test_views(void **state) {
    (void)state;
    loom_mem_stats s0, s1;
    loom_mem_get_stats(&s0);
    int64_t shape[3] = {2, 3, 4};
    loom_tensor *t = iota(3, shape);
    /* reshape shares storage */
    loom_tensor *r = loom_tensor_view(t, 2, (const int64_t[]){6, 4});
    assert_non_null(r);
    assert_ptr_equal(loom_tensor_data(r), loom_tensor_data(t));
    assert_int_equal(r->storage->refcount, 2);
    /* transpose (0, 2): element [k][j][i] = t[i][j][k] */
    loom_tensor *tr = loom_tensor_transpose(t, 0, 2);
    assert_int_equal(tr->shape[0], 4);
    assert_false(loom_tensor_is_contiguous(tr));
    float out[24];
    loom_tensor_read_f32(tr, out);
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 3; j++)
            for (int i = 0; i < 2; i++) assert_float_equal(out[(k * 3 + j) * 2 + i], (float)((i * 3 + j) * 4 + k), 0);
    /* permute (1, 2, 0) */
    loom_tensor *pm = loom_tensor_permute(t, (const int[]){1, 2, 0});
    loom_tensor *pc = loom_tensor_contiguous(pm, LOOM_MEM_ACTIVATIONS);
    assert_true(loom_tensor_is_contiguous(pc));
    const float *pd = loom_tensor_data(pc);
    for (int j = 0; j < 3; j++)
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 2; i++) assert_float_equal(pd[(j * 4 + k) * 2 + i], (float)((i * 3 + j) * 4 + k), 0);
    /* slice dim 1 [1, 3) */
    loom_tensor *sl = loom_tensor_slice(t, 1, 1, 3);
    assert_int_equal(sl->shape[1], 2);
    float so[16];
    loom_tensor_read_f32(sl, so);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            for (int k = 0; k < 4; k++) assert_float_equal(so[(i * 2 + j) * 4 + k], (float)((i * 3 + j + 1) * 4 + k), 0);
    /* a view of a non-contiguous tensor is refused with a message */
    assert_null(loom_tensor_view(tr, 1, (const int64_t[]){24}));
    assert_non_null(strstr(loom_last_error(), "not contiguous"));
    assert_null(loom_tensor_view(t, 1, (const int64_t[]){25}));
    assert_null(loom_tensor_slice(t, 1, 2, 5));
    assert_null(loom_tensor_permute(t, (const int[]){0, 0, 1}));
    assert_null(loom_tensor_new(LOOM_F32, 5, (const int64_t[]){1, 1, 1, 1, 1}, LOOM_MEM_ACTIVATIONS));
    /* conversion round trip through bf16 */
    loom_tensor *b = loom_tensor_to(t, LOOM_BF16, LOOM_MEM_ACTIVATIONS);
    assert_int_equal(loom_tensor_nbytes(b), 48);
    float bo[24];
    loom_tensor_read_f32(b, bo);
    for (int i = 0; i < 24; i++) assert_float_equal(bo[i], (float)i, 0); /* small integers are exact in bf16 */
    char d[64];
    assert_string_equal(loom_tensor_describe(b, d, sizeof d), "(2, 3, 4) bf16");
    loom_tensor *all[] = {r, tr, pm, pc, sl, b};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) loom_tensor_release(all[i]);
    assert_int_equal(t->storage->refcount, 1);
    loom_tensor_release(t);
    loom_mem_get_stats(&s1);
    assert_int_equal(s1.current[LOOM_MEM_ACTIVATIONS], s0.current[LOOM_MEM_ACTIVATIONS]);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_views)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
