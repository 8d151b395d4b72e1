/*
 * test_safetensors.c — safetensors round trips for every dtype, conversion
 * on read, every kind of corruption (each must give LOOM_ERR_FORMAT naming
 * the file, never a crash), and the atomic writer's failure paths.
 */
#include "io_test.h"
#include "loom/checkpoint.h"

#include <errno.h>
#include <sys/stat.h>

#include "io/io_internal.h"

/* Deterministic pseudo-random bytes. */
static void fill_bytes(unsigned char *p, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n; i += 16) {
        uint32_t r[4];
        loom_philox4x32(seed, i / 16, r);
        for (size_t j = 0; j < 16 && i + j < n; j++) p[i + j] = (unsigned char)(r[j / 4] >> (8 * (j % 4)));
    }
}

static void test_round_trip_all_dtypes(void **state) {
    (void)state;
    const char *path = io_path("all.safetensors");
    enum { N = LOOM_SAFETENSORS_N_DTYPES };
    int64_t shapes[N][3];
    int ndims[N];
    unsigned char *data[N];
    size_t bytes[N];
    char names[N][32];
    loom_safetensors_writer *w;
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    for (int i = 0; i < N; i++) {
        /* Odd sizes so offsets are not all multiples of 8; a scalar; an empty tensor. */
        ndims[i] = i % 4 == 3 ? 0 : 1 + i % 3;
        size_t n = 1;
        for (int d = 0; d < ndims[i]; d++) {
            shapes[i][d] = i == 5 && d == 0 ? 0 : 1 + (i * 7 + d * 3) % 5;
            n *= (size_t)shapes[i][d];
        }
        bytes[i] = n * loom_safetensors_dtype_size((loom_safetensors_dtype)i);
        data[i] = malloc(bytes[i] + 1);
        fill_bytes(data[i], bytes[i], 100 + (uint64_t)i);
        /* Names not in sorted order, so lookup cannot rely on insertion order. */
        snprintf(names[i], sizeof names[i], "layer.%d.%s", (N - i) * 13 % N,
                 loom_safetensors_dtype_name((loom_safetensors_dtype)i));
        assert_int_equal(loom_safetensors_writer_add(w, names[i], (loom_safetensors_dtype)i, shapes[i],
                                                     ndims[i], data[i]), LOOM_OK);
    }
    assert_int_equal(loom_safetensors_writer_set_metadata(w, "format", "pt"), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_set_metadata(w, "note", "first"), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_set_metadata(w, "note", "a \"quoted\" \xc3\xa9 value"), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_write(w, path), LOOM_OK);
    loom_safetensors_writer_free(w);

    /* Header length is a multiple of 8 and the header is space-padded JSON. */
    size_t fsize;
    unsigned char *raw = io_read_raw(path, &fsize);
    uint64_t hlen;
    memcpy(&hlen, raw, 8);
    assert_int_equal(hlen % 8, 0);
    assert_true(raw[8] == '{');
    free(raw);

    loom_safetensors *st;
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_OK);
    assert_int_equal(loom_safetensors_count(st), N);
    for (int i = 0; i < N; i++) {
        loom_safetensors_tensor t;
        assert_int_equal(loom_safetensors_at(st, (size_t)i, &t), LOOM_OK);
        assert_string_equal(t.name, names[i]); /* data order == insertion order */
        assert_true(loom_safetensors_has(st, names[i]));
        assert_int_equal(loom_safetensors_get(st, names[i], &t), LOOM_OK);
        assert_int_equal(t.dtype, i);
        assert_int_equal(t.ndim, ndims[i]);
        for (int d = 0; d < ndims[i]; d++) assert_int_equal(t.shape[d], shapes[i][d]);
        assert_int_equal(t.n_bytes, bytes[i]);
        assert_true(tu_bits_equal(t.data, data[i], bytes[i], names[i]));
        free(data[i]);
    }
    assert_int_equal(loom_safetensors_metadata_count(st), 2);
    assert_string_equal(loom_safetensors_metadata(st, "format"), "pt");
    assert_string_equal(loom_safetensors_metadata(st, "note"), "a \"quoted\" \xc3\xa9 value");
    assert_null(loom_safetensors_metadata(st, "missing"));
    assert_false(loom_safetensors_has(st, "missing"));
    loom_safetensors_tensor t;
    assert_int_equal(loom_safetensors_get(st, "missing.weight", &t), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("missing.weight");
    IO_ASSERT_MSG(path);
    assert_int_equal(loom_safetensors_at(st, N, &t), LOOM_ERR_INVALID);
    loom_safetensors_close(st);
}

static void test_read_converts(void **state) {
    (void)state;
    const char *path = io_path("convert.safetensors");
    enum { R = 3, C = 5, n = R * C };
    int64_t shape[2] = {R, C};
    float src[n];
    tu_fill_uniform(src, n, -3.0f, 3.0f, 7);
    src[0] = 1.0f + 1.0f / 512.0f; /* rounds differently in bf16 and f16 */
    void *bf = tu_from_f32(src, n, LOOM_BF16), *hf = tu_from_f32(src, n, LOOM_F16);
    double f64[n];
    int32_t i32[n];
    int8_t i8[n];
    for (int i = 0; i < n; i++) {
        f64[i] = (double)src[i] * 1.000001;
        i32[i] = (int32_t)(src[i] * 1000.0f);
        i8[i] = (int8_t)(src[i] * 40.0f);
    }
    loom_safetensors_writer *w;
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "f32", LOOM_SAFETENSORS_F32, shape, 2, src), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "bf16", LOOM_SAFETENSORS_BF16, shape, 2, bf), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "f16", LOOM_SAFETENSORS_F16, shape, 2, hf), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "f64", LOOM_SAFETENSORS_F64, shape, 2, f64), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "i32", LOOM_SAFETENSORS_I32, shape, 2, i32), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "i8", LOOM_SAFETENSORS_I8, shape, 2, i8), LOOM_OK);
    unsigned char fp8[n] = {0};
    assert_int_equal(loom_safetensors_writer_add(w, "fp8", LOOM_SAFETENSORS_F8_E4M3, shape, 2, fp8), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_write(w, path), LOOM_OK);
    loom_safetensors_writer_free(w);

    loom_safetensors *st;
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_OK);
    const loom_dtype dts[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int k = 0; k < 3; k++) {
        loom_dtype dt = dts[k];
        uint16_t out16[n];
        float out32[n], got[n], want[n];
        void *out = dt == LOOM_F32 ? (void *)out32 : (void *)out16;
        /* From f32: each element rounded once to dt. */
        assert_int_equal(loom_safetensors_read(st, "f32", dt, shape, 2, out), LOOM_OK);
        for (int i = 0; i < n; i++) { got[i] = loom_load(out, (size_t)i, dt); want[i] = loom_round_to(src[i], dt); }
        assert_true(tu_bits_equal(got, want, sizeof got, "f32 -> dt"));
        /* From bf16 / f16: the stored value, rounded to dt. */
        assert_int_equal(loom_safetensors_read(st, "bf16", dt, shape, 2, out), LOOM_OK);
        for (int i = 0; i < n; i++) { got[i] = loom_load(out, (size_t)i, dt); want[i] = loom_round_to(loom_load(bf, (size_t)i, LOOM_BF16), dt); }
        assert_true(tu_bits_equal(got, want, sizeof got, "bf16 -> dt"));
        assert_int_equal(loom_safetensors_read(st, "f16", dt, NULL, 0, out), LOOM_OK);
        for (int i = 0; i < n; i++) { got[i] = loom_load(out, (size_t)i, dt); want[i] = loom_round_to(loom_load(hf, (size_t)i, LOOM_F16), dt); }
        assert_true(tu_bits_equal(got, want, sizeof got, "f16 -> dt"));
        assert_int_equal(loom_safetensors_read(st, "f64", dt, shape, 2, out), LOOM_OK);
        for (int i = 0; i < n; i++) { got[i] = loom_load(out, (size_t)i, dt); want[i] = loom_round_to((float)f64[i], dt); }
        assert_true(tu_bits_equal(got, want, sizeof got, "f64 -> dt"));
        assert_int_equal(loom_safetensors_read(st, "i32", dt, shape, 2, out), LOOM_OK);
        for (int i = 0; i < n; i++) { got[i] = loom_load(out, (size_t)i, dt); want[i] = loom_round_to((float)i32[i], dt); }
        assert_true(tu_bits_equal(got, want, sizeof got, "i32 -> dt"));
        assert_int_equal(loom_safetensors_read(st, "i8", dt, shape, 2, out), LOOM_OK);
        for (int i = 0; i < n; i++) { got[i] = loom_load(out, (size_t)i, dt); want[i] = loom_round_to((float)i8[i], dt); }
        assert_true(tu_bits_equal(got, want, sizeof got, "i8 -> dt"));
    }
    float out[n];
    int64_t wrong[2] = {C, R};
    assert_int_equal(loom_safetensors_read(st, "f32", LOOM_F32, wrong, 2, out), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("[3, 5]");
    IO_ASSERT_MSG("[5, 3]");
    IO_ASSERT_MSG("\"f32\"");
    int64_t flat[1] = {n};
    assert_int_equal(loom_safetensors_read(st, "f32", LOOM_F32, flat, 1, out), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("[15]");
    assert_int_equal(loom_safetensors_read(st, "fp8", LOOM_F32, shape, 2, out), LOOM_ERR_UNSUPPORTED);
    IO_ASSERT_MSG("F8_E4M3");
    assert_int_equal(loom_safetensors_read(st, "nope", LOOM_F32, shape, 2, out), LOOM_ERR_INVALID);
    loom_safetensors_close(st);
    free(bf);
    free(hf);
}

/* Write 8-byte length + header text (+ pad) + `data_bytes` bytes, open it. */
static loom_status open_crafted(const char *name, const char *header, size_t data_bytes) {
    size_t hl = strlen(header), total = 8 + hl + data_bytes;
    unsigned char *buf = calloc(1, total + 1);
    uint64_t h = hl;
    memcpy(buf, &h, 8);
    memcpy(buf + 8, header, hl);
    fill_bytes(buf + 8 + hl, data_bytes, 3);
    const char *path = io_path(name);
    io_write_raw(path, buf, total);
    free(buf);
    loom_safetensors *st = (loom_safetensors *)0x1;
    loom_status s = loom_safetensors_open(path, &st);
    if (s == LOOM_OK) loom_safetensors_close(st);
    else assert_null(st);
    return s;
}

#define EXPECT_CORRUPT(header, data_bytes, part)                                      \
    do {                                                                              \
        assert_int_equal(open_crafted("bad.safetensors", (header), (data_bytes)),     \
                         LOOM_ERR_FORMAT);                                            \
        IO_ASSERT_MSG(part);                                                          \
        IO_ASSERT_MSG("bad.safetensors");                                             \
    } while (0)

static void test_corrupt_headers(void **state) {
    (void)state;
    /* The well-formed baseline opens, so each failure below is its one defect. */
    assert_int_equal(open_crafted("ok.safetensors",
                                  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                  "\"b\":{\"dtype\":\"I8\",\"shape\":[],\"data_offsets\":[8,9]}}", 9),
                     LOOM_OK);
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "does not parse");
    EXPECT_CORRUPT("not json at all", 0, "does not parse");
    EXPECT_CORRUPT("[1, 2]", 0, "not an object");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F24\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, "duplicate");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "\"dtype\"");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "\"shape\"");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "shape[0]");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8, "shape[0]");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
                   "dimensions");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
                   "\"data_offsets\":[0,8]}}", 8, "overflow");
    /* The element count fits in 64 bits; its byte size does not. */
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2305843009213693952,2],"
                   "\"data_offsets\":[0,0]}}", 0, "larger than any file can hold");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "data_offsets");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "end before");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12 bytes");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 6, "run past");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlaps");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "gap");
    EXPECT_CORRUPT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 9, "trailing");
    EXPECT_CORRUPT("{\"a\":[1,2]}", 0, "not a JSON object");
    EXPECT_CORRUPT("{\"__metadata__\":{\"k\":3}}", 0, "__metadata__");
    EXPECT_CORRUPT("{\"__metadata__\":[\"k\"]}", 0, "__metadata__");
    assert_int_equal(open_crafted("null-meta.safetensors", "{\"__metadata__\":null}", 0), LOOM_OK);
    /* An empty tensor listed after a non-empty one at the same offset: valid
     * (the reference implementation orders spans by begin, then end). */
    assert_int_equal(open_crafted("empty-tie.safetensors",
                                  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                  "\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 8),
                     LOOM_OK);

    /* Header length fields that do not fit the file. */
    unsigned char small[16] = {0};
    uint64_t h = 1000;
    memcpy(small, &h, 8);
    const char *path = io_path("len.safetensors");
    io_write_raw(path, small, sizeof small);
    loom_safetensors *st;
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_ERR_FORMAT);
    IO_ASSERT_MSG("exceeds");
    h = UINT64_MAX;
    memcpy(small, &h, 8);
    io_write_raw(path, small, sizeof small);
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_ERR_FORMAT);
    io_write_raw(path, small, 5);
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_ERR_FORMAT);
    IO_ASSERT_MSG("too short");
    io_write_raw(path, small, 0);
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_ERR_FORMAT);
    IO_ASSERT_MSG("len.safetensors");
    /* Missing file and a directory: I/O errors, not format errors. */
    assert_int_equal(loom_safetensors_open(io_path("absent.safetensors"), &st), LOOM_ERR_IO);
    IO_ASSERT_MSG("absent.safetensors");
    assert_int_equal(loom_safetensors_open(io_scratch, &st), LOOM_ERR_IO);
    IO_ASSERT_MSG("directory");
}

/* Every truncation of a valid file fails cleanly; random byte corruption of
 * the header either fails cleanly or yields tensors inside the file. */
static void test_truncation_and_fuzz(void **state) {
    (void)state;
    const char *path = io_path("fuzz-src.safetensors"), *bad = io_path("fuzz.safetensors");
    float a[6];
    uint16_t b[3] = {1, 2, 3};
    tu_fill_uniform(a, 6, -1.0f, 1.0f, 11);
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    loom_safetensors_writer *w;
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "a", LOOM_SAFETENSORS_F32, sa, 2, a), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "b", LOOM_SAFETENSORS_BF16, sb, 1, b), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_set_metadata(w, "k", "v"), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_write(w, path), LOOM_OK);
    loom_safetensors_writer_free(w);
    size_t n;
    unsigned char *good = io_read_raw(path, &n);
    loom_safetensors *st;
    for (size_t len = 0; len < n; len++) {
        io_write_raw(bad, good, len);
        assert_int_equal(loom_safetensors_open(bad, &st), LOOM_ERR_FORMAT);
    }
    uint64_t hlen;
    memcpy(&hlen, good, 8);
    unsigned char *mut = malloc(n);
    int n_ok = 0, n_bad = 0;
    for (int trial = 0; trial < 400; trial++) {
        uint32_t r[4];
        loom_philox4x32(99, (uint64_t)trial, r);
        memcpy(mut, good, n);
        size_t pos = r[0] % (8 + hlen);
        mut[pos] = (unsigned char)(trial % 2 ? r[1] : (uint32_t)"0123456789[]{},:\"- "[r[1] % 19]);
        io_write_raw(bad, mut, n);
        loom_status s = loom_safetensors_open(bad, &st);
        if (s == LOOM_OK) {
            n_ok++;
            for (size_t i = 0; i < loom_safetensors_count(st); i++) {
                loom_safetensors_tensor t;
                assert_int_equal(loom_safetensors_at(st, i, &t), LOOM_OK);
                /* The data fits after the header and every byte is readable. */
                uint64_t h2;
                memcpy(&h2, mut, 8);
                assert_true(t.n_bytes <= n - 8 - h2);
                unsigned sum = 0;
                for (size_t k = 0; k < t.n_bytes; k++) sum += ((const unsigned char *)t.data)[k];
                (void)sum;
            }
            loom_safetensors_close(st);
        } else {
            n_bad++;
            assert_int_equal(s, LOOM_ERR_FORMAT);
        }
    }
    assert_true(n_bad > 0);
    free(mut);
    free(good);
}

static void test_writer_rejects_bad_entries(void **state) {
    (void)state;
    loom_safetensors_writer *w;
    float x[4] = {0};
    int64_t s1[1] = {4}, neg[1] = {-1};
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "x", LOOM_SAFETENSORS_F32, s1, 1, x), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "x", LOOM_SAFETENSORS_F32, s1, 1, x), LOOM_ERR_INVALID);
    IO_ASSERT_MSG("twice");
    assert_int_equal(loom_safetensors_writer_add(w, "__metadata__", LOOM_SAFETENSORS_F32, s1, 1, x),
                     LOOM_ERR_INVALID);
    assert_int_equal(loom_safetensors_writer_add(w, "", LOOM_SAFETENSORS_F32, s1, 1, x), LOOM_ERR_INVALID);
    assert_int_equal(loom_safetensors_writer_add(w, "n", LOOM_SAFETENSORS_F32, neg, 1, x), LOOM_ERR_INVALID);
    assert_int_equal(loom_safetensors_writer_add(w, "d", LOOM_SAFETENSORS_N_DTYPES, s1, 1, x), LOOM_ERR_INVALID);
    assert_int_equal(loom_safetensors_writer_add(w, "z", LOOM_SAFETENSORS_F32, s1, 1, NULL), LOOM_ERR_INVALID);
    assert_int_equal(loom_safetensors_writer_add(w, "m", LOOM_SAFETENSORS_F32, s1, 9, x), LOOM_ERR_INVALID);
    loom_safetensors_writer_free(w);
    /* An empty writer makes a valid empty file. */
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_write(w, io_path("empty.safetensors")), LOOM_OK);
    loom_safetensors_writer_free(w);
    loom_safetensors *st;
    assert_int_equal(loom_safetensors_open(io_path("empty.safetensors"), &st), LOOM_OK);
    assert_int_equal(loom_safetensors_count(st), 0);
    assert_int_equal(loom_safetensors_metadata_count(st), 0);
    loom_safetensors_close(st);
}

/* A filled tensor: value k is base + k; `fail` stops the write. */
typedef struct fill_user {
    float base;
    int fail, calls;
} fill_user;

static loom_status fill_values(void *user, void *dst, size_t n_bytes) {
    fill_user *u = user;
    u->calls++;
    if (u->fail) return loom_error(LOOM_ERR_IO, "fill failed on purpose");
    float *v = dst;
    for (size_t k = 0; k < n_bytes / sizeof *v; k++) v[k] = u->base + (float)k;
    return LOOM_OK;
}

/* Tensors filled at write time sit among borrowed ones, in order, through
 * one buffer (a small one filled after a larger keeps only its own bytes);
 * a fill that fails leaves the old file as it was. */
static void test_writer_fill(void **state) {
    (void)state;
    loom_safetensors_writer *w;
    float mid[3] = {-1.0f, -2.0f, -3.0f};
    int64_t big[1] = {6}, small[1] = {2}, three[1] = {3};
    fill_user a = {100.0f, 0, 0}, b = {200.0f, 0, 0};
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add_fill(w, "a", LOOM_SAFETENSORS_F32, big, 1, fill_values, &a), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add(w, "mid", LOOM_SAFETENSORS_F32, three, 1, mid), LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add_fill(w, "b", LOOM_SAFETENSORS_F32, small, 1, fill_values, &b),
                     LOOM_OK);
    assert_int_equal(loom_safetensors_writer_add_fill(w, "c", LOOM_SAFETENSORS_F32, small, 1, NULL, NULL),
                     LOOM_ERR_INVALID);
    assert_int_equal(loom_safetensors_writer_write(w, io_path("fill.safetensors")), LOOM_OK);
    assert_true(a.calls == 1 && b.calls == 1);
    loom_safetensors *st;
    float got[6];
    assert_int_equal(loom_safetensors_open(io_path("fill.safetensors"), &st), LOOM_OK);
    assert_int_equal(loom_safetensors_read(st, "a", LOOM_F32, big, 1, got), LOOM_OK);
    for (int k = 0; k < 6; k++) assert_true(got[k] == 100.0f + (float)k);
    assert_int_equal(loom_safetensors_read(st, "mid", LOOM_F32, three, 1, got), LOOM_OK);
    assert_memory_equal(got, mid, sizeof mid);
    assert_int_equal(loom_safetensors_read(st, "b", LOOM_F32, small, 1, got), LOOM_OK);
    assert_true(got[0] == 200.0f && got[1] == 201.0f);
    loom_safetensors_close(st);
    size_t n_before, n_after;
    unsigned char *before = io_read_raw(io_path("fill.safetensors"), &n_before);
    b.fail = 1;
    assert_int_equal(loom_safetensors_writer_write(w, io_path("fill.safetensors")), LOOM_ERR_IO);
    IO_ASSERT_MSG("on purpose");
    unsigned char *after = io_read_raw(io_path("fill.safetensors"), &n_after);
    assert_true(n_before == n_after && memcmp(before, after, n_before) == 0);
    assert_int_equal(io_count_files(".tmp."), 0);
    free(before);
    free(after);
    loom_safetensors_writer_free(w);
}

/* Reading a large file tensor by tensor, the reader hands back each
 * tensor's pages once copied out: the process's resident file pages grow
 * by a third at most of the 12 MiB read (without, by all of it, as reading
 * them through views after shows), and a tensor read again comes back from
 * the file the same. */
static void test_read_hands_back_pages(void **state) {
    (void)state;
    enum { K = 12, N = 1 << 18 }; /* 12 tensors of 1 MiB */
    loom_safetensors_writer *w;
    fill_user u[K];
    int64_t shape[1] = {N};
    char name[K][8];
    assert_int_equal(loom_safetensors_writer_init(&w), LOOM_OK);
    for (int k = 0; k < K; k++) {
        u[k] = (fill_user){1000.0f * (float)k, 0, 0};
        snprintf(name[k], sizeof name[k], "t%d", k);
        assert_int_equal(loom_safetensors_writer_add_fill(w, name[k], LOOM_SAFETENSORS_F32, shape, 1, fill_values,
                                                          &u[k]), LOOM_OK);
    }
    assert_int_equal(loom_safetensors_writer_write(w, io_path("large.safetensors")), LOOM_OK);
    loom_safetensors_writer_free(w);
    loom_safetensors *st;
    assert_int_equal(loom_safetensors_open(io_path("large.safetensors"), &st), LOOM_OK);
    float *got = malloc(N * sizeof *got);
    long before = io_rss_mapped_kib(), most = 0;
    for (int k = 0; k <= K; k++) { /* every tensor, then the first again */
        assert_int_equal(loom_safetensors_read(st, name[k % K], LOOM_F32, shape, 1, got), LOOM_OK);
        for (int i = 0; i < N; i += 4099) assert_true(got[i] == 1000.0f * (float)(k % K) + (float)i);
        long now = io_rss_mapped_kib() - before;
        if (now > most) most = now;
    }
    /* The instrument: the same pages touched through views, which hand
     * nothing back, show (else this kernel does not count them: skip). */
    long touched = 0;
    for (int k = 0; k < K; k++) {
        loom_safetensors_tensor t;
        assert_int_equal(loom_safetensors_get(st, name[k], &t), LOOM_OK);
        for (size_t b = 0; b < t.n_bytes; b += 1024) touched += ((const unsigned char *)t.data)[b];
    }
    long shown = io_rss_mapped_kib() - before;
    loom_safetensors_close(st);
    free(got);
    if (shown < 8192) {
        fprintf(stderr, "mapped pages touched show as %ld KiB of 12 MiB (sum %ld): not measurable here\n", shown,
                touched);
        skip();
    }
    if (most > 4096) fprintf(stderr, "resident file pages grew by %ld KiB reading 12 MiB\n", most);
    assert_true(most <= 4096);
}

/* Write a small safetensors file holding one F32 tensor of `n` values. */
static loom_status write_st(const char *path, const float *v, int64_t n) {
    loom_safetensors_writer *w;
    LOOM_TRY(loom_safetensors_writer_init(&w));
    loom_status s = loom_safetensors_writer_add(w, "v", LOOM_SAFETENSORS_F32, &n, 1, v);
    if (s == LOOM_OK) s = loom_safetensors_writer_write(w, path);
    loom_safetensors_writer_free(w);
    return s;
}

static void test_atomic_failures_keep_old_file(void **state) {
    (void)state;
    const char *path = io_path("keep.safetensors");
    float oldv[300], newv[300];
    tu_fill_uniform(oldv, 300, 0.0f, 1.0f, 1);
    tu_fill_uniform(newv, 300, 2.0f, 3.0f, 2);
    assert_int_equal(write_st(path, oldv, 300), LOOM_OK);
    size_t n0;
    unsigned char *before = io_read_raw(path, &n0);
    const struct { io_fail_point point; int skip, err; const char *part; } cases[] = {
        {IO_FAIL_WRITE, 0, ENOSPC, "disk full?"},  {IO_FAIL_WRITE, 0, EDQUOT, "disk full?"},
        {IO_FAIL_WRITE, 0, EIO, "keep.safetensors"}, {IO_FAIL_OPEN, 0, EACCES, "writable"},
        {IO_FAIL_FSYNC, 0, EIO, "syncing"},        {IO_FAIL_RENAME, 0, EXDEV, "renaming"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        io_test_inject_failure(cases[c].point, cases[c].skip, cases[c].err);
        assert_int_equal(write_st(path, newv, 300), LOOM_ERR_IO);
        IO_ASSERT_MSG(cases[c].part);
        IO_ASSERT_MSG(path);
        size_t n1;
        unsigned char *after = io_read_raw(path, &n1);
        assert_int_equal(n0, n1);
        assert_true(tu_bits_equal(before, after, n0, "target after a failed write"));
        free(after);
        assert_int_equal(io_count_files(".tmp."), 0);
    }
    /* A long path (three 250-character directories) still leaves room for
     * why: the reason comes before the paths, and nothing is cut. */
    char deep[1200];
    snprintf(deep, sizeof deep, "%s", io_path(""));
    for (int level = 0; level < 3; level++) {
        size_t n = strlen(deep);
        snprintf(deep + n, sizeof deep - n, "/%0250d", level);
        assert_int_equal(loom_mkdir_p(deep), LOOM_OK);
    }
    char deep_file[1300];
    snprintf(deep_file, sizeof deep_file, "%s/keep.safetensors", deep);
    io_test_inject_failure(IO_FAIL_WRITE, 0, ENOSPC);
    assert_int_equal(write_st(deep_file, newv, 300), LOOM_ERR_IO);
    IO_ASSERT_MSG("disk full?");
    IO_ASSERT_MSG(deep_file);
    IO_ASSERT_MSG("was left unchanged");
    io_test_inject_failure(IO_FAIL_NONE, 0, 0);
    /* Then a write that succeeds replaces it. */
    assert_int_equal(write_st(path, newv, 300), LOOM_OK);
    loom_safetensors *st;
    float got[300];
    assert_int_equal(loom_safetensors_open(path, &st), LOOM_OK);
    int64_t shape[1] = {300};
    assert_int_equal(loom_safetensors_read(st, "v", LOOM_F32, shape, 1, got), LOOM_OK);
    assert_true(tu_bits_equal(got, newv, sizeof got, "new content"));
    loom_safetensors_close(st);
    free(before);

    /* Real failures: a missing directory; a target that is a directory. */
    assert_int_equal(write_st(io_path("no/such/dir/x.safetensors"), newv, 300), LOOM_ERR_IO);
    IO_ASSERT_MSG("no/such/dir/x.safetensors");
    const char *dir = io_path("adir");
    assert_int_equal(mkdir(dir, 0755), 0);
    assert_int_equal(write_st(dir, newv, 300), LOOM_ERR_IO);
    struct stat sb;
    assert_int_equal(stat(dir, &sb), 0);
    assert_true(S_ISDIR(sb.st_mode));
    assert_int_equal(io_count_files(".tmp."), 0);
    /* A read-only directory (only meaningful when not root). */
    if (geteuid() != 0) {
        const char *ro = io_path("ro");
        assert_int_equal(mkdir(ro, 0555), 0);
        char p[600];
        snprintf(p, sizeof p, "%s/x.safetensors", ro);
        assert_int_equal(write_st(p, newv, 300), LOOM_ERR_IO);
        chmod(ro, 0755);
    }
}

static void test_atomic_file_api(void **state) {
    (void)state;
    const char *path = io_path("stream.bin");
    loom_atomic_file *f;
    unsigned char big[200000];
    fill_bytes(big, sizeof big, 5);
    assert_int_equal(loom_atomic_file_open(path, &f), LOOM_OK);
    assert_int_equal(loom_atomic_file_write(f, "abc", 3), LOOM_OK);
    assert_int_equal(loom_atomic_file_write(f, big, sizeof big), LOOM_OK);
    assert_int_equal(loom_atomic_file_write(f, "xyz", 3), LOOM_OK);
    assert_int_equal(io_count_files("stream.bin"), 1); /* only the temp so far */
    assert_int_equal(loom_atomic_file_commit(f), LOOM_OK);
    void *data;
    size_t n;
    assert_int_equal(loom_read_file(path, &data, &n), LOOM_OK);
    assert_int_equal(n, 6 + sizeof big);
    assert_memory_equal(data, "abc", 3);
    assert_memory_equal((char *)data + 3, big, sizeof big);
    assert_memory_equal((char *)data + 3 + sizeof big, "xyz", 3);
    assert_int_equal(((char *)data)[n], '\0');
    free(data);

    /* Abort leaves the old content and no temp file. */
    assert_int_equal(loom_atomic_file_open(path, &f), LOOM_OK);
    assert_int_equal(loom_atomic_file_write(f, "zz", 2), LOOM_OK);
    loom_atomic_file_abort(f);
    assert_int_equal(loom_read_file(path, &data, &n), LOOM_OK);
    assert_int_equal(n, 6 + sizeof big);
    free(data);
    assert_int_equal(io_count_files(".tmp."), 0);

    /* A failed write is sticky: commit repeats it and removes the temp file. */
    assert_int_equal(loom_atomic_file_open(path, &f), LOOM_OK);
    io_test_inject_failure(IO_FAIL_WRITE, 0, ENOSPC);
    assert_int_equal(loom_atomic_file_write(f, big, sizeof big), LOOM_ERR_IO);
    assert_int_equal(loom_atomic_file_write(f, "a", 1), LOOM_ERR_IO);
    assert_int_equal(loom_atomic_file_commit(f), LOOM_ERR_IO);
    IO_ASSERT_MSG("disk full?");
    assert_int_equal(io_count_files(".tmp."), 0);
    assert_int_equal(loom_read_file(path, &data, &n), LOOM_OK);
    assert_int_equal(n, 6 + sizeof big);
    free(data);

    /* One-shot write, empty content, and reading errors. */
    assert_int_equal(loom_file_write_atomic(path, "", 0), LOOM_OK);
    assert_int_equal(loom_read_file(path, &data, &n), LOOM_OK);
    assert_int_equal(n, 0);
    free(data);
    assert_int_equal(loom_read_file(io_path("none"), &data, &n), LOOM_ERR_IO);
    assert_null(data);
    IO_ASSERT_MSG("none");
    assert_int_equal(loom_read_file(io_scratch, &data, &n), LOOM_ERR_IO);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_all_dtypes),
        cmocka_unit_test(test_read_converts),
        cmocka_unit_test(test_corrupt_headers),
        cmocka_unit_test(test_truncation_and_fuzz),
        cmocka_unit_test(test_writer_rejects_bad_entries),
        cmocka_unit_test(test_writer_fill),
        cmocka_unit_test(test_read_hands_back_pages),
        cmocka_unit_test(test_atomic_failures_keep_old_file),
        cmocka_unit_test(test_atomic_file_api),
    };
    return cmocka_run_group_tests(tests, io_scratch_setup, io_scratch_teardown);
}
