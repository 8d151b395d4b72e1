/*
 * io_internal.h — private helpers shared by the io sources (and their tests):
 * failure injection for the atomic writer, read-only file mappings, the
 * hash maps behind the tokenizer, and the tokenizer's pre-splitter.
 * Nothing here is public API; names carry an `io_` or `bpe_` prefix.
 */
#ifndef LOOM_IO_INTERNAL_H
#define LOOM_IO_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "loom/io.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "loom's file formats are little-endian; this host is not"
#endif

/* ------------------------------------------------------ failure injection */

/* Points in the atomic writer where a test can force a failure. */
typedef enum io_fail_point {
    IO_FAIL_NONE = 0,
    IO_FAIL_OPEN,   /* creating the temporary file */
    IO_FAIL_WRITE,  /* a write(2) of the temporary file */
    IO_FAIL_FSYNC,  /* fsync of the temporary file */
    IO_FAIL_RENAME  /* rename over the target */
} io_fail_point;

/* Make the (skip + 1)-th call at `point` on this thread fail with errno
 * `err` (ENOSPC, EIO, ...), once. IO_FAIL_NONE disarms. Test-only. */
void io_test_inject_failure(io_fail_point point, int skip, int err);

/* ------------------------------------------------------- mapped files */

/* A whole file, read-only: memory-mapped, or read into a malloc'd buffer
 * when mapping is not possible (an empty file has data == NULL). */
typedef struct io_mapped {
    const unsigned char *data;
    size_t size;
    int is_mmap;
} io_mapped;

/* Errors: LOOM_ERR_IO naming `path` (`what` says what kind of file was
 * expected, e.g. "safetensors file"). */
loom_status io_map_file(const char *path, const char *what, io_mapped *m);
void io_unmap_file(io_mapped *m);
/* Hand back the whole pages of [p, p + n) (inside m's data) that the
 * process holds of a mapped file: what was read from them has been copied
 * out, and reading them again faults them back in from the file. So a
 * reader's resident memory counts what it keeps, not every page of the
 * file it went through. Nothing for a file read into memory. */
void io_mapped_drop(const io_mapped *m, const void *p, size_t n);
/* io_mapped_drop of m's data from the page holding p (all read) to end. */
void io_mapped_drop_to(const io_mapped *m, const void *p, const void *end);
/* Hand back the pages of a shard's tokens (a mask's bytes) before end,
 * from the page holding first on: the data loader's, behind its position,
 * where everything before end has been read (so the page where first
 * lies, begun before it, is done with too). */
void io_shard_drop(const loom_shard *s, size_t first, size_t end);
void io_mask_drop(const loom_mask *m, size_t first, size_t end);

/* fsync the directory holding `path`, so a rename in it is durable: 0, or
 * the errno (file systems that cannot sync a directory count as 0). */
int io_fsync_parent(const char *path);

/* LOOM_ERR_FORMAT naming the file, the tensor and the first element that is
 * NaN or Inf among v[0 .. n); LOOM_OK when all are finite. */
/* The length of <base> when name is "<base>.tmp.<pid>" (what
 * loom_file_write_atomic and a checkpoint save write first) and process pid
 * is gone; 0 otherwise (another name, or a writer still alive). */
size_t io_dead_temporary(const char *name);
/* Remove dir/<name>.tmp.<pid> for each of names whose writer is gone. */
void io_remove_dead_temporaries(const char *dir, const char *const *names, int n_names);

/* loom_read_file, its errors naming the file as `what` ("config"). */
loom_status io_read_file(const char *path, const char *what, void **data, size_t *len);

loom_status io_check_finite(const float *v, size_t n, const char *path, const char *name);

typedef struct loom_llama loom_llama;
/* The widest full (unsplit) tensor among m->params[0 .. n), in elements
 * (at least 1): the size of a buffer any of them can be gathered into. */
size_t io_widest_param(const loom_llama *m, int n);

/* loom_dataloader_fingerprint with another budget of tokens hashed whole
 * (the tests' way to the sampled shards without 256 MiB of them). */
loom_status dataloader_fingerprint_budget(const loom_dataloader *dl, size_t full_tokens, uint64_t *out);

/* Format the errno `err` of a failed write of `path` into a message suffix
 * with a hint ("disk full?" for ENOSPC/EDQUOT). */
const char *io_write_hint(int err);

/* ------------------------------------------------------------ hash maps */

/* uint64 key -> int64 value, open addressing. Key UINT64_MAX is reserved. */
typedef struct io_u64map {
    uint64_t *keys;
    int64_t *values;
    size_t cap, n; /* cap is a power of two (or 0) */
} io_u64map;

void io_u64map_free(io_u64map *m);
/* The value slot for `key`, or NULL when absent. */
int64_t *io_u64map_find(const io_u64map *m, uint64_t key);
/* The value slot for `key`, inserted with `init` when absent; NULL when out
 * of memory. *inserted (may be NULL) tells which. Pointers into the map are
 * invalidated by the next insertion. */
int64_t *io_u64map_upsert(io_u64map *m, uint64_t key, int64_t init, int *inserted);

/* Byte-string keys -> dense entry index 0..n-1 in insertion order. The map
 * copies each key into its own arena. */
typedef struct io_bytesmap {
    int32_t *slots;      /* entry index + 1, 0 = empty */
    uint64_t *hashes;    /* hash of each entry (by entry index) */
    size_t *key_off;     /* arena offset of each entry's key */
    uint32_t *key_len;
    char *arena;
    size_t arena_len, arena_cap;
    size_t cap, n, entries_cap;
} io_bytesmap;

void io_bytesmap_free(io_bytesmap *m);
void io_bytesmap_clear(io_bytesmap *m);
/* Entry index of the key, or -1 when absent. */
int64_t io_bytesmap_find(const io_bytesmap *m, const void *key, size_t len);
/* Entry index of the key, inserted when absent (*inserted says so); -1 when
 * out of memory. */
int64_t io_bytesmap_insert(io_bytesmap *m, const void *key, size_t len, int *inserted);

/* ----------------------------------------------------------- tokenizer */

#define BPE_MAX_CHUNK 128
#define BPE_MAX_SPLITS 4 /* regular expressions a Hugging Face pre-tokenizer may chain */
#define BPE_MAX_NORM 8   /* steps a Hugging Face normalizer may chain */
/* Unicode's normal forms, as Hugging Face's normalizers of those names apply them. */
enum bpe_form { BPE_FORM_NONE, BPE_NFC, BPE_NFD, BPE_NFKC, BPE_NFKD };

/* The tokenizer: loom's own (ids 0..255 the bytes, 256 + r merge r, then
 * "<|endoftext|>") or a Hugging Face byte-level BPE (tokenizer_hf.c), whose
 * ids are the file's. */
struct loom_tokenizer {
    int n_merges, vocab_size, eot, bos;
    int32_t *merges;      /* (n_merges, 2): the pair merge r joins, in rank order */
    int32_t *merged;      /* (n_merges): the id merge r makes */
    int32_t byte_id[256]; /* the id of each single byte */
    size_t *tok_off;      /* (vocab_size + 1): id i is arena[tok_off[i] .. tok_off[i+1]) */
    char *arena;
    unsigned char *special; /* (vocab_size): 1 for a special token (never produced by encode) */
    io_u64map ranks;      /* (a << 32 | b) -> r */
    /* Hugging Face pre-tokenization: the text is split by each regular
     * expression in turn (matches and the gaps between them become pieces);
     * n_splits == 0 is loom's own pre-split (bpe_chunk_len). */
    void *splits[BPE_MAX_SPLITS]; /* pcre2_code_8 * */
    void *match[BPE_MAX_SPLITS];  /* pcre2_match_data_8 * for each */
    int n_splits;
    int hf;               /* read from a Hugging Face file: pre-split by splits only (none: one piece) */
    /* SentencePiece-style BPE (Hugging Face's byte_fallback files: Llama 2,
     * Mistral): the normalizer's steps, then the whole text is one piece of
     * characters, each the vocabulary's token for it or its bytes'
     * <0xXX> tokens; `whole` maps every vocabulary string to its entry. */
    int sp;
    /* sp: a Metaspace pre-tokenizer (transformers' legacy=False files):
     * spaces become meta_rep, which is put before a piece that does not
     * start with it (every piece, or the text's first only), and with
     * meta_split each meta_rep starts a piece of its own. */
    enum { META_NONE, META_ALWAYS, META_FIRST, META_NEVER } meta;
    char meta_rep[8];
    size_t meta_rep_len;
    int meta_split;
    int32_t unk;          /* sp: a character some of whose bytes have no token is this (-1: none) */
    int fuse_unk;         /* sp: consecutive unknown characters are one */
    int n_norm;
    /* Hugging Face's added tokens that are not special: matched in text
     * before anything else (leftmost, longest), on the raw text or (normalized)
     * on the normalizer's output. */
    int n_added;
    struct bpe_added { int32_t id; int normalized; char *bytes; size_t len; } *added;
    unsigned char added_first[256]; /* 1 where some added token starts with that byte */
    /* The normalizer's steps, in order: prepend a, replace a by b, or (form)
     * a Unicode normal form (bpe_form). */
    struct bpe_norm { int prepend; enum bpe_form form; char *a, *b; size_t na, nb; } norm[BPE_MAX_NORM];
    int ignore_merges;    /* a piece the vocabulary spells whole is that one id */
    io_bytesmap whole;    /* with ignore_merges: spelling -> entry, whole_id[entry] the id */
    int32_t *whole_id;
    io_bytesmap cache;    /* chunk -> entry e, whose ids are cache_ids[cache_start[e] .. [e+1]) */
    int32_t *cache_ids;
    size_t *cache_start;
    size_t cache_ids_cap, cache_start_cap;
};

/* Length of the first pre-split chunk of s[0..n) (0 only when n == 0). */
size_t bpe_chunk_len(const unsigned char *s, size_t n);

/* GPT-2's byte alphabet: byte b is spelled s[b] (len[b] UTF-8 bytes, the
 * code point b for printable bytes, 256 + k for the k-th other byte). */
typedef struct bpe_byte_chars {
    char s[256][2];
    int len[256];
} bpe_byte_chars;
void bpe_byte_chars_init(bpe_byte_chars *bc);

/* Allocate the tables of a tokenizer of vocab_size ids and n_merges merges
 * (merges, merged, tok_off, special zeroed); NULL when out of memory. */
loom_tokenizer *bpe_tokenizer_alloc(int vocab_size, int n_merges);
/* A Hugging Face tokenizer's normalizer on s[0..n): a malloc'd result of
 * *out bytes (NULL when out of memory). With cont, Prepend steps are left
 * out (the text continues another); on empty text they do nothing. */
unsigned char *bpe_normalize(const loom_tokenizer *tok, const unsigned char *s, size_t n, int cont, size_t *out);
/* A Unicode normal form of s[0..n), malloc'd, *out
 * bytes; NULL when out of memory. Bytes that are not UTF-8 stay as they
 * are, and each stretch of UTF-8 between them is normalized apart. At most
 * BPE_FORM_GROWTH(form) times n bytes. */
unsigned char *bpe_unicode_form(const unsigned char *s, size_t n, enum bpe_form form, size_t *out);
/* The most a normal form multiplies UTF-8's length by (Unicode's bounds, UAX
 * #15: 3 for the canonical forms, 11 for the compatibility ones). */
#define BPE_FORM_GROWTH(form) ((form) >= BPE_NFKC ? 11u : 3u)
/* Parse a Hugging Face tokenizer.json (already parsed as root). */
loom_status bpe_tokenizer_load_hf(const char *path, const void *root, loom_tokenizer **out);

/* Build a tokenizer from validated merges (merges[2r], merges[2r+1] create
 * id 256 + r) with or without the end-of-text token. Takes nothing over. */
loom_status bpe_tokenizer_build(const int32_t *merges, int n_merges, int with_eot,
                                loom_tokenizer **out);

#endif
