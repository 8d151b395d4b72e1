#!/usr/bin/env python3
"""peer_gemms.py: the GEMMs of one training step of the PyTorch peer, one by one.

The counterpart of `loom bench --gemms`: for each linear shape of the model
(q, k, v, o, gate, up, down per layer, and lm_head), applied to batch * seq
rows, it times the forward y = x W^T, dX = dy W and dW += dy^T x with torch's
own kernels (the system BLAS for fp32, its bf16 path for bf16), each the best
of --steps calls after --warmup, and prints their sum over a step. Same shape
flags as ../shared/peers/torch_llama.py. Run with /usr/bin/python3 (Debian's
python3-torch).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_env  # noqa: E402  (before torch: the peer's fastest kernels)
peer_env.apply()
import torch  # noqa: E402


def best_ms(fn, warmup, steps):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def step_gemm_ms(a, report=print):
    """The summed best-of-a.steps times of a step's GEMMs for the shape in a
    (vocab, dim, layers, heads, kv_heads, ffn, seq, batch, threads,
    precision, warmup, steps); report gets one line per shape and the sum."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dt = torch.float32 if a.precision == "fp32" else torch.bfloat16
    kv = a.dim // a.heads * a.kv_heads
    T, L = a.batch * a.seq, a.layers
    shapes = [("q", a.dim, a.dim, L), ("k", kv, a.dim, L), ("v", kv, a.dim, L), ("o", a.dim, a.dim, L),
              ("gate", a.ffn, a.dim, L), ("up", a.ffn, a.dim, L), ("down", a.dim, a.ffn, L),
              ("lm_head", a.vocab, a.dim, 1)]
    total = flops = 0.0
    for name, out, inp, count in shapes:
        x = torch.rand(T, inp, dtype=dt)
        dy = torch.rand(T, out, dtype=dt)
        w = torch.rand(out, inp, dtype=dt)
        g = torch.zeros(out, inp)  # fp32 gradient, as the peer's parameters are fp32
        f = best_ms(lambda: x @ w.t(), a.warmup, a.steps)
        d = best_ms(lambda: dy @ w, a.warmup, a.steps)
        if dt == torch.float32:
            u = best_ms(lambda: g.addmm_(dy.t(), x), a.warmup, a.steps)
        else:
            u = best_ms(lambda: g.add_((dy.t() @ x).float()), a.warmup, a.steps)
        gf = 6.0 * T * out * inp * 1e-9
        total += count * (f + d + u)
        flops += count * gf
        report(f"peer gemm {name:<7s} rows={T} out={out} in={inp} count={count} fwd_ms={f:.3f} dx_ms={d:.3f} "
               f"dw_ms={u:.3f} gflops={gf / ((f + d + u) * 1e-3):.1f}")
    report(f"peer gemms torch={torch.__version__} precision={a.precision} step_gemm_ms={total:.1f} "
           f"gemm_gflops={flops / (total * 1e-3):.1f} threads={a.threads} "
           f"(every GEMM of a step, each the best of {a.steps} calls, summed)")

    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=288)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be positive and --warmup >= 0")
    step_gemm_ms(a)


if __name__ == "__main__":
    main()
