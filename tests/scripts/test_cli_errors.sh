#!/usr/bin/env bash
# Bad input gets a clear message naming the problem and a non-zero exit, never
# a crash; a failed checkpoint never damages an existing one.
source "$(dirname "$0")/lib.sh"
make_data "$WORK/data"
small_config "$WORK/cfg.json" 512
D=(--data "$WORK/data" --config "$WORK/cfg.json" --batch 2 --seq 16 --eval-every 0)

# Flags and commands
expect_usage "unknown flag '--bogus'" "$LOOM" train --bogus
expect_error "unknown command" "$LOOM" frobnicate
expect_error "--data DIR is required" "$LOOM" train
expect_usage "expects an integer" "$LOOM" train "${D[@]}" --steps ten
expect_usage "--bucket-size 2147483648 is out of range" "$LOOM" train "${D[@]}" --bucket-size 2147483648
expect_usage "--steps 99999999999999999999 is out of range" "$LOOM" train "${D[@]}" --steps 99999999999999999999
expect_usage "--precision" "$LOOM" train "${D[@]}" --precision fp8
expect_usage "--recompute expects" "$LOOM" train "${D[@]}" --recompute most
expect_usage "--recompute-blocks must be >= 0" "$LOOM" train "${D[@]}" --recompute full --recompute-blocks -1
expect_usage "--recompute-blocks 1 chooses which blocks recompute" "$LOOM" train "${D[@]}" --recompute-blocks 1
expect_usage "--recompute-budget picks the number of blocks itself" "$LOOM" train "${D[@]}" --recompute-budget 5 \
  --recompute-blocks 1
expect_usage "--recompute-budget must be >= 0" "$LOOM" train "${D[@]}" --recompute-budget -1
expect_usage "--recompute-blocks 3 is more than the model's 2 blocks" "$LOOM" train "${D[@]}" --recompute full \
  --recompute-blocks 3 --out "$WORK/rb3"
expect_usage "--schedule: unknown learning-rate schedule 'step'" "$LOOM" train "${D[@]}" --schedule step
expect_usage "--schedule constant does not decay" "$LOOM" train "${D[@]}" --schedule constant --min-lr 1e-5
expect_usage "--decay-frac sizes the decay of --schedule wsd, not of cosine" "$LOOM" train "${D[@]}" --decay-frac 0.3
expect_usage "--decay-frac must be in \(0, 1\]" "$LOOM" train "${D[@]}" --schedule wsd --decay-frac 0 --out "$WORK/df0"
expect_error "expects on or off" "$LOOM" train "${D[@]}" --master-grad maybe
expect_error "unknown preset" "$LOOM" train --data "$WORK/data" --preset huge
expect_usage "longer than the model's context" "$LOOM" train "${D[@]}" --seq 1000
expect_usage "--threads must be >= 0" "$LOOM" train "${D[@]}" --threads -3 --out "$WORK/t3"
expect_error "--threads must be >= 0" "$LOOM" generate --model "$WORK/nowhere" --threads -1
# --model that is not a model directory: said so (it used to name a missing tokenizer.json).
expect_error "nowhere is not a model directory \(no config.json" "$LOOM" generate --model "$WORK/nowhere"
expect_error "nowhere is not a model directory \(no config.json" "$LOOM" export --model "$WORK/nowhere" --out "$WORK/x0"
expect_error "--threads must be >= 0" "$LOOM" bench --preset tiny --gemm-peak 100,100 --threads -2
expect_error "--threads 99999 is more than loom's limit of 1024" "$LOOM" bench --preset tiny --gemm-peak 100,100 --threads 99999
expect_error "--threads 5000 is more than loom's limit" "$LOOM" train "${D[@]}" --threads 5000 --out "$WORK/t4"
expect_error "one step needs" "$LOOM" train "${D[@]}" --batch 2000000000 --seq 32 --out "$WORK/bigbatch"
expect_usage "--min-lr 5 is above --lr" "$LOOM" train "${D[@]}" --min-lr 5 --out "$WORK/minlr"
expect_error "--gemm-peak expects two positive numbers" "$LOOM" bench --preset tiny --gemm-peak inf,1
expect_usage "LOOM_SIMD: unknown SIMD level 'avx3'" env LOOM_SIMD=avx3 "$LOOM" --version
# (Outputs are taken whole before grep -q: with pipefail, loom writing after
# grep -q has matched and exited would fail the pipe with SIGPIPE.)
out=$(LOOM_SIMD=portable "$LOOM" --version)
grep -q "kernels: portable" <<<"$out" || fail "LOOM_SIMD=portable is not the portable kernels"
out=$("$LOOM" train --help)
grep -q -- "--recompute-mode" <<<"$out" || fail "train --help lacks flags"
out=$("$LOOM" --help)
grep -q "generate" <<<"$out" || fail "loom --help lacks commands"

# Missing and corrupt files
expect_error "no token shards match" "$LOOM" train --data "$WORK/nope" --config "$WORK/cfg.json"
mkdir -p "$WORK/bad"
cp "$WORK/data/val_000000.bin" "$WORK/bad/"
printf 'garbage that is not a shard header' > "$WORK/bad/train_000000.bin"
expect_error "train_000000.bin" "$LOOM" train --data "$WORK/bad" --config "$WORK/cfg.json" --batch 2 --seq 16
head -c 2000 "$WORK/data/train_000000.bin" > "$WORK/bad/train_000000.bin"   # truncated: count says more
expect_error "train_000000.bin" "$LOOM" train --data "$WORK/bad" --config "$WORK/cfg.json" --batch 2 --seq 16
small_config "$WORK/cfg-small-vocab.json" 100                                 # tokens >= vocab
expect_error "vocab|vocabulary|token" "$LOOM" train --data "$WORK/data" --config "$WORK/cfg-small-vocab.json" --batch 2 --seq 16
echo '{"hidden_size": 64, "num_hidden_layers": 2' > "$WORK/broken.json"
expect_error "broken.json" "$LOOM" train --data "$WORK/data" --config "$WORK/broken.json"
echo '{"hidden_size": 65, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 512}' > "$WORK/odd.json"
expect_error "heads" "$LOOM" train --data "$WORK/data" --config "$WORK/odd.json"
config_plus "$WORK/scaled.json" "$WORK/cfg.json" '"rope_scaling": {"type": "mrope", "factor": 2.0}'
expect_error 'rope_scaling "mrope" is not supported' "$LOOM" train --data "$WORK/data" --config "$WORK/scaled.json"
config_plus "$WORK/scaled.json" "$WORK/cfg.json" '"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 64}'
expect_error "rope_scaling: .*low_freq_factor" "$LOOM" train --data "$WORK/data" --config "$WORK/scaled.json"
config_plus "$WORK/scaled.json" "$WORK/cfg.json" '"rope_scaling": {"rope_type": "llama3", "factor": 8.0}'
expect_error "low_freq_factor" "$LOOM" train --data "$WORK/data" --config "$WORK/scaled.json"
config_plus "$WORK/qwen.json" "$WORK/cfg.json" '"model_type": "qwen3_moe"'
expect_error 'model_type "qwen3_moe" is not a LLaMA model' "$LOOM" train --data "$WORK/data" --config "$WORK/qwen.json"
config_plus "$WORK/mlpb.json" "$WORK/cfg.json" '"mlp_bias": true'
expect_error 'mlp_bias = true is not supported' "$LOOM" train --data "$WORK/data" --config "$WORK/mlpb.json"
# attention dropout (Granite 3's 0.1): training applies it (the first loss moves), the model saved keeps it, and
# evaluation applies none (as Hugging Face's): the loss of the same weights without it, to the digit
config_plus "$WORK/adrop.json" "$WORK/cfg.json" '"attention_dropout": 0.1'
for a in adrop cfg; do
  "$LOOM" train --data "$WORK/data" --config "$WORK/$a.json" --steps 1 --batch 2 --seq 32 --eval-every 0 \
    --out "$WORK/$a-run" >/dev/null 2>"$WORK/adrop.log" || { cat "$WORK/adrop.log"; fail "train with $a.json"; }
done
first_loss() { grep -o '"loss":[0-9.e+-]*' "$1/metrics.jsonl" | head -1 | cut -d: -f2; }
[ "$(first_loss "$WORK/adrop-run")" != "$(first_loss "$WORK/cfg-run")" ] || fail "attention_dropout changed no loss"
grep -q '"attention_dropout": 0.1' "$WORK/adrop-run/model/config.json" || fail "the saved config lost attention_dropout"
e1=$("$LOOM" eval --model "$WORK/adrop-run/model" --data "$WORK/data" --batch 2 --seq 32 2>/dev/null) ||
  fail "eval refused a config with attention_dropout"
cp "$WORK/cfg.json" "$WORK/adrop-run/model/config.json"
e0=$("$LOOM" eval --model "$WORK/adrop-run/model" --data "$WORK/data" --batch 2 --seq 32 2>/dev/null)
[ "$e1" = "$e0" ] || fail "eval with attention_dropout says '$e1', without '$e0'"
# Mistral's sliding window: a context past the window trains (each query sees the 16 keys up to it), and the
# model saves as Mistral's class with its window and context.
config_plus "$WORK/mistral.json" "$WORK/cfg.json" '"model_type": "mistral", "sliding_window": 16'
"$LOOM" train --data "$WORK/data" --config "$WORK/mistral.json" --batch 2 --seq 32 --steps 1 --eval-every 0 \
  --out "$WORK/mistral" >/dev/null 2>"$WORK/mistral.log" || { cat "$WORK/mistral.log"; fail "a Mistral config past its window"; }
grep -q '"sliding_window": 16' "$WORK/mistral/model/config.json" &&
  grep -q 'MistralForCausalLM' "$WORK/mistral/model/config.json" || fail "the window was not saved as Mistral's"
config_plus "$WORK/mistral.json" "$WORK/cfg.json" '"model_type": "mistral", "sliding_window": 1.5'
expect_error "sliding_window must be a positive integer" "$LOOM" train --data "$WORK/data" --config "$WORK/mistral.json"
# transformers v5 keeps theta and the scaling in rope_parameters; with the old fields too they must agree.
config_plus "$WORK/v5.json" "$WORK/cfg.json" '"rope_parameters": {"rope_theta": 500000.0, "rope_type": "mrope", "factor": 4.0}'
expect_error 'rope_parameters "mrope" is not supported' "$LOOM" train --data "$WORK/data" --config "$WORK/v5.json"
config_plus "$WORK/v5.json" "$WORK/cfg.json" '"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}'
expect_error "rope_parameters and rope_theta/rope_scaling disagree" "$LOOM" train --data "$WORK/data" --config "$WORK/v5.json"
# Optional fields set to null take their defaults, as in Hugging Face's
# LlamaConfig ("num_key_value_heads": null: one kv head per attention head);
# a required one set to null is an error.
sed 's/"num_key_value_heads": 2/"num_key_value_heads": null/' "$WORK/cfg.json" > "$WORK/kvnull.json"
sed 's/"num_key_value_heads": 2/"num_key_value_heads": 4/' "$WORK/cfg.json" > "$WORK/kv4.json"
grep -q '"num_key_value_heads": null' "$WORK/kvnull.json" || fail "no null kv heads config"
K=(--data "$WORK/data" --batch 2 --seq 16 --eval-every 0 --steps 1)
"$LOOM" train "${K[@]}" --config "$WORK/kvnull.json" --out "$WORK/kvn" --dump-grads "$WORK/kvn.st" 2>/dev/null
"$LOOM" train "${K[@]}" --config "$WORK/kv4.json" --out "$WORK/kv4" --dump-grads "$WORK/kv4.st" 2>/dev/null
cmp -s "$WORK/kvn.st" "$WORK/kv4.st" || fail "\"num_key_value_heads\": null is not as many kv heads as attention heads"
sed 's/"num_hidden_layers": 2/"num_hidden_layers": null/' "$WORK/cfg.json" > "$WORK/layersnull.json"
expect_error "num_hidden_layers\" must be a positive integer" "$LOOM" train --data "$WORK/data" --config "$WORK/layersnull.json"
echo '{"type": "loom-bpe", "version": 1, "merges": [[1, 999999]]' > "$WORK/tok.json"
expect_error "tok.json" "$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$SRC/README.md" --out "$WORK/t2"
expect_error "cannot|No such|missing" "$LOOM" tokenize --train "$WORK/does-not-exist.txt" --out "$WORK/t.json"

# A model directory whose weights disagree with its config, or are corrupt
"$LOOM" train "${D[@]}" --steps 1 --out "$WORK/r" 2>/dev/null
mkdir -p "$WORK/m2" && cp "$WORK/r/model/"* "$WORK/m2/"
sed -i 's/"intermediate_size": 128/"intermediate_size": 96/' "$WORK/m2/config.json"
expect_error "mlp.*proj.weight" "$LOOM" generate --model "$WORK/m2" --prompt x
cp "$WORK/r/model/config.json" "$WORK/m2/config.json"
head -c 5000 "$WORK/r/model/model.safetensors" > "$WORK/m2/model.safetensors"
expect_error "model.safetensors" "$LOOM" generate --model "$WORK/m2" --prompt x
expect_error "model.safetensors" "$LOOM" train --data "$WORK/data" --batch 2 --seq 16 --init "$WORK/m2" --out "$WORK/r3"
printf 'not json' > "$WORK/m2/model.safetensors"
expect_error "model.safetensors" "$LOOM" export --model "$WORK/m2" --out "$WORK/x"

# Values that are not values
expect_error "finite number" "$LOOM" train "${D[@]}" --lr nan
expect_error "finite number" "$LOOM" train "${D[@]}" --weight-decay 1e999
expect_error "empty string" "$LOOM" train "${D[@]}" --out ""

# --data as a glob names training shards only: no validation on them.
"$LOOM" train --data "$WORK/data/train_*.bin" --config "$WORK/cfg.json" --batch 2 --seq 16 --eval-every 1 \
    --steps 1 --out "$WORK/g" 2>"$WORK/g.log" || { cat "$WORK/g.log"; fail "training from a glob"; }
grep -q "not a directory, so it has no val_\*.bin split" "$WORK/g.log" || { cat "$WORK/g.log"; fail "no note on validation"; }
grep -q val_loss "$WORK/g/metrics.jsonl" && fail "validated on training shards"
[ -f "$WORK/g/model/tokenizer.json" ] || fail "the tokenizer beside the shards was not found for a glob"

# Shards of an earlier tokenize run in the output directory are removed.
mkdir -p "$WORK/t3" && cp "$WORK/data/train_000000.bin" "$WORK/t3/train_000007.bin"
"$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$SRC/README.md" --out "$WORK/t3" 2>"$WORK/t3.log"
[ -e "$WORK/t3/train_000007.bin" ] && fail "tokenize left a shard of an earlier run"
grep -q "removed 1 shard of an earlier run" "$WORK/t3.log" || fail "tokenize did not say it removed old shards"
[ -e "$WORK/t3/.tokenize-incomplete" ] && fail "a finished tokenize left its marker"
# A directory that a tokenize crashed while replacing (its marker is still
# there) is refused, since its shards and tokenizer may belong to two runs;
# a tokenize that finishes there clears it.
touch "$WORK/t3/.tokenize-incomplete"
expect_error "tokenize-incomplete exists.*run the tokenize again" "$LOOM" train --data "$WORK/t3" \
  --config "$WORK/cfg.json" --batch 1 --seq 8 --steps 1 --out "$WORK/t3run"
"$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$SRC/README.md" --out "$WORK/t3" 2>/dev/null
"$LOOM" train --data "$WORK/t3" --config "$WORK/cfg.json" --batch 1 --seq 8 --steps 1 --eval-every 0 \
  --out "$WORK/t3run" 2>/dev/null || fail "training after a finished tokenize"

# Validation shards that are there but damaged are an error, as damaged
# training shards are (it used to turn validation off with a note); no
# validation shards at all is a note.
mkdir -p "$WORK/badval" && cp "$WORK/data/train_000000.bin" "$WORK/data/tokenizer.json" "$WORK/badval/"
head -c 600 "$WORK/data/val_000000.bin" > "$WORK/badval/val_000000.bin"
expect_error "val_000000.bin" "$LOOM" train --data "$WORK/badval" --config "$WORK/cfg.json" --batch 2 --seq 16 \
  --steps 1 --eval-every 1 --out "$WORK/badval-run"
rm "$WORK/badval/val_000000.bin"
"$LOOM" train --data "$WORK/badval" --config "$WORK/cfg.json" --batch 2 --seq 16 --steps 1 --eval-every 1 \
  --out "$WORK/noval-run" 2>"$WORK/noval.log" || { cat "$WORK/noval.log"; fail "training without validation shards"; }
grep -q "validation is off: no shards matching '\*val\*.bin'" "$WORK/noval.log" ||
  { cat "$WORK/noval.log"; fail "no note on missing validation"; }
# Validation shards too short for one step: a note too, not an error that
# stops training (the step grows with the batch and the ranks).
# (A fixed 20000 bytes: 0.5% of their tokens stays below one step as README.md grows.)
head -c 20000 "$SRC/README.md" > "$WORK/short.txt"
"$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$WORK/short.txt" --val-fraction 0.005 --out "$WORK/shortval" 2>/dev/null
"$LOOM" train --data "$WORK/shortval" --config "$WORK/cfg.json" --batch 2 --seq 32 --steps 1 --eval-every 1 \
  --out "$WORK/shortval-run" 2>"$WORK/shortval.log" || { cat "$WORK/shortval.log"; fail "a short validation split stopped training"; }
grep -q "validation is off: data loader: one step needs" "$WORK/shortval.log" || { cat "$WORK/shortval.log"; fail "no note on a short validation split"; }
# Flags that would be ignored: refused, or noted.
expect_error "--preset applies to presets; the model comes from --config" "$LOOM" train "${D[@]}" --preset small \
  --steps 1 --out "$WORK/ign"
expect_error "--tie-embeddings applies to presets" "$LOOM" train "${D[@]}" --tie-embeddings --steps 1 --out "$WORK/ign"
"$LOOM" train "${D[@]}" --steps 1 --recompute selective --recompute-mode reentrant --zero 1 --out "$WORK/ign" \
  2>"$WORK/ign.log" || { cat "$WORK/ign.log"; fail "a run with noted flags failed"; }
grep -q "recompute-mode applies to --recompute full" "$WORK/ign.log" || fail "no note on --recompute-mode"
grep -q "with one, nothing is sharded" "$WORK/ign.log" || fail "no note on --zero 1 in one process"
# Exporting into a dataset directory would replace its tokenizer: refused.
expect_error "holds token shards" "$LOOM" export --model "$WORK/r/model" --out "$WORK/data"
# GGUF export: a bad format, a directory for the file, no tokenizer, a
# tokenizer with more tokens than the model has ids.
expect_usage "--format must be hf or gguf, not 'onnx'" "$LOOM" export --model "$WORK/r/model" --out "$WORK/g" \
  --format onnx
expect_usage "is a directory; --format gguf writes one file" "$LOOM" export --model "$WORK/r/model" --out "$WORK/data" \
  --format gguf
expect_usage "unknown GGUF type 'q4_0' \(fp32, fp16, bf16 or q8_0\)" "$LOOM" export --model "$WORK/r/model" \
  --out "$WORK/g.gguf" --format gguf --dtype q4_0
expect_usage "q8_0 is for --format gguf" "$LOOM" export --model "$WORK/r/model" --out "$WORK/g" --dtype q8_0
expect_usage "ends in '/'; --format gguf writes one file" "$LOOM" export --model "$WORK/r/model" --out "$WORK/gdir/" \
  --format gguf
[ -e "$WORK/gdir" ] && fail "a refused GGUF export created its directory"
echo '{"hello": 1}' > "$WORK/bogus-tok.json"
expect_error "bogus-tok.json" "$LOOM" export --model "$WORK/r/model" --out "$WORK/gx" --tokenizer "$WORK/bogus-tok.json"
[ -e "$WORK/gx" ] && fail "an export with a bad tokenizer wrote its directory"
mkdir -p "$WORK/notok" && cp "$WORK/r/model/config.json" "$WORK/r/model/model.safetensors" "$WORK/notok/"
expect_usage "has no tokenizer.json, and a GGUF file must carry the vocabulary" "$LOOM" export --model "$WORK/notok" \
  --out "$WORK/g.gguf" --format gguf
expect_usage "cannot read the tokenizer" "$LOOM" export --model "$WORK/notok" --out "$WORK/g.gguf" --format gguf \
  --tokenizer "$WORK/nowhere.json"
"$LOOM" tokenize --train $(corpus) --vocab 700 --in "$SRC/README.md" --out "$WORK/tok700" 2>/dev/null
expect_error "tokenizer.json has 700 tokens but the model only 512" "$LOOM" export --model "$WORK/notok" \
  --out "$WORK/g.gguf" --format gguf --tokenizer "$WORK/tok700/tokenizer.json"
[ -e "$WORK/g.gguf" ] && fail "a refused GGUF export left a file"
# loom eval: data made with another tokenizer, a bad split, too long a sequence.
expect_usage "--model DIR and --data PATH are required" "$LOOM" eval --model "$WORK/r/model"
expect_usage "--split must be val or train, not 'test'" "$LOOM" eval --model "$WORK/r/model" --data "$WORK/data" \
  --split test
expect_usage "--seq 1000 is longer than the model's context \(64\)" "$LOOM" eval --model "$WORK/r/model" \
  --data "$WORK/data" --seq 1000
for d in "$WORK/tok700" "$WORK/tok700/train_000000.bin" "$WORK/tok700/*.bin"; do
  expect_error "was made with another tokenizer than the model's" "$LOOM" eval --model "$WORK/r/model" --data "$d"
done
expect_usage "--split chooses among a dataset directory's shards" "$LOOM" eval --model "$WORK/r/model" \
  --data "$WORK/data/val_000000.bin" --split train
expect_usage "more than 2\^30 tokens per batch" "$LOOM" eval --model "$WORK/r/model" --data "$WORK/data" \
  --batch 100000 --seq 20000
# --tp in a single process: says how to start it.
expect_error "start tensor parallelism with mpirun" "$LOOM" train "${D[@]}" --steps 1 --tp 2 --out "$WORK/tp1"
set +e; "$LOOM" train "${D[@]}" --steps 1 --tp 0 --out "$WORK/tp0" 2>"$WORK/tp0.log"; rc=$?; set -e
[ $rc -eq 2 ] && grep -q -- "--tp must be positive" "$WORK/tp0.log" || fail "--tp 0: exit $rc, not a usage error"

# Two runs into one --out: the second is refused while the first holds the
# directory's lock, naming it (they used to both "succeed", mixing
# checkpoints, model and metrics).
"$LOOM" train "${D[@]}" --steps 100000 --out "$WORK/busy" 2>/dev/null &
busy=$!
for i in $(seq 1 500); do [ -s "$WORK/busy/metrics.jsonl" ] && break; sleep 0.02; done
expect_error "busy is in use by another loom process \(pid $busy" "$LOOM" train "${D[@]}" --steps 3 --out "$WORK/busy"
expect_error "in use by another loom process" "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" \
  --in "$SRC/README.md" --out "$WORK/busy"
kill -TERM $busy
wait $busy || true
flock -n "$WORK/busy/.loom.lock" true || fail "the lock outlived its run"

# --doc-sep in a CRLF file: "%\r" is the separator line too (it used to make
# the whole file one document); three documents, too few for one at 5% to
# go to validation: the last one does; a file with no text is an error.
printf 'first doc\r\n%%\r\nsecond doc\r\n%%\r\nthird doc\r\n' > "$WORK/crlf.txt"
"$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$WORK/crlf.txt" --doc-sep % --out "$WORK/crlf" 2>"$WORK/crlf.log"
grep -q "3 documents" "$WORK/crlf.log" || { cat "$WORK/crlf.log"; fail "CRLF separator lines were not separators"; }
grep -q "validation tokens" "$WORK/crlf.log" && ! grep -q " 0 validation tokens" "$WORK/crlf.log" ||
  { cat "$WORK/crlf.log"; fail "three documents gave no validation document"; }
# --val-fraction 0.7 of 10 documents is 7 (0.7 as a float is 0.69999998: it gave 6), 0.35 of 20 is 7.
for nf in "10 0.7 7" "20 0.35 7" "10 0.3 3" "10 0.9 9"; do
  set -- $nf
  for i in $(seq "$1"); do printf 'document %d\n%%\n' "$i"; done > "$WORK/docs$1.txt"
  "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$WORK/docs$1.txt" --doc-sep % --val-fraction "$2" \
    --out "$WORK/split" 2>"$WORK/split.log"
  grep -q "$1 documents ($3 for validation)" "$WORK/split.log" || { cat "$WORK/split.log"; fail "--val-fraction $2 of $1"; }
done
printf '%%\n%%\n' > "$WORK/nodocs.txt"
expect_error "hold no text" "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$WORK/nodocs.txt" \
  --doc-sep % --out "$WORK/nodocs"
: > "$WORK/empty.txt"
expect_error "hold no text \(empty\)" "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$WORK/empty.txt" \
  --out "$WORK/nodocs"

# Tokenize: what a killed tokenize left in the directory is removed; shards
# of another tool there are refused; --train alone into a directory is refused.
mkdir -p "$WORK/t4/.shards.new.999999999" && touch "$WORK/t4/.shards.new.999999999/train_000000.bin.tmp.1" "$WORK/t4/tokenizer.json.new"
"$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$SRC/README.md" --out "$WORK/t4" 2>/dev/null
[ -e "$WORK/t4/.shards.new.999999999" ] || [ -e "$WORK/t4/tokenizer.json.new" ] && fail "a killed tokenize's leftovers stayed"
cp "$WORK/data/train_000000.bin" "$WORK/t4/fineweb_train_000001.bin"
expect_error "holds fineweb_train_000001.bin, shards this command did not write" "$LOOM" tokenize \
  --tokenizer "$WORK/data/tokenizer.json" --in "$SRC/README.md" --out "$WORK/t4"
expect_error "is a directory: with --train alone, --out is the tokenizer file" "$LOOM" tokenize --train "$SRC/README.md" \
  --vocab 300 --out "$WORK/t4"

# --out holding another run's checkpoints: never mixed into this run.
expect_error "holds checkpoints of an earlier run.*--resume" "$LOOM" train "${D[@]}" --steps 1 --out "$WORK/r"
"$LOOM" train "${D[@]}" --steps 3 --ckpt-every 1 --keep 5 --out "$WORK/h" 2>/dev/null
expect_error "after step 1" "$LOOM" train "${D[@]}" --steps 3 --out "$WORK/h" --resume "$WORK/h/ckpt-00000001"
# A dead writer's temporary and a user's ckpt-best are not checkpoints; the
# temporary is cleaned up, ckpt-best is left alone.
mkdir -p "$WORK/h/ckpt-00000009.tmp.999999999" "$WORK/h/ckpt-best"
# So are a killed writer's metrics and staged model files (removed), not a user's notes.tmp.PID (kept).
touch "$WORK/h/metrics.jsonl.tmp.999999999" "$WORK/h/model/model.safetensors.new.tmp.999999999" \
  "$WORK/h/notes.tmp.999999999"
"$LOOM" train "${D[@]}" --steps 4 --ckpt-every 1 --keep 5 --out "$WORK/h" --resume "$WORK/h" 2>"$WORK/h.log" ||
  { cat "$WORK/h.log"; fail "resuming the latest checkpoint"; }
for f in metrics.jsonl.tmp.999999999 model/model.safetensors.new.tmp.999999999; do
  [ -e "$WORK/h/$f" ] && fail "a killed writer's $f stayed"
done
[ -e "$WORK/h/notes.tmp.999999999" ] || fail "a user's notes.tmp.999999999 was removed"
grep -q "training shards changed" "$WORK/h.log" && fail "a note on changed shards when none changed"
# The data position is an index into the sorted shards: resuming on other shards says so.
mkdir -p "$WORK/data2" && cp "$WORK"/data/* "$WORK/data2/" && cp "$WORK/data/train_000000.bin" "$WORK/data2/train_000001.bin"
"$LOOM" train --data "$WORK/data2" --config "$WORK/cfg.json" --batch 2 --seq 16 --eval-every 0 --steps 5 \
  --out "$WORK/hd" --resume "$WORK/h/ckpt-00000004" 2>"$WORK/hd.log" || { cat "$WORK/hd.log"; fail "resume on more shards"; }
grep -q "training shards changed since the checkpoint (1 then, 2 now" "$WORK/hd.log" ||
  { cat "$WORK/hd.log"; fail "no note on changed shards"; }
grep -q "resumed from $WORK/h/ckpt-00000003 " "$WORK/h.log" || { cat "$WORK/h.log"; fail "did not resume ckpt-00000003"; }
[ -d "$WORK/h/ckpt-00000009.tmp.999999999" ] && fail "a dead writer's temporary checkpoint was left"
[ -d "$WORK/h/ckpt-best" ] || fail "ckpt-best was removed"
# A dead writer's temporary goes when a run starts, before its first save
# (here a run that saves nothing): on a tight disk it would leave no room.
mkdir -p "$WORK/h/ckpt-00000009.tmp.999999999"
"$LOOM" train "${D[@]}" --steps 9 --out "$WORK/h" --resume "$WORK/h" --dump-grads "$WORK/h-grads.safetensors" 2>/dev/null
[ -d "$WORK/h/ckpt-00000009.tmp.999999999" ] && fail "a dead writer's temporary stayed until a save"
# A checkpoint that is a symlink to a directory outside the run: pruning
# removes the link, never the files it points to.
"$LOOM" train "${D[@]}" --steps 2 --ckpt-every 1 --keep 5 --out "$WORK/sym" 2>/dev/null
mkdir -p "$WORK/archive" && mv "$WORK/sym/ckpt-00000001" "$WORK/archive/"
ln -s "$WORK/archive/ckpt-00000001" "$WORK/sym/ckpt-00000001"
"$LOOM" train "${D[@]}" --steps 4 --ckpt-every 1 --keep 2 --out "$WORK/sym" --resume "$WORK/sym" 2>/dev/null
[ -L "$WORK/sym/ckpt-00000001" ] && fail "the pruned symlink is still there"
[ -s "$WORK/archive/ckpt-00000001/state.safetensors" ] || fail "pruning deleted the files behind a symlinked checkpoint"

# Resuming with a --config of another model is refused.
small_config "$WORK/cfg-256.json" 256
# A model whose vocabulary is smaller than the data's tokenizer: refused
# before any step, naming both sizes (it used to fail at the first batch,
# blaming the data).
expect_error "tokenizer.json has 512 tokens but the model's vocabulary has 256" "$LOOM" train --data "$WORK/data" \
  --config "$WORK/cfg-256.json" --batch 2 --seq 16 --steps 1 --out "$WORK/v256"
expect_error "describes another model" "$LOOM" train "${D[@]}" --steps 5 --out "$WORK/cm" --resume "$WORK/h/ckpt-00000004" \
    --config "$WORK/cfg-256.json"
# So is one whose sizes match but whose RoPE base, norm epsilon, activation
# or Granite's multipliers do not: the checkpoint's values would be used
# without a word.
for kv in 's/"rope_theta": [0-9.e+]*/"rope_theta": 500000.0/' 's/"rms_norm_eps": [0-9.e+-]*/"rms_norm_eps": 1e-3/' \
          's/"rms_norm_eps": 1e-5}/"rms_norm_eps": 1e-5, "hidden_act": "gelu_pytorch_tanh"}/' \
          's/"rms_norm_eps": 1e-5}/"rms_norm_eps": 1e-5, "model_type": "granite", "residual_multiplier": 0.5}/'; do
  sed "$kv" "$WORK/cfg.json" > "$WORK/cfg-other.json"
  cmp -s "$WORK/cfg.json" "$WORK/cfg-other.json" && fail "sed '$kv' changed nothing in the config"
  expect_error "describes another model" "$LOOM" train "${D[@]}" --steps 5 --out "$WORK/cm" \
      --resume "$WORK/h/ckpt-00000004" --config "$WORK/cfg-other.json"
done

# Damaged checkpoint metadata: a clear error, not NaN weights.
damage() { # $1 checkpoint dir, $2 metadata key, $3 value
  /usr/bin/python3 - "$1/state.safetensors" "$2" "$3" <<'PY'
import json, struct, sys
path, key, value = sys.argv[1:]
b = open(path, 'rb').read()
n = struct.unpack('<Q', b[:8])[0]
h = json.loads(b[8:8 + n])
h['__metadata__'][key] = value
t = json.dumps(h).encode()
t += b' ' * (-len(t) % 8)
open(path, 'wb').write(struct.pack('<Q', len(t)) + t + b[8 + n:])
PY
}
# poison FILE TENSOR: element 3 of an fp32 tensor of a safetensors file becomes NaN.
poison() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, struct, sys
with open(sys.argv[1], "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    entry = json.loads(f.read(n))[sys.argv[2]]
    assert entry["dtype"] == "F32"
    f.seek(8 + n + entry["data_offsets"][0] + 4 * 3)
    f.write(struct.pack("<f", float("nan")))
PY
}
rm -rf "$WORK/dmg" "$WORK/dmg-out" && cp -r "$WORK/h/ckpt-00000004" "$WORK/dmg"
poison "$WORK/dmg/state.safetensors" adam_v.model.norm.weight
expect_error "adam_v.model.norm.weight holds nan at element 3" "$LOOM" train "${D[@]}" --steps 6 --out "$WORK/dmg-out" \
  --resume "$WORK/dmg"
for kv in "loss_scale nan" "loss_scale 0" "loss_scale 1e-50" "step -1" "adam_steps 99999999999" "loom_checkpoint_version 2"; do
  set -- $kv
  rm -rf "$WORK/dmg" "$WORK/dmg-out" && cp -r "$WORK/h/ckpt-00000004" "$WORK/dmg"
  damage "$WORK/dmg" "$1" "$2"
  want="\"$1\" = \"$2\" .*damaged"
  [ "$1" = loom_checkpoint_version ] && want="format version \"2\" is not one this loom reads"
  expect_error "$want" "$LOOM" train "${D[@]}" --steps 6 --out "$WORK/dmg-out" --resume "$WORK/dmg"
done

# Outputs that cannot be written
touch "$WORK/a-file"
expect_error "not a directory|cannot" "$LOOM" train "${D[@]}" --steps 1 --out "$WORK/a-file"
expect_error "/proc" "$LOOM" export --model "$WORK/r/model" --out /proc/loom-export

# NaN in training: a clear error, not a silent NaN model; with fp16 loss
# scaling, once the scale is at its floor and the gradients still overflow.
expect_error "NaN|Inf" "$LOOM" train "${D[@]}" --precision fp32 --lr 1e9 --clip 0 --warmup 0 --steps 20 --out "$WORK/nan"
expect_error "smallest loss scale" "$LOOM" train "${D[@]}" --precision fp16 --lr 1e9 --clip 0 --warmup 0 --steps 60 \
  --out "$WORK/nan16"
[ -e "$WORK/nan16/model" ] && fail "a diverged fp16 run wrote a model"

# Config values a float cannot hold; NaN weights; a FIFO where a file belongs.
sed 's/"rope_theta": 10000.0/"rope_theta": 1e300/' "$WORK/cfg.json" > "$WORK/cfg-huge.json"
expect_error "rope_theta" "$LOOM" train --data "$WORK/data" --config "$WORK/cfg-huge.json" --steps 1 --out "$WORK/huge"
cp -r "$WORK/r/model" "$WORK/nanmodel"
poison "$WORK/nanmodel/model.safetensors" model.norm.weight
expect_error "model.norm.weight.*element 3" "$LOOM" generate --model "$WORK/nanmodel" --prompt a --tokens 2
mkfifo "$WORK/fifo"
expect_error "not a regular file" timeout 20 "$LOOM" generate --model "$WORK/r/model" --tokenizer "$WORK/fifo"

# SIGINT during training: the first asks for a checkpoint after the step (a
# step that takes minutes here, so the run goes on); a second stops at once.
"$LOOM" train "${D[@]}" --grad-accum 1000000 --steps 2 --out "$WORK/sig2" 2>"$WORK/sig2.log" &
pid=$!
for _ in $(seq 200); do grep -q "^train: .* parameters" "$WORK/sig2.log" && break; sleep 0.05; done
grep -q "^train: .* parameters" "$WORK/sig2.log" || { kill -9 $pid; fail "SIGINT test: training did not start"; }
sleep 0.5
kill -INT $pid
sleep 1
kill -0 $pid 2>/dev/null || fail "the first SIGINT during training stopped train at once"
kill -INT $pid
for _ in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then kill -9 $pid; fail "a second SIGINT did not stop train"; fi
wait $pid 2>/dev/null || true

# Flags that changed nothing: refused (they used to be ignored).
expect_error "--config and --init both give the model" "$LOOM" train "${D[@]}" --init "$WORK/r/model" --steps 1 \
  --out "$WORK/ic"
expect_error "--min-lr, --warmup" "$LOOM" train "${D[@]}" --min-lr -3 --steps 1 --out "$WORK/negmin"
expect_error "--seq >= 0" "$LOOM" train "${D[@]}" --seq -5 --steps 1 --out "$WORK/negseq"
expect_error "--train makes a new tokenizer and --tokenizer names an existing one" "$LOOM" tokenize \
  --train "$SRC/README.md" --tokenizer "$WORK/data/tokenizer.json" --in "$SRC/README.md" --out "$WORK/tk1"
expect_error "--vocab sizes a tokenizer being trained" "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" \
  --vocab 300 --in "$SRC/README.md" --out "$WORK/tk1"
expect_error "--val-fraction applies to the shards" "$LOOM" tokenize --train "$SRC/README.md" --val-fraction 0.2 \
  --out "$WORK/tk1.json"
expect_error "--doc-sep applies to the shards" "$LOOM" tokenize --train "$SRC/README.md" --doc-sep % --out "$WORK/tk1.json"
{ [ -e "$WORK/tk1" ] || [ -e "$WORK/tk1.json" ]; } && fail "a refused tokenize wrote its output"
# A user's train_1_backup.bin is not one of tokenize's shards: refused, never deleted.
mkdir -p "$WORK/t5" && echo keep > "$WORK/t5/train_1_backup.bin"
expect_error "holds train_1_backup.bin, shards this command did not write" "$LOOM" tokenize \
  --tokenizer "$WORK/data/tokenizer.json" --in "$SRC/README.md" --out "$WORK/t5"
[ -s "$WORK/t5/train_1_backup.bin" ] || fail "tokenize deleted a user's train_1_backup.bin"

# Resuming one run into the --out of another: refused (it used to prune the
# other run's checkpoints and mix both runs' metrics).
"$LOOM" train "${D[@]}" --steps 2 --ckpt-every 1 --keep 5 --out "$WORK/other" 2>/dev/null
expect_error "holds checkpoints of another run" "$LOOM" train "${D[@]}" --steps 5 --ckpt-every 1 --keep 1 \
  --resume "$WORK/h/ckpt-00000004" --out "$WORK/other"
[ -d "$WORK/other/ckpt-00000001" ] && [ -d "$WORK/other/ckpt-00000002" ] || fail "the other run's checkpoints went"

# Weights that turned Inf in a step whose gradients were finite (weight decay
# x lr overflows): the checkpoint is refused, never written to prune the good.
expect_error "holds NaN or Inf: training diverged, so checkpoint .*ckpt-00000001 is not written" "$LOOM" train \
  "${D[@]}" --precision fp32 --lr 3e38 --weight-decay 10 --warmup 0 --clip 0 --steps 3 --ckpt-every 1 --out "$WORK/infw"
[ -e "$WORK/infw/ckpt-00000001" ] && fail "a checkpoint of Inf weights was written"

# fp16 steps skipped for overflow: metrics.jsonl stays JSON (loss and norm null).
"$LOOM" train "${D[@]}" --precision fp16 --lr 30 --warmup 0 --clip 0 --steps 40 --out "$WORK/skip16" 2>/dev/null || true
/usr/bin/python3 - "$WORK/skip16/metrics.jsonl" <<'PY' || fail "metrics.jsonl of skipped fp16 steps is not JSON"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
skipped = [r for r in rows if r.get("skipped")]
assert skipped, "no step was skipped: the test needs one"
assert all(r["grad_norm"] is None for r in skipped), skipped[:2]
assert any(r["loss"] is None for r in skipped), "no skipped step with a NaN loss: the test needs one"
PY

# The text that cannot be written: an error, not exit 0 with the text lost.
expect_error "cannot write the text to standard output.*disk full" bash -c \
  '"$0" generate --model "$1" --prompt a --tokens 2 > /dev/full' "$LOOM" "$WORK/r/model"
# A FIFO as the config: refused at once (it used to wait forever for a writer).
expect_error "config .*fifo.*not a regular file" timeout 20 "$LOOM" train --data "$WORK/data" --config "$WORK/fifo" \
  --steps 1 --out "$WORK/ff"

# A model directory whose save stopped while replacing its files (the marker
# is there): refused by every reader; a save that finishes clears it.
[ -e "$WORK/r/model/.save-incomplete" ] && fail "a finished save left its marker"
cp -r "$WORK/r/model" "$WORK/half" && touch "$WORK/half/.save-incomplete"
expect_error "looks like a training run's output; the model is --model .*/r/model" "$LOOM" export --model "$WORK/r" \
  --out "$WORK/x1"
expect_error "a save stopped while replacing its files" "$LOOM" generate --model "$WORK/half" --prompt a --tokens 2
expect_error "a save stopped while replacing its files" "$LOOM" export --model "$WORK/half" --out "$WORK/half-x"
expect_error "a save stopped while replacing its files" "$LOOM" train --data "$WORK/data" --init "$WORK/half" \
  --batch 2 --seq 16 --steps 1 --out "$WORK/half-t"
"$LOOM" export --model "$WORK/r/model" --out "$WORK/half" 2>/dev/null
"$LOOM" generate --model "$WORK/half" --prompt a --tokens 2 >/dev/null 2>&1 || fail "a finished save did not clear the marker"

# expect_full_disk KB MESSAGE DIR CMD...: CMD, allowed files of at most KB
# KiB, exits 1 with MESSAGE in its error and leaves every file in DIR as it
# was.
expect_full_disk() {
  local kb=$1 want=$2 dir=$3 before after rc
  shift 3
  before=$(cd "$dir" && md5sum *)
  set +e
  ( ulimit -f "$kb"; trap '' XFSZ; "$@" ) >/dev/null 2>"$WORK/err.log"
  rc=$?
  set -e
  [ $rc -eq 1 ] || { cat "$WORK/err.log"; fail "full disk ($*): exit code $rc"; }
  grep -q "$want" "$WORK/err.log" || { cat "$WORK/err.log"; fail "full disk ($*): no '$want' in the error"; }
  after=$(cd "$dir" && md5sum *)
  [ "$before" = "$after" ] || fail "full disk ($*): $dir changed"
}

# A full disk while logging: metrics.jsonl cannot take the next line.
expect_error "cannot write metrics.jsonl" bash -c 'ulimit -f 1; trap "" XFSZ; exec "$@"' _ \
  "$LOOM" train "${D[@]}" --steps 40 --out "$WORK/fullmetrics"

# A full disk while checkpointing: the new checkpoint fails, the old one is intact.
"$LOOM" train "${D[@]}" --steps 1 --ckpt-every 1 --keep 5 --out "$WORK/full" 2>/dev/null
expect_full_disk 200 "not written" "$WORK/full/ckpt-00000001" \
  "$LOOM" train "${D[@]}" --steps 4 --ckpt-every 1 --keep 5 --out "$WORK/full" --resume "$WORK/full/ckpt-00000001"
ls -d "$WORK"/full/*.tmp.* 2>/dev/null && fail "a temporary checkpoint was left behind"

# A full disk while re-tokenizing into a dataset directory: the old tokenizer
# and shards stay, nothing staged is left.
"$LOOM" tokenize --train $(corpus) --vocab 300 --in $(corpus) --out "$WORK/retok" 2>/dev/null
expect_full_disk 40 "train_000000.bin" "$WORK/retok" \
  "$LOOM" tokenize --train $(corpus) --vocab 400 --in $(corpus) --out "$WORK/retok"
[ -z "$(ls -A "$WORK/retok" | grep -v -E '^(tokenizer.json|(train|val)_[0-9]+[.]bin|[.]loom[.]lock)$')" ] || \
  fail "a failed tokenize left staged files: $(ls -A "$WORK/retok")"

# A full disk while replacing a model directory: the old model stays whole
# (no new config.json beside the old weights), nothing staged is left.
"$LOOM" export --model "$WORK/full/ckpt-00000001" --out "$WORK/fullmodel" --dtype bf16 2>/dev/null
expect_full_disk 8 "model.safetensors" "$WORK/fullmodel" \
  "$LOOM" export --model "$WORK/full/ckpt-00000001" --out "$WORK/fullmodel"
ls "$WORK"/fullmodel/*.new* 2>/dev/null && fail "a failed export left staged files behind"
# The same for a GGUF export over an existing one: the old file stays whole.
"$LOOM" export --model "$WORK/full/ckpt-00000001" --out "$WORK/fullgguf/m.gguf" --format gguf 2>/dev/null || \
  fail "GGUF export of a checkpoint failed"
expect_full_disk 8 "disk full" "$WORK/fullgguf" \
  "$LOOM" export --model "$WORK/full/ckpt-00000001" --out "$WORK/fullgguf/m.gguf" --format gguf --dtype bf16
ls "$WORK"/fullgguf/*.tmp.* 2>/dev/null && fail "a failed GGUF export left its temporary file behind"
echo "1 passed, 0 failed"
