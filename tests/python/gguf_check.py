"""gguf_check.py — `loom export --format gguf` against the GGUF format and
against the math of llama.cpp's "llama" architecture.

It makes random model directories (grouped-query attention, a vocabulary
larger than the tokenizer's, tied embeddings) and a random loom
tokenizer, exports them in fp32, bf16, fp16 and q8_0, and checks, with a GGUF reader
written here from the format's description (no gguf package):

- the file: magic, version 3, the tensors in order, each aligned and right
  after the one before (as llama.cpp requires), nothing after the last;
- the metadata: every llama.* hyperparameter equals config.json's, and each
  key has the value type llama.cpp's loader reads it as;
- the tensors: llama.cpp's names, dimensions fastest first, norms in fp32,
  matrices in the dtype asked for, q and k in the order llama.cpp's own
  converter gives them (its reshape and swap of axes, written here in numpy),
  each value the model's value rounded to it
  (torch's round to nearest even), Q8_0 blocks byte for byte those of ggml's
  reference quantizer (written here in numpy), and fp16 for a matrix whose
  rows Q8_0 cannot split into blocks of 32;
- the math: a forward written the way llama.cpp computes "llama" (RoPE on
  adjacent pairs (x[2i], x[2i+1]), no reordering of anything) on the GGUF's
  weights gives the logits of the Hugging Face forward (rotate-half RoPE,
  llama_ref.py) on the model directory's weights. Without the q/k row
  reordering, or with it wrong, the logits differ at order one;
- the vocabulary: every token string, spelled in GPT-2's byte alphabet, reads
  back as the token's bytes (computed here from the tokenizer's merges), the
  merges are "left right" of those strings in rank order, <|endoftext|> is a
  control token and BOS and EOS, padding ids are unused tokens.
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref as ref  # noqa: E402
from gpt2_bytes import gpt2_byte_chars  # noqa: E402

# ------------------------------------------------------------ GGUF reader

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGML = {0: (torch.float32, 4), 1: (torch.float16, 2), 30: (torch.bfloat16, 2)}
Q8_0 = 8  # blocks of 32: an fp16 scale d, then 32 int8; the value is d * q


class Reader:
    def __init__(self, blob):
        self.b, self.o, self.elem = blob, 0, None

    def take(self, fmt):
        (v,) = struct.unpack_from(fmt, self.b, self.o)
        self.o += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take("<Q")
        s = self.b[self.o:self.o + n]
        assert len(s) == n, "string runs past the end of the file"
        self.o += n
        return s.decode("utf-8")

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("<I"), self.take("<Q")
            self.elem = et
            return [self.value(et) for _ in range(n)]
        return self.take(_SCALARS[t])


def read_gguf(path):
    """(metadata {key: value}, {name: (type, dims, tensor in numpy order)});
    metadata["__types__"] is {key: value type, or (9, element type) for an
    array}."""
    with open(path, "rb") as f:
        blob = f.read()
    r = Reader(blob)
    assert blob[:4] == b"GGUF", "bad magic"
    r.o = 4
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    assert version == 3, f"version {version}"
    meta, types = {}, {}
    for _ in range(n_kv):
        key = r.string()
        assert key not in meta, f"metadata key {key} twice"
        t = r.take("<I")
        meta[key] = r.value(t)
        types[key] = (9, r.elem) if t == 9 else t
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("<I")
        dims = [r.take("<Q") for _ in range(nd)]
        infos.append((name, dims, r.take("<I"), r.take("<Q")))
    align = meta.get("general.alignment", 32)
    start = (r.o + align - 1) // align * align
    assert all(b == 0 for b in blob[r.o:start]), "padding before the data is not zeros"
    tensors, end = {}, start
    for name, dims, typ, off in infos:  # llama.cpp wants them in order, each padded, no gaps
        assert name not in tensors, f"tensor {name} twice"
        assert off % align == 0, f"{name}: offset {off} is not a multiple of {align}"
        assert start + off == end, f"{name} is at {start + off}, not right after the tensor before it ({end})"
        n = math.prod(dims)
        nbytes = n // 32 * 34 if typ == Q8_0 else n * _GGML[typ][1]
        a = start + off
        raw = bytearray(blob[a:a + nbytes])
        assert len(raw) == nbytes, f"{name} runs past the end of the file"
        if typ == Q8_0:
            assert dims[0] % 32 == 0, f"{name}: Q8_0 rows of {dims[0]} values"
            t = np.frombuffer(raw, dtype=np.uint8).reshape(list(reversed(dims[1:])) + [dims[0] // 32, 34])
        else:
            t = torch.frombuffer(raw, dtype=_GGML[typ][0]).reshape(list(reversed(dims)))
        tensors[name] = (typ, dims, t)
        end = (a + nbytes + align - 1) // align * align
    assert end == len(blob), f"the file has {len(blob) - end} bytes after its last tensor"
    meta["__types__"] = types
    return meta, tensors


def q8_0_blocks(x):
    """ggml's reference Q8_0 of a (rows, cols) fp32 array, as (rows, cols/32,
    34) bytes: per block d = max|x| / 127 in fp32, q = round(x * (1 / d)) half
    away from zero, d stored as fp16."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (b * inv[..., None]).astype(np.float32).astype(np.float64)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    out = np.empty(b.shape[:2] + (34,), dtype=np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out


def q8_0_values(blocks):
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((d * q).reshape(blocks.shape[0], -1))


# ------------------------------------------------------------ vocabulary

def make_tokenizer(path, rng, n_merges):
    """A random valid loom tokenizer; merges use every kind of byte."""
    merges, seen, lens = [], set(), [1] * 256
    while len(merges) < n_merges:
        hi = 256 + len(merges)
        a, b = int(rng.integers(hi)), int(rng.integers(hi))
        if (a, b) in seen or lens[a] + lens[b] > 16:
            continue
        seen.add((a, b))
        merges.append([a, b])
        lens.append(lens[a] + lens[b])
    n = 256 + n_merges + 1
    with open(path, "w") as f:
        json.dump({"type": "loom-bpe", "version": 1, "vocab_size": n, "merges": merges,
                   "special": {"<|endoftext|>": n - 1}}, f)
    tok = [bytes([i]) for i in range(256)]
    for a, b in merges:
        tok.append(tok[a] + tok[b])
    return tok, merges


def check_vocabulary(meta, tok, merges, vocab_size):
    enc = gpt2_byte_chars()
    dec = {c: b for b, c in enc.items()}
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(tokens) == len(types) == vocab_size, (len(tokens), len(types), vocab_size)
    eot = len(tok)
    for i, s in enumerate(tokens):
        if i < eot:
            got = bytes(dec[c] for c in s)
            assert got == tok[i], f"token {i} reads back as {got!r}, not {tok[i]!r}"
            assert types[i] == 1, f"token {i} has type {types[i]}, not normal"
        elif i == eot:
            assert s == "<|endoftext|>" and types[i] == 3, (i, s, types[i])
        else:
            assert types[i] == 5, f"padding token {i} has type {types[i]}, not unused"
    assert len(set(tokens)) == len(tokens), "two tokens share a string"
    want = ["".join(enc[c] for c in tok[a]) + " " + "".join(enc[c] for c in tok[b]) for a, b in merges]
    assert meta["tokenizer.ggml.merges"] == want, "merges differ"
    assert meta["tokenizer.ggml.bos_token_id"] == eot and meta["tokenizer.ggml.eos_token_id"] == eot
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.pre"] == "gpt-2"


# ------------------------------------------------------------ llama.cpp's math

def rope_pairs(x, theta):
    """RoPE on adjacent pairs, as llama.cpp's "llama" (x: B, T, H, HS)."""
    HS = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, HS, 2, dtype=torch.int64).float() / HS))
    ang = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), inv_freq)  # (T, HS/2)
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def forward_gguf(meta, w, inputs):
    C = meta["llama.embedding_length"]
    NH, NKV = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    HS, eps, theta = C // NH, meta["llama.attention.layer_norm_rms_epsilon"], meta["llama.rope.freq_base"]
    B, T = inputs.shape
    x = F.embedding(inputs, w["token_embd.weight"])
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    for l in range(meta["llama.block_count"]):
        p = f"blk.{l}."
        h = ref.rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = rope_pairs(F.linear(h, w[p + "attn_q.weight"]).view(B, T, NH, HS), theta).transpose(1, 2)
        k = rope_pairs(F.linear(h, w[p + "attn_k.weight"]).view(B, T, NKV, HS), theta).transpose(1, 2)
        v = F.linear(h, w[p + "attn_v.weight"]).view(B, T, NKV, HS).transpose(1, 2)
        k, v = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
        s = (q @ k.transpose(-1, -2) / math.sqrt(HS)).masked_fill(mask, float("-inf"))
        a = torch.softmax(s, dim=-1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, C), w[p + "attn_output.weight"])
        h = ref.rms_norm(x, w[p + "ffn_norm.weight"], eps)
        x = x + F.linear(F.silu(F.linear(h, w[p + "ffn_gate.weight"])) * F.linear(h, w[p + "ffn_up.weight"]),
                         w[p + "ffn_down.weight"])
    x = ref.rms_norm(x, w["output_norm.weight"], eps)
    return F.linear(x, w.get("output.weight", w["token_embd.weight"]))


# ------------------------------------------------------------ the checks

GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, l, rest = hf.split(".", 3)
    return f"blk.{l}.{GGUF_NAMES[rest[:-len('.weight')]]}.weight"


def interleave_heads(w, heads):
    """llama.cpp's converter's reordering of a Hugging Face q/k matrix (its
    `permute`): per head, rows (2, HS/2) -> (HS/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# u32 = 4, i32 = 5, f32 = 6, bool = 7, string = 8, array = 9: the types
# llama.cpp's loader reads each key as (it refuses another).
KEY_TYPES = {"general.architecture": 8, "general.file_type": 4, "general.alignment": 4,
             "llama.context_length": 4, "llama.embedding_length": 4, "llama.block_count": 4,
             "llama.feed_forward_length": 4, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 4,
             "llama.rope.dimension_count": 4, "llama.rope.freq_base": 6,
             "llama.attention.layer_norm_rms_epsilon": 6, "llama.vocab_size": 4,
             "tokenizer.ggml.model": 8, "tokenizer.ggml.pre": 8, "tokenizer.ggml.tokens": (9, 8),
             "tokenizer.ggml.token_type": (9, 5), "tokenizer.ggml.merges": (9, 8),
             "tokenizer.ggml.bos_token_id": 4, "tokenizer.ggml.eos_token_id": 4,
             "tokenizer.ggml.add_bos_token": 7, "tokenizer.ggml.add_eos_token": 7}


def export(loom, model, out, dtype, *extra):
    cmd = [loom, "export", "--model", model, "--out", out, "--format", "gguf", "--dtype", dtype, *extra]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"gguf_check: FAIL: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")


def check_model(loom, work, label, config, tokenizer, dtypes, rng):
    d = os.path.join(work, label)
    ref.make_model_dir(d, config, rng, embed_std=None)
    tok, merges = tokenizer
    cfg, params = ref.load_model_dir(d)
    inputs = torch.from_numpy(rng.integers(cfg.vocab_size, size=(2, 24)))
    with torch.no_grad():
        want, _ = ref.forward(cfg, params, inputs, torch.full_like(inputs, -1))
    for dtype in dtypes:
        out = os.path.join(work, f"{label}.{dtype}.gguf")
        export(loom, d, out, dtype, "--tokenizer", os.path.join(work, "tokenizer.json"))
        meta, tensors = read_gguf(out)
        expect = {"general.architecture": "llama", "llama.embedding_length": cfg.dim,
                  "llama.block_count": cfg.n_layers, "llama.feed_forward_length": cfg.ffn_dim,
                  "llama.attention.head_count": cfg.n_heads, "llama.attention.head_count_kv": cfg.n_kv_heads,
                  "llama.rope.dimension_count": cfg.head_size, "llama.context_length": cfg.max_seq,
                  "llama.vocab_size": cfg.vocab_size, "llama.rope.freq_base": ref.f32(cfg.rope_theta),
                  "llama.attention.layer_norm_rms_epsilon": ref.f32(cfg.norm_eps)}
        for k, v in expect.items():
            assert meta.get(k) == v, f"{label} {dtype}: {k} is {meta.get(k)!r}, not {v!r}"
        for k, t in KEY_TYPES.items():
            assert meta["__types__"].get(k) == t, f"{label} {dtype}: {k} has type {meta['__types__'].get(k)}, not {t}"
        check_vocabulary(meta, tok, merges, cfg.vocab_size)
        names = {gguf_name(n): n for n in cfg.param_shapes()}
        assert set(tensors) == set(names), f"{label}: tensors {sorted(set(tensors) ^ set(names))} differ"
        w, stored = {}, set()
        for g, hf in names.items():
            typ, dims, t = tensors[g]
            p = params[hf].detach()
            assert dims == list(reversed(p.shape)), f"{g}: dims {dims}, model shape {list(p.shape)}"
            # Norms stay fp32; Q8_0 needs rows of a multiple of 32 (else fp16).
            store = "fp32" if p.dim() == 1 else "fp16" if dtype == "q8_0" and p.shape[1] % 32 else dtype
            want_typ = {"fp32": 0, "fp16": 1, "bf16": 30, "q8_0": Q8_0}[store]
            assert typ == want_typ, f"{label} {dtype}: {g} stored as type {typ}, not {want_typ}"
            # q and k in the converter's order; the rest as they are.
            heads = cfg.n_heads if ".attn_q." in g else cfg.n_kv_heads if ".attn_k." in g else 0
            v = interleave_heads(p.numpy(), heads) if heads else p.numpy()
            if store == "q8_0":
                assert np.array_equal(t, q8_0_blocks(v)), f"{label} {dtype}: {g} is not ggml's Q8_0"
                w[g] = q8_0_values(t)
            else:
                tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[store]
                assert torch.equal(t, torch.from_numpy(v).to(tdt)), f"{label} {dtype}: {g} is not the model's values"
                w[g] = t.float()
            stored.add(store)
        # general.file_type: what the matrices were written as (q8_0 asked
        # for with every matrix in fp16 is fp16).
        matrices = "q8_0" if "q8_0" in stored else "fp16" if dtype == "q8_0" else dtype
        want_ft = {"fp32": 0, "fp16": 1, "bf16": 32, "q8_0": 7}[matrices]
        assert meta["general.file_type"] == want_ft, \
            f"{label} {dtype}: general.file_type is {meta['general.file_type']}, not {want_ft}"
        if dtype == "q8_0":
            print(f"gguf_check: {label} q8_0: matrices stored as {sorted(stored - {'fp32'})}")
        with torch.no_grad():
            got = forward_gguf(meta, w, inputs)
        tol = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2, "q8_0": 5e-2}[dtype]
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"gguf_check: {label} {dtype}: logits vs the Hugging Face forward, max rel err {err:.2e} (tol {tol})")
        assert err < tol, f"{label} {dtype}: logits differ (rel err {err:.3e} >= {tol})"
        if dtype == "fp32":
            # The reordering is what makes them agree: without it they do not.
            unpermuted = dict(w)
            for g, hf in names.items():
                if ".attn_q." in g or ".attn_k." in g:
                    unpermuted[g] = params[hf].detach()
            with torch.no_grad():
                bad = forward_gguf(meta, unpermuted, inputs)
            assert ((bad - want).abs().max() / want.abs().max()).item() > 100 * tol, \
                "the check cannot tell the q/k reordering from none"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    rng = np.random.default_rng(20261201)
    torch.manual_seed(0)
    tokenizer = make_tokenizer(os.path.join(a.workdir, "tokenizer.json"), rng, 200)
    n_tok = 256 + 200 + 1
    gqa = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 80, "vocab_size": n_tok + 7, "max_position_embeddings": 64,
           "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    tied = {"hidden_size": 36, "num_hidden_layers": 1, "num_attention_heads": 3, "intermediate_size": 52,
            "vocab_size": n_tok, "tie_word_embeddings": True}
    check_model(a.loom, a.workdir, "gqa", gqa, tokenizer, ["fp32", "bf16", "fp16", "q8_0"], rng)
    check_model(a.loom, a.workdir, "tied", tied, tokenizer, ["fp32", "q8_0"], rng)  # rows of 36: q8_0 -> fp16
    print("gguf_check: passed")


if __name__ == "__main__":
    main()
