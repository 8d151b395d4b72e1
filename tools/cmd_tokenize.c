/*
 * cmd_tokenize.c — `loom tokenize`: train a byte-level BPE tokenizer and/or
 * encode text files into llm.c token shards (train and validation). Text
 * comes as plain files (one document each, or split at a separator line) or
 * as JSON Lines (.jsonl: one document per line, a string field of an object).
 */
#include "cli.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <fnmatch.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARD_TOKENS 100000000

/* A document: text, and for supervised fine-tuning a prompt before it whose
 * tokens are no targets of the loss (prompt NULL: none). */
typedef struct doc { const char *prompt; size_t prompt_len; const char *text; size_t len; } doc;

typedef struct doc_list { doc *items; size_t n, cap; } doc_list;

static int push_pair(doc_list *l, const char *prompt, size_t prompt_len, const char *text, size_t len) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 1024;
        doc *d = realloc(l->items, cap * sizeof *d);
        if (!d) return -1;
        l->items = d;
        l->cap = cap;
    }
    l->items[l->n++] = (doc){prompt, prompt_len, text, len};
    return 0;
}

static int push_doc(doc_list *l, const char *text, size_t len) { return push_pair(l, NULL, 0, text, len); }

/* Split text into documents at lines equal to sep (if sep is set); a line
 * ends at \n, and a \r before it is not part of it (CRLF files). */
static int split_docs(doc_list *l, const char *text, size_t len, const char *sep) {
    if (!sep || !*sep) return len ? push_doc(l, text, len) : 0; /* an empty file is no document */
    size_t sl = strlen(sep), start = 0, i = 0;
    while (i <= len) {
        size_t eol = i;
        while (eol < len && text[eol] != '\n') eol++;
        size_t line = eol - i - (eol > i && text[eol - 1] == '\r');
        int is_sep = line == sl && !memcmp(text + i, sep, sl);
        if (is_sep || eol >= len) {
            size_t end = is_sep ? i : len;
            if (end > start && push_doc(l, text + start, end - start) != 0) return -1;
            start = eol + 1;
        }
        i = eol + 1;
    }
    return 0;
}

/* Buffers the documents point into, freed at the end. */
typedef struct buf_list { void **items; size_t n, cap; } buf_list;

static int keep(buf_list *l, void *p) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        void **items = realloc(l->items, cap * sizeof *items);
        if (!items) return -1;
        l->items = items;
        l->cap = cap;
    }
    l->items[l->n++] = p;
    return 0;
}

static void free_bufs(buf_list *l) {
    for (size_t i = 0; i < l->n; i++) free(l->items[i]);
    free(l->items);
}

static int is_jsonl(const char *path) {
    size_t n = strlen(path);
    return n >= 6 && strcasecmp(path + n - 6, ".jsonl") == 0;
}

/* *out: a copy (kept in owned) of string field `key` of line line_no's
 * object o, *n its length. `flag` names the option that chooses the key. */
static loom_status jsonl_field(const char *path, size_t line_no, json_t *o, const char *key, const char *flag,
                               buf_list *owned, const char **out, size_t *n) {
    json_t *v = json_is_object(o) ? json_object_get(o, key) : NULL;
    const char *what = !json_is_object(o) ? "is not a JSON object" : !v ? "has no field" : "has a field";
    if (!json_is_string(v))
        return loom_error(LOOM_ERR_FORMAT, "%s:%zu: the line %s \"%s\"%s (each line's object must have that "
                          "string field; %s names another)", path, line_no, what, key,
                          v ? " that is not a string" : "", flag);
    *n = json_string_length(v);
    char *copy = malloc(*n + 1);
    if (copy) {
        memcpy(copy, json_string_value(v), *n);
        copy[*n] = '\0';
    }
    if (!copy || keep(owned, copy) != 0) {
        free(copy);
        return loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory reading %s", path);
    }
    *out = copy;
    return LOOM_OK;
}

/* The documents of a JSON Lines file: each line that is not blank is one
 * JSON object, and its string field `key` one document (an empty string is
 * none), after its field prompt_key when that is not NULL (a prompt and its
 * completion). A line that is not such an object is an error naming it. */
static loom_status jsonl_docs(const char *path, const char *text, size_t len, const char *key,
                              const char *prompt_key, doc_list *docs, buf_list *owned) {
    size_t line_no = 0, i = len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3) ? 3 : 0; /* a UTF-8 byte order mark */
    while (i < len) {
        line_no++;
        size_t eol = i, j = i;
        while (eol < len && text[eol] != '\n') eol++;
        while (j < eol && isspace((unsigned char)text[j])) j++;
        if (j < eol) {
            json_error_t err;
            /* Numbers too large for an integer are read as reals: valid JSON
             * in another field is no reason to refuse a line. */
            json_t *o = json_loadb(text + i, eol - i, JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &err);
            if (!o)
                return loom_error(LOOM_ERR_FORMAT, "%s:%zu: cannot parse the line as JSON (%s, column %d); each line "
                                  "of a .jsonl file must be one JSON object", path, line_no, err.text, err.column);
            size_t n = 0, pn = 0;
            const char *prompt = NULL, *body = NULL;
            loom_status fs = prompt_key ? jsonl_field(path, line_no, o, prompt_key, "--jsonl-prompt-key", owned,
                                                      &prompt, &pn) : LOOM_OK;
            if (fs == LOOM_OK) fs = jsonl_field(path, line_no, o, key, "--jsonl-key", owned, &body, &n);
            json_decref(o);
            LOOM_TRY(fs);
            if ((n || pn) && push_pair(docs, prompt, pn, body, n) != 0)
                return loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory reading %s", path);
        }
        i = eol + 1;
    }
    return LOOM_OK;
}

/* The documents of one input file: a .jsonl file's lines, or a text file
 * whole, or split at lines equal to sep (NULL: whole). */
static loom_status file_docs(const char *path, const char *sep, const char *key, const char *prompt_key,
                             doc_list *docs, buf_list *owned) {
    void *text = NULL;
    size_t len = 0;
    LOOM_TRY(loom_read_file(path, &text, &len));
    if (keep(owned, text) != 0) {
        free(text);
        return loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory");
    }
    if (is_jsonl(path)) return jsonl_docs(path, text, len, key, prompt_key, docs, owned);
    if (split_docs(docs, text, len, sep) != 0) return loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory");
    return LOOM_OK;
}

/* Token ids, and beside them the loss mask: 1 for a target of the loss, 0
 * for a prompt's token; `masked` once any is 0 (then the shards get masks). */
typedef struct tok_buf { int32_t *ids; uint8_t *mask; size_t n, cap; int masked; } tok_buf;

/* Room for `need` ids in all. */
static loom_status reserve(tok_buf *b, size_t need) {
    if (need <= b->cap) return LOOM_OK;
    size_t cap = need + need / 2;
    int32_t *ids = realloc(b->ids, cap * sizeof *ids);
    if (ids) b->ids = ids;
    uint8_t *mask = ids ? realloc(b->mask, cap) : NULL;
    if (!mask) return loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory");
    b->mask = mask;
    b->cap = cap;
    return LOOM_OK;
}

/* Encode text after b's ids (as a continuation with `more`), keeping room
 * for one id after it. Room is made for one id per byte, which holds for
 * most text; when a normalizer makes more (loom_tokenizer_max_ids can be
 * eleven times the bytes), the text is encoded again in the room it asked
 * for, not reserved at that bound for every document. */
static loom_status encode_into(loom_tokenizer *tok, tok_buf *b, const char *text, size_t len, int more, size_t *n) {
    LOOM_TRY(reserve(b, b->n + len + 1));
    for (int again = 0;; again = 1) {
        size_t room = b->cap - b->n - 1;
        loom_status st = more ? loom_tokenizer_encode_more(tok, text, len, b->ids + b->n, room, n)
                              : loom_tokenizer_encode(tok, text, len, b->ids + b->n, room, n);
        if (st == LOOM_OK || again || *n <= room) return st;
        LOOM_TRY(reserve(b, b->n + *n + 1));
    }
}

static loom_status append_doc(loom_tokenizer *tok, tok_buf *b, const doc *d) {
    LOOM_TRY(reserve(b, b->n + 1));
    size_t n = 0, start = b->n;
    /* Every document starts with the begin-of-text token (a target: the end
     * of the last), and ends with the end-of-text token when that is another
     * (Llama 3's convention; loom's own and GPT-2's tokenizers have one). */
    int bos = loom_tokenizer_bos(tok), eot = loom_tokenizer_eot(tok);
    if (bos >= 0) b->ids[b->n++] = bos;
    if (d->prompt) {
        LOOM_TRY(encode_into(tok, b, d->prompt, d->prompt_len, 0, &n));
        memset(b->mask + start, 1, b->n - start);
        memset(b->mask + b->n, 0, n); /* the prompt: no target */
        b->n += n;
        b->masked |= n > 0;
        start = b->n;
    }
    /* the completion continues its prompt */
    LOOM_TRY(encode_into(tok, b, d->text, d->len, d->prompt != NULL, &n));
    b->n += n;
    if (eot >= 0 && eot != bos) b->ids[b->n++] = eot;
    memset(b->mask + start, 1, b->n - start);
    return LOOM_OK;
}

/* Say how documents are framed: which token starts one, which ends one. */
static void note_framing(const loom_tokenizer *tok) {
    int bos = loom_tokenizer_bos(tok), eot = loom_tokenizer_eot(tok);
    const char *b = "", *e = "";
    size_t nb = 0, ne = 0;
    if (bos >= 0) loom_tokenizer_token_bytes(tok, bos, &b, &nb);
    if (eot >= 0) loom_tokenizer_token_bytes(tok, eot, &e, &ne);
    if (bos < 0) fprintf(stderr, "tokenize: the tokenizer has no begin- or end-of-text token: documents are joined "
                         "as they are\n");
    else if (eot < 0 || eot == bos)
        fprintf(stderr, "tokenize: %d tokens; each document starts with %.*s (id %d)\n", loom_tokenizer_vocab_size(tok),
                (int)nb, b, bos);
    else
        fprintf(stderr, "tokenize: %d tokens; each document starts with %.*s (id %d) and ends with %.*s (id %d)\n",
                loom_tokenizer_vocab_size(tok), (int)nb, b, bos, (int)ne, e, eot);
}

/* floor(n f), for a decimal f given on the command line: the product of
 * a double that is a hair below the decimal (0.7) and the n that makes the
 * decimal's product whole lands a hair below that whole number. */
static size_t share(size_t n, double f) { return (size_t)floor((double)n * f + 1e-9); }

/* Whether name is a shard or a loss mask this command writes: train_ or
 * val_, digits, .bin or .mask (write_shards). train_1_backup.bin is not: it
 * is somebody's file. */
static int is_our_shard(const char *name) {
    const char *p = !strncmp(name, "train_", 6) ? name + 6 : !strncmp(name, "val_", 4) ? name + 4 : NULL;
    if (!p || !(*p >= '0' && *p <= '9')) return 0;
    while (*p >= '0' && *p <= '9') p++;
    return !strcmp(p, ".bin") || !strcmp(p, ".mask");
}

/* Shards an earlier run wrote here (train_NNNNNN.bin, val_NNNNNN.bin) and
 * their masks: the data loader reads every *train*.bin of a directory, so
 * shards this run does not rewrite would silently join the new data, and a
 * mask of the old data would mask the new. */
static loom_status remove_old_shards(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return LOOM_OK; /* nothing there yet */
    int removed = 0;
    loom_status st = LOOM_OK;
    char path[4096];
    for (struct dirent *e; st == LOOM_OK && (e = readdir(d));) {
        if (!is_our_shard(e->d_name)) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (unlink(path) != 0) st = loom_error(LOOM_ERR_IO, "cannot remove the old shard %s: %s", path, strerror(errno));
        else removed++;
    }
    closedir(d);
    if (removed) fprintf(stderr, "tokenize: removed %d shard%s of an earlier run from %s\n", removed,
                         removed == 1 ? "" : "s", dir);
    return st;
}

static loom_status write_shards(const char *dir, const char *split, const tok_buf *b, int vocab) {
    char path[4096], mask[4096];
    for (size_t off = 0, k = 0; off < b->n || k == 0; off += SHARD_TOKENS, k++) {
        size_t n = b->n - off < SHARD_TOKENS ? b->n - off : SHARD_TOKENS;
        snprintf(path, sizeof path, "%s/%s_%06zu.bin", dir, split, k);
        LOOM_TRY(loom_shard_write(path, b->ids + off, n, vocab));
        if (b->masked) {
            LOOM_TRY(loom_mask_path(path, mask, sizeof mask));
            LOOM_TRY(loom_mask_write(mask, b->mask + off, n));
        }
        if (n == 0) break;
    }
    return LOOM_OK;
}

/* The new dataset is written beside the old one (shards in a staging
 * directory, the tokenizer as tokenizer.json.new) and takes its place only
 * when all of it is complete: a failure (a full disk) leaves the old
 * dataset as it was, never a new tokenizer beside old shards. */
static loom_status publish_dataset(const char *out, const char *staging, const char *staged_tok) {
    /* The marker makes the swap all-or-nothing to readers: until it is
     * gone, data loaders refuse the directory, so a crash midway leaves an
     * error, never old and new shards mixed. Its removal also syncs the
     * directory, making the renames durable. */
    char marker[4608];
    snprintf(marker, sizeof marker, "%s/%s", out, LOOM_SHARDS_INCOMPLETE);
    static const char note[] = "loom tokenize is replacing the shards in this directory; if it is not running, "
                               "it crashed: run it again\n";
    LOOM_TRY(loom_file_write_atomic(marker, note, sizeof note - 1));
    LOOM_TRY(remove_old_shards(out));
    DIR *d = opendir(staging);
    if (!d) return loom_error(LOOM_ERR_IO, "cannot read %s: %s", staging, strerror(errno));
    loom_status st = LOOM_OK;
    char from[4608], to[4608];
    for (struct dirent *e; st == LOOM_OK && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        snprintf(from, sizeof from, "%s/%s", staging, e->d_name);
        snprintf(to, sizeof to, "%s/%s", out, e->d_name);
        if (rename(from, to) != 0) st = loom_error(LOOM_ERR_IO, "cannot move %s to %s: %s", from, to, strerror(errno));
        else fprintf(stderr, "tokenize: wrote %s\n", to);
    }
    closedir(d);
    snprintf(to, sizeof to, "%s/tokenizer.json", out);
    if (st == LOOM_OK && rename(staged_tok, to) != 0)
        st = loom_error(LOOM_ERR_IO, "cannot move %s to %s: %s", staged_tok, to, strerror(errno));
    if (st == LOOM_OK) st = loom_file_remove_durable(marker);
    return st;
}

/* Remove the staging directory with whatever is left in it, and a staged
 * tokenizer that was not moved into place. */
static void remove_staged(const char *staging, const char *staged_tok) {
    DIR *d = opendir(staging);
    char path[4608];
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", staging, e->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(staging);
    if (staged_tok) unlink(staged_tok);
}

/* The dataset directory, locked for this run. What a killed tokenize left
 * there (its staging directory, a staged tokenizer) is removed: holding the
 * lock, no other tokenize is writing them. Shards of another tool (names
 * the loader reads, *train*.bin or *val*.bin, that this command would not
 * replace) are refused: they would join the new data silently. */
static loom_status prepare_out(const char *out) {
    LOOM_TRY(loom_mkdir_p(out));
    LOOM_TRY(cli_lock_dir(out));
    DIR *d = opendir(out);
    if (!d) return loom_error(LOOM_ERR_IO, "%s: cannot read %s", strerror(errno), out);
    loom_status st = LOOM_OK;
    char path[4608];
    for (struct dirent *e; st == LOOM_OK && (e = readdir(d));) {
        snprintf(path, sizeof path, "%s/%s", out, e->d_name);
        if (!strncmp(e->d_name, ".shards.new.", 12)) {
            remove_staged(path, NULL);
            fprintf(stderr, "tokenize: removed %s, left by a tokenize that did not finish\n", path);
        } else if (!strcmp(e->d_name, "tokenizer.json.new")) {
            unlink(path);
        } else if ((!fnmatch("*train*.bin", e->d_name, 0) || !fnmatch("*val*.bin", e->d_name, 0)) &&
                   !is_our_shard(e->d_name)) {
            st = loom_error(LOOM_ERR_STATE, "%s holds %s, shards this command did not write, which training "
                            "would read with the new ones: move them away, or use another --out", out, e->d_name);
        }
    }
    closedir(d);
    return st;
}

/* Entropy (nats) of the unigram distribution of the tokens: the loss a
 * model that ignores context cannot beat. */
static double unigram_entropy(const tok_buf *b, int vocab) {
    double *count = calloc((size_t)vocab, sizeof *count), h = 0.0;
    if (!count || b->n == 0) { free(count); return 0.0; }
    for (size_t i = 0; i < b->n; i++) count[b->ids[i]] += 1.0;
    for (int v = 0; v < vocab; v++)
        if (count[v] > 0) h -= count[v] / (double)b->n * log(count[v] / (double)b->n);
    free(count);
    return h;
}

static int run(int argc, char **argv) {
    string_list train = {0}, in = {0};
    const char *out = NULL, *tok_path = NULL, *doc_sep = NULL, *jsonl_key = NULL, *prompt_key = NULL;
    int vocab = INT_MIN;         /* INT_MIN, NAN: not given (then 4096, 0.05) */
    double val_fraction = NAN;
    const flag flags[] = {
        {"train", FLAG_LIST, &train, "FILE...", "train a BPE tokenizer on these text (or .jsonl) files"},
        {"vocab", FLAG_INT, &vocab, "N", "vocabulary size when training (default 4096)"},
        {"tokenizer", FLAG_STRING, &tok_path, "FILE", "an existing tokenizer.json to encode with: loom's, or a Hugging Face BPE"},
        {"in", FLAG_LIST, &in, "FILE...", "text (or .jsonl) files to encode into shards"},
        {"out", FLAG_STRING, &out, "PATH", "tokenizer file (training only) or shard directory"},
        {"val-fraction", FLAG_DOUBLE, &val_fraction, "F", "share of documents for validation (default 0.05)"},
        {"doc-sep", FLAG_STRING, &doc_sep, "LINE", "a line that separates documents, e.g. % (default: one per file)"},
        {"jsonl-key", FLAG_STRING, &jsonl_key, "KEY", "the field of each .jsonl line that holds its document (default text)"},
        {"jsonl-prompt-key", FLAG_STRING, &prompt_key, "KEY", "fine-tuning data: each .jsonl line's prompt, before its "
                                                              "document; no loss on the prompt's tokens"},
    };
    int n_flags = (int)(sizeof flags / sizeof flags[0]);
    int rc = cli_parse(&cmd_tokenize, flags, n_flags, argc, argv);
    if (rc) { free(train.items); free(in.items); return rc > 0 ? 0 : 2; }
    /* A flag that would change nothing is refused, not ignored. */
    if (!out) rc = cli_usage_error("tokenize", "--out is required");
    else if (!train.n && !in.n) rc = cli_usage_error("tokenize", "give --train FILE... and/or --in FILE...");
    else if (train.n && tok_path)
        rc = cli_usage_error("tokenize", "--train makes a new tokenizer and --tokenizer names an existing one: give "
                             "one of them");
    else if (in.n && !train.n && !tok_path) rc = cli_usage_error("tokenize", "--in needs --tokenizer FILE (or --train)");
    else if (!train.n && vocab != INT_MIN) rc = cli_usage_error("tokenize", "--vocab sizes a tokenizer being trained: "
                                                                "it needs --train FILE...");
    else if (!in.n && (!isnan(val_fraction) || doc_sep))
        rc = cli_usage_error("tokenize", "--%s applies to the shards: it needs --in FILE...",
                             doc_sep ? "doc-sep" : "val-fraction");
    else if (!isnan(val_fraction) && !(val_fraction >= 0.0 && val_fraction < 1.0))
        rc = cli_usage_error("tokenize", "--val-fraction must be in [0, 1)");
    int any_jsonl = 0, in_text = 0;
    for (int i = 0; i < train.n; i++) any_jsonl |= is_jsonl(train.items[i]);
    for (int i = 0; i < in.n; i++) {
        any_jsonl |= is_jsonl(in.items[i]);
        in_text |= !is_jsonl(in.items[i]);
    }
    if (!rc && (jsonl_key || prompt_key) && !any_jsonl)
        rc = cli_usage_error("tokenize", "--%s names a field of .jsonl files, and no file given ends in .jsonl",
                             jsonl_key ? "jsonl-key" : "jsonl-prompt-key");
    if (!rc && prompt_key && !strcmp(prompt_key, jsonl_key ? jsonl_key : "text"))
        rc = cli_usage_error("tokenize", "--jsonl-prompt-key and --jsonl-key name the same field '%s': the prompt "
                             "and its completion are two fields", prompt_key);
    if (!rc && doc_sep && in.n && !in_text)
        rc = cli_usage_error("tokenize", "--doc-sep splits text files, and every --in file is .jsonl (one document "
                             "per line already)");
    if (!jsonl_key) jsonl_key = "text";
    if (vocab == INT_MIN) vocab = 4096;
    if (isnan(val_fraction)) val_fraction = 0.05;
    if (rc) { free(train.items); free(in.items); return rc; }

    struct stat sb;
    if (!in.n && stat(out, &sb) == 0 && S_ISDIR(sb.st_mode))
        return free(train.items), free(in.items),
               cli_usage_error("tokenize", "--out %s is a directory: with --train alone, --out is the tokenizer file "
                               "(e.g. %s/tokenizer.json); add --in FILE... to make shards there", out, out);

    loom_status st = in.n ? prepare_out(out) : LOOM_OK;
    loom_tokenizer *tok = NULL;
    char tok_out[4096];
    buf_list owned = {0};
    if (train.n) {
        double t0 = cli_now();
        /* A text file trains whole; a .jsonl file's documents each apart. */
        doc_list tdocs = {0};
        for (int i = 0; i < train.n && st == LOOM_OK; i++)
            st = file_docs(train.items[i], NULL, jsonl_key, prompt_key, &tdocs, &owned);
        if (st == LOOM_OK && tdocs.n == 0)
            st = loom_error(LOOM_ERR_INVALID, "tokenize: the --train files hold no text to learn merges from");
        /* A prompt and its completion are two texts: they are encoded apart. */
        const char **texts = malloc((2 * tdocs.n + 1) * sizeof *texts);
        size_t *lens = malloc((2 * tdocs.n + 1) * sizeof *lens), total = 0, n_texts = 0;
        if (st == LOOM_OK && (!texts || !lens)) st = loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory");
        for (size_t i = 0; st == LOOM_OK && i < tdocs.n; i++) {
            const doc *d = &tdocs.items[i];
            if (d->prompt_len) {
                texts[n_texts] = d->prompt;
                lens[n_texts++] = d->prompt_len;
            }
            if (d->len) {
                texts[n_texts] = d->text;
                lens[n_texts++] = d->len;
            }
            total += d->prompt_len + d->len;
        }
        if (st == LOOM_OK) st = loom_tokenizer_train(texts, lens, n_texts, vocab, &tok);
        free(texts);
        free(lens);
        free(tdocs.items);
        if (st == LOOM_OK) {
            /* Training alone: --out is the tokenizer file; with --in, a directory. */
            if (in.n) { /* prepare_out made the directory */
                snprintf(tok_out, sizeof tok_out, "%s/tokenizer.json.new", out);
            } else {
                snprintf(tok_out, sizeof tok_out, "%s", out);
            }
        }
        if (st == LOOM_OK) st = loom_tokenizer_save(tok, tok_out);
        if (st == LOOM_OK)
            fprintf(stderr, "tokenize: trained %d tokens on %.1f MB in %.1f s%s%s\n", loom_tokenizer_vocab_size(tok),
                    (double)total / 1e6, cli_now() - t0, in.n ? "" : " -> ", in.n ? "" : tok_out);
        if (st == LOOM_OK && loom_tokenizer_vocab_size(tok) < vocab)
            fprintf(stderr, "tokenize: note: --vocab %d asked for more tokens than the text has pairs to merge; "
                    "the vocabulary has %d\n", vocab, loom_tokenizer_vocab_size(tok));
    } else if (st == LOOM_OK) {
        st = loom_tokenizer_load(tok_path, &tok);
        if (st == LOOM_OK) {
            snprintf(tok_out, sizeof tok_out, "%s/tokenizer.json.new", out);
            st = loom_file_copy_atomic(tok_path, tok_out);
        }
        if (st == LOOM_OK) note_framing(tok);
    }
    if (st == LOOM_OK && in.n) {
        doc_list docs = {0};
        for (int i = 0; i < in.n && st == LOOM_OK; i++)
            st = file_docs(in.items[i], doc_sep, jsonl_key, prompt_key, &docs, &owned);
        if (st == LOOM_OK && docs.n == 0)
            st = loom_error(LOOM_ERR_INVALID, "tokenize: the --in files hold no text%s%s%s", doc_sep ? " (empty, or only "
                            : " (empty)", doc_sep ? doc_sep : "", doc_sep ? " lines)" : "");
        tok_buf tr = {0}, va = {0};
        /* Document i goes to validation when floor((i+1) f) > floor(i f):
         * an even spread, the same every run, floor(n f) in all. Too few
         * documents for one at that rate: the last one. */
        int last_to_val = docs.n >= 2 && val_fraction > 0.0 && share(docs.n, val_fraction) == 0;
        size_t n_val_docs = 0;
        for (size_t i = 0; i < docs.n && st == LOOM_OK; i++) {
            int is_val = share(i + 1, val_fraction) > share(i, val_fraction) || (last_to_val && i == docs.n - 1);
            n_val_docs += is_val;
            st = append_doc(tok, is_val ? &va : &tr, &docs.items[i]);
        }
        if (st == LOOM_OK && docs.n == 1 && val_fraction > 0.0) {
            /* One document: the validation set is its last share of tokens. */
            size_t n_val = (size_t)share(tr.n, val_fraction);
            va.ids = malloc((n_val + 1) * sizeof *va.ids);
            va.mask = malloc(n_val + 1);
            if (!va.ids || !va.mask) {
                st = loom_error(LOOM_ERR_NOMEM, "tokenize: out of memory");
            } else {
                memcpy(va.ids, tr.ids + tr.n - n_val, n_val * sizeof *va.ids);
                memcpy(va.mask, tr.mask + tr.n - n_val, n_val);
                va.n = n_val;
                va.masked = tr.masked;
                tr.n -= n_val;
            }
        }
        char staging[4200];
        snprintf(staging, sizeof staging, "%s/.shards.new.%d", out, (int)getpid());
        if (st == LOOM_OK) st = loom_mkdir_p(staging);
        if (st == LOOM_OK) st = write_shards(staging, "train", &tr, loom_tokenizer_vocab_size(tok));
        if (st == LOOM_OK && val_fraction > 0.0) st = write_shards(staging, "val", &va, loom_tokenizer_vocab_size(tok));
        if (st == LOOM_OK) st = publish_dataset(out, staging, tok_out);
        remove_staged(staging, tok_out); /* what failed, or the emptied staging directory */
        if (st == LOOM_OK)
            fprintf(stderr, "tokenize: %zu documents (%zu for validation), %zu train tokens, %zu validation tokens; "
                    "unigram entropy %.3f nats/token\n", docs.n, docs.n == 1 ? 0 : n_val_docs, tr.n, va.n,
                    unigram_entropy(&tr, loom_tokenizer_vocab_size(tok)));
        if (st == LOOM_OK && (tr.masked || va.masked)) {
            size_t targets = 0;
            for (size_t i = 0; i < tr.n; i++) targets += tr.mask[i];
            fprintf(stderr, "tokenize: loss masks beside the shards: %zu of the %zu train tokens are targets, the "
                    "rest prompts\n", targets, tr.n);
        }
        free(tr.ids);
        free(tr.mask);
        free(va.ids);
        free(va.mask);
        free(docs.items);
    }
    free_bufs(&owned);
    free(train.items);
    free(in.items);
    loom_tokenizer_free(tok);
    return st == LOOM_OK ? 0 : cli_fail("tokenize", st);
}

const command cmd_tokenize = {
    "tokenize",
    "train a byte-level BPE tokenizer (or take loom's or a Hugging Face one) and encode text into token shards",
    "tokenize --train FILE... --vocab N --out tok.json\n"
    "       loom tokenize --tokenizer tok.json --in FILE... --out DIR [--val-fraction F]\n"
    "       loom tokenize --train FILE... --vocab N --in FILE... --out DIR",
    "Shards use llm.c's format (uint16 tokens up to 65536 ids, else uint32):\n"
    "DIR/train_000000.bin, DIR/val_000000.bin, and DIR/tokenizer.json. Documents are\n"
    "joined with the <|endoftext|> token. --tokenizer also reads a Hugging Face\n"
    "tokenizer.json of BPE (GPT-2, Llama 3, Llama 2, Mistral and the like): each\n"
    "document then starts with its begin-of-text token and ends with its end-of-text\n"
    "token when that is another (README). A file ending in .jsonl is JSON Lines: each\n"
    "line an object whose \"text\" field (--jsonl-key) is one document; --doc-sep\n"
    "applies to the other files. With --jsonl-prompt-key KEY each line's KEY field is a\n"
    "prompt before the document, and DIR/NAME.mask beside each shard marks the\n"
    "prompts' tokens as no target of the loss (supervised fine-tuning).",
    run,
};
