/*
 * train_agree.h — what the ranks of a `loom train` job must agree on before
 * training, checked collectively (every rank calls, every rank gets the
 * same verdict). Both return LOOM_OK at once in a single process.
 */
#ifndef LOOM_TRAIN_AGREE_H
#define LOOM_TRAIN_AGREE_H

#include "loom/loom.h"

#define TRAIN_AGREE_RECORD 2048 /* bytes of a settings record, at most */

/* `record` is this rank's settings, one "--flag value" per line. Rank 0's
 * goes to every rank; a rank whose record differs prints the first line
 * that does ("rank 1 was started with --steps 6 where rank 0 has --steps
 * 3"), and every rank returns LOOM_ERR_INVALID naming rank 0's line. */
loom_status train_agree_settings(loom_comm *world, const char *record);
/* Before the model is built (collective): every rank must build the same
 * model; --config, --init or --resume files may differ between machines,
 * and ranks of one TP group that disagree would wait in collectives of
 * different sizes. LOOM_ERR_INVALID on every rank when they differ. */
loom_status train_agree_model(loom_comm *world, const loom_llama_config *cfg);
/* After setup, the data-parallel replicas must hold the same weights (the same --seed gives
 * the same initialisation, the same checkpoint the same state; different
 * --init files or checkpoints per machine would not), every rank the same
 * step, and every rank the same token shards. */
loom_status train_agree_state(loom_comm *world, const loom_dist *dist, const loom_llama *m, int step,
                              const loom_dataloader *train, const loom_dataloader *val);

#endif
