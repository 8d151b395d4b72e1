/*
 * dtype.c — dtype names, parsing and bulk conversion. The scalar conversions
 * are inline in loom/core.h; this file only loops over them.
 */
#include "loom/core.h"
#include "core/simd.h"

#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

const char *loom_dtype_name(loom_dtype dt) {
    switch (dt) {
    case LOOM_F32: return "fp32";
    case LOOM_BF16: return "bf16";
    case LOOM_F16: return "fp16";
    }
    return "?";
}

loom_status loom_dtype_parse(const char *s, loom_dtype *out) {
    if (!s || !out)
        return loom_error(LOOM_ERR_INVALID, "loom_dtype_parse: %s is NULL",
                          !s ? "the precision string" : "the output pointer");
    if (!strcasecmp(s, "fp32") || !strcasecmp(s, "f32") || !strcasecmp(s, "float32")) *out = LOOM_F32;
    else if (!strcasecmp(s, "bf16") || !strcasecmp(s, "bfloat16")) *out = LOOM_BF16;
    else if (!strcasecmp(s, "fp16") || !strcasecmp(s, "f16") || !strcasecmp(s, "float16")) *out = LOOM_F16;
    else return loom_error(LOOM_ERR_INVALID, "unknown precision '%s': use fp32, bf16 or fp16", s);
    return LOOM_OK;
}

#define CONVERT_CHUNK 16384 /* elements per task (a multiple of 8) */

void loom_convert(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt, size_t n) {
    if (dst_dt == src_dt) {
        if (dst != src) memmove(dst, src, n * loom_dtype_size(dst_dt));
        return;
    }
    size_t nchunks = (n + CONVERT_CHUNK - 1) / CONVERT_CHUNK;
    #pragma omp parallel for schedule(static) if (nchunks > 4)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i = c * CONVERT_CHUNK, m = n - i < CONVERT_CHUNK ? n - i : CONVERT_CHUNK;
        if (src_dt == LOOM_F32) {
            convert_from_f32((char *)dst + i * loom_dtype_size(dst_dt), dst_dt, (const float *)src + i, m);
        } else if (dst_dt == LOOM_F32) {
            convert_to_f32((float *)dst + i, (const char *)src + i * loom_dtype_size(src_dt), src_dt, m);
        } else { /* bf16 <-> f16 through fp32, in pieces */
            float buf[512];
            for (size_t k = 0; k < m; k += 512) {
                size_t w = m - k < 512 ? m - k : 512;
                convert_to_f32(buf, (const uint16_t *)src + i + k, src_dt, w);
                convert_from_f32((uint16_t *)dst + i + k, dst_dt, buf, w);
            }
        }
    }
}

double loom_float_decimal(float x) {
    char buf[32];
    for (int p = 1; p < 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)x);
        if ((float)strtod(buf, NULL) == x) return strtod(buf, NULL);
    }
    return (double)x;
}
