/*
 * train_agree.c — the ranks of a `loom train` job agree before training:
 * the same training flags (rank 0's go to every rank), the same model (a
 * digest of its config, before it is built), and after setup the
 * same weights on data-parallel replicas, the same step, the same token
 * shards. A rank that differs says how, and every rank stops with one error
 * instead of hanging in, or crashing on, collectives they no longer call
 * alike.
 */
#include "train_agree.h"

#include <stdio.h>
#include <string.h>

loom_status train_agree_settings(loom_comm *world, const char *record) {
    if (loom_comm_size(world) == 1) return LOOM_OK;
    char root[TRAIN_AGREE_RECORD] = {0}; /* this rank's record, then rank 0's */
    if (strlen(record) >= sizeof root) return loom_error(LOOM_ERR_INVALID, "train: the settings record is too long");
    memcpy(root, record, strlen(record));
    LOOM_TRY(loom_comm_broadcast(world, root, sizeof root, 0));
    int first = 0; /* 1 + the line where this rank differs from rank 0 */
    const char *a = record, *b = root;
    for (int line = 1; *a || *b; line++) {
        const char *ea = strchr(a, '\n'), *eb = strchr(b, '\n');
        size_t la = ea ? (size_t)(ea - a) : strlen(a), lb = eb ? (size_t)(eb - b) : strlen(b);
        if (la != lb || memcmp(a, b, la)) {
            first = line;
            fprintf(stderr, "train: rank %d was started with %.*s where rank 0 has %.*s\n", loom_comm_rank(world),
                    (int)la, a, (int)lb, b);
            break;
        }
        a += la + (ea != NULL);
        b += lb + (eb != NULL);
    }
    int worst = first;
    LOOM_TRY(loom_comm_allreduce_max_int(world, &worst, 1));
    if (!worst) return LOOM_OK;
    const char *line = root;
    for (int k = 1; k < worst && strchr(line, '\n'); k++) line = strchr(line, '\n') + 1;
    const char *end = strchr(line, '\n');
    return loom_error(LOOM_ERR_INVALID, "the ranks were started with different training flags (rank 0: %.*s; the "
                      "ranks that differ say so above): start every rank with the same flags",
                      (int)(end ? end - line : (long)strlen(line)), line);
}

loom_status train_agree_model(loom_comm *world, const loom_llama_config *c) {
    if (loom_comm_size(world) == 1) return LOOM_OK;
    char rec[1024];
    int rl = snprintf(rec, sizeof rec, "%d %d %d %d %d %d %d %d %d %d %d %d %d %a %a %a %a %a %a %d %d %d %d %a %a %a %a %d %d %d %a %a %a %d %d %d %a %a %a %d %a %d", c->dim,
                      c->n_layers, c->n_heads, c->n_kv_heads, loom_llama_head_dim(c), c->ffn_dim, c->vocab_size,
                      c->max_seq, c->tie_embeddings, c->qkv_bias, c->o_bias, c->qk_norm, (int)c->rope_type,
                      (double)c->rope_theta, (double)c->norm_eps, (double)c->rope_factor,
                      (double)c->rope_low_freq_factor, (double)c->rope_high_freq_factor,
                      (double)c->attention_dropout, c->rope_original_max_pos, (int)c->act, c->norm_unit_offset,
                      c->scale_embeddings, (double)c->embedding_multiplier, (double)c->residual_multiplier,
                      (double)c->attention_multiplier, (double)c->logits_scaling, c->fused_proj, c->nope_interval,
                      c->post_norms, (double)c->attn_softcap, (double)c->final_softcap,
                      (double)c->query_pre_attn_scalar, c->sliding_window, c->window_from,
                      c->window_global_interval, (double)c->rope_local_theta, (double)c->rope_beta_fast,
                      (double)c->rope_beta_slow, c->rope_truncate, (double)c->rope_attention_factor,
                      loom_llama_rotary_dim(c));
    uint32_t hc = 2166136261u; /* FNV-1a */
    for (int k = 0; k < rl && k < (int)sizeof rec; k++) hc = (hc ^ (unsigned char)rec[k]) * 16777619u;
    /* longrope's factors, byte by byte */
    const float *parts[2] = {c->rope_short, c->rope_long};
    size_t counts[2] = {(size_t)c->rope_n_ext, (size_t)c->rope_n_ext};
    for (int p = 0; c->rope_type == LOOM_ROPE_LONGROPE && p < 2; p++)
        for (size_t k = 0; k < counts[p] * sizeof(float) && counts[p] <= LOOM_ROPE_EXT_MAX; k++)
            hc = (hc ^ ((const unsigned char *)parts[p])[k]) * 16777619u;
    int cfg = (int)(hc & 0x7fffffff);
    int v[2] = {cfg, -cfg};
    LOOM_TRY(loom_comm_allreduce_max_int(world, v, 2));
    if (v[0] != -v[1])
        return loom_error(LOOM_ERR_INVALID, "the ranks built different models (their --config, --init or --resume "
                          "files differ between machines): give every rank the same ones");
    return LOOM_OK;
}

loom_status train_agree_state(loom_comm *world, const loom_dist *dist, const loom_llama *m, int step,
                              const loom_dataloader *train, const loom_dataloader *val) {
    if (loom_comm_size(world) == 1) return LOOM_OK;
    uint32_t h = 2166136261u; /* FNV-1a over the compute copies this rank holds */
    for (int i = 0; i < m->n_params; i++) {
        const loom_tensor *w = m->params[i]->tensor;
        const unsigned char *b = loom_tensor_data(w);
        size_t n = (size_t)loom_tensor_numel(w) * loom_dtype_size(w->dtype);
        for (size_t k = 0; k < n; k++) h = (h ^ b[k]) * 16777619u;
    }
    int w[2] = {(int)(h & 0x7fffffff), -(int)(h & 0x7fffffff)}; /* max and -min over the replicas */
    LOOM_TRY(loom_comm_allreduce_max_int(dist->dp, w, 2));
    /* Every rank reads the same files (data-parallel ranks their own spans
     * of them, tensor-parallel ones the same spans): */
    uint64_t fp[2] = {0, 0};
    LOOM_TRY(loom_dataloader_fingerprint(train, &fp[0]));
    if (val) LOOM_TRY(loom_dataloader_fingerprint(val, &fp[1]));
    int data[2];
    for (int k = 0; k < 2; k++) data[k] = (int)((fp[k] ^ (fp[k] >> 31) ^ (fp[k] >> 62)) & 0x7fffffff);
    /* Over every rank (TP groups compare their own shards above): */
    int v[7] = {w[0] != -w[1], step, -step, data[0], -data[0], data[1], -data[1]};
    LOOM_TRY(loom_comm_allreduce_max_int(world, v, 7));
    if (v[1] != -v[2])
        return loom_error(LOOM_ERR_INVALID, "the ranks resumed at different steps (this rank: %d): give every rank "
                          "the same checkpoint", step);
    for (int k = 0; k < 2; k++) {
        const loom_dataloader *dl = k ? val : train;
        const char *first = loom_dataloader_shard_path(dl, 0);
        if (v[3 + 2 * k] != -v[4 + 2 * k])
            return loom_error(LOOM_ERR_INVALID, "the ranks' --data differ: their %s shards are not the same files "
                              "(this rank reads %zu, the first %s; a count, a length or tokens differ between "
                              "ranks): give every machine the same token shards", k ? "validation" : "training",
                              loom_dataloader_num_shards(dl), first ? first : "none");
    }
    if (v[0])
        return loom_error(LOOM_ERR_INVALID, "the data-parallel ranks hold different weights after setup (different "
                          "--init or --resume files on different machines?): give every rank the same ones");
    return LOOM_OK;
}
