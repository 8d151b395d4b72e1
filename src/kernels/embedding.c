/*
 * embedding.c — token embedding lookup and its gradient.
 *
 * Owns: out[i, :] = table[tokens[i], :] and dtable[tokens[i], :] += dout[i, :].
 * The backward is parallel over blocks of EMB_COLS columns: a thread owns its
 * columns of every table row, so repeated tokens accumulate without races and
 * each element sums its rows in token order (bit-identical for any number of
 * threads).
 * Must never: check tokens (the caller has), or write dtable rows of tokens
 * that do not occur.
 */
#include "kernels/kernels.h"

#define EMB_COLS 32 /* fp32 columns per backward task: two cache lines */

void embedding_fwd(void *out, const int32_t *tokens, const void *table,
                   int N, int C, loom_dtype dt) {
    size_t row = (size_t)C * loom_dtype_size(dt);
    #pragma omp parallel for schedule(dynamic, 64) if ((size_t)N * C > 65536)
    for (int i = 0; i < N; i++)
        memcpy((char *)out + (size_t)i * row, (const char *)table + (size_t)tokens[i] * row, row);
}

void embedding_bwd(float *dtable, const void *dout, const int32_t *tokens,
                   int N, int C, int V, loom_dtype dt) {
    (void)V; // tokens are validated by the caller
    int nblocks = (C + EMB_COLS - 1) / EMB_COLS;
    #pragma omp parallel for schedule(dynamic, 1) if ((size_t)N * C > 65536)
    for (int cb = 0; cb < nblocks; cb++) {
        int c0 = cb * EMB_COLS, c1 = c0 + EMB_COLS < C ? c0 + EMB_COLS : C;
        for (int i = 0; i < N; i++) {
            float *d = dtable + (size_t)tokens[i] * C; // (C) row of this token
            size_t off = (size_t)i * C;
            for (int c = c0; c < c1; c++) d[c] += loom_load(dout, off + c, dt);
        }
    }
}
