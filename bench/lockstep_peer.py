#!/usr/bin/env python3
"""lockstep_peer.py: loom and the PyTorch peer taking turns, step by step.

compare_peer.sh runs loom and the peer one after the other, each in its own
run of several steps; on a machine whose speed drifts over seconds (this
one's does, by 10-20%), a pair of runs measures the drift as much as the
two programs. Here both stay resident and alternate single training steps:
`loom bench --lockstep` waits for a line on its standard input before each
step and reports the step's time; this driver builds the peer's model in its
own process (the classes of ../shared/peers/torch_llama.py, the setup of its
main(): seed 0, AdamW lr 3e-4, random tokens) and runs one peer step between
two of loom's. Whoever goes first alternates from pair to pair, and the first
3 pairs are not timed (--warmup; the peer's first three steps on small are
20-40% slower than its steady ones). While one
side runs, the other waits on a pipe with its OpenMP threads asleep
(OMP_WAIT_POLICY=passive, as compare_peer.sh), so each has both cores.

Each timed pair gives a speedup, the peer's step time over loom's (tokens/s
are per step, both sides run the same batch and sequence); the driver prints
every pair and their median. Peak memory is not measured here: two
processes are resident at once (compare_peer.sh gives peak RSS per run).

--floor R then times the step's GEMMs alone on both sides in the same
session (`loom bench --gemms` and peer_gemms.py, R rounds in turns, each
GEMM the best of 10 calls, the lower round sum kept) and prints what is left
of each side's step beside its GEMMs, and the speedup loom would have if its
step were its GEMMs alone: the most any work outside the GEMMs can buy.

Run with /usr/bin/python3 (Debian's python3-torch).
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch starts its OpenMP pool
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_env  # noqa: E402  (the peer's fastest kernels, also before torch starts)
peer_env.apply()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # loom's presets (src/nn/llama.c)
    "tiny": dict(dim=288, layers=6, heads=6, kv_heads=6, ffn=768, vocab=4096, seq=256),
    "small": dict(dim=512, layers=8, heads=8, kv_heads=8, ffn=1376, vocab=8192, seq=512),
}
LOOM_RECOMPUTE = {"none": ("none", "nonreentrant"), "selective": ("selective", "nonreentrant"),
                  "full": ("full", "nonreentrant"), "full-reentrant": ("full", "reentrant")}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--loom-recompute", choices=sorted(LOOM_RECOMPUTE), default="none")
    p.add_argument("--peer-recompute", choices=["none", "reentrant", "nonreentrant"], default="none")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=0, help="default: the preset's context")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=9, help="timed pairs (default 9)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed pairs first (default 3: the peer's first three steps on small are slow)")
    p.add_argument("--floor", type=int, default=0, metavar="R",
                   help="then time each side's GEMMs alone, R rounds in turns (default 0: not)")
    p.add_argument("--loom", default=os.environ.get("LOOM", os.path.join(ROOT, "build", "loom")))
    p.add_argument("--peer", default=os.environ.get("PEER", os.path.join(ROOT, "..", "shared", "peers",
                                                                         "torch_llama.py")))
    a = p.parse_args()
    for name in ("batch", "threads", "steps"):
        if getattr(a, name) <= 0:
            p.error(f"--{name} must be positive")
    if a.threads > 1024:
        p.error("--threads must be at most 1024 (loom's limit)")
    if a.floor < 0:
        p.error("--floor must be >= 0")
    if a.warmup < 0 or a.seq < 0 or a.seq > SHAPES[a.preset]["seq"]:
        p.error(f"--warmup must be >= 0 and --seq in 1..{SHAPES[a.preset]['seq']}")
    if not os.access(a.loom, os.X_OK):
        p.error(f"{a.loom} is not built (scripts/build.sh) or not executable")
    if not os.path.isfile(a.peer):
        p.error(f"peer script {a.peer} not found (--peer or PEER)")
    return a


def load_peer(path):
    spec = importlib.util.spec_from_file_location("torch_llama", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Peer:
    """The peer's model and optimizer as its main() sets them up; step() is
    the body of its timed loop."""

    def __init__(self, mod, a, shape, seq):
        import torch
        self.torch, self.a = torch, a
        torch.set_num_threads(a.threads)
        torch.manual_seed(0)
        self.m = mod.Llama(shape["vocab"], shape["dim"], shape["layers"], shape["heads"], shape["kv_heads"],
                           shape["ffn"], seq)
        self.opt = torch.optim.AdamW(self.m.parameters(), lr=3e-4)
        self.idx = torch.randint(0, shape["vocab"], (a.batch, seq))
        self.tgt = torch.randint(0, shape["vocab"], (a.batch, seq))

    def step(self):
        torch, a = self.torch, self.a
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = self.m(self.idx, self.tgt, a.peer_recompute)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) * 1e3


class Loom:
    """loom bench --lockstep: one step per line written to it."""

    def __init__(self, a, seq):
        recompute, mode = LOOM_RECOMPUTE[a.loom_recompute]
        cmd = [a.loom, "bench", "--preset", a.preset, "--batch", str(a.batch), "--seq", str(seq), "--threads",
               str(a.threads), "--precision", a.precision, "--master-grad", "on", "--recompute", recompute,
               "--recompute-mode", mode, "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--gemm-peak", "1,1", "--no-header", "--lockstep"]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def check_alive(self):
        if self.p.poll() is not None:
            sys.exit(f"lockstep_peer: loom bench exited ({self.p.returncode}) before its first step: "
                     f"{self.p.stdout.read().strip()}")

    def step(self):
        try:
            self.p.stdin.write("\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            self.p.wait()
            sys.exit(f"lockstep_peer: loom bench exited ({self.p.returncode}) instead of taking a step")
        line = self.p.stdout.readline()
        if not line.startswith("lockstep step="):
            self.p.kill()
            sys.exit(f"lockstep_peer: loom bench stopped instead of reporting a step (got {line!r})")
        return float(line.split("ms=")[1])

    def finish(self):
        self.p.stdin.close()
        rest = self.p.stdout.read()
        if self.p.wait() != 0:
            sys.exit(f"lockstep_peer: loom bench failed (exit {self.p.returncode}): {rest}")
        return rest


def loom_gemm_ms(a, seq):
    """`loom bench --gemms` at the lockstep's settings: its step_gemm_ms."""
    cmd = [a.loom, "bench", "--gemms", "--preset", a.preset, "--batch", str(a.batch), "--seq", str(seq),
           "--threads", str(a.threads), "--precision", a.precision, "--master-grad", "on", "--steps", "10",
           "--warmup", "2"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode != 0 or "step_gemm_ms=" not in last:
        sys.exit(f"lockstep_peer: loom bench --gemms failed (exit {r.returncode}): {r.stdout.strip()}")
    return float(last.split("step_gemm_ms=")[1].split()[0])


def gemm_floors(a, shape, seq):
    """The step's GEMMs alone, loom's and the peer's, a.floor rounds in
    turns; the lower round of each side."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peer_gemms
    pa = argparse.Namespace(vocab=shape["vocab"], dim=shape["dim"], layers=shape["layers"], heads=shape["heads"],
                            kv_heads=shape["kv_heads"], ffn=shape["ffn"], seq=seq, batch=a.batch,
                            threads=a.threads, precision=a.precision, warmup=2, steps=10)
    lf = pf = float("inf")
    for r in range(a.floor):
        l, p = loom_gemm_ms(a, seq), peer_gemms.step_gemm_ms(pa, report=lambda line: None)
        print(f"floor round {r + 1} loom_gemm_ms={l:.1f} peer_gemm_ms={p:.1f}", flush=True)
        lf, pf = min(lf, l), min(pf, p)
    return lf, pf


def main():
    a = parse_args()
    shape = SHAPES[a.preset]
    seq = a.seq or shape["seq"]
    # As compare_peer.sh: the peer's OpenMP (and a threaded BLAS) get the thread count too.
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    loom = Loom(a, seq)
    peer = Peer(load_peer(a.peer), a, shape, seq)
    loom.check_alive()
    import torch
    print(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} lockstep preset={a.preset} batch={a.batch} "
          f"seq={seq} threads={a.threads} precision={a.precision} loom_recompute={a.loom_recompute} "
          f"peer_recompute={a.peer_recompute} pairs={a.steps} warmup={a.warmup} torch={torch.__version__} "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')} "
          f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')}",
          flush=True)
    pairs = []
    for k in range(a.warmup + a.steps):
        if k % 2 == 0:
            lm = loom.step()
            pm = peer.step()
        else:
            pm = peer.step()
            lm = loom.step()
        if k >= a.warmup:
            pairs.append((lm, pm))
            print(f"pair {k - a.warmup + 1} first={'loom' if k % 2 == 0 else 'peer'} loom_ms={lm:.1f} "
                  f"peer_ms={pm:.1f} speedup={pm / lm:.3f}", flush=True)
    loom.finish()
    speedups = [pm / lm for lm, pm in pairs]
    tokens = a.batch * seq
    lm_med = statistics.median(lm for lm, _ in pairs)
    pm_med = statistics.median(pm for _, pm in pairs)
    print(f"lockstep preset={a.preset} precision={a.precision} loom_step_ms={lm_med:.1f} peer_step_ms={pm_med:.1f} "
          f"loom_tok/s={tokens / lm_med * 1e3:.0f} peer_tok/s={tokens / pm_med * 1e3:.0f} "
          f"speedup_median={statistics.median(speedups):.3f} range={min(speedups):.3f}-{max(speedups):.3f} "
          f"pairs={len(pairs)}", flush=True)
    if a.floor:
        lf, pf = gemm_floors(a, shape, seq)
        print(f"floor preset={a.preset} precision={a.precision} loom_gemm_ms={lf:.1f} peer_gemm_ms={pf:.1f} "
              f"loom_rest_ms={lm_med - lf:.1f} peer_rest_ms={pm_med - pf:.1f} "
              f"speedup_if_loom_were_gemms_alone={pm_med / lf:.3f}")


if __name__ == "__main__":
    main()
