#!/usr/bin/env bash
# Run a loom model in llama.cpp: export it as GGUF (fp32, fp16, bf16, q8_0),
# continue a few prompts greedily in llama.cpp and in loom, and compare the
# texts.
#
#   bash scripts/llamacpp_check.sh [MODEL_DIR]   (default out/demo/model, from scripts/demo.sh)
#
# llama.cpp comes from npm (node-llama-cpp and its prebuilt linux-x64 binary,
# installed once into ${LOOM_LLAMACPP_DIR:-$HOME/.cache/loom/llamacpp}); it
# needs node and npm (Debian's nodejs and npm) and the npm registry, so this is
# not part of the test suite, whose GGUF test (tests/scripts/test_gguf.sh)
# checks the file and llama.cpp's math without llama.cpp. The fp32 file must
# give loom's fp32 text; rounded weights may pick another token at a near tie,
# so the other files' agreement is reported, not required.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-out/demo/model}
DIR=${LOOM_LLAMACPP_DIR:-$HOME/.cache/loom/llamacpp}
N=40
[ -f "$MODEL/config.json" ] || { echo "llamacpp_check: $MODEL is not a model directory (run scripts/demo.sh?)" >&2; exit 1; }
command -v npm >/dev/null || { echo "llamacpp_check: needs node and npm: apt-get install nodejs npm" >&2; exit 1; }
if [ ! -d "$DIR/node_modules/node-llama-cpp" ]; then
  mkdir -p "$DIR"
  (cd "$DIR" && npm install --no-audit --no-fund node-llama-cpp@3 >/dev/null)
fi
cp scripts/llamacpp_generate.mjs "$DIR/"
bash scripts/build.sh >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
types=(fp32 fp16 bf16 q8_0)
for dt in "${types[@]}"; do build/loom export --model "$MODEL" --out "$work/model-$dt.gguf" --format gguf --dtype $dt; done
prompts=("The " "A man" "You will" "Love is" "It is a")
pass=0 fail=0
for p in "${prompts[@]}"; do
  loom=$(build/loom generate --model "$MODEL" --prompt "$p" --tokens $N --temperature 0)
  loom=${loom#"$p"}
  for dt in "${types[@]}"; do
    cpp=$(node "$DIR/llamacpp_generate.mjs" "$work/model-$dt.gguf" "$p" $N 2>/dev/null)
    if [ "$cpp" = "$loom" ]; then
      verdict=same
      [ $dt = fp32 ] && pass=$((pass + 1))
    else
      verdict=DIFFERENT
      [ $dt = fp32 ] && fail=$((fail + 1))
    fi
    printf '%-5s %-9s %-10q loom: %q\n%26s llama.cpp: %q\n' "$dt" "$verdict" "$p" "$loom" "" "$cpp"
  done
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
