#!/usr/bin/env bash
# The main job: build loom, tokenize the default corpus (Debian's fortunes),
# train the `tiny` LLaMA for a few minutes, then generate text from it.
# Environment: STEPS (default 200), OUT (default out/demo, recreated).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-200}
OUT=${OUT:-out/demo}
bash scripts/build.sh >/dev/null
corpus=()
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat|*.u8) continue ;; esac
  [ -f "$f" ] && corpus+=("$f")
done
if [ ${#corpus[@]} -eq 0 ]; then
  echo "demo: no fortunes corpus in /usr/share/games/fortunes; run scripts/setup.sh" >&2
  exit 1
fi
build/loom tokenize --train "${corpus[@]}" --vocab 4096 --in "${corpus[@]}" --doc-sep % --out data/fortunes
rm -rf "$OUT" # the demo's own output: a rerun starts afresh (train refuses another run's checkpoints)
build/loom train --data data/fortunes --preset tiny --out "$OUT" --steps "$STEPS" --batch 8 --seq 256 \
  --lr 2e-3 --warmup 20 --eval-every 50 --precision bf16 --master-grad on
echo
echo "== generated text (loom generate --model $OUT/model --prompt 'The ')"
build/loom generate --model "$OUT/model" --prompt "The " --tokens 120 --temperature 0.8 --top-p 0.95 --seed 7
echo
echo "== the model for llama.cpp (loom export --format gguf --dtype q8_0)"
build/loom export --model "$OUT/model" --out "$OUT/model-q8_0.gguf" --format gguf --dtype q8_0
