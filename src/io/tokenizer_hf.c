/*
 * tokenizer_hf.c — a Hugging Face tokenizer.json of byte-level BPE (the
 * GPT-2 family: GPT-2, Llama 3, SmolLM and the like) read into loom's
 * tokenizer, so that models trained elsewhere can be tokenized for,
 * fine-tuned and sampled with their own vocabulary.
 *
 * What it reads: model "BPE" (vocab, merges as "a b" or ["a", "b"],
 * ignore_merges), no normalizer (or an empty Sequence), a pre-tokenizer that
 * is ByteLevel or a Sequence of regex Splits ("Isolated", or "Removed"
 * inverted) and Digits ending in ByteLevel, a ByteLevel
 * decoder, added tokens. Ids are the file's. The begin-of-text token is the
 * one the post-processor's template puts first, else the special token
 * "<|begin_of_text|>", "<s>" or DeepSeek's "<｜begin▁of▁sentence｜>"; the
 * end-of-text token is the special token "<|endoftext|>", "<|end_of_text|>",
 * "</s>" or "<｜end▁of▁sentence｜>"; with no begin-of-text token both are the
 * end-of-text token (GPT-2's convention). (tokenizer_config.json, which
 * names them too, is not read: the model directories loom writes carry
 * tokenizer.json alone.)
 *
 * Owns: the checks that make every id decodable and every merge's result a
 * vocabulary token. Must never: accept a file it would encode differently
 * from what it says (a normalizer, byte fallback, a prefix space, word
 * affixes: all refused by name), or produce a special token from text.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "io/io_internal.h"

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
 * (TemplateProcessing, alone or in a Sequence), or -1. */
static int32_t template_bos(json_t *post, json_t *added) {
    if (!strcmp(type_of(post), "Sequence")) {
        size_t i;
        json_t *p;
        json_array_foreach(json_object_get(post, "processors"), i, p) {
            int32_t id = template_bos(p, added);
            if (id >= 0) return id;
        }
        return -1;
    }
    if (strcmp(type_of(post), "TemplateProcessing")) return -1;
    json_t *first = json_object_get(json_array_get(json_object_get(post, "single"), 0), "SpecialToken");
    json_t *name = json_object_get(first, "id");
    if (!json_is_string(name)) return -1;
    json_t *ids = json_object_get(json_object_get(json_object_get(post, "special_tokens"), json_string_value(name)),
                                  "ids");
    if (json_array_size(ids) == 1 && json_is_integer(json_array_get(ids, 0)))
        return (int32_t)json_integer_value(json_array_get(ids, 0));
    return added_id(added, json_string_value(name));
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

static loom_status token_bytes(hf_load *L, json_t *vocab, json_t *added) {
    loom_tokenizer *tok = L->tok;
    size_t V = (size_t)tok->vocab_size;
    const char **src = calloc(V, sizeof *src);   /* id -> its string in the file */
    const char **extra = calloc(V, sizeof *extra); /* id -> an added token's content */
    unsigned char *kind = calloc(V, 1);
    loom_status st = src && extra && kind ? LOOM_OK : loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
    size_t i;
    json_t *v;
    json_array_foreach(added, i, v) {
        if (st != LOOM_OK) break;
        size_t id = (size_t)json_integer_value(json_object_get(v, "id"));
        const char *c = json_string_value(json_object_get(v, "content"));
        if (extra[id]) st = hf_bad(L->path, "added tokens \"%s\" and \"%s\" have the same id %zu", extra[id], c, id);
        extra[id] = c;
        tok->special[id] = json_is_true(json_object_get(v, "special"));
    }
    const char *key;
    json_object_foreach(vocab, key, v) {
        if (st != LOOM_OK) break;
        size_t id = (size_t)json_integer_value(v);
        if (src[id]) st = hf_bad(L->path, "vocabulary entries \"%s\" and \"%s\" have the same id %zu", src[id], key, id);
        else if (spell_bytes(L, key, strlen(key), NULL) >= 0) kind[id] = ID_SPELLED;
        else if (extra[id] && !strcmp(extra[id], key)) kind[id] = ID_RAW;
        else
            st = hf_bad(L->path, "vocabulary entry \"%s\" (id %zu) is not spelled in GPT-2's byte alphabet: not a "
                        "byte-level BPE (SentencePiece vocabularies are not supported)", key, id);
        src[id] = key;
    }
    for (size_t id = 0; st == LOOM_OK && id < V; id++) {
        if (extra[id] && src[id] && strcmp(src[id], extra[id]))
            st = hf_bad(L->path, "added token \"%s\" has id %zu, which the vocabulary gives \"%s\"", extra[id], id,
                        src[id]);
        if (extra[id] && !src[id]) {
            src[id] = extra[id];
            kind[id] = ID_RAW;
            tok->special[id] = 1; /* outside the merges' vocabulary: only ever given, never made from text */
        }
        if (!src[id]) tok->special[id] = 1; /* no token: empty, never made */
        size_t n = kind[id] == ID_SPELLED ? (size_t)spell_bytes(L, src[id], strlen(src[id]), NULL)
                   : kind[id] == ID_RAW  ? strlen(src[id])
                                         : 0;
        tok->tok_off[id + 1] = tok->tok_off[id] + n;
    }
    if (st == LOOM_OK && !(tok->arena = malloc(tok->tok_off[V] + 1)))
        st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", L->path);
    for (size_t id = 0; st == LOOM_OK && id < V; id++) {
        char *dst = tok->arena + tok->tok_off[id];
        if (kind[id] == ID_SPELLED) spell_bytes(L, src[id], strlen(src[id]), dst);
        else if (kind[id] == ID_RAW) memcpy(dst, src[id], strlen(src[id]));
    }
    for (int b = 0; st == LOOM_OK && b < 256; b++) {
        char s[3] = {L->bc.s[b][0], L->bc.len[b] > 1 ? L->bc.s[b][1] : 0, 0};
        if ((tok->byte_id[b] = vocab_id(vocab, s)) < 0)
            st = hf_bad(L->path, "byte 0x%02x (\"%s\") is not in the vocabulary: a byte-level BPE has all 256", b, s);
    }
    /* whole pieces, for ignore_merges: the vocabulary's tokens by their bytes */
    for (size_t id = 0; tok->ignore_merges && st == LOOM_OK && id < V; id++) {
        if (kind[id] != ID_SPELLED) continue;
        int inserted;
        int64_t e = io_bytesmap_insert(&tok->whole, tok->arena + tok->tok_off[id],
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

loom_status bpe_tokenizer_load_hf(const char *path, const void *root_v, loom_tokenizer **out) {
    json_t *root = (json_t *)root_v;
    *out = NULL;
    json_t *model = json_object_get(root, "model"), *vocab = json_object_get(model, "vocab");
    json_t *list = json_object_get(model, "merges"), *added = json_object_get(root, "added_tokens");
    json_t *pre = json_object_get(root, "pre_tokenizer"), *dec = json_object_get(root, "decoder");
    if (strcmp(type_of(model), "BPE"))
        return hf_bad(path, "its model is \"%s\"; loom reads byte-level BPE only", type_of(model));
    if (!unset(model, "byte_fallback"))
        return hf_bad(path, "it is a SentencePiece-style BPE (byte_fallback), which loom does not read; loom reads "
                      "byte-level BPE (GPT-2, Llama 3 and the like)");
    if (!unset(model, "continuing_subword_prefix") || !unset(model, "end_of_word_suffix") || !unset(model, "dropout"))
        return hf_bad(path, "its BPE has word affixes or dropout, which loom does not support");
    json_t *norm = json_object_get(root, "normalizer");
    if (!unset(root, "normalizer") &&
        !(!strcmp(type_of(norm), "Sequence") && json_array_size(json_object_get(norm, "normalizers")) == 0))
        return hf_bad(path, "it has a normalizer (\"%s\"), which loom does not apply", type_of(json_object_get(root, "normalizer")));
    if (!json_is_object(vocab) || !json_is_array(list))
        return hf_bad(path, "its model has no \"vocab\" object or no \"merges\" array");
    if (added && !json_is_array(added)) return hf_bad(path, "\"added_tokens\" is not an array");
    if (!json_is_object(pre)) return hf_bad(path, "it has no pre-tokenizer; a byte-level BPE has ByteLevel");
    if (dec && !json_is_null(dec) && strcmp(type_of(dec), "ByteLevel"))
        return hf_bad(path, "its decoder is \"%s\", not ByteLevel", type_of(dec));
    if (json_array_size(list) > (1u << 24)) return hf_bad(path, "it has more than 2^24 merges");
    hf_load L = {.path = path};
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
    tok->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    loom_status st = LOOM_OK;
    if (tok->ignore_merges && !(tok->whole_id = malloc((size_t)V * sizeof *tok->whole_id)))
        st = loom_error(LOOM_ERR_NOMEM, "out of memory loading '%s'", path);
    if (st == LOOM_OK) st = pre_tokenizer(&L, pre);
    if (st == LOOM_OK && !tok->n_splits) /* a whole document would be one piece, its BPE quadratic */
        st = hf_bad(path, "its pre-tokenizer does not split the text (ByteLevel without use_regex, and no Split)");
    if (st == LOOM_OK) st = token_bytes(&L, vocab, added);
    if (st == LOOM_OK) st = merges(&L, vocab, list);
    if (st == LOOM_OK) {
        static const char *const ends[] = {"<|endoftext|>", "<|end_of_text|>", "</s>",
                                           "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"};
        for (size_t i = 0; i < sizeof ends / sizeof *ends && tok->eot < 0; i++) {
            int32_t id = added_id(added, ends[i]);
            if (id >= 0 && tok->special[id]) tok->eot = id;
        }
        int32_t bos = template_bos(json_object_get(root, "post_processor"), added);
        static const char *const begins[] = {"<|begin_of_text|>", "<s>",
                                             "<\xef\xbd\x9c" "begin\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"};
        for (size_t i = 0; i < sizeof begins / sizeof *begins && (bos < 0 || bos >= V); i++) {
            int32_t id = added_id(added, begins[i]);
            if (id >= 0 && tok->special[id]) bos = id;
        }
        tok->bos = bos >= 0 && bos < V ? bos : tok->eot;
        if (tok->bos >= 0) tok->special[tok->bos] = 1;
    }
    if (st != LOOM_OK) {
        loom_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return LOOM_OK;
}
