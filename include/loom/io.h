/*
 * loom/io.h — files: atomic writes, safetensors, llm.c token shards and the
 * data loader, the byte-level BPE tokenizer.
 *
 * Conventions (as in loom/core.h): every function that can fail returns a
 * loom_status; on failure loom_last_error() names the file (and the tensor,
 * token or position) involved, what was wrong and what to do. No function
 * here aborts on bad input or a bad file: corrupt files give
 * LOOM_ERR_FORMAT, failed reads/writes LOOM_ERR_IO, bad arguments
 * LOOM_ERR_INVALID, allocation failures LOOM_ERR_NOMEM.
 *
 * Ownership: an object returned through `**out` by an _open/_init/_train/
 * _load function belongs to the caller, who releases it with the matching
 * _close/_free (which accept NULL). On failure `*out` is set to NULL and
 * nothing needs releasing. Pointers an object hands out (names, tensor data,
 * token bytes) stay valid until that object is released. Handles are not
 * thread-safe: use one handle per thread or lock around it.
 */
#ifndef LOOM_IO_H
#define LOOM_IO_H

#include <stddef.h>
#include <stdint.h>

#include "loom/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================ plain files */

/* Read a whole file. On success *data is a malloc'd buffer of *len bytes
 * followed by one extra '\0' (so text can be used as a C string); the caller
 * releases it with free(). On failure *data is NULL and *len is 0.
 * Errors: LOOM_ERR_IO (missing, unreadable, a directory), LOOM_ERR_NOMEM. */
loom_status loom_read_file(const char *path, void **data, size_t *len);

/* Replace `path` with exactly `n` bytes of `data`, atomically: the bytes go
 * to "<path>.tmp.<pid>", which is flushed, fsynced and renamed over `path`,
 * then the directory is fsynced. A reader sees the old file or the new one,
 * never a mix, even across a crash. On any failure the temporary file is
 * removed and an existing `path` is left untouched.
 * Errors: LOOM_ERR_IO (a message naming the file; "disk full?" when the
 * device is out of space). Two writers of the same path in one process must
 * not overlap (they would share the temporary name). */
loom_status loom_file_write_atomic(const char *path, const void *data, size_t n);
/* Replace `to` with a copy of the file `from`, atomically as above. */
loom_status loom_file_copy_atomic(const char *from, const char *to);

/* Remove `path` (a missing one is fine), then fsync its directory so the
 * removal, and every rename made in that directory before it, is durable.
 * Errors: LOOM_ERR_IO, naming the file. */
loom_status loom_file_remove_durable(const char *path);

/* A shard directory holding this file is being written by `loom tokenize`
 * (or was, by one that crashed): its shards and tokenizer may be a mix of
 * two runs, so data loaders refuse it until a tokenize completes there. */
#define LOOM_SHARDS_INCOMPLETE ".tokenize-incomplete"

/* The streaming form of loom_file_write_atomic, for files written in parts
 * (checkpoints). Open creates the temporary file; write appends; commit
 * flushes, fsyncs, renames over the target and fsyncs the directory; abort
 * removes the temporary file. Commit and abort always release the handle,
 * whatever they return. After a failed write, later writes and commit
 * return that first error again (commit then removes the temporary file).
 * One case leaves the new file in place yet returns LOOM_ERR_IO: the rename
 * succeeded but the directory could not be fsynced. */
typedef struct loom_atomic_file loom_atomic_file;
loom_status loom_atomic_file_open(const char *path, loom_atomic_file **out);
loom_status loom_atomic_file_write(loom_atomic_file *f, const void *data, size_t n);
loom_status loom_atomic_file_commit(loom_atomic_file *f);
void loom_atomic_file_abort(loom_atomic_file *f);

/* ============================================================ safetensors */

/* The element types a safetensors file may hold. loom_safetensors_read
 * converts the float, integer and bool types to f32/bf16/f16 (rounding to
 * nearest); the FP8 types are listed, sized and validated but not converted. */
typedef enum loom_safetensors_dtype {
    LOOM_SAFETENSORS_BOOL = 0,
    LOOM_SAFETENSORS_U8, LOOM_SAFETENSORS_I8,
    LOOM_SAFETENSORS_U16, LOOM_SAFETENSORS_I16,
    LOOM_SAFETENSORS_U32, LOOM_SAFETENSORS_I32,
    LOOM_SAFETENSORS_U64, LOOM_SAFETENSORS_I64,
    LOOM_SAFETENSORS_F16, LOOM_SAFETENSORS_BF16,
    LOOM_SAFETENSORS_F32, LOOM_SAFETENSORS_F64,
    LOOM_SAFETENSORS_F8_E4M3, LOOM_SAFETENSORS_F8_E5M2,
    LOOM_SAFETENSORS_N_DTYPES
} loom_safetensors_dtype;

#define LOOM_SAFETENSORS_MAX_DIMS 8

/* The file's name for a dtype ("F32", "BF16", ...), "?" if out of range. */
const char *loom_safetensors_dtype_name(loom_safetensors_dtype dt);
/* Bytes per element (0 if out of range). */
size_t loom_safetensors_dtype_size(loom_safetensors_dtype dt);
/* The safetensors dtype of a loom compute dtype (F32, BF16, F16). */
loom_safetensors_dtype loom_safetensors_dtype_of(loom_dtype dt);

/* One tensor as stored. `name` and `data` point into the open file and stay
 * valid until loom_safetensors_close. `data` holds `n_bytes` little-endian
 * bytes and may be unaligned in files other writers produced. */
typedef struct loom_safetensors_tensor {
    const char *name;
    loom_safetensors_dtype dtype;
    int ndim;                                  /* 0 (a scalar) .. MAX_DIMS */
    int64_t shape[LOOM_SAFETENSORS_MAX_DIMS];  /* shape[ndim..] are 0 */
    size_t n_elements;                         /* product of shape (1 for a scalar) */
    size_t n_bytes;
    const void *data;
} loom_safetensors_tensor;

typedef struct loom_safetensors loom_safetensors;

/* Open and validate a safetensors file: the header length against the file
 * size, the JSON (syntax, duplicate keys, field types), each tensor's dtype,
 * shape and data_offsets (in range, size == product(shape) * dtype size, no
 * overlap, no gap, covering the whole byte buffer), and __metadata__ (string
 * values only). The file is memory-mapped (read into memory if it cannot be):
 * do not truncate or rewrite it in place while it is open (loom's writers
 * replace files by rename, which is safe).
 * Errors: LOOM_ERR_IO (cannot open/read), LOOM_ERR_FORMAT (anything wrong in
 * the file: the message names the file and the tensor), LOOM_ERR_NOMEM. */
loom_status loom_safetensors_open(const char *path, loom_safetensors **out);
/* Unmap and release everything (NULL is a no-op). */
void loom_safetensors_close(loom_safetensors *st);

/* Number of tensors; tensors are indexed 0..count-1 in the order of their
 * data in the file. */
size_t loom_safetensors_count(const loom_safetensors *st);
/* Tensor i (i < count), or LOOM_ERR_INVALID. */
loom_status loom_safetensors_at(const loom_safetensors *st, size_t i, loom_safetensors_tensor *out);
/* The tensor called `name`. Errors: LOOM_ERR_INVALID when there is none (the
 * message names the file). */
loom_status loom_safetensors_get(const loom_safetensors *st, const char *name,
                                 loom_safetensors_tensor *out);
/* 1 if the file holds a tensor called `name`, else 0. */
int loom_safetensors_has(const loom_safetensors *st, const char *name);

/* Read tensor `name` into `dst` (room for its elements in dtype `dt`),
 * converting (round to nearest even) from the stored type. `shape`/`ndim`
 * are what the caller expects; a different shape is LOOM_ERR_INVALID with a
 * message giving both shapes. Pass shape == NULL to skip the check (then dst
 * must hold n_elements). Once copied, the tensor's whole mapped pages are
 * handed back (madvise), so reading a large file tensor by tensor holds
 * one copy of it, not two; a `data` pointer from loom_safetensors_get
 * stays valid (its pages fault back in from the file). Errors:
 * LOOM_ERR_INVALID (no such tensor, shape mismatch), LOOM_ERR_UNSUPPORTED
 * (an FP8 tensor). */
loom_status loom_safetensors_read(const loom_safetensors *st, const char *name, loom_dtype dt,
                                  const int64_t *shape, int ndim, void *dst);
/* Rows row0 .. row0 + n_rows of tensor `name`, which must be (rows, cols),
 * into dst (room for n_rows x cols in dtype dt), as loom_safetensors_read
 * converts them (the rows' pages handed back): one part of a fused tensor,
 * as Phi-3's qkv_proj. Errors: those of loom_safetensors_read, and
 * LOOM_ERR_INVALID for rows outside the tensor. */
loom_status loom_safetensors_read_rows(const loom_safetensors *st, const char *name, loom_dtype dt, int64_t rows,
                                       int64_t cols, int64_t row0, int64_t n_rows, void *dst);

/* __metadata__ entries. The value for `key` or NULL if absent; entry i
 * (i < metadata_count) through *key / *value. Strings are owned by st. */
const char *loom_safetensors_metadata(const loom_safetensors *st, const char *key);
size_t loom_safetensors_metadata_count(const loom_safetensors *st);
loom_status loom_safetensors_metadata_at(const loom_safetensors *st, size_t i,
                                         const char **key, const char **value);

/* The writer: collect tensors (in the order they will be stored) and
 * metadata, then write the file atomically (as loom_file_write_atomic). The
 * header JSON is padded with spaces to a multiple of 8 bytes so every
 * tensor's data starts 8-byte aligned relative to the buffer. */
typedef struct loom_safetensors_writer loom_safetensors_writer;
loom_status loom_safetensors_writer_init(loom_safetensors_writer **out);
void loom_safetensors_writer_free(loom_safetensors_writer *w);
/* Add a tensor. `name` and `shape` are copied; `data` (n_elements *
 * dtype_size bytes, little-endian) is borrowed and must stay valid until
 * loom_safetensors_writer_write returns. Errors: LOOM_ERR_INVALID (empty,
 * duplicate or reserved name "__metadata__", bad dtype, ndim or negative
 * dimension, NULL data for a non-empty tensor), LOOM_ERR_NOMEM. */
loom_status loom_safetensors_writer_add(loom_safetensors_writer *w, const char *name,
                                        loom_safetensors_dtype dtype, const int64_t *shape,
                                        int ndim, const void *data);
/* Add a tensor whose bytes a function makes when the file is written:
 * fill(user, dst, n_bytes) fills dst (n_elements * dtype_size bytes) and
 * returns LOOM_OK, or an error that stops the write (the old file stays).
 * Filled tensors pass through one writer buffer, one at a time, so a file
 * of computed tensors never holds them all in memory. `user` is borrowed:
 * it must stay valid until the last write returns. Errors as
 * loom_safetensors_writer_add. */
typedef loom_status (*loom_safetensors_fill_fn)(void *user, void *dst, size_t n_bytes);
loom_status loom_safetensors_writer_add_fill(loom_safetensors_writer *w, const char *name,
                                             loom_safetensors_dtype dtype, const int64_t *shape, int ndim,
                                             loom_safetensors_fill_fn fill, void *user);
/* Set a __metadata__ entry (copied; a second set of the same key replaces). */
loom_status loom_safetensors_writer_set_metadata(loom_safetensors_writer *w, const char *key,
                                                 const char *value);
/* Write everything to `path` atomically. The writer stays usable (it can
 * write the same content again). Errors: LOOM_ERR_IO (the old file is
 * untouched), LOOM_ERR_NOMEM. */
loom_status loom_safetensors_writer_write(loom_safetensors_writer *w, const char *path);

/* ======================================================= llm.c token shards */

/* A shard: a 1024-byte header of 256 little-endian int32 (header[0] magic,
 * header[1] version, header[2] token count) and then the tokens:
 *   magic 20240520, version 1: uint16 tokens (vocabularies up to 65536),
 *   magic 20240801, version 7: uint32 tokens. */
#define LOOM_SHARD_MAGIC_U16 20240520
#define LOOM_SHARD_VERSION_U16 1
#define LOOM_SHARD_MAGIC_U32 20240801
#define LOOM_SHARD_VERSION_U32 7
#define LOOM_SHARD_HEADER_BYTES 1024

/* Write `n` tokens atomically to `path`, as uint16 when vocab_size <= 65536,
 * else uint32; a loss mask of the shard it replaces (below) is removed.
 * Errors: LOOM_ERR_INVALID (a token outside [0, vocab_size): the message
 * gives its index; n above INT32_MAX), LOOM_ERR_IO. */
loom_status loom_shard_write(const char *path, const int32_t *tokens, size_t n, int vocab_size);

typedef struct loom_shard loom_shard;
/* Open (memory-map) and validate a shard: magic/version pair, a
 * non-negative count and a file size of exactly header + count * token size.
 * As with safetensors, do not rewrite the file in place while it is open.
 * Errors: LOOM_ERR_IO, LOOM_ERR_FORMAT (the message names the file). */
loom_status loom_shard_open(const char *path, loom_shard **out);
void loom_shard_close(loom_shard *s);
size_t loom_shard_count(const loom_shard *s);
/* 2 (uint16 tokens) or 4 (uint32 tokens). */
int loom_shard_token_bytes(const loom_shard *s);

/* Loss masks, for supervised fine-tuning: beside shard DIR/NAME.bin,
 * DIR/NAME.mask holds one byte per token of the shard, 1 where the token
 * counts as a target of the loss and 0 where it does not (a prompt's
 * tokens): the shard's 1024-byte header layout with magic 20261201, version
 * 1 and the count, then the bytes. A shard without one counts every token. */
#define LOOM_MASK_MAGIC 20261201
#define LOOM_MASK_VERSION 1
/* The mask path of a shard path ending in ".bin" (else LOOM_ERR_INVALID). */
loom_status loom_mask_path(const char *shard_path, char *out, size_t cap);
/* Write n mask bytes (each 0 or 1, else LOOM_ERR_INVALID naming the index)
 * atomically. Errors also: LOOM_ERR_IO. */
loom_status loom_mask_write(const char *path, const uint8_t *mask, size_t n);
typedef struct loom_mask loom_mask;
/* Open (memory-map) and validate the header against the file size.
 * Errors: LOOM_ERR_IO, LOOM_ERR_FORMAT (the message names the file). */
loom_status loom_mask_open(const char *path, loom_mask **out);
void loom_mask_close(loom_mask *m);
size_t loom_mask_count(const loom_mask *m);
/* The count bytes (owned by m; values are not checked here). */
const uint8_t *loom_mask_bytes(const loom_mask *m);
/* Copy tokens [start, start + n) as int32 into dst. Errors: LOOM_ERR_INVALID
 * (range past the end), LOOM_ERR_FORMAT (a uint32 token above INT32_MAX). */
loom_status loom_shard_read(const loom_shard *s, size_t start, size_t n, int32_t *dst);

/* ============================================================ data loader */

/* The loader reads shards in sorted-name order. Each step reads one span of
 * B*T+1 consecutive tokens per rank: inputs = span[0 .. B*T), targets =
 * span[1 .. B*T+1), i.e. B rows of T+1-token windows (row b's last target is
 * row b+1's first input), shaped (B, T). A step's spans for ranks 0..W-1 are
 * consecutive in the shard, so ranks never share an input token; then the
 * position advances by B*T*W. When a shard has no room for a whole step (all
 * W spans) the loader moves to the next shard, and after the last one it
 * starts the next epoch at the first. Shards too short for one step are
 * skipped. */
typedef struct loom_dataloader_options {
    int batch_size;    /* B >= 1 */
    int seq_len;       /* T >= 1 */
    int rank;          /* 0 <= rank < world_size */
    int world_size;    /* number of data-parallel ranks, >= 1 */
    int vocab_size;    /* every token must be < vocab_size (> 0) */
    const char *split; /* for a directory source: files "*<split>*.bin" ("train", "val") */
} loom_dataloader_options;

/* A saved reading position; identical on every rank for the same step, so
 * rank 0 can save it in a checkpoint for all. */
typedef struct loom_dataloader_position {
    uint64_t epoch;  /* completed passes over all shards */
    uint64_t shard;  /* index of the current shard in sorted order */
    uint64_t offset; /* token offset in that shard where the next step begins */
} loom_dataloader_position;

typedef struct loom_dataloader loom_dataloader;

/* `source` is a directory (its files "*<split>*.bin", e.g. DIR/train_000000.bin),
 * a glob pattern (e.g. "data/train_*.bin"), or a single shard file. Every shard's
 * header is validated up front. Errors: LOOM_ERR_INVALID (bad options, no
 * files match, no shard holds one step of B*T*W+1 tokens), LOOM_ERR_FORMAT /
 * LOOM_ERR_IO (a bad shard, named), LOOM_ERR_NOMEM. */
loom_status loom_dataloader_open(const char *source, const loom_dataloader_options *opt,
                                 loom_dataloader **out);
void loom_dataloader_close(loom_dataloader *dl);
/* Fill inputs and targets, each (B, T) int32, with this rank's next batch;
 * a target is -1 where its shard's loss mask is 0. Errors: LOOM_ERR_FORMAT
 * (a token >= vocab_size, a mask byte other than 0 or 1: file and position
 * named), LOOM_ERR_IO. On error the position does not advance. */
loom_status loom_dataloader_next(loom_dataloader *dl, int32_t *inputs, int32_t *targets);
/* The position of the next batch; restoring it (on a loader opened with the
 * same shards and options) makes the following batches identical. */
void loom_dataloader_get_position(const loom_dataloader *dl, loom_dataloader_position *pos);
/* A position where this loader's step no longer fits (one saved with a
 * smaller batch, sequence or world size) moves on to the next place where
 * one does, as after a step. Errors: LOOM_ERR_INVALID (shard index or
 * offset out of range for these shards: the message names both). */
loom_status loom_dataloader_set_position(loom_dataloader *dl, const loom_dataloader_position *pos);
/* Back to epoch 0, first shard, offset 0. */
loom_status loom_dataloader_reset(loom_dataloader *dl);
/* A 64-bit summary of the data this loader reads: the shards' count and
 * order, each one's token count, their tokens and their loss masks (not the
 * names: paths differ between machines). Shards are hashed whole, in order,
 * while the tokens hashed whole stay within LOOM_FINGERPRINT_FULL_TOKENS
 * (256 MiB of tokens: 0.11 s from the page cache on the Zen 4 of
 * BENCHMARKS.md, more when they come from disk); each shard past that
 * contributes 64 spans of 64 tokens (and their mask bytes), evenly spread.
 * Loaders over the same files agree; a missing, extra, reordered, longer or
 * rewritten shard almost always changes it (in a sampled shard, a change
 * between the spans does not). Errors: LOOM_ERR_IO / LOOM_ERR_FORMAT (a shard that no longer
 * opens), LOOM_ERR_NOMEM. */
#define LOOM_FINGERPRINT_FULL_TOKENS ((size_t)64 << 20)
loom_status loom_dataloader_fingerprint(const loom_dataloader *dl, uint64_t *out);
size_t loom_dataloader_num_shards(const loom_dataloader *dl);
/* How many of the shards have a loss mask (DIR/NAME.mask beside
 * DIR/NAME.bin). loom_dataloader_open validates each (LOOM_ERR_FORMAT for a
 * bad file or a count other than its shard's). */
size_t loom_dataloader_num_masked(const loom_dataloader *dl);
/* Path of shard i (owned by dl), NULL when out of range. */
const char *loom_dataloader_shard_path(const loom_dataloader *dl, size_t i);

/* ============================================================= tokenizer */

/* loom's own tokenizers: byte-level BPE. Ids 0..255 are the bytes; id 256 + r is the r-th merge
 * (the concatenation of its two parts' bytes); after the merges come the
 * special tokens. A trained tokenizer has exactly one, "<|endoftext|>", with
 * the last id (vocab_size - 1): the document separator. Special tokens are
 * never produced by encode (text cannot inject them); decode writes their
 * name (an unused id of a Hugging Face file: nothing). Text is pre-split
 * into chunks — letters (and bytes >= 0x80) with an optional leading space,
 * digits with an optional space, other symbols with an optional space, runs
 * of whitespace, at most 128 bytes each — and merges never cross chunks.
 * Any byte string round-trips: decode(encode(s)) == s.
 *
 * loom_tokenizer_load also reads a Hugging Face tokenizer.json of BPE, with
 * the file's ids (vocab_size is the largest + 1; an unused id is an empty
 * special token) and merges applied in Hugging Face's order (the
 * lowest-ranked pair, the leftmost among equals, one at a time):
 *  - byte-level (GPT-2, Llama 3, StarCoder, DeepSeek, GPT-4 as converted
 *    from tiktoken): the pre-tokenizer's expressions (ByteLevel's GPT-2 one,
 *    regex Splits, Digits) matched with PCRE2 as Unicode, ignore_merges.
 *    Bytes that are not UTF-8 are never matched and stay pieces of their
 *    own, so the round trip above holds for these too (unless the
 *    normalizer has a Unicode normal form: then decode gives back the
 *    normalized text);
 *  - SentencePiece-style (byte_fallback: Llama 2, Mistral, Gemma): the
 *    normalizer's Prepend and Replace steps, or a Metaspace pre-tokenizer
 *    (transformers' legacy=False files), then the text is one piece of
 *    characters (with Metaspace's split, one per U+2581), a character
 *    without a token as its bytes' <0xXX> tokens (or the unknown token).
 *    decode(encode(s)) is s normalized, U+2581 read as a space (Llama 2's
 *    adds a leading space).
 * Either may have Unicode normal forms (NFC, NFD, NFKC, NFKD; Qwen 2's NFC)
 * among its normalizer's steps, applied in their place with utf8proc (the
 * stretches of UTF-8 between bytes that are not UTF-8 normalized apart,
 * those bytes kept); decode gives back the normalized text.
 * Its added tokens that are not special are found in text before anything
 * else, as Hugging Face does (those it normalizes in normalized text, as
 * their normalized content); special ones never are (Hugging Face finds them
 * too; loom keeps text from making them), and no merge may make one. The one
 * special token encode gives is a SentencePiece-style file's unknown token,
 * for a character that neither a token nor its bytes' tokens spell.
 * Refused by name: WordPiece and Unigram models, word affixes or dropout,
 * other normalizer steps (in a byte-level file, anything but normal
 * forms), ByteLevel's add_prefix_space, other
 * pre-tokenizers, Split behaviours and decoders, ignore_merges in a
 * SentencePiece-style file, added tokens that are not special and strip
 * spaces or match single words only. Such a tokenizer is not saved
 * (loom_tokenizer_save): its file is copied. */
#define LOOM_TOKENIZER_EOT "<|endoftext|>"

typedef struct loom_tokenizer loom_tokenizer;

/* Learn vocab_size - 257 merges from texts[0..n_texts) (lengths[i] bytes
 * each; lengths may be NULL for NUL-terminated texts): repeatedly merge the
 * most frequent adjacent pair (ties: smallest first id, then smallest second
 * id). Stops early, with a smaller vocabulary, when no pair is left.
 * Errors: LOOM_ERR_INVALID (vocab_size < 257 or > 1<<24, NULL text),
 * LOOM_ERR_NOMEM. */
loom_status loom_tokenizer_train(const char *const *texts, const size_t *lengths, size_t n_texts,
                                 int vocab_size, loom_tokenizer **out);
void loom_tokenizer_free(loom_tokenizer *tok);

/* Number of ids (bytes + merges + specials; a Hugging Face tokenizer's
 * largest id + 1). */
int loom_tokenizer_vocab_size(const loom_tokenizer *tok);
int loom_tokenizer_num_merges(const loom_tokenizer *tok);
/* The end-of-text id: "<|endoftext|>" (for a Hugging Face tokenizer the
 * first special token of "<|endoftext|>", "<|end_of_text|>", "</s>",
 * "<eos>", DeepSeek's "<｜end▁of▁sentence｜>"), or -1 when it has none.
 * Generation stops at it. */
int loom_tokenizer_eot(const loom_tokenizer *tok);
/* The begin-of-text id every document starts with: the end-of-text token
 * for loom's tokenizers (it separates documents); for a Hugging Face one the
 * token its post-processor's template puts first; without a template the
 * special token "<|begin_of_text|>" (Llama 3), "<s>", "<bos>" or DeepSeek's
 * "<｜begin▁of▁sentence｜>"; else the end-of-text token (GPT-2's
 * convention); -1 when there is none. */
int loom_tokenizer_bos(const loom_tokenizer *tok);
/* 1 when id is a special token (never produced by encode, but for a
 * SentencePiece-style file's unknown token), else 0. */
int loom_tokenizer_is_special(const loom_tokenizer *tok, int32_t id);

/* Encode `len` bytes into ids. `out` has room for `capacity` ids;
 * loom_tokenizer_max_ids(tok, len) always suffice (`len` for loom's and
 * byte-level tokenizers without a normalizer). Encoding fills an internal cache (hence non-const).
 * Errors: LOOM_ERR_INVALID (capacity too small: the message gives the size
 * needed), LOOM_ERR_NOMEM. */
loom_status loom_tokenizer_encode(loom_tokenizer *tok, const void *text, size_t len,
                                  int32_t *out, size_t capacity, size_t *n_out);
/* loom_tokenizer_encode of text that continues another (a completion after
 * its prompt, encoded apart): the same, but a SentencePiece-style
 * normalizer's Prepend steps, which mark the start of a text, are left out
 * of its first piece. */
loom_status loom_tokenizer_encode_more(loom_tokenizer *tok, const void *text, size_t len,
                                       int32_t *out, size_t capacity, size_t *n_out);
/* The most ids `len` bytes can encode to: len, or for a Hugging Face
 * tokenizer with a normalizer what it can make of them (a prefix for each
 * piece between added tokens; a space whose replacement falls back to its
 * bytes' tokens; 3 times the bytes for NFC and NFD, 11 for NFKC and NFKD,
 * Unicode's bounds), SIZE_MAX when that does not fit a size_t. */
size_t loom_tokenizer_max_ids(const loom_tokenizer *tok, size_t len);
/* Decode ids into bytes. With out == NULL only *n_out (the byte count) is
 * computed. Errors: LOOM_ERR_INVALID (an id out of range: index and id
 * named; capacity below the size needed). The output is not NUL-terminated. */
loom_status loom_tokenizer_decode(const loom_tokenizer *tok, const int32_t *ids, size_t n,
                                  void *out, size_t capacity, size_t *n_out);
/* The bytes of one id (owned by tok). Errors: LOOM_ERR_INVALID. */
loom_status loom_tokenizer_token_bytes(const loom_tokenizer *tok, int32_t id,
                                       const char **bytes, size_t *len);
/* The id whose bytes are exactly bytes[0 .. len) (a special token's name,
 * such as "<|eot_id|>", first), or -1 when none is. */
int32_t loom_tokenizer_find(const loom_tokenizer *tok, const void *bytes, size_t len);
/* Merge r's two parts (in rank order): for loom's tokenizers id 256 + r is
 * the concatenation of ids *a and *b.
 * Errors: LOOM_ERR_INVALID (r outside [0, loom_tokenizer_num_merges)). */
loom_status loom_tokenizer_merge(const loom_tokenizer *tok, int r, int32_t *a, int32_t *b);

/* Save as JSON, atomically: {"type":"loom-bpe","version":1,"vocab_size":N,
 * "merges":[[a,b],...],"special":{"<|endoftext|>":N-1}}. Errors: LOOM_ERR_IO,
 * LOOM_ERR_INVALID (a Hugging Face tokenizer: copy its file instead). */
loom_status loom_tokenizer_save(const loom_tokenizer *tok, const char *path);
/* Load and validate a saved tokenizer: JSON syntax, type, version, merges
 * (pairs of ids smaller than the id they create, no duplicates), vocab_size
 * == 256 + merges + specials, special ids right after the merges; or a
 * Hugging Face tokenizer.json of BPE (a JSON object with "model" and no
 * "type"; see above). Errors: LOOM_ERR_IO, LOOM_ERR_FORMAT (the message
 * names the file and what is wrong), LOOM_ERR_UNSUPPORTED (a NUL character
 * in an object key, which the JSON parser cannot hold). */
loom_status loom_tokenizer_load(const char *path, loom_tokenizer **out);

#ifdef __cplusplus
}
#endif
#endif
