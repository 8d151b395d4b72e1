#!/usr/bin/env python3
"""Compare every tensor of two safetensors files (F32 only, as loom's dumps).

usage: compare_safetensors.py A B --rtol R [--atol A]
A tensor passes when max|a - b| <= atol + rtol * max|b|. Prints the worst
tensor; exits 1 on any mismatch, missing tensor or shape difference.
"""
import argparse, json, struct, sys
import numpy as np

def load(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {t['dtype']}, expected F32")
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[base + b: base + e], dtype="<f4").reshape(t["shape"])
    return out, header.get("__metadata__", {})

def main():
    p = argparse.ArgumentParser()
    p.add_argument("a"); p.add_argument("b")
    p.add_argument("--rtol", type=float, required=True)
    p.add_argument("--atol", type=float, default=0.0)
    args = p.parse_args()
    a, ma = load(args.a)
    b, mb = load(args.b)
    if set(a) != set(b):
        sys.exit(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
    worst, worst_name, bad = 0.0, "", []
    for name in sorted(a):
        if a[name].shape != b[name].shape:
            sys.exit(f"{name}: shape {a[name].shape} vs {b[name].shape}")
        scale = float(np.max(np.abs(b[name]))) if b[name].size else 0.0
        err = float(np.max(np.abs(a[name].astype(np.float64) - b[name]))) if b[name].size else 0.0
        ratio = err / (args.atol + args.rtol * scale) if (args.atol + args.rtol * scale) > 0 else (0.0 if err == 0 else float("inf"))
        if not (np.isfinite(a[name]).all() and np.isfinite(b[name]).all()):
            ratio = float("inf")  # NaN compares false with everything: it must not pass as "close"
        if not ratio <= worst:
            worst, worst_name = ratio, f"{name}: max error {err:.3g} (scale {scale:.3g})"
        if not ratio <= 1.0:
            bad.append(name)
    if "loss" in ma and "loss" in mb:
        la, lb = float(ma["loss"]), float(mb["loss"])
        if not abs(la - lb) <= args.atol + args.rtol * abs(lb):
            bad.append(f"loss {la} vs {lb}")
    print(f"{len(a)} tensors, worst {worst_name or 'exact'} (ratio {worst:.3g})")
    if bad:
        sys.exit(f"mismatch in {len(bad)}: {bad[:5]}")

if __name__ == "__main__":
    main()
