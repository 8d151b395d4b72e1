#!/usr/bin/env python3
"""crosscheck.py — loom against PyTorch (issue #4 item 8).

Makes a small random token dataset and two random Hugging Face model
directories, runs `loom train` on them and compares with llama_ref.py:
  1. fp32: logits, loss and every gradient of the first batch (both configs);
  2. bf16 with master-grad on: the same, against the exact (fp32) math of the
     bf16-rounded weights, with torch's own pure-bf16 model as a yardstick;
  3. a 20-step fp32 training run (AdamW, warmup + cosine, clipping, weight
     decay): the loss curve step by step;
  4. LoRA (untied config): the adapters' gradients, a 20-step curve with the
     model's weights frozen, and the saved model with the adapters merged;
     DoRA's gradients (A, B and the magnitudes) with PEFT's DoRA math (on
     the qwen2 config too, whose biases DoRA does not scale).
Configs with biases: qwen2 (q, k, v) and attention-bias (q, k, v, o);
head-dim has heads of their own size (q and o wider than the model); qwen3
normalizes each query and key head (and has DoRA checked too); gemma is
Gemma's model (norms of 1 + weight, scaled embeddings, the tanh GELU);
gemma3 is Gemma 3's text model (q/k norms, a local RoPE base on its
windowed blocks); granite has Granite's four multipliers and Granite 3's
attention dropout (the reference drawing loom's Philox masks); phi3 reads and writes Phi-3's fused
qkv_proj and gate_up_proj (phi3-longrope scales its RoPE as Phi-3.5's
within its original context, phi3-long past it, with its long factors;
phi4-mini turns 12 of each head's 16, as Phi-4-mini's partial RoPE);
smollm3 has a block without RoPE; yarn scales Qwen 2's RoPE by YaRN. Sliding windows shorter than the
sequence: mistral (every block), gemma2 (every other), qwen3 (from
max_window_layers on), phi3.
Prints a table of the errors and exits 1 on any mismatch.

Usage: /usr/bin/python3 crosscheck.py --loom build/loom --workdir DIR
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref as ref  # noqa: E402

B, T = 2, 16
VOCAB = 96

# Two configurations that between them exercise GQA (4 heads over 2 kv
# heads), untied and tied lm_head, two RoPE bases and two RMSNorm eps. The
# tied one leaves rope_theta and rms_norm_eps out, so loom must apply
# LlamaConfig's defaults (10000, 1e-6).
CONFIGS = {
    "untied": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
               "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "tied": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
             "tie_word_embeddings": True},
    # Llama 3.1's RoPE scaling, its wavelengths set so that this head size (16)
    # has a kept, a blended and six divided frequencies, and tied as Llama 3.2
    "llama3-rope": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
                    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # YaRN (Qwen 2.5's long contexts): factor 4 over an original context whose correction range here keeps
    # three frequencies, divides two and blends three; cosines and sines times 0.1 ln 4 + 1
    "yarn": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
             "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
    # Qwen 2's model: biases on q, k and v (the file says so by its model_type alone), tied as Qwen 2.5's
    # small ones; its sliding_window is not applied without use_sliding_window
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 8,
              "use_sliding_window": False},
    # heads of their own size (Mistral NeMo's head_dim): 4 x 24 = 96 wide q and o beside a dim of 64
    "head-dim": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 24, "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # Qwen 3's model: each query and key head normalized (q_norm, k_norm) before RoPE, heads of 24 (its
    # default head_dim, 128, would be far wider than this model), tied; a sliding window of 4 keys on the
    # blocks from max_window_layers (1) on, as Qwen's with use_sliding_window
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96, "vocab_size": VOCAB,
              "max_position_embeddings": 32, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": True,
              "sliding_window": 4, "max_window_layers": 1},
    # Mistral's model: LLaMA's with a sliding window on every block, 6 keys of the 16 positions
    "mistral": {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB,
                "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "sliding_window": 6},
    # Gemma's model: norms of 1 + weight, embeddings times sqrt(48) (not a whole number), the tanh GELU's gate
    # (which Gemma 1.0's files call hidden_act "gelu" and leave hidden_activation out), tied by default, one kv
    # head (Gemma 2B's multi-query attention), heads of 32 beside a dim of 48
    "gemma": {"model_type": "gemma", "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "vocab_size": VOCAB,
              "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "hidden_act": "gelu"},
    # Gemma 2's model: Gemma's, with norms of each block's outputs, the scores scaled by 24^-0.5 and softcapped at
    # 5 (low enough to bend these scores), the logits at 3, a window of 5 keys on the first block (of every two);
    # heads of 32, GemmaConfig-style defaults otherwise
    "gemma2": {"model_type": "gemma2", "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": VOCAB,
               "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "sliding_window": 5},
    # Gemma 3's text model: Gemma 2's blocks with q/k norms of 1 + weight, no softcaps, a window of 5 keys on
    # every block but every 3rd (its older sliding_window_pattern), whose blocks rotate with rope_local_base_freq
    # (10000) and the others with rope_theta (1e6, Gemma3TextConfig's) and a linear scaling
    "gemma3": {"model_type": "gemma3_text", "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": VOCAB,
               "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24,
               "sliding_window": 5, "sliding_window_pattern": 3,
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # Granite's model: the embeddings times 12, each block's outputs times 0.22 before their residual adds, the
    # scores times 0.0625 (not 1/sqrt(16)), the logits divided by 10 (not a power of two), tied; Granite 3's
    # attention dropout of 0.1 while training, the reference drawing loom's masks (llama_ref.dropout_factors)
    "granite": {"model_type": "granite", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22, "attention_multiplier": 0.0625, "logits_scaling": 10.0,
                "attention_dropout": 0.1},
    # Phi-3's model: LLaMA's, in files whose q, k, v are one qkv_proj and gate, up one gate_up_proj; its
    # rms_norm_eps left out (Phi3Config's 1e-5), a sliding window of 7 keys (as Phi-3-mini-4k's 2047), untied
    "phi3": {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
             "sliding_window": 7, "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    # Phi-3.5's longrope: frequencies divided by its short factors, cosines and sines times sqrt(1 + ln 8 / ln 32)
    # (its context 256 over the original 32, which loom's context stops at)
    "phi3-longrope": {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB,
                      "max_position_embeddings": 256, "original_max_position_embeddings": 32,
                      "tie_word_embeddings": False,
                      "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                       "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0]}},
    # Phi-3.5's longrope past its original context: 8 positions, so the 16 of a batch rotate with the long factors
    "phi3-long": {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB,
                  "max_position_embeddings": 64, "original_max_position_embeddings": 8, "tie_word_embeddings": False,
                  "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                   "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}},
    # Phi-4-mini's: RoPE on 12 of each head's 16 (partial_rotary_factor 0.75), longrope's 6 factors over them, tied
    "phi4-mini": {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB,
                  "max_position_embeddings": 256, "original_max_position_embeddings": 32, "tie_word_embeddings": True,
                  "partial_rotary_factor": 0.75,
                  "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.3],
                                   "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}},
    # SmolLM3's model: every 2nd block without RoPE (its no_rope_layers list), its rope_theta and tying left to
    # SmolLM3Config's defaults (2e6, tied)
    "smollm3": {"model_type": "smollm3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
                "rms_norm_eps": 1e-6, "no_rope_layers": [1, 0], "use_sliding_window": False},
    # LLaMA's attention_bias: q, k, v and o
    "attention-bias": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 32,
                       "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True},
}

# ---------------------------------------------------------------- tolerances
#
# All comparisons are per tensor: err = max|loom - torch| / max|torch|.
#
# fp32: both sides compute the same function in fp32 and differ only in the
# order of the sums (GEMM blocking, online vs. two-pass softmax, the RMSNorm
# backward's chunked reduction). Each result is a sum of at most a few hundred
# terms through a handful of layers, so the error is a small multiple of
# n * 2^-24 ~ 1e-5 in the worst case and ~1e-6 in practice; 1e-4 has margin
# and is still far below real bugs (measured: a 1e-5 instead of 1e-6 RMSNorm
# eps moves logits and gradients by ~4e-2; a reversed RoPE rotation or the
# SwiGLU gate and up swapped, by ~1).
TOL_FP32 = 1e-4
# bf16 (compute dtype bf16, fp32 master weights and main_grad): the reference
# is torch in fp32 on the bf16-rounded weights, i.e. the exact value of the
# function loom evaluates, so the error measured is loom's own rounding and
# nothing else. That is more meaningful than comparing with torch's bf16
# autocast, which keeps a different set of tensors in fp32 (the residual
# stream, for one): that would measure the difference of two rounding
# policies, not the error of one. loom rounds each stored activation to bf16
# (unit roundoff u = 2^-9 ~ 2e-3): logits pass ~10 roundings, gradients ~20
# (forward and backward through two blocks). Independent roundings add like
# a random walk, so sqrt(20) * u ~ 1e-2 relative is typical. Measured over
# 14 random draws of data and weights: logits <= 1.7e-2, gradients <= 3.8e-2
# (worst tensor of 20), loss <= 9e-4 (a mean over B*T tokens, in which the
# logit errors mostly cancel). We allow 3e-2, 6e-2 and 5e-3. Real bugs are
# far above: a wrong RoPE direction or SwiGLU order gives errors ~1.
# As a check that this is the error of bf16 and not of loom, the same error of
# torch's own pure-bf16 model (model.to(bfloat16), as Hugging Face runs it)
# is the yardstick: per tensor, loom's error must stay below 3x torch's (or the
# tolerance, whichever is smaller; where torch's own error is above the
# tolerance, 1.5x torch's: bf16_tolerance). loom keeps fp32 main_grad and computes
# inside its kernels in fp32, so it measures about half of torch's error
# (the ratio per tensor was at most 1.1 over those 14 draws).
TOL_BF16_LOGITS = 3e-2
TOL_BF16_LOSS = 5e-3
TOL_BF16_GRAD = 6e-2
BF16_VS_TORCH = 3.0
# 20 training steps in fp32: the step-0 loss agrees to ~1e-9 and metrics.jsonl
# prints it with 6 decimals (~1e-7 relative). Each update moves a weight by
# ~lr * mhat / sqrt(vhat), so a relative gradient difference d becomes a
# weight difference ~lr * d; over 20 steps the curves drift apart by
# ~3e-7 (measured). We allow 1e-5 at step 0 growing by 2e-6 per step (5e-5 at
# step 19): a 30x margin for machines whose GEMM sums in another order, yet
# far below what the updates do to the loss (the trained curve departs from
# the frozen model's by ~1e-2 relative; the test checks that this stays above
# 20x the tolerance, or it would be blind). Measured on the untied model: no
# clipping, no bias correction, (step)/warmup warmup, a cosine one step off,
# weight decay 0 or 0.2 or on the norms each exceed the tolerance 10x .. 200x.
TOL_CURVE0 = 1e-5
TOL_CURVE_PER_STEP = 2e-6

TRAIN = {"steps": 20, "lr": 1e-3, "warmup": 5, "min_lr": 1e-4, "clip": 1.0, "weight_decay": 0.1}
TRAIN_FLAGS = ["--steps", TRAIN["steps"], "--lr", TRAIN["lr"], "--warmup", TRAIN["warmup"], "--min-lr",
               TRAIN["min_lr"], "--clip", TRAIN["clip"], "--weight-decay", TRAIN["weight_decay"]]


# ---------------------------------------------------------------- fixtures

def make_data(d, rng):
    """Train and val shards. The tokens follow a noisy rule (next = 7*cur +
    small noise mod V) so the model has something to learn in 20 steps."""
    os.makedirs(d, exist_ok=True)
    for name, n in (("train_000000.bin", 1024), ("val_000000.bin", 256)):
        toks = np.empty(n, dtype=np.int64)
        toks[0] = rng.integers(VOCAB)
        noise = rng.integers(0, 4, size=n)
        for i in range(1, n):
            toks[i] = (7 * toks[i - 1] + noise[i]) % VOCAB
        ref.write_shard(os.path.join(d, name), toks)


def run_loom(loom, out, *args):
    cmd = [loom, "train", "--out", out, "--eval-every", "0", "--threads", "2", *map(str, args)]
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"crosscheck: FAIL: loom exited with {p.returncode}: {' '.join(cmd)}")
    return time.time() - t0


# ---------------------------------------------------------------- checks

class Report:
    def __init__(self):
        self.rows, self.failures = [], []

    def check(self, what, err, tol, note=""):
        ok = err <= tol
        self.rows.append((what, err, tol, "ok" if ok else "FAIL", note))
        if not ok:
            self.failures.append(f"{what}: error {err:.3g} > tolerance {tol:.3g} {note}")
        return ok

    def print(self):
        w = max([len(r[0]) for r in self.rows] + [5])
        print(f"{'check':<{w}} {'max error':>10} {'tolerance':>10}  result")
        for what, err, tol, res, note in self.rows:
            print(f"{what:<{w}} {err:>10.3g} {tol:>10.3g}  {res} {note}")


def rel_err(a, b):
    """max|a - b| / max|b| over one tensor (b the reference); inf when a holds
    NaN or Inf, which no comparison below may let pass."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def first_batch(data_dir):
    tokens = ref.read_shard(os.path.join(data_dir, "train_000000.bin"))
    return next(ref.batches(tokens, B, T))


def load_dumps(logits_path, grads_path, like):
    """(logits shaped like `like`, loss, {name: gradient}) from loom's dumps."""
    lg, lmeta = ref.read_safetensors(logits_path)
    gr, gmeta = ref.read_safetensors(grads_path)
    if lmeta.get("loss") is None or lmeta.get("loss") != gmeta.get("loss"):
        raise SystemExit(f"crosscheck: FAIL: the dumps' loss metadata is missing or differs "
                         f"({lmeta.get('loss')} vs {gmeta.get('loss')})")
    logits = lg["logits"]
    if logits.numel() != like.numel():
        raise SystemExit(f"crosscheck: FAIL: loom's logits have shape {tuple(logits.shape)}, "
                         f"expected {tuple(like.shape)} elements in (B*T, V) order")
    return logits.view_as(like), float(lmeta["loss"]), gr


def bf16_tolerance(tol, yard):
    """A bf16 tensor's tolerance given torch's own pure-bf16 error on it: within 3x torch's or tol, whichever is
    smaller; on a tensor where torch's own error exceeds tol (an ill-conditioned one: measured 0.067 on a
    Gemma 3 k_norm gradient, where loom's was 0.066), within 1.5x torch's, at most 2 tol."""
    return max(min(tol, BF16_VS_TORCH * max(yard, 1e-3)), min(1.5 * yard, 2 * tol))


def check_grads(rep, label, loom_grads, torch_grads, tol, yardstick=None, note=""):
    """Every gradient; the table gets the worst tensor and a FAIL row per bad one."""
    missing = set(torch_grads) ^ set(loom_grads)
    if missing:
        rep.failures.append(f"{label}: gradient names differ: {sorted(missing)}")
        return
    worst, worst_name, worst_tol, bad = -1.0, "", tol, 0
    for name, g in torch_grads.items():
        lg = loom_grads[name]
        if tuple(lg.shape) != tuple(g.shape):
            rep.failures.append(f"{label}: {name}: shape {tuple(lg.shape)} != {tuple(g.shape)}")
            continue
        e = rel_err(lg, g)
        t = tol if yardstick is None else bf16_tolerance(tol, yardstick[name])
        if not e <= t:
            bad += 1
            rep.check(f"{label} grad {name}", e, t)
        if not e <= worst:
            worst, worst_name, worst_tol = e, name, t
    if not bad:
        rep.check(f"{label} grads, worst of {len(torch_grads)}", worst, worst_tol, f"({worst_name}){note}")


def check_first_step(rep, loom, work, name, data_dir, model_dir, inputs, targets):
    cfg, params = ref.load_model_dir(model_dir)

    # fp32
    out = os.path.join(work, f"out-{name}-fp32")
    lpath, gpath = os.path.join(work, f"{name}-fp32-logits.st"), os.path.join(work, f"{name}-fp32-grads.st")
    run_loom(loom, out, "--data", data_dir, "--init", model_dir, "--dump-logits", lpath, "--dump-grads", gpath,
             "--precision", "fp32", "--master-grad", "on", "--batch", B, "--seq", T, "--steps", 1)
    logits, loss, g = ref.grads(cfg, params, inputs, targets, rng=ref.train_rng())
    l_logits, l_loss, l_grads = load_dumps(lpath, gpath, logits)
    rep.check(f"{name} fp32 logits", rel_err(l_logits, logits), TOL_FP32)
    rep.check(f"{name} fp32 loss", abs(l_loss - loss) / abs(loss), TOL_FP32, f"(torch {loss:.6f})")
    check_grads(rep, f"{name} fp32", l_grads, g, TOL_FP32)

    # bf16 with master-grad: the reference is fp32 math on bf16-rounded weights
    out = os.path.join(work, f"out-{name}-bf16")
    lpath, gpath = os.path.join(work, f"{name}-bf16-logits.st"), os.path.join(work, f"{name}-bf16-grads.st")
    run_loom(loom, out, "--data", data_dir, "--init", model_dir, "--dump-logits", lpath, "--dump-grads", gpath,
             "--precision", "bf16", "--master-grad", "on", "--batch", B, "--seq", T, "--steps", 1)
    with torch.no_grad():
        rounded = {k: v.to(torch.bfloat16).float().requires_grad_(True) for k, v in params.items()}
    logits, loss, g = ref.grads(cfg, rounded, inputs, targets, rng=ref.train_rng())
    t_logits, t_loss, t_g = ref.grads(cfg, rounded, inputs, targets, dtype=torch.bfloat16, rng=ref.train_rng())
    yard = {k: rel_err(t_g[k], g[k]) for k in g}
    yard_logits, yard_loss = rel_err(t_logits.float(), logits), abs(t_loss - loss) / abs(loss)
    l_logits, l_loss, l_grads = load_dumps(lpath, gpath, logits)
    e = rel_err(l_logits, logits)
    rep.check(f"{name} bf16 logits", e, min(TOL_BF16_LOGITS, BF16_VS_TORCH * max(yard_logits, 1e-3)),
              f"(torch bf16: {yard_logits:.3g})")
    e = abs(l_loss - loss) / abs(loss)
    rep.check(f"{name} bf16 loss", e, TOL_BF16_LOSS, f"(torch bf16: {yard_loss:.3g})")
    check_grads(rep, f"{name} bf16", l_grads, g, TOL_BF16_GRAD, yard,
                f" (torch bf16 worst: {max(yard.values()):.3g})")


def check_curve(rep, loom, work, name, data_dir, model_dir):
    out = os.path.join(work, f"out-{name}-train")
    a = TRAIN
    run_loom(loom, out, "--data", data_dir, "--init", model_dir, "--precision", "fp32", "--master-grad", "on",
             "--batch", B, "--seq", T, *TRAIN_FLAGS)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    l_losses = [r["loss"] for r in rows if "loss" in r]
    cfg, params = ref.load_model_dir(model_dir)
    tokens = ref.read_shard(os.path.join(data_dir, "train_000000.bin"))
    frozen = ref.eval_losses(cfg, params, tokens, B, T, a["steps"])
    t_losses = ref.train(cfg, params, tokens, B, T, a["steps"], a["lr"], a["min_lr"], a["warmup"],
                         a["weight_decay"], a["clip"])
    compare_curves(rep, name, l_losses, t_losses, frozen)


def compare_curves(rep, name, l_losses, t_losses, frozen):
    """loom's losses step by step against the reference's, and a check that
    training moved the reference's far beyond the tolerance (from `frozen`,
    the untrained model's on the same batches)."""
    a = TRAIN
    if len(l_losses) != len(t_losses):
        rep.failures.append(f"{name} curve: loom logged {len(l_losses)} losses, expected {len(t_losses)}")
        return
    worst, worst_step, worst_ratio = 0.0, 0, -1.0
    for k, (x, y) in enumerate(zip(l_losses, t_losses)):
        e = abs(x - y) / abs(y)
        ratio = e / (TOL_CURVE0 + TOL_CURVE_PER_STEP * k)
        if ratio > worst_ratio:
            worst, worst_step, worst_ratio = e, k, ratio
    # The check is blind unless training moves the loss far more than the
    # tolerance: compare with the untrained model on the same batches.
    moved = max(abs(x - y) / y for x, y in zip(t_losses, frozen))
    rep.check(f"{name} fp32 {a['steps']}-step loss curve", worst, TOL_CURVE0 + TOL_CURVE_PER_STEP * worst_step,
              f"(step {worst_step}; loss {t_losses[0]:.4f} -> {t_losses[-1]:.4f}, {moved:.2g} from untrained)")
    need = 20 * (TOL_CURVE0 + TOL_CURVE_PER_STEP * (len(t_losses) - 1))
    if moved < need:
        rep.failures.append(f"{name} curve: training moved the reference loss by only {moved:.3g} (relative) "
                            f"from the untrained model's; below {need:.3g} the curve check means nothing: "
                            f"strengthen the data or the learning rate")


# LoRA: rank 4, alpha 8 (a scale of 2, so a missing scale shows), on five of
# the seven linears (v and up stay plain).
LORA = {"rank": 4, "alpha": 8.0, "targets": "q,k,o,gate,down"}
LORA_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def lora_flags(model_dir):
    """loom train's flags for the LoRA runs: LORA on the model, fp32, the
    batch shape."""
    return ["--init", model_dir, "--precision", "fp32", "--master-grad", "on", "--batch", B, "--seq", T,
            "--lora", LORA["rank"], "--lora-alpha", LORA["alpha"], "--lora-targets", LORA["targets"]]


def train_then_dump(loom, work, data_dir, tag, run_flags):
    """Train TRAIN's steps (checkpoints every 5), then dump step 6's
    gradients from step 5's state (B no longer zero): the run's directory,
    step 5's state, the dumped gradients and their metadata."""
    out = os.path.join(work, f"out-{tag}")
    run_loom(loom, out, "--data", data_dir, *run_flags, *TRAIN_FLAGS, "--ckpt-every", 5, "--keep", 10)
    gpath = os.path.join(work, f"{tag}-grads.st")
    run_loom(loom, os.path.join(work, f"out-{tag}-dump"), "--data", data_dir, *run_flags, *TRAIN_FLAGS,
             "--resume", os.path.join(out, "ckpt-00000005"), "--dump-grads", gpath)
    st5, _ = ref.read_safetensors(os.path.join(out, "ckpt-00000005", "state.safetensors"))
    return (out, st5, *ref.read_safetensors(gpath))


def step6_batch(data_dir):
    """The tokens of the batch step 6 trains on (and their shard's tokens)."""
    tokens = ref.read_shard(os.path.join(data_dir, "train_000000.bin"))
    it = ref.batches(tokens, B, T)
    for _ in range(5):
        next(it)
    return tokens, next(it)


def check_lora(rep, loom, work, data_dir, model_dir):
    """loom train --lora against the reference with PEFT's LoRA math (frozen
    weights, x W^T + alpha/rank (x A^T) B^T, AdamW on the adapters only):
    the adapters' gradients with B nonzero, the 20-step loss curve, and the
    saved (merged) model."""
    a = TRAIN
    flags = lora_flags(model_dir)
    # A as drawn: a step without weight decay leaves it (its gradient is zero while B is).
    out0 = os.path.join(work, "out-lora-init")
    run_loom(loom, out0, "--data", data_dir, *flags, "--steps", 1, "--weight-decay", 0)
    drawn, _ = ref.read_safetensors(os.path.join(out0, "ckpt-00000001", "state.safetensors"))
    cfg, base = ref.load_model_dir(model_dir)
    cfg.lora_scale = LORA["alpha"] / LORA["rank"]
    names = [f"model.layers.{l}.{LORA_MODULES[t]}" for l in range(cfg.n_layers) for t in LORA["targets"].split(",")]

    def model_with(adapters):
        params = {k: v.detach() for k, v in base.items()}  # frozen
        for k, v in adapters.items():
            params[k] = v.float().clone().requires_grad_(True)
        return params

    start = {}
    for n in names:
        start[n + ".lora_A.weight"] = drawn[f"master.{n}.lora_A.weight"]
        start[n + ".lora_B.weight"] = torch.zeros(base[n + ".weight"].shape[0], LORA["rank"])

    out, st5, l_grads, meta = train_then_dump(loom, work, data_dir, "lora", flags)
    params = model_with({k: st5["master." + k] for k in start})
    tokens, (inputs, targets) = step6_batch(data_dir)
    _, loss, g = ref.grads(cfg, params, inputs, targets)
    rep.check("lora fp32 loss at step 6", abs(float(meta["loss"]) - loss) / abs(loss), TOL_FP32)
    check_grads(rep, "lora fp32", {k: l_grads[k] for k in start}, {k: g[k] for k in start}, TOL_FP32)
    nonzero = [k for k in base if l_grads[k].abs().max().item() != 0.0]
    if nonzero:
        rep.failures.append(f"lora: frozen weights got gradients: {nonzero[:3]}")

    # bf16 with fp32 main_grad, the same way: step 6's adapter gradients
    # against the exact math of the bf16-rounded weights (the frozen ones are
    # held in bf16 only), torch's pure-bf16 model as the yardstick.
    _, st5b, l_grads, _ = train_then_dump(loom, work, data_dir, "lora-bf16",
                                          [f if f != "fp32" else "bf16" for f in flags])
    with torch.no_grad():
        rounded = {k: v.to(torch.bfloat16).float() for k, v in base.items()}
        for k in start:
            rounded[k] = st5b["master." + k].float().to(torch.bfloat16).float().requires_grad_(True)
    _, _, g = ref.grads(cfg, rounded, inputs, targets)
    _, _, t_g = ref.grads(cfg, rounded, inputs, targets, dtype=torch.bfloat16)
    yard = {k: rel_err(t_g[k], g[k]) for k in start}
    check_grads(rep, "lora bf16", {k: l_grads[k] for k in start}, {k: g[k] for k in start}, TOL_BF16_GRAD, yard,
                f" (torch bf16 worst: {max(yard.values()):.3g})")

    # The curve, and the saved model: the adapters merged, W + alpha/rank B A.
    with open(os.path.join(out, "metrics.jsonl")) as f:
        l_losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    params = model_with(start)
    frozen = ref.eval_losses(cfg, params, tokens, B, T, a["steps"])
    t_losses = ref.train(cfg, params, tokens, B, T, a["steps"], a["lr"], a["min_lr"], a["warmup"],
                         a["weight_decay"], a["clip"], trainable=list(start))
    compare_curves(rep, "lora", l_losses, t_losses, frozen)
    saved, _ = ref.read_safetensors(os.path.join(out, "model", "model.safetensors"))
    worst, moved = 0.0, 0.0
    with torch.no_grad():
        for k, w in base.items():
            n = k[:-len(".weight")]
            if n not in names:
                if not torch.equal(saved[k].float(), w):
                    rep.failures.append(f"lora: {k} is not adapted, but the saved model changed it")
                continue
            merged = w + cfg.lora_scale * params[n + ".lora_B.weight"] @ params[n + ".lora_A.weight"]
            worst = max(worst, rel_err(saved[k].float(), merged))
            moved = max(moved, rel_err(w, merged))
    rep.check("lora saved model (merged)", worst, TOL_FP32, f"(the adapters moved the weights {moved:.2g})")
    if moved < 100 * TOL_FP32:
        rep.failures.append(f"lora: the adapters moved the merged weights by only {moved:.3g}: the check is blind")


def check_dora(rep, loom, work, data_dir, model_dir, tag="dora"):
    """loom train --lora-dora against the reference with PEFT's DoRA math:
    step 6's gradients of A, B and the magnitudes (fp32, from step 5's
    state, B and m trained), and the loss there (on a model with biases,
    which DoRA does not scale, too)."""
    _, st5, l_grads, meta = train_then_dump(loom, work, data_dir, tag, lora_flags(model_dir) + ["--lora-dora"])
    cfg, base = ref.load_model_dir(model_dir)
    cfg.lora_scale = LORA["alpha"] / LORA["rank"]
    names = [f"model.layers.{l}.{LORA_MODULES[t]}" for l in range(cfg.n_layers) for t in LORA["targets"].split(",")]
    keys = [n + s for n in names for s in (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector")]
    params = {k: v.detach() for k, v in base.items()}
    for k in keys:
        params[k] = st5["master." + k].float().clone().requires_grad_(True)
    moved = max(rel_err(params[n + ".lora_magnitude_vector"].detach(), base[n + ".weight"].norm(dim=1))
                for n in names)
    if moved < 1e-3:
        rep.failures.append(f"{tag}: the magnitudes moved by only {moved:.3g} from the weights' norms: the check "
                            "is blind")
    _, (inputs, targets) = step6_batch(data_dir)
    _, loss, g = ref.grads(cfg, params, inputs, targets)
    rep.check(f"{tag} fp32 loss at step 6", abs(float(meta["loss"]) - loss) / abs(loss), TOL_FP32)
    check_grads(rep, f"{tag} fp32", {k: l_grads[k] for k in keys}, {k: g[k] for k in keys}, TOL_FP32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True, help="the loom executable")
    ap.add_argument("--workdir", required=True, help="a scratch directory (created if missing)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    t0 = time.time()
    torch.set_num_threads(2)
    os.makedirs(args.workdir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    data_dir = os.path.join(args.workdir, "data")
    make_data(data_dir, rng)
    inputs, targets = first_batch(data_dir)
    rep = Report()
    for name, config in CONFIGS.items():
        model_dir = os.path.join(args.workdir, f"model-{name}")
        ref.make_model_dir(model_dir, config, rng)
        check_first_step(rep, args.loom, args.workdir, name, data_dir, model_dir, inputs, targets)
        check_curve(rep, args.loom, args.workdir, name, data_dir, model_dir)
        if name == "untied":
            check_lora(rep, args.loom, args.workdir, data_dir, model_dir)
            check_dora(rep, args.loom, args.workdir, data_dir, model_dir)
        if name in ("qwen2", "qwen3"):
            check_dora(rep, args.loom, args.workdir, data_dir, model_dir, name + "-dora")
    rep.print()
    print(f"crosscheck: {time.time() - t0:.1f} s")
    if rep.failures:
        print("crosscheck: FAIL: loom and the PyTorch reference disagree:", file=sys.stderr)
        for f in rep.failures:
            print("  " + f, file=sys.stderr)
        return 1
    print("crosscheck: loom matches PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
