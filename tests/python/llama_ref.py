"""llama_ref.py — loom's PyTorch oracle: a compact LLaMA, its training step and
the file formats loom reads and writes, written for the cross-check only.

The model follows Hugging Face's LlamaForCausalLM term by term: RMSNorm
x * rsqrt(mean(x^2) + eps) * w (statistics in fp32), rotate-half RoPE with
inv_freq = 1 / theta^(arange(0, HS, 2) / HS) in fp32, grouped-query attention
by repeat_interleave of the kv heads, causal softmax attention (softmax in
fp32), SwiGLU MLP down(silu(gate(x)) * up(x)), lm_head (or the tied
embedding), and mean cross-entropy over targets != -1.

The optimizer is loom's, not torch.optim's: AdamW (b1 .9, b2 .95, eps 1e-8)
with the decoupled decay inside the update, p -= lr * (mhat / (sqrt(vhat) +
eps) + wd * p), no decay on 1-D parameters, the global-norm clip coefficient
max_norm / (norm + 1e-6) folded into the gradient, and warmup + cosine
learning rates, each in fp32 in the same order of operations as
src/optim/adamw.c, src/kernels/adamw.c and src/amp/amp.c.

Needs only torch and numpy (no transformers, no safetensors package).
"""
import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ files

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path):
    """Returns ({name: tensor}, metadata) of a safetensors file: an 8-byte
    little-endian header length, a JSON header, then the raw tensor bytes."""
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + hlen])
    data = blob[8 + hlen:]
    meta = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; only F32, BF16, F16 are read")
        a, b = info["data_offsets"]
        raw = bytearray(data[a:b])  # writable: torch.frombuffer warns on bytes
        t = torch.frombuffer(raw, dtype=dtype) if b > a else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"]).clone()
    return tensors, meta


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} (F32, BF16 or F16) as a safetensors file."""
    header, chunks, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        # bytes of any dtype: view the storage as uint8 (numpy has no bf16)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)  # align the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


SHARD_MAGIC_U16, SHARD_VERSION_U16 = 20240520, 1


def write_shard(path, tokens):
    """An llm.c shard: 256 int32 header (magic, version, count) + uint16 tokens."""
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 65536
    header = np.zeros(256, dtype="<i4")
    header[:3] = [SHARD_MAGIC_U16, SHARD_VERSION_U16, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_lora_run(base_dir, run_dir):
    """A `loom train --lora` run against its base model directory: the base
    weights, the run's saved (merged) weights, its PEFT adapter tensors and
    adapter_config.json."""
    base, _ = read_safetensors(base_dir + "/model.safetensors")
    tuned, _ = read_safetensors(run_dir + "/model/model.safetensors")
    lora, _ = read_safetensors(run_dir + "/adapter/adapter_model.safetensors")
    with open(run_dir + "/adapter/adapter_config.json") as f:
        cfg = json.load(f)
    return base, tuned, lora, cfg


def read_shard(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        assert header[0] == SHARD_MAGIC_U16 and header[1] == SHARD_VERSION_U16, path
        tokens = np.frombuffer(f.read(), dtype="<u2")
    assert len(tokens) == header[2], path
    return tokens.astype(np.int64)


def batches(tokens, B, T):
    """loom's data loader on one shard, one rank: step k reads the span
    tokens[off : off + B*T + 1], inputs = span[:-1], targets = span[1:], then
    off += B*T; when fewer than B*T + 1 tokens remain it starts again at 0."""
    off = 0
    while True:
        if len(tokens) - off < B * T + 1:
            off = 0
        span = torch.from_numpy(tokens[off:off + B * T + 1].copy())
        yield span[:-1].view(B, T), span[1:].view(B, T)
        off += B * T


# ------------------------------------------------------------------ model

class Config:
    """The fields of a Hugging Face LlamaConfig that the math uses, with
    LlamaConfig's defaults for the optional ones."""

    def __init__(self, d):
        self.dim = d["hidden_size"]
        self.n_layers = d["num_hidden_layers"]
        self.n_heads = d["num_attention_heads"]
        self.n_kv_heads = d.get("num_key_value_heads") or self.n_heads
        self.ffn_dim = d["intermediate_size"]
        self.vocab_size = d["vocab_size"]
        self.max_seq = d.get("max_position_embeddings", {"qwen2": 32768, "qwen3": 32768, "smollm3": 32768,
                                                          "gemma": 8192, "gemma2": 8192, "gemma3_text": 131072,
                                                          "phi3": 4096}.get(d.get("model_type"), 2048))
        mt = d.get("model_type", "llama")
        self.rope_theta = float(d.get("rope_theta", {"smollm3": 2e6, "gemma3_text": 1e6}.get(mt, 10000.0)))
        self.rope_scaling = d.get("rope_scaling")
        # Phi-3's longrope: its short factors for a forward within its original context, its long ones for one past
        # it (the longrope update: the forward's largest position + 1 against the original); cosines and sines times
        # an attention factor, given or sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original
        # (modeling_rope_utils.py)
        rs = self.rope_scaling or {}
        self.rope_af = 1.0
        if rs.get("rope_type", rs.get("type")) in ("longrope", "su"):
            top = d.get("original_max_position_embeddings")
            orig = top or rs["original_max_position_embeddings"]
            s = self.max_seq / orig if top or "factor" not in rs else rs["factor"]
            self.rope_af = rs.get("attention_factor") or (1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig)))
            self.rope_scaling = dict(rs, original_max_position_embeddings=orig)
        if rs.get("rope_type", rs.get("type")) == "yarn":  # _compute_yarn_parameters' defaults, resolved here
            orig = rs.get("original_max_position_embeddings") or self.max_seq
            factor = rs.get("factor") or self.max_seq / orig

            def mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
            both = rs.get("mscale") and rs.get("mscale_all_dim")
            self.rope_af = rs.get("attention_factor") or (
                mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"]) if both else mscale(factor))
            self.rope_scaling = dict(rs, factor=factor, original_max_position_embeddings=orig)
        # Phi-3's files fuse q, k, v (qkv_proj) and gate, up (gate_up_proj); Phi3Config's eps is 1e-5
        self.fused = d.get("model_type") == "phi3"
        self.norm_eps = float(d.get("rms_norm_eps", 1e-5 if self.fused else 1e-6))
        self.tie = bool(d.get("tie_word_embeddings", False))
        # Qwen 2's attention has biases on q, k and v; LLaMA's attention_bias puts them on o too
        # Qwen 3's: a norm of each query and key head before RoPE, LLaMA's attention_bias, head_dim 128 by default
        # Gemma 3's (text): Gemma 2's, with q/k norms of 1 + weight, no softcaps by default, its windowed blocks
        # rotating with rope_local_base_freq (Gemma3TextConfig's 10000; rope_theta 1e6)
        self.gemma3 = mt == "gemma3_text"
        self.rope_local = float(d.get("rope_local_base_freq", 10000.0)) if self.gemma3 else None
        qwen2, self.qk_norm = mt == "qwen2", mt in ("qwen3", "gemma3_text")
        self.qkv_bias = qwen2 or bool(d.get("attention_bias", False))
        self.o_bias = not qwen2 and bool(d.get("attention_bias", False))
        # Gemma's: norms scale by 1 + weight (computed in fp32), embeddings by sqrt(hidden_size) in the activations'
        # dtype, the tanh GELU's gate (hidden_activation, which its first files leave out and call hidden_act
        # "gelu"), heads of 256, tied, 16 kv heads by default
        # Gemma 2's, beside Gemma's: norms of each block's attention and MLP outputs (post_attention_layernorm,
        # post_feedforward_layernorm; the MLP's input norm is pre_feedforward_layernorm), the scores scaled by
        # query_pre_attn_scalar^-0.5 and softcapped, the logits softcapped; hidden_activation alone
        self.gemma2 = mt in ("gemma2", "gemma3_text")  # the post norms, scale, softcaps and activation
        self.gemma = mt == "gemma" or self.gemma2
        act = d.get("hidden_act", "silu")
        if self.gemma2:
            act = d.get("hidden_activation") or "gelu_pytorch_tanh"
        elif self.gemma:  # hidden_activation; else hidden_act, where "gelu" (or nothing) means the tanh GELU
            act = d.get("hidden_activation") or ("gelu_pytorch_tanh" if d.get("hidden_act", "gelu") == "gelu" else act)
        self.attn_softcap = d.get("attn_logit_softcapping", None if self.gemma3 else 50.0) if self.gemma2 else None
        self.final_softcap = d.get("final_logit_softcapping", None if self.gemma3 else 30.0) if self.gemma2 else None
        self.qpas = d.get("query_pre_attn_scalar", 256) if self.gemma2 else None
        self.attn_dropout = float(d.get("attention_dropout") or 0.0)  # training forwards only
        assert act in ("silu", "gelu_pytorch_tanh", "gelu_new"), act
        self.gelu = act != "silu"
        if self.gemma:  # Gemma 2's too (its default kv heads 4)
            self.tie = bool(d.get("tie_word_embeddings", True))
            self.n_kv_heads = d.get("num_key_value_heads", 4 if self.gemma2 else 16)
        self.head_size = d.get("head_dim") or (128 if mt == "qwen3" else 256 if self.gemma else self.dim // self.n_heads)
        # Phi-3's partial_rotary_factor (Phi-4-mini's): RoPE turns the first int(head_size * factor) of each head
        prf = d.get("partial_rotary_factor") or (d.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
        self.rotary = int(self.head_size * prf) if self.fused else self.head_size
        # SmolLM3's NoPE blocks: no_rope_layers (1: RoPE), else every no_rope_layer_interval-th block without
        self.rope_layers = [1] * self.n_layers
        if d.get("model_type") == "smollm3":
            n = d.get("no_rope_layer_interval", 4)
            self.rope_layers = d.get("no_rope_layers") or [int((l + 1) % n != 0) for l in range(self.n_layers)]
            self.tie = bool(d.get("tie_word_embeddings", True))
        # Granite's: embeddings times embedding_multiplier, the attention's and the MLP's outputs times
        # residual_multiplier, the scores times attention_multiplier (not 1/sqrt(head size)), the logits divided by
        # logits_scaling; GraniteConfig's 1.0 each
        self.granite = d.get("model_type") == "granite"
        self.mult = {k: float(d.get(k, 1.0)) for k in ("embedding_multiplier", "residual_multiplier",
                                                         "attention_multiplier", "logits_scaling")}
        # Sliding windows, as each config class sets them (windows[l]: keys a query of block l sees, None: all):
        # Mistral's (4096 by default) and Phi-3's on every block, Gemma 2's (4096) on the even blocks, Qwen's
        # (4096) only with use_sliding_window and from max_window_layers (28) on; a layer_types list over these
        w = d.get("sliding_window", 4096 if mt in ("mistral", "gemma2", "gemma3_text", "qwen2", "qwen3") else None)
        if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            w = None
        if mt in ("gemma2", "gemma3_text"):  # Gemma 3's older files: sliding_window_pattern (6)
            n = d.get("sliding_window_pattern", 6) if self.gemma3 else 2
            sliding = [bool((l + 1) % n) for l in range(self.n_layers)]
        elif mt in ("qwen2", "qwen3"):
            sliding = [l >= d.get("max_window_layers", 28) for l in range(self.n_layers)]
        else:
            sliding = [mt in ("mistral", "phi3")] * self.n_layers
        if d.get("layer_types") is not None and mt in ("gemma2", "gemma3_text", "qwen2", "qwen3"):  # who read it
            sliding = [t == "sliding_attention" for t in d["layer_types"]]
        self.windows = [w if sliding[l] else None for l in range(self.n_layers)]
        self.sliding = sliding  # Gemma 3's local RoPE follows the pattern, a window or not
        self.lora_scale = None  # LoRA's alpha / rank, when params hold adapters

    def param_shapes(self):
        """{Hugging Face name: shape} in loom's parameter order."""
        C, F_, V, KV = self.dim, self.ffn_dim, self.vocab_size, self.n_kv_heads * self.head_size
        s = {"model.embed_tokens.weight": (V, C)}
        for l in range(self.n_layers):
            p = f"model.layers.{l}."
            s[p + "input_layernorm.weight"] = (C,)
            Q = self.n_heads * self.head_size
            for proj, out, inp in (("q", Q, C), ("k", KV, C), ("v", KV, C), ("o", C, Q)):
                s[p + f"self_attn.{proj}_proj.weight"] = (out, inp)
                if self.o_bias if proj == "o" else self.qkv_bias:
                    s[p + f"self_attn.{proj}_proj.bias"] = (out,)
            if self.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (self.head_size,)
                s[p + "self_attn.k_norm.weight"] = (self.head_size,)
            s[p + "post_attention_layernorm.weight"] = (C,)  # Gemma 2's: the attention output's norm
            if self.gemma2:
                s[p + "pre_feedforward_layernorm.weight"] = (C,)
            s[p + "mlp.gate_proj.weight"] = (F_, C)
            s[p + "mlp.up_proj.weight"] = (F_, C)
            s[p + "mlp.down_proj.weight"] = (C, F_)
            if self.gemma2:
                s[p + "post_feedforward_layernorm.weight"] = (C,)
        s["model.norm.weight"] = (C,)
        if not self.tie:
            s["lm_head.weight"] = (V, C)
        return s


FUSED = (("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight")),
         ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")))


def fuse(cfg, tensors):
    """Phi-3's file layout of {name: tensor}: each layer's q, k, v rows in one qkv_proj, gate and up in one
    gate_up_proj."""
    out = dict(tensors)
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        for fused, parts in FUSED:
            out[p + fused] = torch.cat([out.pop(p + q) for q in parts], dim=0)
    return out


def unfuse(cfg, tensors):
    """The parts of Phi-3's fused tensors, by their shapes in cfg.param_shapes()."""
    out, shapes = dict(tensors), cfg.param_shapes()
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        for fused, parts in FUSED:
            rows = [shapes[p + q][0] for q in parts]
            for q, t in zip(parts, torch.split(out.pop(p + fused), rows, dim=0)):
                out[p + q] = t.contiguous()
    return out


def load_model_dir(path):
    """(Config, {name: fp32 leaf tensor}) from config.json + model.safetensors; Phi-3's fused tensors as they
    are (the forward slices them as Hugging Face's Phi3 does; grads() names their parts)."""
    with open(f"{path}/config.json") as f:
        cfg = Config(json.load(f))
    tensors, _ = read_safetensors(f"{path}/model.safetensors")
    shapes = cfg.param_shapes()
    if cfg.fused:
        shapes = {k: tuple(v.shape) for k, v in fuse(cfg, {k: torch.empty(s) for k, s in shapes.items()}).items()}
    params = {}
    for name, shape in shapes.items():
        t = tensors[name].float()
        assert tuple(t.shape) == shape, (name, t.shape, shape)
        params[name] = t.requires_grad_(True)
    return cfg, params


def make_model_dir(d, config, rng, embed_std=0.02):
    """A random model directory (config.json + model.safetensors). Weight
    scales are chosen so that every part of the math matters: projections ~
    1/sqrt(fan_in) give attention scores of order one (a nearly uniform
    softmax would hide RoPE and mask errors), norm weights are 1 +- 0.2 (not
    all ones), and the embedding is small (std embed_std, 0.02 like a fresh
    LLaMA) so that mean(x^2) ~ 4e-4 and the RMSNorm eps changes the result by
    ~1e-2 .. 1e-3; embed_std None scales it as the projections."""
    os.makedirs(d, exist_ok=True)
    cfg = Config(config)
    tensors = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith(".bias"):
            w = 0.3 * rng.standard_normal(shape)
        elif len(shape) == 1:  # Gemma's are offsets from 1
            w = (0.0 if cfg.gemma else 1.0) + 0.2 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight" and embed_std is not None:
            w = embed_std * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[name] = torch.from_numpy(w.astype(np.float32))
    write_safetensors(os.path.join(d, "model.safetensors"), fuse(cfg, tensors) if cfg.fused else tensors,
                      {"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        mt = config.get("model_type", "llama")
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "granite": "GraniteForCausalLM",
                "phi3": "Phi3ForCausalLM",
                "smollm3": "SmolLM3ForCausalLM", "mistral": "MistralForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}[mt]
        act = config.get("hidden_act", "gelu" if mt == "gemma" else "silu")  # Gemma 1.0's files say "gelu"
        json.dump(dict(config, architectures=[arch], model_type=mt, hidden_act=act,
                       torch_dtype="float32"), f, indent=2)


def rms_norm(x, w, eps, gemma=False):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # GemmaRMSNorm: (1 + w) in fp32, rounded once
        return (y * (1.0 + w.float())).to(x.dtype)
    return w * y.to(x.dtype)


def rope_inv_freq(HS, theta, scaling=None, seq_len=0):
    """Hugging Face's inv_freq (modeling_rope_utils.py), scaled as rope_scaling says: "linear" divides by
    factor; "llama3" keeps the high frequencies, divides the low ones by factor, blends between; "longrope" by
    its short factors, or its long ones for a forward of seq_len positions past the original context."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, HS, 2, dtype=torch.int64).float() / HS))  # (HS/2) fp32
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("longrope", "su"):
        shape = torch.arange(0, HS, 2, dtype=torch.int64).float() / HS
        ext = scaling["long_factor" if seq_len > scaling["original_max_position_embeddings"] else "short_factor"]
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape)
    elif kind == "yarn":  # the extrapolated frequencies below the correction range, interpolated above, a ramp between
        factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def corr(rotations):
            return HS * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = corr(beta_fast), corr(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, HS - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(HS // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos = theta ** (torch.arange(0, HS, 2).float() / HS)
        keep = 1 - ramp
        inv_freq = 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, llama)
    return inv_freq


def rope_cos_sin(T, HS, theta, scaling=None, af=1.0):
    inv_freq = rope_inv_freq(HS, theta, scaling, T)
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)  # (T, HS/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, HS)
    return emb.cos() * af, emb.sin() * af


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def lin(x, params, name, cfg):
    """x W^T for the weight `name`.weight, plus PEFT's LoRA term
    lora_scale * (x A^T) B^T when params hold its adapter (`name`.lora_A.weight,
    `name`.lora_B.weight) and cfg.lora_scale is set; with DoRA's magnitudes
    (`name`.lora_magnitude_vector) too, PEFT's DoRA term: c = m / |W + s B A|
    per row, the norm detached, y + (c - 1) y + c s (x A^T) B^T. Then the
    bias `name`.bias, if any, which PEFT's DoRA does not scale."""
    w = params[name + ".weight"]
    bias = params.get(name + ".bias")
    y = F.linear(x, w)
    a = params.get(name + ".lora_A.weight")
    if a is None:
        return y if bias is None else y + bias
    b = params[name + ".lora_B.weight"]
    lora = F.linear(F.linear(x, a), b) * cfg.lora_scale
    m = params.get(name + ".lora_magnitude_vector")
    if m is None:
        out = y + lora
    else:
        with torch.no_grad():
            norm = (w + cfg.lora_scale * b @ a).norm(dim=1)
        c = (m / norm).view(1, -1)
        out = y + (c - 1) * y + c * lora
    return out if bias is None else out + bias


# ---------------------------------------------------------------- dropout

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(seed, counters):
    """Philox4x32-10 (Salmon et al., SC 2011) of the 64-bit counters (uint64
    array) under the 64-bit seed, as loom's src/core/rng.c keys it: counter
    {low, high, 0, 0}, key {low, high}. Returns (n, 4) uint32."""
    m32 = np.uint64(0xFFFFFFFF)
    c = [counters & m32, counters >> np.uint64(32), np.zeros_like(counters), np.zeros_like(counters)]
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    for _ in range(10):
        p0, p1 = np.uint64(_PHILOX_M[0]) * c[0], np.uint64(_PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & m32, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & m32]
        k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
    return np.stack(c, axis=1).astype(np.uint32)


# Random123's known answer for Philox4x32-10, counter and key zero
assert [int(v) for v in philox4x32(0, np.zeros(1, dtype=np.uint64))[0]] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C,
                                                                             0x9B00DBD8]


def dropout_factors(rng, shape, p):
    """loom's dropout mask over a tensor of `shape` drawn from rng (a dict:
    seed, and the offset in 4 x 32-bit blocks, moved past the tensor's
    draws, as loom_rng_reserve does): element e is kept when lane e % 4 of
    Philox(seed, offset + e / 4), as (bits >> 8) / 2^24, is >= p. Returns the
    fp32 factors 1 / (1 - p) or 0."""
    n = int(np.prod(shape))
    blocks = (n + 3) // 4
    r = philox4x32(rng["seed"], np.arange(blocks, dtype=np.uint64) + np.uint64(rng["offset"])).reshape(-1)[:n]
    rng["offset"] += blocks
    u = (r >> 8).astype(np.float32) * np.float32(1.0 / 16777216.0)
    keep = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return torch.from_numpy(np.where(u >= np.float32(p), keep, np.float32(0.0)).astype(np.float32)).view(shape)


def attention(x, params, p, cfg, cos, sin, window=None, rng=None):
    B, T, C = x.shape
    NH, NKV, HS = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
    if cfg.fused:  # Phi3Attention: qkv_proj's output cut at query_pos and after the keys
        qkv = lin(x, params, p + "self_attn.qkv_proj", cfg)
        qp = NH * HS
        q, k, v = qkv[..., :qp], qkv[..., qp:qp + NKV * HS], qkv[..., qp + NKV * HS:]
        q, k = q.reshape(B, T, NH, HS), k.reshape(B, T, NKV, HS)
        v = v.reshape(B, T, NKV, HS).transpose(1, 2)
    else:
        q = lin(x, params, p + "self_attn.q_proj", cfg).view(B, T, NH, HS)
        k = lin(x, params, p + "self_attn.k_proj", cfg).view(B, T, NKV, HS)
        v = lin(x, params, p + "self_attn.v_proj", cfg).view(B, T, NKV, HS).transpose(1, 2)
    if cfg.qk_norm:  # Gemma 3's scale by 1 + weight
        q = rms_norm(q, params[p + "self_attn.q_norm.weight"], cfg.norm_eps, cfg.gemma)
        k = rms_norm(k, params[p + "self_attn.k_norm.weight"], cfg.norm_eps, cfg.gemma)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, NH, T, HS)
    if cos is not None:  # None: one of SmolLM3's NoPE blocks
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        rd = cfg.rotary  # Phi3Attention: the rotary part turns, the rest passes
        q = torch.cat((q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]), dim=-1)
        k = torch.cat((k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]), dim=-1)
    k = k.repeat_interleave(NH // NKV, dim=1)  # query head h reads kv head h // (NH / NKV)
    v = v.repeat_interleave(NH // NKV, dim=1)
    if cfg.granite:  # GraniteAttention's scaling
        s = (q @ k.transpose(-1, -2)) * cfg.mult["attention_multiplier"]
    elif cfg.gemma2:  # Gemma2Attention: query_pre_attn_scalar's scaling, then the softcap
        s = (q @ k.transpose(-1, -2)) * cfg.qpas ** -0.5
        if cfg.attn_softcap:
            s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
    else:
        s = q @ k.transpose(-1, -2) / math.sqrt(HS)  # (B, NH, T, T)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    if window is not None:  # masking_utils' sliding window: key j seen by query i when i - window < j <= i
        mask |= torch.ones(T, T, dtype=torch.bool).tril(-window)
    s = s.masked_fill(mask, float("-inf"))
    a = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    if rng is not None and cfg.attn_dropout > 0:  # the eager attention's dropout(attn_weights) in training
        a = a * dropout_factors(rng, a.shape, cfg.attn_dropout).to(a.dtype)
    a = a @ v  # (B, NH, T, HS)
    return lin(a.transpose(1, 2).reshape(B, T, NH * HS), params, p + "self_attn.o_proj", cfg)


def mlp(x, params, p, cfg):
    if cfg.fused:  # Phi3MLP: gate, up = gate_up_proj(x).chunk(2, dim=-1)
        g, u = lin(x, params, p + "mlp.gate_up_proj", cfg).chunk(2, dim=-1)
    else:
        g = lin(x, params, p + "mlp.gate_proj", cfg)
        u = lin(x, params, p + "mlp.up_proj", cfg)
    act = F.gelu(g, approximate="tanh") if cfg.gelu else F.silu(g)
    return lin(act * u, params, p + "mlp.down_proj", cfg)


def forward(cfg, params, inputs, targets, dtype=torch.float32, rng=None):
    """Logits (B, T, V) in `dtype` and the fp32 mean cross-entropy over
    targets != -1. With dtype bf16 every weight is cast (differentiably) and
    the activations are bf16, as in Hugging Face's model.to(torch.bfloat16).
    rng (training: loom's default RNG, a dict of seed and offset): the
    config's attention dropout draws its masks from it, block by block."""
    w = {k: v.to(dtype) for k, v in params.items()}
    B, T = inputs.shape
    cos, sin = rope_cos_sin(T, cfg.rotary, cfg.rope_theta, cfg.rope_scaling, cfg.rope_af)
    if cfg.gemma3:  # Gemma3TextModel's rotary_emb_local: the default RoPE of its own base, on the windowed blocks
        cos_l, sin_l = rope_cos_sin(T, cfg.head_size, cfg.rope_local, None, 1.0)
    x = F.embedding(inputs, w["model.embed_tokens.weight"])  # (B, T, C)
    if cfg.gemma:  # GemmaModel: times sqrt(hidden_size) as a tensor of the activations' dtype
        x = x * torch.tensor(cfg.dim ** 0.5, dtype=x.dtype)
    g = cfg.gemma
    rm = cfg.mult["residual_multiplier"] if cfg.granite else None
    if cfg.granite:  # GraniteModel: a Python float, so fp32 math rounded to the activations' dtype once
        x = x * cfg.mult["embedding_multiplier"]
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        rope = cfg.rope_layers[l]
        c_, s_ = (cos_l, sin_l) if cfg.gemma3 and cfg.sliding[l] else (cos, sin)
        a = attention(rms_norm(x, w[p + "input_layernorm.weight"], cfg.norm_eps, g), w, p, cfg, c_ if rope else None,
                      s_ if rope else None, cfg.windows[l], rng)
        if cfg.gemma2:
            a = rms_norm(a, w[p + "post_attention_layernorm.weight"], cfg.norm_eps, g)
        x = x + (a if rm is None else a * rm)
        if cfg.gemma2:
            f = mlp(rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.norm_eps, g), w, p, cfg)
            f = rms_norm(f, w[p + "post_feedforward_layernorm.weight"], cfg.norm_eps, g)
        else:
            f = mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps, g), w, p, cfg)
        x = x + (f if rm is None else f * rm)
    x = rms_norm(x, w["model.norm.weight"], cfg.norm_eps, g)
    head = w["model.embed_tokens.weight"] if cfg.tie else w["lm_head.weight"]
    logits = F.linear(x, head)  # (B, T, V)
    if cfg.granite:  # GraniteForCausalLM
        logits = logits / cfg.mult["logits_scaling"]
    if cfg.gemma2 and cfg.final_softcap:  # Gemma2ForCausalLM
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), targets.reshape(-1), ignore_index=-1)
    return logits, loss


def train_rng(seed=1337):
    """loom train's default RNG at its first step (--seed, 1337 unless said)."""
    return {"seed": seed, "offset": 0}


def grads(cfg, params, inputs, targets, dtype=torch.float32, rng=None):
    """(logits, loss, {name: fp32 gradient}) of one forward and backward, for
    the parameters that require one; rng: forward's."""
    for t in params.values():
        t.grad = None
    logits, loss = forward(cfg, params, inputs, targets, dtype, rng)
    loss.backward()
    g = {k: v.grad.detach().float().clone() for k, v in params.items() if v.requires_grad}
    return logits.detach(), loss.item(), unfuse(cfg, g) if cfg.fused else g  # named as loom's parameters


# -------------------------------------------------------------- optimizer

def f32(x):
    """x rounded to fp32, as a Python float (what a C float holds)."""
    return float(np.float32(x))


def lr_cosine(step, warmup, total, max_lr, min_lr):
    """loom_lr_cosine: linear warmup (step+1)/warmup * max_lr, then a cosine
    from max_lr to min_lr over the remaining steps (progress in double, the
    blend in fp32)."""
    max_lr, min_lr = np.float32(max_lr), np.float32(min_lr)
    if warmup > 0 and step < warmup:
        return float(max_lr * np.float32(step + 1) / np.float32(warmup))
    if step >= total:
        return float(min_lr)
    progress = (step - warmup) / max(total - warmup, 1)
    c = 0.5 * (1.0 + math.cos(math.pi * progress))
    return float(min_lr + np.float32(c) * (max_lr - min_lr))


class AdamW:
    """loom's AdamW on fp32 masters (src/optim/adamw.c, src/kernels/adamw.c)."""

    def __init__(self, params, weight_decay, b1=0.9, b2=0.95, eps=1e-8):
        self.params = params
        self.b1, self.b2, self.eps, self.wd = f32(b1), f32(b2), f32(eps), f32(weight_decay)
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.steps = 0

    @torch.no_grad()
    def step(self, lr, grad_multiplier):
        self.steps += 1
        t = self.steps
        bc1 = f32(1.0 - self.b1 ** t)  # computed in double, rounded to fp32
        bc2 = f32(1.0 - self.b2 ** t)
        c1, c2 = f32(np.float32(1) - np.float32(self.b1)), f32(np.float32(1) - np.float32(self.b2))
        for name, p in self.params.items():
            wd = 0.0 if p.dim() == 1 else self.wd  # no decay on norms
            g = p.grad * grad_multiplier
            m = self.b1 * self.m[name] + c1 * g
            v = self.b2 * self.v[name] + c2 * g * g
            update = (m / bc1) / (torch.sqrt(v / bc2) + self.eps) + wd * p
            self.m[name], self.v[name] = m, v
            p -= lr * update


def clip_multiplier(params, max_norm):
    """(grad_norm, multiplier) as loom_amp_prepare_step: the global norm of
    all gradients (sum of squares in double), coefficient max_norm / (norm +
    1e-6) when norm > max_norm, rounded to fp32."""
    ss = sum(float(p.grad.double().pow(2).sum()) for p in params.values())
    norm = math.sqrt(ss)
    coef = 1.0
    if max_norm > 0 and norm > max_norm:
        coef = f32(max_norm / (norm + 1e-6))
    return norm, coef


@torch.no_grad()
def eval_losses(cfg, params, data, B, T, steps):
    """The loss of each of the first `steps` batches with the weights fixed."""
    it = batches(data, B, T)
    return [forward(cfg, params, *next(it))[1].item() for _ in range(steps)]


def train(cfg, params, data, B, T, steps, lr, min_lr, warmup, weight_decay, clip, trainable=None):
    """loom train's loop, one micro-batch per step: returns the loss of each
    step (before its update). trainable: the names the optimizer steps and
    clipping sees (LoRA's adapters); default every parameter."""
    stepped = {k: params[k] for k in (trainable or params)}
    opt = AdamW(stepped, weight_decay)
    it = batches(data, B, T)
    losses = []
    rng = train_rng()
    for step in range(steps):
        inputs, targets = next(it)
        for p in params.values():
            p.grad = None
        _, loss = forward(cfg, params, inputs, targets, rng=rng)
        loss.backward()
        losses.append(loss.item())
        _, mult = clip_multiplier(stepped, clip)
        opt.step(lr_cosine(step, warmup, steps, lr, min_lr), mult)
    return losses
