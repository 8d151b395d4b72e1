/*
 * checkpoint.c — training checkpoints: a model directory plus
 * state.safetensors (fp32 masters, AdamW moments, resume metadata).
 *
 * Written into "<dir>.tmp.<pid>" and renamed to <dir> once every file is
 * fsynced; the parent directory is fsynced after the rename. Must never:
 * write into an existing checkpoint, or leave a partial one under the final
 * name.
 */
#include "loom/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static void remove_tree(const char *dir) {
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

static void fsync_parent(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    char *slash = strrchr(buf, '/');
    if (slash) *slash = '\0';
    else snprintf(buf, sizeof buf, ".");
    int fd = open(buf, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

typedef struct meta_kv {
    const char *key;
    char value[64];
} meta_kv;

static loom_status write_state(const char *path, loom_llama *m, loom_adamw *opt, const loom_train_state *st) {
    loom_safetensors_writer *w;
    LOOM_TRY(loom_safetensors_writer_init(&w));
    loom_status s = LOOM_OK;
    char name[256];
    for (int i = 0; i < m->n_params && s == LOOM_OK; i++) {
        loom_param *p = m->params[i];
        const int64_t *shape = p->tensor->shape;
        int nd = p->tensor->ndim;
        snprintf(name, sizeof name, "master.%s", p->name);
        s = loom_safetensors_writer_add(w, name, LOOM_SAFETENSORS_F32, shape, nd, loom_param_master(p));
        snprintf(name, sizeof name, "adam_m.%s", p->name);
        if (s == LOOM_OK) s = loom_safetensors_writer_add(w, name, LOOM_SAFETENSORS_F32, shape, nd, loom_adamw_m(opt, i));
        snprintf(name, sizeof name, "adam_v.%s", p->name);
        if (s == LOOM_OK) s = loom_safetensors_writer_add(w, name, LOOM_SAFETENSORS_F32, shape, nd, loom_adamw_v(opt, i));
    }
    meta_kv meta[] = {
        {"loom_checkpoint_version", ""}, {"step", ""}, {"adam_steps", ""}, {"rng_seed", ""}, {"rng_offset", ""},
        {"data_epoch", ""}, {"data_shard", ""}, {"data_offset", ""}, {"loss_scale", ""},
        {"scaler_good_steps", ""}, {"scaler_skipped", ""}, {"tokens_seen", ""},
    };
    snprintf(meta[0].value, 64, "1");
    snprintf(meta[1].value, 64, "%d", st->step);
    snprintf(meta[2].value, 64, "%d", loom_adamw_steps(opt));
    snprintf(meta[3].value, 64, "%" PRIu64, st->rng_seed);
    snprintf(meta[4].value, 64, "%" PRIu64, st->rng_offset);
    snprintf(meta[5].value, 64, "%" PRIu64, st->data.epoch);
    snprintf(meta[6].value, 64, "%" PRIu64, st->data.shard);
    snprintf(meta[7].value, 64, "%" PRIu64, st->data.offset);
    snprintf(meta[8].value, 64, "%a", (double)st->loss_scale); /* hex: exact */
    snprintf(meta[9].value, 64, "%d", st->scaler_good_steps);
    snprintf(meta[10].value, 64, "%ld", st->scaler_skipped);
    snprintf(meta[11].value, 64, "%" PRIu64, st->tokens_seen);
    for (size_t k = 0; k < sizeof meta / sizeof meta[0] && s == LOOM_OK; k++)
        s = loom_safetensors_writer_set_metadata(w, meta[k].key, meta[k].value);
    if (s == LOOM_OK) s = loom_safetensors_writer_write(w, path);
    loom_safetensors_writer_free(w);
    return s;
}

loom_status loom_checkpoint_save(const char *dir, loom_llama *m, loom_adamw *opt, const loom_train_state *st,
                                 const char *tokenizer_path) {
    struct stat sb;
    if (stat(dir, &sb) == 0)
        return loom_error(LOOM_ERR_IO, "checkpoint %s already exists; refusing to overwrite it", dir);
    char tmp[4096], path[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", dir, (int)getpid()) >= (int)sizeof tmp)
        return loom_error(LOOM_ERR_INVALID, "checkpoint path too long: %s", dir);
    remove_tree(tmp); /* a stale temporary from a crashed run of this pid */
    loom_status s = loom_model_dir_save(m, LOOM_F32, tokenizer_path, tmp);
    if (s == LOOM_OK) {
        snprintf(path, sizeof path, "%s/state.safetensors", tmp);
        s = write_state(path, m, opt, st);
    }
    if (s == LOOM_OK && rename(tmp, dir) != 0)
        s = loom_error(LOOM_ERR_IO, "cannot rename %s to %s: %s", tmp, dir, strerror(errno));
    if (s != LOOM_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", loom_last_error());
        remove_tree(tmp);
        return loom_error(s, "checkpoint %s not written (earlier checkpoints are intact): %s", dir, msg);
    }
    fsync_parent(dir);
    return LOOM_OK;
}

static loom_status meta_u64(const loom_safetensors *sf, const char *path, const char *key, uint64_t *out) {
    const char *v = loom_safetensors_metadata(sf, key);
    char *end;
    if (!v || !*v) return loom_error(LOOM_ERR_FORMAT, "%s: metadata \"%s\" is missing", path, key);
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end || errno) return loom_error(LOOM_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not a number", path, key, v);
    *out = x;
    return LOOM_OK;
}

loom_status loom_checkpoint_load(const char *dir, loom_llama *m, loom_adamw *opt, loom_train_state *st) {
    char path[4200];
    loom_llama_config cfg;
    snprintf(path, sizeof path, "%s/config.json", dir);
    LOOM_TRY(loom_llama_config_load(path, &cfg));
    if (cfg.dim != m->cfg.dim || cfg.n_layers != m->cfg.n_layers || cfg.n_heads != m->cfg.n_heads ||
        cfg.n_kv_heads != m->cfg.n_kv_heads || cfg.ffn_dim != m->cfg.ffn_dim || cfg.vocab_size != m->cfg.vocab_size ||
        cfg.tie_embeddings != m->cfg.tie_embeddings)
        return loom_error(LOOM_ERR_INVALID, "%s: the checkpoint's model configuration differs from this run's", path);
    snprintf(path, sizeof path, "%s/state.safetensors", dir);
    loom_safetensors *sf;
    LOOM_TRY(loom_safetensors_open(path, &sf));
    loom_status s = LOOM_OK;
    char name[256];
    for (int i = 0; i < m->n_params && s == LOOM_OK; i++) {
        loom_param *p = m->params[i];
        const int64_t *shape = p->tensor->shape;
        int nd = p->tensor->ndim;
        snprintf(name, sizeof name, "master.%s", p->name);
        s = loom_safetensors_read(sf, name, LOOM_F32, shape, nd, loom_param_master(p));
        snprintf(name, sizeof name, "adam_m.%s", p->name);
        if (s == LOOM_OK) s = loom_safetensors_read(sf, name, LOOM_F32, shape, nd, loom_adamw_m(opt, i));
        snprintf(name, sizeof name, "adam_v.%s", p->name);
        if (s == LOOM_OK) s = loom_safetensors_read(sf, name, LOOM_F32, shape, nd, loom_adamw_v(opt, i));
        if (s == LOOM_OK) loom_param_sync_from_master(p);
    }
    uint64_t v[10] = {0};
    const char *keys[] = {"step", "adam_steps", "rng_seed", "rng_offset", "data_epoch", "data_shard",
                          "data_offset", "scaler_good_steps", "scaler_skipped", "tokens_seen"};
    for (int k = 0; k < 10 && s == LOOM_OK; k++) s = meta_u64(sf, path, keys[k], &v[k]);
    const char *scale = loom_safetensors_metadata(sf, "loss_scale");
    if (s == LOOM_OK && !scale) s = loom_error(LOOM_ERR_FORMAT, "%s: metadata \"loss_scale\" is missing", path);
    if (s == LOOM_OK) {
        memset(st, 0, sizeof *st);
        st->step = (int)v[0];
        loom_adamw_set_steps(opt, (int)v[1]);
        st->rng_seed = v[2];
        st->rng_offset = v[3];
        st->data.epoch = v[4];
        st->data.shard = v[5];
        st->data.offset = v[6];
        st->scaler_good_steps = (int)v[7];
        st->scaler_skipped = (long)v[8];
        st->tokens_seen = v[9];
        st->loss_scale = (float)strtod(scale, NULL);
    }
    loom_safetensors_close(sf);
    return s;
}

/* Names of the checkpoints in out_dir, sorted (oldest first); caller frees. */
static int list_checkpoints(const char *out_dir, char (**names)[64]) {
    DIR *d = opendir(out_dir);
    *names = NULL;
    if (!d) return -1;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "ckpt-", 5) || strchr(e->d_name, '.') || strlen(e->d_name) >= 64) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char(*nn)[64] = realloc(*names, (size_t)cap * sizeof **names);
            if (!nn) break;
            *names = nn;
        }
        snprintf((*names)[n++], 64, "%s", e->d_name);
    }
    closedir(d);
    if (n) qsort(*names, (size_t)n, 64, (int (*)(const void *, const void *))strcmp);
    return n;
}

loom_status loom_checkpoint_prune(const char *out_dir, int keep) {
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
