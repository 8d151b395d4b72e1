/*
 * dtype.c — dtype names, parsing and bulk conversion. The scalar conversions
 * are inline in loom/core.h; this file only loops over them.
 */
#include "loom/core.h"

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

void loom_convert(void *dst, loom_dtype dst_dt, const void *src, loom_dtype src_dt, size_t n) {
    if (dst_dt == src_dt) {
        if (dst != src) memmove(dst, src, n * loom_dtype_size(dst_dt));
        return;
    }
    if (src_dt == LOOM_F32 && dst_dt == LOOM_BF16) {
        const float *s = src; uint16_t *d = dst;
        #pragma omp parallel for schedule(static) if (n > 65536)
        for (size_t i = 0; i < n; i++) d[i] = loom_f32_to_bf16(s[i]);
        return;
    }
    if (src_dt == LOOM_BF16 && dst_dt == LOOM_F32) {
        const uint16_t *s = src; float *d = dst;
        #pragma omp parallel for schedule(static) if (n > 65536)
        for (size_t i = 0; i < n; i++) d[i] = loom_bf16_to_f32(s[i]);
        return;
    }
    #pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) loom_store(dst, i, dst_dt, loom_load(src, i, src_dt));
}
