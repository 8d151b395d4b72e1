#!/usr/bin/env bash
# Installs the Debian packages loom's build, tests and default data need,
# when they are missing. Safe to run again. Needs root (or sudo).
# libopenblas0-pthread gives the PyTorch peer (bench/compare_peer.sh) and the
# cross-check a real BLAS: with Debian's default reference BLAS the peer's
# fp32 runs 12x slower, which would flatter loom's side-by-side figures.
# libsimde-dev (headers) writes the AVX-512 tiles portably, so the tests run
# them emulated on CPUs without AVX-512.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config libdnnl-dev libopenmpi-dev openmpi-bin
      libjansson-dev libpcre2-dev libutf8proc-dev libcmocka-dev libsimde-dev ocl-icd-opencl-dev python3 python3-torch python3-numpy python3-regex libopenblas0-pthread fortunes)
# --fuzz: also clang, its libFuzzer runtime and OpenMP runtime, for
# scripts/fuzz.sh.
if [ "${1:-}" = "--fuzz" ]; then pkgs+=(clang libclang-rt-14-dev libomp-dev); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi
