/*
 * checkpoint.c — training checkpoints: a model directory plus
 * state.safetensors (fp32 masters, AdamW moments, resume metadata).
 *
 * Written into "<dir>.tmp.<pid>" and renamed to <dir> once every file is
 * fsynced; the parent directory is fsynced after the rename. Must never:
 * write into an existing checkpoint, or leave a partial one under the final
 * name.
 */
#include "loom/amp.h"
#include "loom/checkpoint.h"
#include "io/io_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

/* Remove a checkpoint directory and its files; a symlink in its place is
 * removed itself, never followed (its target lies outside the run). */
static void remove_tree(const char *dir) {
    struct stat sb;
    if (lstat(dir, &sb) == 0 && S_ISLNK(sb.st_mode)) {
        unlink(dir);
        return;
    }
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        char path[4096];
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(dir);
}

typedef struct meta_kv {
    const char *key;
    char value[64];
} meta_kv;

/* One tensor of the state: parameter i's master (kind 0), one of its
 * moments (1: m, 2: v), or a frozen bf16 weight's compute copy
 * (STATE_FROZEN), which has no master. */
enum { STATE_FROZEN = 3 };

typedef struct state_tensor {
    loom_llama *m;
    const loom_moments_io *io;
    int i, kind;
    int fill;       /* produced when written (gathered), not borrowed */
    int done;       /* produced (its gathers are over) */
    float *scratch; /* this rank's shard, when the io cannot lend it */
} state_tensor;

/* This rank's values of the tensor: borrowed where they are held whole,
 * else fetched into into (which may be NULL on a rank that only takes part
 * in fetching them) and returned. */
static loom_status state_local(const state_tensor *t, float *into, const float **out) {
    loom_param *p = t->m->params[t->i];
    const float *v = t->kind == 0 ? loom_param_master(p) : t->io->view(t->io->user, t->i, t->kind - 1);
    if (!v) {
        LOOM_TRY(t->io->get(t->io->user, t->i, t->kind - 1, into));
        v = into;
    }
    *out = v;
    return LOOM_OK;
}

/* The tensor's full values into dst (n_bytes): this rank's shard, gathered
 * over the tensor-parallel group (every TP rank calls it, in the same
 * order). */
static loom_status state_fill(void *user, void *dst, size_t n_bytes) {
    state_tensor *t = user;
    t->done = 1;
    const float *local;
    int tp = t->m->tp_size > 1;
    if (t->kind == STATE_FROZEN) {
        /* Split over T >= 2 ranks: this rank's values widened in dst (a
         * shard's floats fit in the whole tensor's bf16 bytes), gathered
         * whole into scratch, rounded back into dst (exactly: they were
         * bf16). */
        size_t n = n_bytes / sizeof(uint16_t);
        loom_param_get_f32(t->m->params[t->i], dst);
        LOOM_TRY(loom_llama_tp_gather(t->m, t->i, dst, t->scratch));
        loom_convert(dst, LOOM_BF16, t->scratch, LOOM_F32, n);
        return LOOM_OK;
    }
    LOOM_TRY(state_local(t, tp ? t->scratch : dst, &local));
    if (tp) return loom_llama_tp_gather(t->m, t->i, local, dst);
    if (local != dst) memcpy(dst, local, n_bytes);
    return LOOM_OK;
}

/* A LoRA setting as train's flags spell it: "--lora 8 --lora-alpha 16
 * --lora-targets q,v" (alpha in full, so equal settings compare equal). */
static void lora_describe(const loom_lora_config *c, char *buf, size_t n) {
    char targets[64];
    loom_lora_targets_format(c->targets, targets, sizeof targets);
    int w = snprintf(buf, n, "--lora %d --lora-alpha %.9g --lora-targets %s", c->rank, (double)c->alpha, targets);
    if (c->rslora && w > 0 && (size_t)w < n) w += snprintf(buf + w, n - (size_t)w, " --lora-rslora");
    if (c->dora && w > 0 && (size_t)w < n) w += snprintf(buf + w, n - (size_t)w, " --lora-dora");
    if (c->dropout > 0.0f && w > 0 && (size_t)w < n)
        snprintf(buf + w, n - (size_t)w, " --lora-dropout %.9g", (double)c->dropout);
}

/* The state's tensors, in the order they are written: each parameter's
 * master, then its moments unless it is frozen. A tensor that this rank
 * holds whole without tensor parallelism is borrowed; the others are
 * filled one at a time as the file is written (gathered over ZeRO's DP
 * group and the TP group), so that saving never holds a second copy of
 * the training state. Every tensor is listed in ts even when adding one to
 * w fails: its gathers are still to be joined. */
static loom_status add_state_tensors(loom_safetensors_writer *w, loom_llama *m, const loom_moments_io *io,
                                     state_tensor *ts, int *n_tensors, float *scratch) {
    char name[256];
    int n = 0;
    loom_status s = LOOM_OK;
    for (int i = 0; i < m->n_params; i++) {
        loom_param *p = m->params[i];
        int64_t fs[2];
        loom_llama_param_full_shape(m, i, fs);
        int nd = p->tensor->ndim;
        if (loom_param_compute_only(p)) { /* a frozen bf16 weight: its bf16 values, as they are */
            state_tensor *t = &ts[n++];
            *t = (state_tensor){m, io, i, STATE_FROZEN, p->tp_split_dim >= 0, 0, scratch}; /* split: gathered */
            snprintf(name, sizeof name, "master.%s", p->name);
            if (!w || s != LOOM_OK) continue;
            if (t->fill)
                s = loom_safetensors_writer_add_fill(w, name, LOOM_SAFETENSORS_BF16, fs, nd, state_fill, t);
            else
                s = loom_safetensors_writer_add(w, name, LOOM_SAFETENSORS_BF16, fs, nd, loom_tensor_data(p->tensor));
            continue;
        }
        static const char *const prefix[3] = {"master", "adam_m", "adam_v"};
        int kinds = p->trainable ? 3 : 1; /* a frozen weight has no moments */
        for (int k = 0; k < kinds; k++) {
            const float *whole = k == 0 ? loom_param_master(p) : io->view(io->user, i, k - 1);
            state_tensor *t = &ts[n++];
            *t = (state_tensor){m, io, i, k, !(m->tp_size == 1 && whole), 0, scratch};
            snprintf(name, sizeof name, "%s.%s", prefix[k], p->name);
            if (!w || s != LOOM_OK) continue;
            if (t->fill)
                s = loom_safetensors_writer_add_fill(w, name, LOOM_SAFETENSORS_F32, fs, nd, state_fill, t);
            else
                s = loom_safetensors_writer_add(w, name, LOOM_SAFETENSORS_F32, fs, nd, whole);
        }
    }
    *n_tensors = n;
    return s;
}

/* The gathers of every state tensor not written (all of them when this
 * rank writes no file, the rest after a failed write), joined all the
 * same: the other ranks are in them. */
static loom_status join_gathers(loom_llama *m, state_tensor *ts, int n_tensors, float *spare) {
    loom_status s = LOOM_OK;
    for (int k = 0; k < n_tensors; k++) {
        if (!ts[k].fill || ts[k].done) continue;
        int64_t fs[2];
        loom_llama_param_full_shape(m, ts[k].i, fs);
        size_t elt = ts[k].kind == STATE_FROZEN ? sizeof(uint16_t) : sizeof(float);
        loom_status g = state_fill(&ts[k], spare, (size_t)(fs[0] * fs[1]) * elt);
        if (s == LOOM_OK) s = g;
    }
    return s;
}

/* path NULL: take part in the gathers of what another rank writes (a TP
 * rank other than 0, or rank 0 after an earlier failure), in the same
 * order. */
static loom_status write_state(const char *path, loom_llama *m, const loom_moments_io *io, int adam_steps,
                               const loom_train_state *st) {
    loom_safetensors_writer *w = NULL;
    int n_tensors = 0;
    state_tensor *ts = calloc((size_t)(3 * m->n_params + 1), sizeof *ts);
    /* Allocated before any gather (a failure later cannot leave this rank
     * out of one); pages only touched when used. spare: a whole tensor
     * whose gathers are joined without writing it. */
    size_t widest = io_widest_param(m, m->n_params);
    float *scratch = m->tp_size > 1 ? malloc(widest * sizeof(float)) : NULL, *spare = malloc(widest * sizeof(float));
    if (!ts || (m->tp_size > 1 && !scratch) || !spare) {
        free(ts);
        free(scratch);
        free(spare);
        return loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
    }
    loom_status s = path ? loom_safetensors_writer_init(&w) : LOOM_OK;
    loom_status listed = add_state_tensors(s == LOOM_OK ? w : NULL, m, io, ts, &n_tensors, scratch);
    if (s == LOOM_OK) s = listed;
    if (!w) {
        loom_status g = join_gathers(m, ts, n_tensors, spare);
        free(ts);
        free(scratch);
        free(spare);
        return s == LOOM_OK ? g : s;
    }
    meta_kv meta[] = {
        {"loom_checkpoint_version", ""}, {"step", ""}, {"adam_steps", ""}, {"rng_seed", ""}, {"rng_offset", ""},
        {"data_epoch", ""}, {"data_shard", ""}, {"data_offset", ""}, {"loss_scale", ""},
        {"scaler_good_steps", ""}, {"scaler_skipped", ""}, {"tokens_seen", ""}, {"loss_scaling", ""},
        {"batch", ""}, {"seq", ""}, {"grad_accum", ""}, {"dp_size", ""}, {"data_shards", ""},
    };
    snprintf(meta[0].value, 64, "1");
    snprintf(meta[1].value, 64, "%d", st->step);
    snprintf(meta[2].value, 64, "%d", adam_steps);
    snprintf(meta[3].value, 64, "%" PRIu64, st->rng_seed);
    snprintf(meta[4].value, 64, "%" PRIu64, st->rng_offset);
    snprintf(meta[5].value, 64, "%" PRIu64, st->data.epoch);
    snprintf(meta[6].value, 64, "%" PRIu64, st->data.shard);
    snprintf(meta[7].value, 64, "%" PRIu64, st->data.offset);
    snprintf(meta[8].value, 64, "%a", (double)st->loss_scale); /* hex: exact */
    snprintf(meta[9].value, 64, "%d", st->scaler_good_steps);
    snprintf(meta[10].value, 64, "%ld", st->scaler_skipped);
    snprintf(meta[11].value, 64, "%" PRIu64, st->tokens_seen);
    snprintf(meta[12].value, 64, "%d", st->loss_scaling > 0);
    snprintf(meta[13].value, 64, "%d", st->batch);
    snprintf(meta[14].value, 64, "%d", st->seq);
    snprintf(meta[15].value, 64, "%d", st->grad_accum);
    snprintf(meta[16].value, 64, "%d", st->dp_size);
    snprintf(meta[17].value, 64, "%d", st->data_shards);
    for (size_t k = 0; k < sizeof meta / sizeof meta[0] && s == LOOM_OK; k++)
        s = loom_safetensors_writer_set_metadata(w, meta[k].key, meta[k].value);
    if (s == LOOM_OK && st->data_shard_name[0])
        s = loom_safetensors_writer_set_metadata(w, "data_shard_name", st->data_shard_name);
    if (s == LOOM_OK && st->optimizer[0]) s = loom_safetensors_writer_set_metadata(w, "optimizer", st->optimizer);
    if (s == LOOM_OK && st->init_dir[0]) s = loom_safetensors_writer_set_metadata(w, "init_dir", st->init_dir);
    if (s == LOOM_OK && m->lora.rank) {
        char lora[256];
        lora_describe(&m->lora, lora, sizeof lora);
        s = loom_safetensors_writer_set_metadata(w, "lora", lora);
    }
    if (s == LOOM_OK) s = loom_safetensors_writer_write(w, path);
    loom_status g = join_gathers(m, ts, n_tensors, spare);
    if (s == LOOM_OK) s = g;
    loom_safetensors_writer_free(w);
    free(ts);
    free(scratch);
    free(spare);
    return s;
}

/* Moments given as arrays, adam_m[i] and adam_v[i]. */
typedef struct moment_arrays {
    float *const *m, *const *v;
} moment_arrays;

static float *arrays_view(void *user, int i, int kind) {
    const moment_arrays *a = user;
    return kind ? a->v[i] : a->m[i];
}

static loom_status arrays_get(void *user, int i, int kind, float *out) {
    (void)user; (void)out;
    return loom_error(LOOM_ERR_INVALID, "checkpoint: no %s given for trainable parameter %d",
                      kind ? "adam_v" : "adam_m", i);
}

loom_status loom_checkpoint_save(const char *dir, loom_llama *m, float *const *adam_m, float *const *adam_v,
                                 int adam_steps, const loom_train_state *st, const char *tokenizer_path) {
    moment_arrays a = {adam_m, adam_v};
    loom_moments_io io = {arrays_view, arrays_get, NULL, &a};
    return loom_checkpoint_save_io(dir, m, &io, adam_steps, st, tokenizer_path);
}

loom_status loom_checkpoint_save_io(const char *dir, loom_llama *m, const loom_moments_io *io, int adam_steps,
                                    const loom_train_state *st, const char *tokenizer_path) {
    struct stat sb;
    char tmp[4096], path[4200];
    loom_status s = LOOM_OK;
    /* What loom_checkpoint_load would refuse is never written. */
    if (!isfinite(st->loss_scale) || !(st->loss_scale >= LOOM_LOSS_SCALE_MIN))
        s = loom_error(LOOM_ERR_INVALID, "checkpoint %s: loss_scale %g is not a finite number from 2^-16 up (1 when "
                       "the run does not scale its loss)", dir, (double)st->loss_scale);
    else if (m->tp_rank == 0 && stat(dir, &sb) == 0)
        s = loom_error(LOOM_ERR_IO, "checkpoint %s already exists; refusing to overwrite it", dir);
    else if (m->tp_rank == 0 && snprintf(tmp, sizeof tmp, "%s.tmp.%d", dir, (int)getpid()) >= (int)sizeof tmp)
        s = loom_error(LOOM_ERR_INVALID, "checkpoint path too long: %s", dir);
    if (m->tp_rank != 0 || s != LOOM_OK) {
        /* The gathers of what TP rank 0 writes, taken part in all the same
         * when this save fails here: the other ranks are in them. */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", s != LOOM_OK ? loom_last_error() : "");
        loom_status g = loom_model_dir_save(m, LOOM_F32, NULL, NULL);
        loom_status w = write_state(NULL, m, io, adam_steps, st);
        if (s != LOOM_OK) return loom_error(s, "%s", msg);
        return g != LOOM_OK ? g : w;
    }
    remove_tree(tmp); /* a stale temporary from a crashed run of this pid */
    s = loom_model_dir_save(m, LOOM_F32, tokenizer_path, tmp);
    snprintf(path, sizeof path, "%s/state.safetensors", tmp);
    loom_status ws = write_state(s == LOOM_OK ? path : NULL, m, io, adam_steps, st); /* NULL: the gathers only */
    if (s == LOOM_OK) s = ws;
    if (s == LOOM_OK && rename(tmp, dir) != 0)
        s = loom_error(LOOM_ERR_IO, "cannot rename %s to %s: %s", tmp, dir, strerror(errno));
    if (s != LOOM_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", loom_last_error());
        remove_tree(tmp);
        return loom_error(s, "checkpoint %s not written (earlier checkpoints are intact): %s", dir, msg);
    }
    int e = io_fsync_parent(dir);
    if (e != 0)
        return loom_error(LOOM_ERR_IO, "checkpoint %s was written but its directory could not be synced (%s); a "
                          "crash now could lose it", dir, strerror(e));
    return LOOM_OK;
}

/* An unsigned decimal counter no larger than max. */
static loom_status meta_u64(const loom_safetensors *sf, const char *path, const char *key, uint64_t max,
                            uint64_t *out) {
    const char *v = loom_safetensors_metadata(sf, key);
    char *end;
    if (!v || !*v) return loom_error(LOOM_ERR_FORMAT, "%s: metadata \"%s\" is missing", path, key);
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end || errno || *v < '0' || *v > '9' || x > max)
        return loom_error(LOOM_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not a count in 0..%llu; the "
                          "checkpoint is damaged: resume from another one", path, key, v, (unsigned long long)max);
    *out = x;
    return LOOM_OK;
}

/* Read a full tensor and keep this rank's shard. */
static loom_status read_shard(loom_safetensors *sf, const char *path, loom_llama *m, int i, const char *name,
                              float *local) {
    int64_t fs[2];
    loom_llama_param_full_shape(m, i, fs);
    float *full = malloc((size_t)(fs[0] * fs[1]) * sizeof(float) + 1);
    if (!full) return loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
    loom_status s = loom_safetensors_read(sf, name, LOOM_F32, fs, m->params[i]->tensor->ndim, full);
    if (s == LOOM_OK) s = io_check_finite(full, (size_t)(fs[0] * fs[1]), path, name);
    if (s == LOOM_OK) loom_llama_tp_shard(m, i, full, local);
    free(full);
    return s;
}

loom_status loom_checkpoint_load(const char *dir, loom_llama *m, float *const *adam_m, float *const *adam_v,
                                 int *adam_steps, loom_train_state *st) {
    moment_arrays a = {adam_m, adam_v};
    loom_moments_io io = {arrays_view, NULL, NULL, &a};
    return loom_checkpoint_load_io(dir, m, &io, adam_steps, st);
}

/* Moment kind of parameter i from the file: straight into the optimizer's
 * own when the io lends it, else through a copy of this rank's shard and
 * set. */
static loom_status read_moment(loom_safetensors *sf, const char *path, loom_llama *m, const loom_moments_io *io,
                               int i, int kind) {
    char name[256];
    snprintf(name, sizeof name, "%s.%s", kind ? "adam_v" : "adam_m", m->params[i]->name);
    float *into = io->view(io->user, i, kind);
    if (into) return read_shard(sf, path, m, i, name, into);
    if (!io->set) return loom_error(LOOM_ERR_INVALID, "checkpoint: nowhere to load %s to", name);
    float *copy = malloc((size_t)loom_param_numel(m->params[i]) * sizeof(float) + 1);
    if (!copy) return loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
    loom_status s = read_shard(sf, path, m, i, name, copy);
    if (s == LOOM_OK) io->set(io->user, i, kind, copy);
    free(copy);
    return s;
}

loom_status loom_checkpoint_load_io(const char *dir, loom_llama *m, const loom_moments_io *io, int *adam_steps,
                                    loom_train_state *st) {
    char path[4200];
    loom_llama_config cfg;
    snprintf(path, sizeof path, "%s/config.json", dir);
    LOOM_TRY(loom_llama_config_load(path, &cfg));
    if (!loom_llama_config_same_weights(&cfg, &m->cfg))
        return loom_error(LOOM_ERR_INVALID, "%s: the checkpoint's model configuration differs from this run's", path);
    snprintf(path, sizeof path, "%s/state.safetensors", dir);
    loom_safetensors *sf;
    LOOM_TRY(loom_safetensors_open(path, &sf));
    loom_status s = LOOM_OK;
    /* LoRA: the run must add the adapters the checkpoint was trained with. */
    const char *saved = loom_safetensors_metadata(sf, "lora");
    char mine[256] = "";
    if (m->lora.rank) lora_describe(&m->lora, mine, sizeof mine);
    if (saved && strcmp(saved, mine))
        s = loom_error(LOOM_ERR_INVALID, "%s: the checkpoint trained LoRA adapters (%s) but this run %s%s; resume "
                       "with the checkpoint's flags", path, saved, m->lora.rank ? "has " : "has none",
                       m->lora.rank ? mine : "");
    else if (!saved && m->lora.rank)
        s = loom_error(LOOM_ERR_INVALID, "%s: the checkpoint has no LoRA adapters but this run has (%s); resume "
                       "without --lora, or start a LoRA run from the checkpoint's weights with --init %s", path,
                       mine, dir);
    char name[256];
    for (int i = 0; i < m->n_params && s == LOOM_OK; i++) {
        loom_param *p = m->params[i];
        snprintf(name, sizeof name, "master.%s", p->name);
        if (!loom_param_compute_only(p)) {
            s = read_shard(sf, path, m, i, name, loom_param_master(p));
        } else { /* a frozen bf16 weight: its shard into its compute copy */
            float *v = malloc((size_t)loom_param_numel(p) * sizeof(float) + 1);
            s = v ? read_shard(sf, path, m, i, name, v) : loom_error(LOOM_ERR_NOMEM, "checkpoint: out of memory");
            if (s == LOOM_OK) s = loom_param_set_f32(p, v, loom_param_numel(p));
            free(v);
        }
        for (int kind = 0; kind < 2 && s == LOOM_OK && p->trainable; kind++) s = read_moment(sf, path, m, io, i, kind);
        if (s == LOOM_OK) loom_param_sync_from_master(p);
    }
    uint64_t v[10] = {0};
    const char *keys[] = {"step", "adam_steps", "rng_seed", "rng_offset", "data_epoch", "data_shard",
                          "data_offset", "scaler_good_steps", "scaler_skipped", "tokens_seen"};
    const uint64_t most[] = {INT_MAX, INT_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX,
                             UINT64_MAX, INT_MAX, LONG_MAX, UINT64_MAX};
    const char *version = loom_safetensors_metadata(sf, "loom_checkpoint_version");
    if (s == LOOM_OK && (!version || strcmp(version, "1")))
        s = loom_error(LOOM_ERR_FORMAT, "%s: checkpoint format version \"%s\" is not one this loom reads (1)", path,
                       version ? version : "(missing)");
    for (int k = 0; k < 10 && s == LOOM_OK; k++) s = meta_u64(sf, path, keys[k], most[k], &v[k]);
    const char *scale = loom_safetensors_metadata(sf, "loss_scale");
    const char *scaling = loom_safetensors_metadata(sf, "loss_scaling");
    double scale_v = 0.0;
    if (s == LOOM_OK && !scale) s = loom_error(LOOM_ERR_FORMAT, "%s: metadata \"loss_scale\" is missing", path);
    if (s == LOOM_OK) {
        char *end;
        scale_v = strtod(scale, &end);
        if (end == scale || *end || !isfinite(scale_v) || !(scale_v >= LOOM_LOSS_SCALE_MIN) || scale_v > FLT_MAX)
            s = loom_error(LOOM_ERR_FORMAT, "%s: metadata \"loss_scale\" = \"%s\" is not a finite number from "
                           "2^-16 (the smallest loss scale) up; the checkpoint is damaged: resume from another one",
                           path, scale);
    }
    /* The data layout: optional (older checkpoints lack it). */
    uint64_t layout[5] = {0};
    const char *layout_keys[5] = {"batch", "seq", "grad_accum", "dp_size", "data_shards"};
    for (int k = 0; k < 5 && s == LOOM_OK; k++)
        if (loom_safetensors_metadata(sf, layout_keys[k])) s = meta_u64(sf, path, layout_keys[k], INT_MAX, &layout[k]);
    if (s == LOOM_OK && scaling && strcmp(scaling, "0") && strcmp(scaling, "1"))
        s = loom_error(LOOM_ERR_FORMAT, "%s: metadata \"loss_scaling\" = \"%s\" is not 0 or 1", path, scaling);
    if (s == LOOM_OK) {
        memset(st, 0, sizeof *st);
        st->step = (int)v[0];
        *adam_steps = (int)v[1];
        st->rng_seed = v[2];
        st->rng_offset = v[3];
        st->data.epoch = v[4];
        st->data.shard = v[5];
        st->data.offset = v[6];
        st->scaler_good_steps = (int)v[7];
        st->scaler_skipped = (long)v[8];
        st->tokens_seen = v[9];
        st->loss_scale = (float)scale_v;
        st->loss_scaling = scaling ? scaling[0] == '1' : -1;
        st->batch = (int)layout[0];
        st->seq = (int)layout[1];
        st->grad_accum = (int)layout[2];
        st->dp_size = (int)layout[3];
        st->data_shards = (int)layout[4];
        const char *shard_name = loom_safetensors_metadata(sf, "data_shard_name");
        snprintf(st->data_shard_name, sizeof st->data_shard_name, "%s", shard_name ? shard_name : "");
        const char *optimizer = loom_safetensors_metadata(sf, "optimizer");
        snprintf(st->optimizer, sizeof st->optimizer, "%s", optimizer ? optimizer : "");
        const char *init_dir = loom_safetensors_metadata(sf, "init_dir");
        snprintf(st->init_dir, sizeof st->init_dir, "%s", init_dir ? init_dir : "");
    }
    loom_safetensors_close(sf);
    return s;
}

/* The step of a checkpoint's name, ckpt- and at least 8 digits; -1 for any
 * other name (a user's ckpt-best, a temporary ckpt-N.tmp.PID). */
static long checkpoint_step(const char *name) {
    if (strncmp(name, "ckpt-", 5)) return -1;
    const char *d = name + 5;
    size_t n = strspn(d, "0123456789");
    if (n < 8 || n > 10 || d[n]) return -1;
    long step = strtol(d, NULL, 10);
    return step <= INT_MAX ? step : -1;
}

static int by_step(const void *a, const void *b) {
    long x = checkpoint_step(a), y = checkpoint_step(b);
    return (x > y) - (x < y);
}

/* Names of the checkpoints in out_dir, oldest (lowest step) first; caller frees. */
static int list_checkpoints(const char *out_dir, char (**names)[64]) {
    DIR *d = opendir(out_dir);
    *names = NULL;
    if (!d) return -1;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (checkpoint_step(e->d_name) < 0 || strlen(e->d_name) >= 64) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char(*nn)[64] = realloc(*names, (size_t)cap * sizeof **names);
            if (!nn) break;
            *names = nn;
        }
        snprintf((*names)[n++], 64, "%s", e->d_name);
    }
    closedir(d);
    if (n) qsort(*names, (size_t)n, 64, by_step);
    return n;
}

/* Temporaries of checkpoints whose writer died (ckpt-N.tmp.PID, PID gone). */
static void remove_stale_temporaries(const char *out_dir) {
    DIR *d = opendir(out_dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "ckpt-", 5) || !io_dead_temporary(e->d_name)) continue;
        char dir[4200];
        if (snprintf(dir, sizeof dir, "%s/%s", out_dir, e->d_name) < (int)sizeof dir) remove_tree(dir);
    }
    closedir(d);
}

int loom_checkpoint_newest_step(const char *out_dir) {
    char(*names)[64];
    int n = list_checkpoints(out_dir, &names);
    long step = n > 0 ? checkpoint_step(names[n - 1]) : -1;
    free(names);
    return (int)step;
}

void loom_checkpoint_remove_stale(const char *out_dir) {
    remove_stale_temporaries(out_dir);
    static const char *const run_files[] = {"metrics.jsonl", "loss.svg"}; /* rewritten whole by train */
    io_remove_dead_temporaries(out_dir, run_files, 2);
}

loom_status loom_checkpoint_prune(const char *out_dir, int keep) {
    remove_stale_temporaries(out_dir);
    char(*names)[64];
    int n = list_checkpoints(out_dir, &names);
    for (int i = 0; i < n - keep; i++) {
        char dir[4200];
        if (snprintf(dir, sizeof dir, "%s/%s", out_dir, names[i]) < (int)sizeof dir) remove_tree(dir);
    }
    free(names);
    return LOOM_OK;
}

loom_status loom_checkpoint_latest(const char *out_dir, char *path, size_t size) {
    char(*names)[64];
    int n = list_checkpoints(out_dir, &names);
    if (n <= 0) {
        free(names);
        return loom_error(LOOM_ERR_IO, "%s: no checkpoint (ckpt-NNNNNNNN) found there", out_dir);
    }
    int w = snprintf(path, size, "%s/%s", out_dir, names[n - 1]);
    free(names);
    if (w < 0 || (size_t)w >= size) return loom_error(LOOM_ERR_INVALID, "path too long: %s", out_dir);
    return LOOM_OK;
}
