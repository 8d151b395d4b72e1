#!/usr/bin/env bash
# ab_attention.sh — flash attention of this tree against another git
# revision's, alternated call by call in one process (bench/ab_attention.c).
#
# Usage: bench/ab_attention.sh REV [REPS] [THREADS] [tiny|small] [WINDOW]
# (WINDOW > 0: both sides with that sliding window, REV from 2026-12-02 on.)
# Builds REV's src/kernels/attention.c and kernel_rows.c with every global
# they define renamed (attention_fwd_B, mm_f32_B, ...) and links them beside this tree's
# build/libloom.a (run scripts/build.sh first; LOOM_BINARY_DIR names another
# build directory). A ratio below 1 means this
# tree is faster. `bench/ab_attention.sh HEAD` is the control: it should
# print about 1.00 (the spread of that number is the instrument's noise).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:?usage: bench/ab_attention.sh REV [REPS] [THREADS] [tiny|small] [WINDOW]}
reps=${2:-40}
threads=${3:-2}
preset=${4:-tiny}
window=${5:-0}
case $preset in
  tiny | small) ;;
  *) echo "ab_attention: unknown preset '$preset': use tiny or small" >&2; exit 2 ;;
esac
bin=${LOOM_BINARY_DIR:-$root/build}
lib=$bin/libloom.a
[ -f "$lib" ] || { echo "ab_attention: $lib not built (scripts/build.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/kernels"
for f in attention.c kernel_rows.c kernel_rows.h kernels.h attention_internal.h; do
  # attention_internal.h is younger than the script: older revisions have none to take
  git -C "$root" cat-file -e "$rev:src/kernels/$f" 2>/dev/null || continue
  git -C "$root" show "$rev:src/kernels/$f" > "$work/src/kernels/$f"
done
# What the library's build defines (src/kernels/*.c see the same macros).
defs=$(awk '/^ *DEFINES = /{sub(/^ *DEFINES = /, ""); print; exit}' "$bin/build.ninja")
cflags="-O2 -fopenmp -std=gnu11 -ffp-contract=off $defs -I$work/src -I$root/include -I$root/src"
# shellcheck disable=SC2086
cc $cflags -c "$work/src/kernels/kernel_rows.c" -o "$work/rows_B.o"
# shellcheck disable=SC2086
cc $cflags -c "$work/src/kernels/attention.c" -o "$work/attention_B.o"
# Every global the two files define gets a _B suffix, in both objects (their
# calls to each other included): REV's attention runs on REV's row kernels;
# the rest (allocator, conversions, and the AVX-512 tiles of mm_avx512.c,
# which only AVX-512 CPUs run) is this tree's.
nm -g --defined-only "$work/rows_B.o" "$work/attention_B.o" | awk 'NF == 3 { print $3 " " $3 "_B" }' | sort -u > "$work/syms"
objcopy --redefine-syms="$work/syms" "$work/rows_B.o"
objcopy --redefine-syms="$work/syms" "$work/attention_B.o"
# The library's link line (the loom executable's, minus its own objects).
libs=$(awk '/^build loom:/{f = 1} f && /^ *LINK_LIBRARIES = /{sub(/^ *LINK_LIBRARIES = /, ""); print; exit}' \
  "$bin/build.ninja")
# shellcheck disable=SC2086
(cd "$bin" && cc -O2 -fopenmp -std=gnu11 $defs -I"$root/include" -I"$root/src" "$root/bench/ab_attention.c" \
  "$work/attention_B.o" "$work/rows_B.o" -o "$work/ab_attention" $libs -lm)
echo "# $(date -u +%Y-%m-%dT%H:%MZ) this tree ($(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo +changes)) against $rev"
"$work/ab_attention" "$reps" "$threads" "$preset" "$window"
