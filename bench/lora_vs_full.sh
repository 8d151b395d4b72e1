#!/usr/bin/env bash
# LoRA against full fine-tuning, one preset, in turns: step time (median of
# the steps after the first two) and peak RSS of `loom train`, from random
# weights on the demo's data (data/fortunes; scripts/demo.sh makes it).
#   bash bench/lora_vs_full.sh [PRESET] [ROUNDS] [LORA FLAGS...]
# e.g. bash bench/lora_vs_full.sh small 2 --lora 8 --lora-alpha 16
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-tiny}; rounds=${2:-2}; shift $(( $# < 2 ? $# : 2 ))
lora=("$@"); [ ${#lora[@]} -gt 0 ] || lora=(--lora 8 --lora-alpha 16)
[ -f data/fortunes/train_000000.bin ] || { echo "no data/fortunes: run scripts/demo.sh first" >&2; exit 1; }
case $preset in tiny) shape=(--batch 8 --seq 256);; small) shape=(--batch 4 --seq 512);; *) shape=();; esac
work=$(mktemp -d /tmp/loom-lora-bench.XXXXXX); trap 'rm -rf "$work"' EXIT
run() { # $1 label, the rest: extra flags
  local label=$1; shift
  /usr/bin/time -f "%M" -o "$work/rss" build/loom train --data data/fortunes --preset "$preset" "${shape[@]}" \
    --steps 20 --eval-every 0 --out "$work/$label" "$@" 2>"$work/$label.log"
  local ms; ms=$(grep -o '"step_ms":[0-9.]*' "$work/$label/metrics.jsonl" | tail -n +3 | cut -d: -f2 | sort -g |
    awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')
  local mem; mem=$(sed -n 's/.*memory per rank: \(.*\)/\1/p' "$work/$label.log")
  printf "%-5s preset=%s step_ms=%s peak_rss_MiB=%.0f (%s)\n" "$label" "$preset" "$ms" \
    "$(awk '{ print $1 / 1024 }' "$work/rss")" "$mem"
  rm -rf "${work:?}/$label"
}
echo "loom train --preset $preset ${shape[*]}; lora: ${lora[*]}; $(nproc) cores"
for r in $(seq "$rounds"); do
  run full
  run lora "${lora[@]}"
done
