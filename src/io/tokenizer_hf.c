/*
 * tokenizer_hf.c — a Hugging Face tokenizer.json of BPE read into loom's
 * tokenizer, so that models trained elsewhere can be tokenized for,
 * fine-tuned and sampled with their own vocabulary.
 *
 * What it reads: model "BPE" with the file's ids (vocab, merges as "a b" or
 * ["a", "b"], ignore_merges, unk_token and fuse_unk), added tokens, and
 * either of two layouts:
 *  - byte-level (GPT-2, Llama 3, StarCoder, DeepSeek, GPT-4, Qwen 2): no
 *    normalizer but Unicode normal forms (NFC, NFD, NFKC, NFKD), a
 *    pre-tokenizer that is ByteLevel or a Sequence of regex Splits
 *    ("Isolated", or "Removed" inverted) and Digits ending in ByteLevel, a
 *    ByteLevel decoder; tokens spelled in GPT-2's byte alphabet;
 *  - SentencePiece-style (byte_fallback: Llama 2, Mistral, Gemma): Prepend,
 *    Replace and normal-form normalizer steps, or a Metaspace pre-tokenizer
 *    (transformers' legacy=False files), tokens as written with U+2581 for a
 *    space and <0xXX> for a byte.
 * The begin-of-text token is the one the post-processor's template puts
 * first; without a template the special token "<|begin_of_text|>", "<s>",
 * "<bos>" or "<｜begin▁of▁sentence｜>"; the end-of-text token is the special
 * token "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>" or
 * "<｜end▁of▁sentence｜>"; with
 * no begin-of-text token both are the end-of-text token (GPT-2's
 * convention). (tokenizer_config.json, which names them too, is not read:
 * the model directories loom writes carry tokenizer.json alone.)
 *
 * Owns: the checks that make every id decodable and every merge's result a
 * vocabulary token. Must never: accept a file it would encode differently
 * from what it says (the refusals io.h lists, all by name), or let text make
 * a special token (a merge that makes one is refused).
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "io/io_internal.h"

#include <ctype.h>
#include <jansson.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2's pre-tokenizer expression, which ByteLevel with use_regex applies. */
static const char gpt2_split[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static loom_status hf_bad(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static loom_status hf_bad(const char *path, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return loom_error(LOOM_ERR_FORMAT, "tokenizer file '%s' (Hugging Face format): %s", path, what);
}

static const char *type_of(json_t *o) {
    json_t *t = json_object_get(o, "type");
    return json_is_string(t) ? json_string_value(t) : "";
}

/* A field that must be absent, null, false, 0 or "" for the encoding to be
 * plain byte-level BPE. */
static int unset(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return !v || json_is_null(v) || json_is_false(v) || (json_is_string(v) && !*json_string_value(v)) ||
           (json_is_number(v) && json_number_value(v) == 0.0);
}

/* The state of one load. */
typedef struct hf_load {
    const char *path;
    loom_tokenizer *tok;
    int sp;             /* SentencePiece-style (byte_fallback): strings as written, ▁ a space, <0xXX> bytes */
    bpe_byte_chars bc;  /* byte -> its character in GPT-2's alphabet */
    int byte_of[512];   /* code point -> byte (-1: not in the alphabet) */
} hf_load;

static loom_status add_split(hf_load *L, const char *pattern) {
    loom_tokenizer *tok = L->tok;
    if (tok->n_splits == BPE_MAX_SPLITS)
        return hf_bad(L->path, "its pre-tokenizer has more than %d regular expressions", BPE_MAX_SPLITS);
    int err;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        return hf_bad(L->path, "its pre-tokenizer's expression does not compile (at %zu: %s)", (size_t)at,
                      (char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* faster when it can; the interpreter otherwise */
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) {
        pcre2_code_free(re);
        return loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
    }
    tok->splits[tok->n_splits] = re;
    tok->match[tok->n_splits++] = md;
    return LOOM_OK;
}

/* ByteLevel: no prefix space; its own GPT-2 expression when use_regex. */
static loom_status byte_level(hf_load *L, json_t *p) {
    if (!unset(p, "add_prefix_space"))
        return hf_bad(L->path, "its ByteLevel pre-tokenizer adds a prefix space, which loom does not support");
    json_t *re = json_object_get(p, "use_regex");
    if (!re || json_is_true(re)) return add_split(L, gpt2_split);
    return LOOM_OK;
}

static loom_status pre_tokenizer(hf_load *L, json_t *p) {
    if (!strcmp(type_of(p), "ByteLevel")) return byte_level(L, p);
    if (strcmp(type_of(p), "Sequence"))
        return hf_bad(L->path, "its pre-tokenizer is \"%s\"; loom reads ByteLevel, or a Sequence of regex "
                      "Splits and Digits ending in ByteLevel", type_of(p));
    json_t *list = json_object_get(p, "pretokenizers");
    size_t n = json_array_size(list);
    if (!n || strcmp(type_of(json_array_get(list, n - 1)), "ByteLevel"))
        return hf_bad(L->path, "its pre-tokenizer Sequence does not end in ByteLevel");
    for (size_t i = 0; i + 1 < n; i++) {
        json_t *s = json_array_get(list, i), *pat = json_object_get(s, "pattern");
        if (!strcmp(type_of(s), "Digits")) { /* each digit (or each run of digits) a piece */
            LOOM_TRY(add_split(L, json_is_true(json_object_get(s, "individual_digits")) ? "\\p{N}" : "\\p{N}+"));
            continue;
        }
        json_t *re = json_object_get(pat, "Regex"), *beh = json_object_get(s, "behavior");
        /* Isolated: matches and gaps are pieces. Removed and inverted (the
         * converted tiktoken files: GPT-4's, GPT-4o's): matches are pieces,
         * gaps dropped; their expressions match all valid text, so the gaps
         * hold only bytes that are not UTF-8, which loom keeps as pieces. */
        int isolated = json_is_string(beh) && !strcmp(json_string_value(beh), "Isolated") && unset(s, "invert");
        int kept = json_is_string(beh) && !strcmp(json_string_value(beh), "Removed") &&
                   json_is_true(json_object_get(s, "invert"));
        if (strcmp(type_of(s), "Split") || !json_is_string(re) || !(isolated || kept))
            return hf_bad(L->path, "pre-tokenizer %zu is \"%s\"; loom reads Digits, and Split on a Regex with "
                          "behavior Isolated (or Removed, inverted)", i, type_of(s));
        LOOM_TRY(add_split(L, json_string_value(re)));
    }
    return byte_level(L, json_array_get(list, n - 1));
}

/* Decode a vocabulary string (GPT-2's alphabet, UTF-8) into bytes; returns
 * the byte count, or -1 for a character outside the alphabet. */
static long spell_bytes(const hf_load *L, const char *s, size_t n, char *out) {
    long k = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = (unsigned char)s[i], cp;
        if (c < 0x80) {
            cp = c;
            i += 1;
        } else if ((c & 0xE0) == 0xC0 && i + 1 < n && ((unsigned char)s[i + 1] & 0xC0) == 0x80) {
            cp = (c & 0x1F) << 6 | ((unsigned char)s[i + 1] & 0x3F);
            i += 2;
        } else {
            return -1;
        }
        if (cp >= 512 || L->byte_of[cp] < 0) return -1;
        if (out) out[k] = (char)L->byte_of[cp];
        k++;
    }
    return k;
}

/* A SentencePiece-style token's bytes: "<0xXX>" is byte XX, otherwise the
 * string with each "\xe2\x96\x81" (U+2581) a space. Returns the count. */
static size_t sp_bytes(const char *s, char *out) {
    size_t n = strlen(s), k = 0;
    unsigned v;
    char tail;
    if (n == 6 && sscanf(s, "<0x%2X%c", &v, &tail) == 2 && tail == '>' && isxdigit((unsigned char)s[3]) &&
        isxdigit((unsigned char)s[4])) {
        if (out) out[0] = (char)v;
        return 1;
    }
    for (size_t i = 0; i < n; k++) {
        if (!strncmp(s + i, "\xe2\x96\x81", 3)) {
            if (out) out[k] = ' ';
            i += 3;
        } else {
            if (out) out[k] = s[i];
            i++;
        }
    }
    return k;
}

/* id of a vocabulary string, or -1. */
static int32_t vocab_id(json_t *vocab, const char *s) {
    json_t *v = json_object_get(vocab, s);
    return json_is_integer(v) ? (int32_t)json_integer_value(v) : -1;
}

/* The id of the special token named `name` among the added tokens, or -1. */
static int32_t added_id(json_t *added, const char *name) {
    size_t i;
    json_t *a;
    json_array_foreach(added, i, a) {
        json_t *c = json_object_get(a, "content"), *id = json_object_get(a, "id");
        if (json_is_string(c) && !strcmp(json_string_value(c), name) && json_is_integer(id))
            return (int32_t)json_integer_value(id);
    }
    return -1;
}

/* The token the post-processor's template puts before a single sequence
 * (TemplateProcessing, alone or in a Sequence): its id, TEMPLATE_NONE when
 * the template puts none first, NO_TEMPLATE when there is no template. */
enum { NO_TEMPLATE = -1, TEMPLATE_NONE = -2 };

static int32_t template_bos(json_t *post, json_t *added, int vocab_size) {
    if (!strcmp(type_of(post), "Sequence")) {
        size_t i;
        json_t *p;
        json_array_foreach(json_object_get(post, "processors"), i, p) {
            int32_t id = template_bos(p, added, vocab_size);
            if (id != NO_TEMPLATE) return id;
        }
        return NO_TEMPLATE;
    }
    if (strcmp(type_of(post), "TemplateProcessing")) return NO_TEMPLATE;
    json_t *first = json_object_get(json_array_get(json_object_get(post, "single"), 0), "SpecialToken");
    json_t *name = json_object_get(first, "id");
    if (!json_is_string(name)) return TEMPLATE_NONE;
    json_t *ids = json_object_get(json_object_get(json_object_get(post, "special_tokens"), json_string_value(name)),
                                  "ids");
    json_t *id = json_array_get(ids, 0);
    if (json_array_size(ids) == 1 && json_is_integer(id) && json_integer_value(id) >= 0 &&
        json_integer_value(id) < vocab_size)
        return (int32_t)json_integer_value(id);
    int32_t by_name = added_id(added, json_string_value(name));
    return by_name >= 0 ? by_name : TEMPLATE_NONE;
}

/* vocab_size = 1 + the largest id of the vocabulary and the added tokens. */
static loom_status count_ids(hf_load *L, json_t *vocab, json_t *added, int *vocab_size) {
    const char *key;
    json_t *v;
    json_int_t top = -1;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= (1 << 24))
            return hf_bad(L->path, "vocabulary entry \"%s\" has no id in [0, 2^24)", key);
        if (json_integer_value(v) > top) top = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(added, i, v) {
        json_t *id = json_object_get(v, "id"), *c = json_object_get(v, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= (1 << 24) ||
            !json_is_string(c) || !*json_string_value(c))
            return hf_bad(L->path, "added token %zu has no id in [0, 2^24) or no content", i);
        if (json_integer_value(id) > top) top = json_integer_value(id);
    }
    if (top < 0) return hf_bad(L->path, "its vocabulary is empty");
    *vocab_size = (int)top + 1;
    return LOOM_OK;
}

/* Every id's bytes: vocabulary strings decoded from GPT-2's alphabet; added
 * tokens as written (one the vocabulary also holds must say the same, in
 * the alphabet or as written: DeepSeek's special tokens are both); an id
 * with no token (GPT-4's unused ids) is empty and special, never made.
 * Fills tok_off, arena, special, byte_id, and the whole-piece map. */
enum { ID_NONE, ID_SPELLED, ID_RAW };

/* The bytes of a token of this kind from its string: a vocabulary string
 * decoded, an added token's as written, none for an unused id. Returns the
 * count; dst NULL only counts. */
static size_t token_text(const hf_load *L, int kind, const char *s, char *dst) {
    if (kind == ID_RAW) {
        size_t n = strlen(s);
        if (dst) memcpy(dst, s, n);
        return n;
    }
    if (kind != ID_SPELLED) return 0;
    return L->sp ? sp_bytes(s, dst) : (size_t)spell_bytes(L, s, strlen(s), dst);
}

static loom_status token_bytes(hf_load *L, json_t *vocab, json_t *added) {
    loom_tokenizer *tok = L->tok;
    size_t V = (size_t)tok->vocab_size;
    const char **src = calloc(V, sizeof *src);   /* id -> its string in the file */
    const char **extra = calloc(V, sizeof *extra); /* id -> an added token's content */
    unsigned char *kind = calloc(V, 1);
    if (json_array_size(added)) tok->added = calloc(json_array_size(added), sizeof *tok->added);
    loom_status st = src && extra && kind && (tok->added || !json_array_size(added))
                         ? LOOM_OK
                         : loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
    size_t i;
    json_t *v;
    json_array_foreach(added, i, v) {
        if (st != LOOM_OK) break;
        size_t id = (size_t)json_integer_value(json_object_get(v, "id"));
        const char *c = json_string_value(json_object_get(v, "content"));
        if (extra[id]) st = hf_bad(L->path, "added tokens \"%s\" and \"%s\" have the same id %zu", extra[id], c, id);
        extra[id] = c;
        tok->special[id] = json_is_true(json_object_get(v, "special"));
        if (st != LOOM_OK || tok->special[id]) continue;
        /* not special: found in text as Hugging Face finds it */
        if (!unset(v, "lstrip") || !unset(v, "rstrip") || !unset(v, "single_word"))
            st = hf_bad(L->path, "added token \"%s\" strips spaces or matches single words only, which loom does "
                        "not support", c);
        else {
            /* a normalized one is found in normalized text, as its content normalized (Hugging Face's
             * default for a token that is not special); without a normalizer that is the content */
            struct bpe_added *t = &tok->added[tok->n_added];
            json_t *nz = json_object_get(v, "normalized");
            t->id = (int32_t)id;
            t->normalized = nz ? json_is_true(nz) : 1;
            t->len = strlen(c);
            t->bytes = t->normalized && tok->n_norm
                           ? (char *)bpe_normalize(tok, (const unsigned char *)c, t->len, 0, &t->len)
                           : strdup(c);
            if (!t->bytes || !t->len) {
                st = t->bytes ? hf_bad(L->path, "added token \"%s\" normalizes to nothing", c)
                              : loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
                free(t->bytes);
            } else {
                tok->n_added++;
                tok->added_first[(unsigned char)t->bytes[0]] = 1;
            }
        }
    }
    const char *key;
    json_object_foreach(vocab, key, v) {
        if (st != LOOM_OK) break;
        size_t id = (size_t)json_integer_value(v);
        if (src[id])
            st = hf_bad(L->path, "vocabulary entries \"%s\" and \"%s\" have the same id %zu", src[id], key, id);
        else if (L->sp || spell_bytes(L, key, strlen(key), NULL) >= 0) kind[id] = ID_SPELLED;
        else if (extra[id] && !strcmp(extra[id], key)) kind[id] = ID_RAW;
        else
            st = hf_bad(L->path, "vocabulary entry \"%s\" (id %zu) is not spelled in GPT-2's byte alphabet: not a "
                        "byte-level BPE (nor SentencePiece-style: its byte_fallback is not true)", key, id);
        src[id] = key;
    }
    for (size_t id = 0; st == LOOM_OK && id < V; id++) {
        if (extra[id] && src[id] && strcmp(src[id], extra[id]))
            st = hf_bad(L->path, "added token \"%s\" has id %zu, which the vocabulary gives \"%s\"", extra[id], id,
                        src[id]);
        if (extra[id] && !src[id]) { /* outside the merges' vocabulary */
            src[id] = extra[id];
            kind[id] = ID_RAW;
        }
        if (!src[id]) tok->special[id] = 1; /* no token: empty, never made */
        tok->tok_off[id + 1] = tok->tok_off[id] + token_text(L, kind[id], src[id], NULL);
    }
    if (st == LOOM_OK && !(tok->arena = malloc(tok->tok_off[V] + 1)))
        st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
    for (size_t id = 0; st == LOOM_OK && id < V; id++) token_text(L, kind[id], src[id], tok->arena + tok->tok_off[id]);
    for (int b = 0; st == LOOM_OK && b < 256; b++) {
        char s[8] = {L->bc.s[b][0], L->bc.len[b] > 1 ? L->bc.s[b][1] : 0, 0};
        if (L->sp) snprintf(s, sizeof s, "<0x%02X>", b);
        /* with byte fallback a missing byte token makes its character the unknown token */
        if ((tok->byte_id[b] = vocab_id(vocab, s)) < 0 && !(L->sp && tok->unk >= 0))
            st = hf_bad(L->path, "byte 0x%02x (\"%s\") is not in the vocabulary: a %s", b, s,
                        L->sp ? "BPE with byte fallback and no unk_token has all 256" : "byte-level BPE has all 256");
    }
    /* whole pieces, for ignore_merges, by their bytes; with sp, every
     * vocabulary string as written (the characters a text starts from) */
    for (size_t id = 0; (tok->ignore_merges || L->sp) && st == LOOM_OK && id < V; id++) {
        if (kind[id] != ID_SPELLED || tok->special[id]) continue; /* text never makes a special token */
        int inserted;
        int64_t e = L->sp ? io_bytesmap_insert(&tok->whole, src[id], strlen(src[id]), &inserted)
                          : io_bytesmap_insert(&tok->whole, tok->arena + tok->tok_off[id],
                                               tok->tok_off[id + 1] - tok->tok_off[id], &inserted);
        if (e < 0) st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
        else tok->whole_id[e] = (int32_t)id;
    }
    free(src);
    free(extra);
    free(kind);
    return st;
}

/* Merge r: "a b" or ["a", "b"]; its parts and their concatenation are
 * vocabulary tokens. */
static loom_status merges(hf_load *L, json_t *vocab, json_t *list) {
    loom_tokenizer *tok = L->tok;
    char *joined = NULL;
    size_t cap = 0;
    loom_status st = LOOM_OK;
    for (int r = 0; st == LOOM_OK && r < tok->n_merges; r++) {
        json_t *m = json_array_get(list, (size_t)r);
        const char *a = NULL, *b = NULL;
        size_t la = 0;
        if (json_is_string(m)) {
            const char *s = json_string_value(m), *sp = strchr(s, ' ');
            if (sp && !strchr(sp + 1, ' ')) {
                a = s;
                la = (size_t)(sp - s);
                b = sp + 1;
            }
        } else if (json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            la = strlen(a);
            b = json_string_value(json_array_get(m, 1));
        }
        if (!a || !la || !*b) {
            st = hf_bad(L->path, "merge %d is not \"a b\" or [\"a\", \"b\"]", r);
            break;
        }
        size_t lb = strlen(b);
        if (la + lb + 1 > cap) {
            cap = 2 * (la + lb + 1);
            char *p = realloc(joined, cap);
            if (!p) {
                st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
                break;
            }
            joined = p;
        }
        memcpy(joined, a, la);
        joined[la] = 0;
        int32_t ia = vocab_id(vocab, joined), ib = vocab_id(vocab, b);
        memcpy(joined + la, b, lb + 1);
        int32_t id = vocab_id(vocab, joined);
        if (ia < 0 || ib < 0 || id < 0) {
            st = hf_bad(L->path, "merge %d (\"%.*s\" + \"%s\") uses or makes a token not in the vocabulary", r,
                        (int)la, a, b);
            break;
        }
        if (tok->special[id]) {
            st = hf_bad(L->path, "merge %d makes the special token \"%s\", which text must never make", r, joined);
            break;
        }
        tok->merges[2 * r] = ia;
        tok->merges[2 * r + 1] = ib;
        tok->merged[r] = id;
        int inserted;
        int64_t *slot = io_u64map_upsert(&tok->ranks, (uint64_t)(uint32_t)ia << 32 | (uint32_t)ib, r, &inserted);
        if (!slot) st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
        else if (!inserted) st = hf_bad(L->path, "merge %d repeats merge %lld", r, (long long)*slot);
    }
    free(joined);
    return st;
}

/* A Unicode normal form's name, or BPE_FORM_NONE. */
static enum bpe_form form_of(const char *t) {
    return !strcmp(t, "NFC") ? BPE_NFC : !strcmp(t, "NFD") ? BPE_NFD : !strcmp(t, "NFKC") ? BPE_NFKC
         : !strcmp(t, "NFKD") ? BPE_NFKD : BPE_FORM_NONE;
}

/* Gemma's pre-tokenizer splits on a string (a space) that its normalizer
 * has already replaced everywhere, the last step to touch it: it finds
 * nothing, and so does nothing. */
static int sp_split_is_noop(json_t *pre, json_t *norm) {
    const char *pat = json_string_value(json_object_get(json_object_get(pre, "pattern"), "String"));
    /* one character (a longer pattern could be joined again from its neighbours), not inverted */
    if (strcmp(type_of(pre), "Split") || !pat || !*pat || !unset(pre, "invert")) return 0;
    size_t n = strlen(pat);
    if (n > 4 || (n > 1 && ((unsigned char)pat[0] & 0xC0) != 0xC0)) return 0;
    for (size_t i = 1; i < n; i++)
        if (((unsigned char)pat[i] & 0xC0) != 0x80) return 0;
    json_t *one[1] = {norm}, *list = json_object_get(norm, "normalizers");
    size_t steps = !strcmp(type_of(norm), "Sequence") ? json_array_size(list) : 1;
    int gone = 0;
    for (size_t i = 0; i < steps; i++) {
        json_t *step = strcmp(type_of(norm), "Sequence") ? one[0] : json_array_get(list, i);
        const char *a = json_string_value(json_object_get(json_object_get(step, "pattern"), "String"));
        const char *b = json_string_value(json_object_get(step, "content"));
        const char *p = json_string_value(json_object_get(step, "prepend"));
        if (!strcmp(type_of(step), "Replace") && a && b && !strcmp(a, pat) && !strstr(b, pat)) gone = 1;
        /* brought back (a normal form may make the character of others) */
        else if ((b && strstr(b, pat)) || (p && strstr(p, pat)) || form_of(type_of(step))) gone = 0;
    }
    return gone;
}

/* Metaspace (transformers' legacy=False conversions of SentencePiece
 * models): the replacement (U+2581), where it goes first (prepend_scheme
 * "always", "first" or "never"; the older add_prefix_space: always or
 * never), and whether it splits the text (split, true when absent). */
static loom_status metaspace(hf_load *L, json_t *pre) {
    loom_tokenizer *tok = L->tok;
    const char *rep = json_string_value(json_object_get(pre, "replacement"));
    json_t *scheme = json_object_get(pre, "prepend_scheme"), *aps = json_object_get(pre, "add_prefix_space");
    json_t *split = json_object_get(pre, "split");
    const char *sc = json_string_value(scheme);
    tok->meta = sc ? (!strcmp(sc, "always") ? META_ALWAYS : !strcmp(sc, "first") ? META_FIRST
                      : !strcmp(sc, "never") ? META_NEVER : META_NONE)
                   : json_is_boolean(aps) ? (json_is_true(aps) ? META_ALWAYS : META_NEVER) : META_ALWAYS;
    if (!rep || !*rep || strlen(rep) >= sizeof tok->meta_rep || tok->meta == META_NONE ||
        (split && !json_is_boolean(split)))
        return hf_bad(L->path, "its Metaspace pre-tokenizer is not one loom reads (a replacement of at most %zu bytes, "
                      "prepend_scheme always, first or never, split true or false)", sizeof tok->meta_rep - 1);
    memcpy(tok->meta_rep, rep, strlen(rep) + 1);
    tok->meta_rep_len = strlen(rep);
    tok->meta_split = !split || json_is_true(split);
    return LOOM_OK;
}

/* The normalizer's steps, alone or in a Sequence: Unicode normal forms (NFC,
 * NFD, NFKC, NFKD: Qwen 2's NFC), and for a SentencePiece-style file also
 * Prepend and Replace of a String (Llama 2's: prepend "▁", then spaces to
 * "▁"). */
static loom_status normalizer(hf_load *L, json_t *n) {
    loom_tokenizer *tok = L->tok;
    if (!n || json_is_null(n)) return LOOM_OK;
    json_t *one[1] = {n}, *list = json_object_get(n, "normalizers");
    int seq = !strcmp(type_of(n), "Sequence");
    if (seq && !json_is_array(list)) return hf_bad(L->path, "its normalizer is a Sequence without \"normalizers\"");
    size_t count = seq ? json_array_size(list) : 1;
    for (size_t i = 0; i < count; i++) {
        json_t *step = seq ? json_array_get(list, i) : one[0];
        const char *t = type_of(step), *a = NULL, *b = "";
        enum bpe_form form = form_of(t);
        int prepend = L->sp && !strcmp(t, "Prepend");
        if (prepend) a = json_string_value(json_object_get(step, "prepend"));
        else if (L->sp && !strcmp(t, "Replace")) {
            a = json_string_value(json_object_get(json_object_get(step, "pattern"), "String"));
            b = json_string_value(json_object_get(step, "content"));
        }
        if (tok->n_norm == BPE_MAX_NORM || (!form && (!a || !*a || !b || strlen(a) > 64 || strlen(b) > 64)))
            return hf_bad(L->path, "its normalizer step \"%s\" is not one loom applies (NFC, NFD, NFKC, NFKD%s; at "
                          "most %d steps)", t, L->sp ? ", Prepend, Replace of a String of at most 64 bytes" : "",
                          BPE_MAX_NORM);
        struct bpe_norm *nm = &tok->norm[tok->n_norm++];
        nm->form = form;
        if (form) continue;
        nm->prepend = prepend;
        nm->na = strlen(a);
        nm->nb = strlen(b);
        nm->a = strdup(a);
        nm->b = strdup(b);
        if (!nm->a || !nm->b) return loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
    }
    return LOOM_OK;
}

loom_status bpe_tokenizer_load_hf(const char *path, const void *root_v, loom_tokenizer **out) {
    json_t *root = (json_t *)root_v;
    *out = NULL;
    json_t *model = json_object_get(root, "model"), *vocab = json_object_get(model, "vocab");
    json_t *list = json_object_get(model, "merges"), *added = json_object_get(root, "added_tokens");
    json_t *pre = json_object_get(root, "pre_tokenizer"), *dec = json_object_get(root, "decoder");
    if (strcmp(type_of(model), "BPE"))
        return hf_bad(path, "its model is \"%s\"; loom reads BPE only (byte-level or SentencePiece-style)",
                      type_of(model));
    int sp = json_is_true(json_object_get(model, "byte_fallback"));
    if (!sp && !unset(model, "byte_fallback")) return hf_bad(path, "its \"byte_fallback\" is not true or false");
    if (!unset(model, "continuing_subword_prefix") || !unset(model, "end_of_word_suffix") || !unset(model, "dropout"))
        return hf_bad(path, "its BPE has word affixes or dropout, which loom does not support");
    json_t *norm = json_object_get(root, "normalizer");
    if (!json_is_object(vocab) || !json_is_array(list))
        return hf_bad(path, "its model has no \"vocab\" object or no \"merges\" array");
    if (added && !json_is_array(added)) return hf_bad(path, "\"added_tokens\" is not an array");
    if (sp) { /* SentencePiece-style: the spaces are the normalizer's or a Metaspace pre-tokenizer's */
        if (pre && !json_is_null(pre) && !sp_split_is_noop(pre, norm) && strcmp(type_of(pre), "Metaspace"))
            return hf_bad(path, "it is a SentencePiece-style BPE with a pre-tokenizer (\"%s\"); loom reads those "
                          "with none, a Metaspace, or a Split on what the normalizer has replaced", type_of(pre));
        if (json_is_true(json_object_get(model, "ignore_merges")))
            return hf_bad(path, "it is a SentencePiece-style BPE with ignore_merges, which loom does not support");
    } else {
        if (!json_is_object(pre)) return hf_bad(path, "it has no pre-tokenizer; a byte-level BPE has ByteLevel");
        if (dec && !json_is_null(dec) && strcmp(type_of(dec), "ByteLevel"))
            return hf_bad(path, "its decoder is \"%s\", not ByteLevel", type_of(dec));
    }
    if (json_array_size(list) > (1u << 24)) return hf_bad(path, "it has more than 2^24 merges");
    hf_load L = {.path = path, .sp = sp};
    bpe_byte_chars_init(&L.bc);
    for (int cp = 0; cp < 512; cp++) L.byte_of[cp] = -1;
    for (int b = 0; b < 256; b++) {
        const unsigned char *c = (const unsigned char *)L.bc.s[b];
        L.byte_of[L.bc.len[b] == 1 ? c[0] : (c[0] & 0x1Fu) << 6 | (c[1] & 0x3Fu)] = b;
    }
    int V = 0;
    LOOM_TRY(count_ids(&L, vocab, added, &V));
    L.tok = bpe_tokenizer_alloc(V, (int)json_array_size(list));
    if (!L.tok) return loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", path);
    loom_tokenizer *tok = L.tok;
    tok->hf = 1;
    tok->sp = sp;
    tok->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    loom_status st = LOOM_OK;
    json_t *unk = json_object_get(model, "unk_token");
    tok->unk = sp && json_is_string(unk) ? vocab_id(vocab, json_string_value(unk)) : -1;
    tok->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    if ((tok->ignore_merges || sp) && !(tok->whole_id = malloc((size_t)V * sizeof *tok->whole_id)))
        st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", path);
    if (st == LOOM_OK) st = normalizer(&L, norm);
    if (st == LOOM_OK && sp && !strcmp(type_of(pre), "Metaspace")) st = metaspace(&L, pre);
    if (st == LOOM_OK && !sp) st = pre_tokenizer(&L, pre);
    if (st == LOOM_OK && !sp && !tok->n_splits) /* a whole document would be one piece */
        st = hf_bad(path, "its pre-tokenizer does not split the text (ByteLevel without use_regex, and no Split)");
    if (st == LOOM_OK) st = token_bytes(&L, vocab, added);
    if (st == LOOM_OK) st = merges(&L, vocab, list);
    if (st == LOOM_OK) {
        static const char *const ends[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>",
                                           "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"};
        for (size_t i = 0; i < sizeof ends / sizeof *ends && tok->eot < 0; i++) {
            int32_t id = added_id(added, ends[i]);
            if (id >= 0 && tok->special[id]) tok->eot = id;
        }
        int32_t bos = template_bos(json_object_get(root, "post_processor"), added, V);
        static const char *const begins[] = {"<|begin_of_text|>", "<s>", "<bos>",
                                             "<\xef\xbd\x9c" "begin\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"};
        for (size_t i = 0; i < sizeof begins / sizeof *begins && bos == NO_TEMPLATE; i++) {
            int32_t id = added_id(added, begins[i]);
            if (id >= 0 && tok->special[id]) bos = id;
        }
        tok->bos = bos >= 0 ? bos : tok->eot;
    }
    if (st != LOOM_OK) {
        loom_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return LOOM_OK;
}
