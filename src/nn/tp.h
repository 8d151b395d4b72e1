/* tp.h — tensor-parallel helpers private to the nn layer (see tp_ops.c). */
#ifndef LOOM_NN_TP_H
#define LOOM_NN_TP_H

#include "loom/nn.h"
#include "loom/dist.h"

loom_status tp_copy(loom_comm *comm, loom_tensor *x, loom_tensor **out);
loom_status tp_reduce(loom_comm *comm, loom_tensor *x, loom_tensor **out);
void tp_full_shape(const loom_param *p, int tp_size, int64_t shape[2]);
void tp_take_shard(const loom_param *p, int tp_rank, int tp_size, const float *full, float *shard);
loom_status tp_gather(loom_comm *comm, const loom_param *p, const float *shard, float *full);

#endif
