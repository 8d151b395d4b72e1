/*
 * loom/nn.h — layers built on the function interface: the fused linear and
 * the LLaMA model.
 */
#ifndef LOOM_NN_H
#define LOOM_NN_H

#include "loom/recompute.h"
#include "loom/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y = x · W^T + b with x (..., K), W (M, K), b (M) or NULL. Backward
 * accumulates dW straight into W's parameter gradient (fp32 main_grad with
 * master-grad on) with one GEMM (beta = 1), and db into b's. Saves
 * (x, W, b) with b possibly NULL. */
loom_status loom_fused_linear(loom_tensor *x, loom_tensor *w, loom_tensor *b, loom_tensor **out);
const loom_function *loom_fused_linear_function(void);

#ifdef __cplusplus
}
#endif
#endif
