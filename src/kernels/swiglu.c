/*
 * swiglu.c — SiLU and the SwiGLU gate of the LLaMA MLP, forward and backward.
 *
 * Owns: silu(x) = x * sigmoid(x), out = silu(gate) * up, and their gradients,
 * element by element in fp32.
 * Must never: read an element after writing it (outputs may alias inputs of
 * the same index).
 */
#include "kernels/kernels.h"

#include <math.h>

/* Below this many elements a parallel region costs more than it saves. */
#define SWIGLU_PAR_MIN 32768

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x). */
static inline float silu_grad(float x) {
    float s = sigmoidf(x);
    return s * (1.0f + x * (1.0f - s));
}

void silu_fwd(void *out, const void *x, size_t n, loom_dtype dt) {
    #pragma omp parallel for schedule(static) if (n > SWIGLU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float v = loom_load(x, i, dt);
        loom_store(out, i, dt, v * sigmoidf(v));
    }
}

void silu_bwd(void *dx, const void *dout, const void *x, size_t n, loom_dtype dt) {
    #pragma omp parallel for schedule(static) if (n > SWIGLU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float g = loom_load(dout, i, dt);
        loom_store(dx, i, dt, g * silu_grad(loom_load(x, i, dt)));
    }
}

void swiglu_fwd(void *out, const void *gate, const void *up, size_t n, loom_dtype dt) {
    #pragma omp parallel for schedule(static) if (n > SWIGLU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float g = loom_load(gate, i, dt), u = loom_load(up, i, dt);
        loom_store(out, i, dt, g * sigmoidf(g) * u);
    }
}

/* dgate = dout * up * silu'(gate); dup = dout * silu(gate). */
void swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate,
                const void *up, size_t n, loom_dtype dt) {
    #pragma omp parallel for schedule(static) if (n > SWIGLU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float d = loom_load(dout, i, dt), g = loom_load(gate, i, dt), u = loom_load(up, i, dt);
        loom_store(dgate, i, dt, d * u * silu_grad(g));
        loom_store(dup, i, dt, d * g * sigmoidf(g));
    }
}
