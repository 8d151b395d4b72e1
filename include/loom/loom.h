/*
 * loom.h — the umbrella header: include this and nothing else.
 *
 *   loom/core.h       status, dtypes, allocator, RNG, threads
 *   loom/tensor.h     tensors and views
 *   loom/autograd.h   parameters, the function interface, backward, audit
 *   loom/ops.h        built-in differentiable ops
 *   loom/recompute.h  checkpoint regions
 *   loom/nn.h         fused linear, LLaMA
 */
#ifndef LOOM_H
#define LOOM_H

#include "loom/core.h"
#include "loom/tensor.h"
#include "loom/autograd.h"
#include "loom/ops.h"
#include "loom/recompute.h"
#include "loom/nn.h"
#include "loom/amp.h"
#include "loom/optim.h"

#endif
