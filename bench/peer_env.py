#!/usr/bin/env python3
"""peer_env.py: the environment that gives the PyTorch peer its fastest CPU kernels.

Debian 12's OpenBLAS (0.3.21) knows neither Zen 4 nor Zen 5: on both it
falls back to Haswell's AVX2 kernels. On Zen 5, whose AVX-512 units are
full width, that halves the peer's fp32 GEMMs (1024^3 on 2 threads: 160-172
GFLOP/s with Haswell's kernels, 239-299 with SkylakeX's). Debian's torch
1.13 likewise runs its own vectorised kernels at AVX2 unless
ATEN_CPU_CAPABILITY says avx512. So that loom is compared with the peer at
its best, where the CPU has the AVX-512 subsets those kernels need
(F, BW, DQ, VL), the bench scripts set OPENBLAS_CORETYPE=SkylakeX and
ATEN_CPU_CAPABILITY=avx512 for the peer, over what the environment says
(the machines of this project set OPENBLAS_CORETYPE=Haswell for every
process); PEER_ENV=keep leaves the environment as it is.

Imported: apply() sets them in os.environ (call it before torch is
imported). Run: prints them as shell `export` lines, for compare_peer.sh.
"""
import os

AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")


def peer_env():
    """The variables to set: {} on a CPU without the AVX-512 subsets."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if os.environ.get("PEER_ENV") == "keep" or not all(x in flags for x in AVX512):
        return {}
    return {"OPENBLAS_CORETYPE": "SkylakeX", "ATEN_CPU_CAPABILITY": "avx512"}


def apply():
    os.environ.update(peer_env())


if __name__ == "__main__":
    for k, v in peer_env().items():
        print(f"export {k}={v}")
