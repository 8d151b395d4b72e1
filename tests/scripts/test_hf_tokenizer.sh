#!/usr/bin/env bash
# Hugging Face tokenizer.json files (byte-level and SentencePiece-style BPE) in loom.
#  - tests/python/hf_tokenizer_check.py: loom's ids equal those of an
#    encoder written in the test, for GPT-2-, StarCoder-, Llama-3-style
#    (shuffled ids, a Split expression, ignore_merges, a template's
#    begin-of-text token, an end-of-text token after each document) and
#    Llama-2-style (SentencePiece: normalizer, byte fallback) files, and
#    files with Unicode normal forms (NFC, NFKD, NFKC and NFD), against
#    Python's unicodedata.
#  - A Llama-2-style file through tokenize, train and generate.
#  - The whole path with the Llama-3-style file and a model shaped as Llama
#    3.2 (tied, llama3 RoPE scaling): tokenize, train, the model directory
#    keeps the file byte for byte, eval, generate (whose output starts with
#    the prompt, and which stops at generation_config.json's eos_token_id),
#    export --format hf keeps it, the config's scaling and the generation
#    config, train --init from that export, and --format gguf is refused by
#    name.
source "$(dirname "$0")/lib.sh"
/usr/bin/python3 -c "import regex" 2>/dev/null || fail "/usr/bin/python3 cannot import regex; install it with \
scripts/setup.sh (Debian package python3-regex)"
/usr/bin/python3 "$SRC/tests/python/hf_tokenizer_check.py" --loom "$LOOM" --workdir "$WORK/check" \
  --corpus "$SRC/README.md" || fail "loom's ids differ from the reference encoder's"
# A SentencePiece-style file (Llama 2's layout) through tokenize, train and generate.
sp=$WORK/check/llama2.json
"$LOOM" tokenize --tokenizer "$sp" --in $(corpus) --out "$WORK/sp" --val-fraction 0.1 2>"$WORK/tok.log" ||
  { cat "$WORK/tok.log"; fail "tokenize with a SentencePiece-style tokenizer"; }
vsp=$(/usr/bin/python3 -c "import json,sys; print(max(json.load(open(sys.argv[1]))['model']['vocab'].values()) + 1)" "$sp")
small_config "$WORK/spconfig.json" "$vsp"
"$LOOM" train --data "$WORK/sp" --config "$WORK/spconfig.json" --steps 2 --batch 2 --seq 32 --eval-every 0 \
  --out "$WORK/sprun" 2>"$WORK/sptrain.log" || { cat "$WORK/sptrain.log"; fail "train (SentencePiece-style)"; }
"$LOOM" generate --model "$WORK/sprun/model" --prompt "The tokenizer" --tokens 8 --temperature 0 \
  >"$WORK/spgen.txt" 2>"$WORK/spgen.log" || { cat "$WORK/spgen.log"; fail "generate (SentencePiece-style)"; }
[ "$(head -c 13 "$WORK/spgen.txt")" = "The tokenizer" ] || fail "generate's text does not start with the prompt"
expect_error "Hugging Face tokenizer is not supported.*convert_hf_to_gguf" \
  "$LOOM" export --model "$WORK/sprun/model" --format gguf --out "$WORK/sp.gguf"

hf=$WORK/check/llama3.json
"$LOOM" tokenize --tokenizer "$hf" --in $(corpus) --out "$WORK/data" --val-fraction 0.1 2>"$WORK/tok.log" ||
  { cat "$WORK/tok.log"; fail "tokenize with a Hugging Face tokenizer"; }
cmp -s "$hf" "$WORK/data/tokenizer.json" || fail "the data directory's tokenizer.json is not the file given"
grep -q "each document starts with <|begin_of_text|> (id [0-9]*) and ends with <|end_of_text|>" "$WORK/tok.log" ||
  { cat "$WORK/tok.log"; fail "tokenize does not say how documents are framed"; }
vocab=$(/usr/bin/python3 -c "import json,sys; print(max(json.load(open(sys.argv[1]))['model']['vocab'].values()) + 1)" "$hf")
# Shaped as Llama 3.2 is: tied embeddings and Llama 3.1's RoPE scaling.
small_config "$WORK/plain.json" "$vocab"
config_plus "$WORK/config.json" "$WORK/plain.json" '"tie_word_embeddings": true, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}'
"$LOOM" train --data "$WORK/data" --config "$WORK/config.json" --steps 3 --batch 2 --seq 32 --eval-every 0 \
  --out "$WORK/run" 2>"$WORK/train.log" || { cat "$WORK/train.log"; fail "train"; }
cmp -s "$hf" "$WORK/run/model/tokenizer.json" || fail "the model directory's tokenizer.json is not the data's"
"$LOOM" eval --model "$WORK/run/model" --data "$WORK/data" --batch 2 --seq 32 >"$WORK/eval.log" 2>&1 ||
  { cat "$WORK/eval.log"; fail "eval"; }
grep -q "loss=" "$WORK/eval.log" || fail "eval printed no loss"
"$LOOM" generate --model "$WORK/run/model" --prompt "The tokenizer" --tokens 8 --temperature 0 \
  >"$WORK/gen.txt" 2>"$WORK/gen.log" || { cat "$WORK/gen.log"; fail "generate"; }
[ "$(head -c 13 "$WORK/gen.txt")" = "The tokenizer" ] || fail "generate's text does not start with the prompt"
"$LOOM" generate --model "$WORK/run/model" --prompt "The tokenizer" --tokens 8 --temperature 0 \
  --stop "<|reserved_special_token_0|>" ">" >"$WORK/gen2.txt" 2>"$WORK/gen.log" || { cat "$WORK/gen.log"; fail "generate --stop"; }
expect_error "stop no-such-token-anywhere: no token" "$LOOM" generate --model "$WORK/run/model" --tokens 2 \
  --stop "no-such-token-anywhere"
# generation_config.json's eos_token_id stops generation (Llama 3's instruct
# models list <|eot_id|> there): listing the id of greedy decoding's first
# token leaves nothing after the prompt. export and train --init carry the
# file to the directories they write, checkpoints too, and a resumed run
# takes it from its checkpoint.
"$LOOM" generate --model "$WORK/run/model" --prompt "The tokenizer" --tokens 1 --temperature 0 >"$WORK/one.txt" \
  2>/dev/null || fail "generate one token"
/usr/bin/python3 - "$hf" "$WORK/one.txt" "$WORK/run/model/generation_config.json" <<'PY' || fail "no id for the first token"
import json, sys
vocab = json.load(open(sys.argv[1]))["model"]["vocab"]
text = open(sys.argv[2], "rb").read()
assert text.startswith(b"The tokenizer") and text.endswith(b"\n"), text
first = text[len(b"The tokenizer"):-1]
assert first, "the first token is the end of text: nothing to stop at"
# GPT-2's byte alphabet: printable bytes as themselves, the others from U+0100 on
keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
alpha = {b: chr(b) for b in keep}
alpha.update({b: chr(256 + k) for k, b in enumerate(x for x in range(256) if x not in keep)})
tid = vocab["".join(alpha[b] for b in first)]
json.dump({"bos_token_id": 0, "eos_token_id": [len(vocab) + 5, tid]}, open(sys.argv[3], "w"))
PY
"$LOOM" generate --model "$WORK/run/model" --prompt "The tokenizer" --tokens 8 --temperature 0 >"$WORK/eos.txt" \
  2>/dev/null || fail "generate with a generation_config.json"
[ "$(cat "$WORK/eos.txt")" = "The tokenizer" ] || fail "generation_config.json's eos_token_id did not stop generation"
# and its sampling, as Hugging Face's generate reads it: greedy without
# do_sample (the file above), else its temperature, top_p and top_k; flags
# given override it
"$LOOM" generate --model "$WORK/run/model" --prompt "The" --tokens 6 >"$WORK/g1.txt" 2>"$WORK/g1.log" ||
  fail "generate with generation_config.json's sampling"
"$LOOM" generate --model "$WORK/run/model" --prompt "The" --tokens 6 --temperature 0 >"$WORK/g2.txt" 2>/dev/null
cmp -s "$WORK/g1.txt" "$WORK/g2.txt" || fail "a generation_config.json without do_sample did not decode greedily"
grep -q "greedy, as .*generation_config.json asks" "$WORK/g1.log" || { cat "$WORK/g1.log"; fail "no note of the greedy decoding"; }
mkdir -p "$WORK/samp" && cp "$WORK/run/model/"{config.json,model.safetensors,tokenizer.json} "$WORK/samp/"
echo '{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 5, "min_p": 0.1}' \
  >"$WORK/samp/generation_config.json"
"$LOOM" generate --model "$WORK/samp" --prompt "The" --tokens 12 --seed 3 >"$WORK/s1.txt" 2>"$WORK/s1.log" ||
  fail "generate with generation_config.json's sampling"
grep -q "temperature 0.7, top-p 0.8, top-k 5, min-p 0.1" "$WORK/s1.log" ||
  { cat "$WORK/s1.log"; fail "no note of the file's sampling"; }
"$LOOM" generate --model "$WORK/samp" --prompt "The" --tokens 6 --temperature 0 >"$WORK/s0.txt" 2>/dev/null
cmp -s "$WORK/s0.txt" "$WORK/g2.txt" || fail "--temperature 0 did not override generation_config.json's sampling"
rm "$WORK/samp/generation_config.json"
"$LOOM" generate --model "$WORK/samp" --prompt "The" --tokens 12 --seed 3 --temperature 0.7 --top-p 0.8 --top-k 5 \
  --min-p 0.1 >"$WORK/s2.txt" 2>/dev/null
cmp -s "$WORK/s1.txt" "$WORK/s2.txt" || fail "generation_config.json's sampling differs from the same flags"
# its repetition_penalty (greedy or not), as the flag gives it
echo '{"repetition_penalty": 1.3}' >"$WORK/samp/generation_config.json"
"$LOOM" generate --model "$WORK/samp" --prompt "The" --tokens 8 >"$WORK/r1.txt" 2>"$WORK/r1.log" ||
  fail "generate with generation_config.json's repetition_penalty"
grep -q "repetition penalty 1.3" "$WORK/r1.log" || { cat "$WORK/r1.log"; fail "no note of the repetition penalty"; }
rm "$WORK/samp/generation_config.json"
"$LOOM" generate --model "$WORK/samp" --prompt "The" --tokens 8 --temperature 0 --repetition-penalty 1.3 \
  >"$WORK/r2.txt" 2>/dev/null
cmp -s "$WORK/r1.txt" "$WORK/r2.txt" || fail "generation_config.json's repetition_penalty differs from the flag's"
expect_usage "repetition-penalty" "$LOOM" generate --model "$WORK/samp" --repetition-penalty 0
expect_usage "min-p in \[0, 1\]" "$LOOM" generate --model "$WORK/samp" --min-p 1.5
echo '{"do_sample": true, "top_p": 2}' >"$WORK/samp/generation_config.json"
expect_error "top_p must be a number in" "$LOOM" generate --model "$WORK/samp" --tokens 2
echo '{"eos_token_id": "x"}' >"$WORK/bad.json" && mkdir -p "$WORK/badgc" && cp "$WORK/run/model/"{config.json,model.safetensors,tokenizer.json} "$WORK/badgc/" &&
  cp "$WORK/bad.json" "$WORK/badgc/generation_config.json"
expect_error "generation_config.json: eos_token_id must be a token id" "$LOOM" generate --model "$WORK/badgc" --tokens 2
"$LOOM" export --model "$WORK/run/model" --out "$WORK/hfdir" 2>"$WORK/export.log" || { cat "$WORK/export.log"; fail "export"; }
cmp -s "$WORK/run/model/generation_config.json" "$WORK/hfdir/generation_config.json" ||
  fail "export did not copy generation_config.json"
cmp -s "$hf" "$WORK/hfdir/tokenizer.json" || fail "export --format hf did not keep the tokenizer.json"
/usr/bin/python3 - "$WORK/hfdir/config.json" <<'PY' || fail "the exported config lost its rope_scaling or tying"
import json, sys
c = json.load(open(sys.argv[1]))
rs = c["rope_scaling"]
assert c["tie_word_embeddings"] is True
assert rs["rope_type"] == "llama3" and rs["factor"] == 32.0 and rs["original_max_position_embeddings"] == 8192, rs
PY
# and it fine-tunes from there (--init reads the directory, scaling and all)
"$LOOM" train --init "$WORK/hfdir" --data "$WORK/data" --steps 1 --batch 2 --seq 32 --eval-every 0 \
  --out "$WORK/again" 2>"$WORK/again.log" || { cat "$WORK/again.log"; fail "train --init the exported directory"; }
cmp -s "$WORK/hfdir/config.json" "$WORK/again/model/config.json" || fail "the fine-tuned model's config differs"
cmp -s "$WORK/hfdir/generation_config.json" "$WORK/again/model/generation_config.json" ||
  fail "train --init did not carry generation_config.json to the fine-tuned model"
cmp -s "$WORK/hfdir/generation_config.json" "$WORK/again/ckpt-00000001/generation_config.json" ||
  fail "the checkpoint does not carry generation_config.json"
# a resumed run (no --init) takes it from the checkpoint into its final model
rm "$WORK/again/model/generation_config.json"
"$LOOM" train --resume "$WORK/again" --data "$WORK/data" --steps 2 --batch 2 --seq 32 --eval-every 0 \
  2>"$WORK/again2.log" || { cat "$WORK/again2.log"; fail "resume the fine-tune"; }
cmp -s "$WORK/hfdir/generation_config.json" "$WORK/again/model/generation_config.json" ||
  fail "a resumed run's model lost generation_config.json"
# a checkpoint without one (an older loom's): --init's then, and with neither
# the final model has none (the stale one removed)
rm "$WORK/again/ckpt-00000002/generation_config.json"
"$LOOM" train --resume "$WORK/again" --init "$WORK/hfdir" --data "$WORK/data" --steps 3 --batch 2 --seq 32 \
  --eval-every 0 2>/dev/null || fail "resume with --init"
cmp -s "$WORK/hfdir/generation_config.json" "$WORK/again/model/generation_config.json" ||
  fail "a resumed run did not take --init's generation_config.json when its checkpoint has none"
rm "$WORK/again/ckpt-00000003/generation_config.json"
"$LOOM" train --resume "$WORK/again" --data "$WORK/data" --steps 4 --batch 2 --seq 32 --eval-every 0 2>/dev/null ||
  fail "resume without a generation config"
[ -e "$WORK/again/model/generation_config.json" ] && fail "a stale generation_config.json was left in the model"
expect_error "is not supported.*convert_hf_to_gguf" \
  "$LOOM" export --model "$WORK/run/model" --format gguf --out "$WORK/m.gguf"
echo "1 passed, 0 failed"
