/*
 * test_embedding.c — embedding lookup and its gradient: rows copied exactly,
 * repeated tokens accumulate onto existing dtable values, untouched rows stay
 * untouched, backward vs central finite differences, and bit-reproducibility
 * across thread counts.
 */
#include "testutil.h"
#include "kernels/kernels.h"

#include <math.h>

#define FD_STEP 1e-3f

/* Tokens with repeats: token of row i is (i * 7) % (V - 2), so the last two
 * rows of the table are never used. */
static int32_t *make_tokens(int N, int V) {
    int32_t *t = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++) t[i] = (i * 7) % (V - 2);
    return t;
}

static void check_fwd(loom_dtype dt) {
    int N = 23, C = 70, V = 11;
    float *tf = malloc(sizeof(float) * V * C);
    tu_fill_uniform(tf, (size_t)V * C, -1.0f, 1.0f, 1);
    void *table = tu_from_f32(tf, (size_t)V * C, dt), *out = malloc((size_t)N * C * 4);
    int32_t *tok = make_tokens(N, V);
    embedding_fwd(out, tok, table, N, C, dt);
    size_t row = (size_t)C * loom_dtype_size(dt);
    for (int i = 0; i < N; i++)
        assert_true(tu_bits_equal((char *)out + i * row, (char *)table + tok[i] * row, row, "row"));
    free(tf); free(table); free(out); free(tok);
}

static void test_fwd_copies_rows(void **state) {
    (void)state;
    check_fwd(LOOM_F32);
    check_fwd(LOOM_BF16);
    check_fwd(LOOM_F16);
}

/* dtable starts non-zero; each used row gains the sum of its dout rows. The
 * oracle sums in double; fp32 accumulation of <= 4 terms of size <= 1 onto a
 * start <= 1 is within a few 2^-24. */
static void check_bwd(loom_dtype dt) {
    int N = 23, C = 70, V = 11;
    float *df = malloc(sizeof(float) * N * C), *dtab = malloc(sizeof(float) * V * C);
    tu_fill_uniform(df, (size_t)N * C, -1.0f, 1.0f, 2);
    tu_fill_uniform(dtab, (size_t)V * C, -1.0f, 1.0f, 3);
    void *dout = tu_from_f32(df, (size_t)N * C, dt);
    double *want = malloc(sizeof(double) * V * C);
    float *wantf = malloc(sizeof(float) * V * C), *before = malloc(sizeof(float) * V * C);
    int32_t *tok = make_tokens(N, V);
    for (int i = 0; i < V * C; i++) want[i] = before[i] = dtab[i];
    for (int i = 0; i < N; i++)
        for (int c = 0; c < C; c++) want[tok[i] * C + c] += loom_load(dout, (size_t)i * C + c, dt);
    for (int i = 0; i < V * C; i++) wantf[i] = (float)want[i];
    embedding_bwd(dtab, dout, tok, N, C, V, dt);
    TU_ASSERT_CLOSE(dtab, wantf, (size_t)V * C, 1e-6, 1e-6);
    assert_false(tu_bits_equal(dtab, before, (size_t)(V - 2) * C * 4, NULL)); // it did add
    assert_true(tu_bits_equal(dtab + (V - 2) * C, before + (V - 2) * C, 2 * C * 4, "unused rows"));
    free(df); free(dtab); free(dout); free(want); free(wantf); free(before); free(tok);
}

static void test_bwd_accumulates(void **state) {
    (void)state;
    check_bwd(LOOM_F32);
    check_bwd(LOOM_BF16);
    check_bwd(LOOM_F16);
}

static double loss_f32(const float *table, const float *dout, const int32_t *tok, int N, int C) {
    float *out = malloc(sizeof(float) * N * C);
    embedding_fwd(out, tok, table, N, C, LOOM_F32);
    double L = 0.0;
    for (int i = 0; i < N * C; i++) L += (double)dout[i] * out[i];
    free(out);
    return L;
}

/* L = sum(dout * table[tokens]) is linear and the forward copies exactly, so
 * the central difference is exact but for the double sum (~1e-16): 1e-5. */
static void test_bwd_finite_differences(void **state) {
    (void)state;
    int N = 9, C = 5, V = 6;
    float *table = malloc(sizeof(float) * V * C), *dout = malloc(sizeof(float) * N * C);
    float *dtab = calloc((size_t)V * C, sizeof(float)), *num = malloc(sizeof(float) * V * C);
    tu_fill_uniform(table, (size_t)V * C, -1.0f, 1.0f, 4);
    tu_fill_uniform(dout, (size_t)N * C, -1.0f, 1.0f, 5);
    int32_t *tok = make_tokens(N, V);
    embedding_bwd(dtab, dout, tok, N, C, V, LOOM_F32);
    for (int i = 0; i < V * C; i++) {
        float p0 = table[i], pp = p0 + FD_STEP, pm = p0 - FD_STEP;
        table[i] = pp;
        double lp = loss_f32(table, dout, tok, N, C);
        table[i] = pm;
        double lm = loss_f32(table, dout, tok, N, C);
        table[i] = p0;
        num[i] = (float)((lp - lm) / ((double)pp - (double)pm));
    }
    TU_ASSERT_CLOSE(dtab, num, (size_t)V * C, 1e-5, 1e-5);
    free(table); free(dout); free(dtab); free(num); free(tok);
}

/* Big enough to run in parallel: 1 and 2 threads give the same bits. */
static void test_bwd_thread_count_invariant(void **state) {
    (void)state;
    int N = 400, C = 300, V = 37;
    float *df = malloc(sizeof(float) * N * C);
    float *d1 = calloc((size_t)V * C, 4), *d2 = calloc((size_t)V * C, 4);
    tu_fill_uniform(df, (size_t)N * C, -1.0f, 1.0f, 6);
    void *dout = tu_from_f32(df, (size_t)N * C, LOOM_BF16);
    int32_t *tok = make_tokens(N, V);
    loom_set_threads(1);
    embedding_bwd(d1, dout, tok, N, C, V, LOOM_BF16);
    loom_set_threads(2);
    embedding_bwd(d2, dout, tok, N, C, V, LOOM_BF16);
    loom_set_threads(0);
    assert_true(tu_bits_equal(d1, d2, (size_t)V * C * 4, "dtable"));
    free(df); free(d1); free(d2); free(dout); free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fwd_copies_rows),
        cmocka_unit_test(test_bwd_accumulates),
        cmocka_unit_test(test_bwd_finite_differences),
        cmocka_unit_test(test_bwd_thread_count_invariant),
    };
    return TU_RUN_SIMD_AND_PORTABLE(tests);
}
