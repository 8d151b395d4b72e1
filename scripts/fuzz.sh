#!/usr/bin/env bash
# Fuzz loom's parsers with libFuzzer (coverage-guided, under ASan and UBSan):
# safetensors, the tokenizer JSON and its encoding of any text, Unicode's
# normal forms (a tokenizer's normalizer) on any bytes, config.json,
# llm.c token shards and their loss masks, and a checkpoint's state
# (tests/fuzz/fuzz_*.c).
# Builds them with clang in build-fuzz/, starts each
# corpus from tests/fuzz/corpus (small valid files, and the inputs earlier
# runs kept: ctest replays those with the ordinary build), runs each fuzzer
# for SECONDS (default 60) and fails if any input crashes, leaks, hangs or
# breaks a harness's check; the input is left in build-fuzz/crashes/ (add it
# to tests/fuzz/corpus once fixed). Not part of scripts/test.sh: a long run,
# and clang is not otherwise needed.
#   bash scripts/fuzz.sh [SECONDS] [NAME...]     e.g. bash scripts/fuzz.sh 300 tokenizer
set -euo pipefail
cd "$(dirname "$0")/.."
secs=60
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then secs=$1; shift; fi
[ "$secs" -gt 0 ] || { echo "fuzz: SECONDS must be positive" >&2; exit 2; }
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(safetensors tokenizer encode normalize config shard checkpoint adapter)
bash scripts/setup.sh --fuzz
B=build-fuzz
CC=clang cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_FUZZ=ON -DLOOM_BUILD_TESTS=OFF \
  -DLOOM_WITH_MPI=OFF >/dev/null
cmake --build "$B" -j"$(nproc)" --target "${names[@]/#/fuzz_}"

# The work corpus starts from the committed one (tests/fuzz/corpus: small
# valid files and inputs earlier runs kept) and keeps what this run finds.
for n in "${names[@]}"; do
  mkdir -p "$B/corpus/$n"
  cp -n tests/fuzz/corpus/"$n"/* "$B/corpus/$n/" 2>/dev/null || true
done

mkdir -p "$B/crashes"
failed=()
for n in "${names[@]}"; do
  echo "fuzz: $n for ${secs}s"
  if ! "$B/fuzz_$n" "$B/corpus/$n" -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
       -artifact_prefix="$B/crashes/$n-" -print_final_stats=1 2>"$B/fuzz_$n.log"; then
    tail -40 "$B/fuzz_$n.log" >&2
    failed+=("$n")
  else
    grep -E '^stat::(number_of_executed_units|new_units_added)' "$B/fuzz_$n.log" | tr '\n' ' '; echo
  fi
done
# What processes now gone left in /dev/shm: a harness's input files (one
# stopped by a crash or a signal skips its exit handler), and the
# registration file clang's OpenMP runtime keeps per process. Files of
# processes still running (another fuzz or ctest run) stay.
for f in /dev/shm/loom-fuzz-* /dev/shm/__KMP_REGISTERED_LIB_*; do
  [ -e "$f" ] || continue
  p=${f#/dev/shm/loom-fuzz-}; p=${p#/dev/shm/__KMP_REGISTERED_LIB_}; p=${p%%[-_]*}
  kill -0 "$p" 2>/dev/null || rm -rf "$f"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs in $B/crashes/; logs in $B/fuzz_*.log)" >&2
  exit 1
fi
echo "fuzz: ${names[*]}: no crash in ${secs}s each"
