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
# The bytes of token ids (JSON on stdin) in the GGUF file $1's vocabulary.
spell() {
  /usr/bin/python3 -c '
import json, sys
sys.path.insert(0, "tests/python")
import gguf_check
meta, _ = gguf_check.read_gguf(sys.argv[1])
dec = {c: b for b, c in gguf_check.gpt2_byte_chars().items()}
toks = meta["tokenizer.ggml.tokens"]
sys.stdout.buffer.write(b"".join(bytes(dec[c] for c in toks[i]) for i in json.load(sys.stdin)))
' "$1"
}
prompts=("The " "A man" "You will" "Love is" "It is a")
pass=0 fail=0
for p in "${prompts[@]}"; do
  build/loom generate --model "$MODEL" --prompt "$p" --tokens $N --temperature 0 > "$work/loom.txt"
  # loom prints the prompt, the continuation and a newline.
  tail -c +$(( $(printf '%s' "$p" | wc -c) + 1 )) "$work/loom.txt" | head -c -1 > "$work/loom.cont"
  for dt in "${types[@]}"; do
    node "$DIR/llamacpp_generate.mjs" "$work/model-$dt.gguf" "$p" $N > "$work/ids.json" 2>"$work/node.err" ||
      { cat "$work/node.err" >&2; echo "llamacpp_check: llama.cpp failed on $work/model-$dt.gguf" >&2; exit 1; }
    spell "$work/model-$dt.gguf" < "$work/ids.json" > "$work/cpp.cont"
    if cmp -s "$work/loom.cont" "$work/cpp.cont"; then
      verdict=same
      [ $dt = fp32 ] && pass=$((pass + 1))
    else
      verdict=DIFFERENT
      [ $dt = fp32 ] && fail=$((fail + 1))
    fi
    printf '%-5s %-9s %-10q loom: %q\n%26s llama.cpp: %q\n' "$dt" "$verdict" "$p" "$(cat "$work/loom.cont")" "" \
      "$(cat "$work/cpp.cont")"
  done
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
