/*
 * loom.h — the umbrella header: include this and nothing else.
 *
 *   loom/core.h        status, dtypes, allocator, RNG, threads
 *   loom/tensor.h      tensors and views
 *   loom/autograd.h    parameters, the function interface, backward, audit
 *   loom/ops.h         built-in differentiable ops
 *   loom/recompute.h   checkpoint regions
 *   loom/amp.h         precision policy, loss scaling, gradient norm
 *   loom/nn.h          fused linear, LLaMA, generation
 *   loom/optim.h       AdamW, learning-rate schedules
 *   loom/io.h          files, safetensors, token shards, tokenizer
 *   loom/checkpoint.h  model directories, training checkpoints
 *   loom/dist.h        communicators (MPI or single process), DP/TP layout
 */
#ifndef LOOM_H
#define LOOM_H

#include "loom/core.h"
#include "loom/tensor.h"
#include "loom/autograd.h"
#include "loom/ops.h"
#include "loom/recompute.h"
#include "loom/amp.h"
#include "loom/nn.h"
#include "loom/optim.h"
#include "loom/io.h"
#include "loom/checkpoint.h"
#include "loom/dist.h"

#endif
