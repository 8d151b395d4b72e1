#!/usr/bin/env bash
# --dump-grads files from --recompute none, selective and full (both modes;
# every block, or the first only) are byte-identical for the same seed and
# precision; so are the weights
# after several steps (optimizer, clipping, fp16 skipped steps); micro-batches
# give the gradients of the batch they split.
source "$(dirname "$0")/lib.sh"
make_data "$WORK/data"
small_config "$WORK/cfg.json" 512
for prec in fp32 bf16 fp16; do
  for mg in on off; do
    ref=""
    # the third word: --recompute-blocks (0: every block; 1: the first of the config's 2)
    for rc in "none nonreentrant 0" "selective nonreentrant 0" "full nonreentrant 0" "full reentrant 0" \
              "full nonreentrant 1" "selective nonreentrant 1"; do
      set -- $rc
      f="$WORK/g-$prec-$mg-$1-$2-$3.safetensors"
      "$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --out "$WORK/o" --batch 4 --seq 32 \
        --precision $prec --master-grad $mg --recompute $1 --recompute-mode $2 --recompute-blocks $3 \
        --dump-grads "$f" 2>/dev/null
      [ -s "$f" ] || fail "no gradient file for $prec $mg $1 $2 $3"
      if [ -z "$ref" ]; then ref=$f; else cmp -s "$ref" "$f" || fail "$prec master-grad=$mg: $1/$2/$3 differs from none"; fi
    done
  done
done
# --recompute-budget: a budget below what recomputing every block takes is
# refused with both measured peaks; one halfway between them recomputes some
# blocks, stays within the budget, and gives the gradients of no recompute.
B=(--data "$WORK/data" --config "$WORK/cfg.json" --out "$WORK/ob" --batch 4 --seq 32 --precision bf16 --master-grad on)
if "$LOOM" train "${B[@]}" --recompute-budget 0.001 2>"$WORK/rb.err"; then fail "a budget of 0.001 MiB was accepted"; fi
all=$(sed -nE 's/.*takes \(([0-9.]+) MiB measured; ([0-9.]+) MiB with none.*/\1/p' "$WORK/rb.err")
none=$(sed -nE 's/.*takes \(([0-9.]+) MiB measured; ([0-9.]+) MiB with none.*/\2/p' "$WORK/rb.err")
[ -n "$all" ] && [ -n "$none" ] || fail "no measured peaks in: $(cat "$WORK/rb.err")"
mid=$(awk -v a="$all" -v b="$none" 'BEGIN { printf "%.3f", (a + b) / 2 }')
"$LOOM" train "${B[@]}" --recompute-budget "$mid" --dump-grads "$WORK/gb.st" 2>"$WORK/rb.log"
grep -q "recompute of 1 of 2 blocks" "$WORK/rb.log" || fail "not 1 of 2 blocks for $mid MiB: $(cat "$WORK/rb.log")"
used=$(sed -nE 's/.* blocks, activations ([0-9.]+) MiB.*/\1/p' "$WORK/rb.log")
awk -v u="$used" -v m="$mid" 'BEGIN { exit !(u <= m + 0.005) }' || fail "the plan's $used MiB is over the budget $mid"
cmp -s "$WORK/g-bf16-on-none-nonreentrant-0.safetensors" "$WORK/gb.st" || fail "--recompute-budget changed the gradients"
"$LOOM" train "${B[@]}" --recompute-budget 1000 2>"$WORK/rb.log"
grep -q "no block needs recomputing" "$WORK/rb.log" || fail "a budget of 1000 MiB recomputes: $(cat "$WORK/rb.log")"
# Eight steps of two micro-batches: the final weights and the optimizer
# state are the same bytes under every recompute mode, with clipping (bf16,
# fp32) and with fp16 steps skipped for overflow.
for pm in "fp32 on" "bf16 on" "bf16 off" "fp16 on" "fp16 off"; do
  set -- $pm
  if [ "$1" = fp16 ]; then opt=(--lr 0.3 --clip 0); else opt=(--lr 0.05 --clip 0.5); fi
  ref=""
  for rc in "none nonreentrant" "selective nonreentrant" "full nonreentrant" "full reentrant"; do
    set -- $pm $rc
    o="$WORK/s-$1-$2-$3-$4"
    "$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --out "$o" --batch 2 --seq 32 --grad-accum 2 \
      --steps 8 --warmup 0 "${opt[@]}" --eval-every 0 --precision $1 --master-grad $2 --recompute $3 \
      --recompute-mode $4 2>/dev/null
    if [ -z "$ref" ]; then
      ref=$o
      [ "$1" != fp16 ] || grep -q '"skipped":1' "$o/metrics.jsonl" || fail "fp16 $2: no skipped step to compare"
    else
      cmp -s "$ref/model/model.safetensors" "$o/model/model.safetensors" || fail "$pm: $3/$4 weights differ from none"
      cmp -s "$ref/ckpt-00000008/state.safetensors" "$o/ckpt-00000008/state.safetensors" ||
        fail "$pm: $3/$4 optimizer state differs from none"
    fi
  done
done

# Tied embeddings (one parameter used at both ends of the model): the same
# gradients under every recompute mode.
config_plus "$WORK/tied.json" "$WORK/cfg.json" '"tie_word_embeddings": true'
grep -q '"tie_word_embeddings": true' "$WORK/tied.json" || fail "no tied config"
for pm in "bf16 on" "fp16 off"; do
  ref=""
  for rc in "none nonreentrant" "selective nonreentrant" "full nonreentrant" "full reentrant"; do
    set -- $pm $rc
    f="$WORK/t-$1-$2-$3-$4.safetensors"
    "$LOOM" train --data "$WORK/data" --config "$WORK/tied.json" --out "$WORK/o" --batch 4 --seq 32 --precision $1 \
      --master-grad $2 --recompute $3 --recompute-mode $4 --check-grads --dump-grads "$f" 2>/dev/null
    [ -s "$f" ] || fail "tied: no gradient file for $pm $3 $4"
    if [ -z "$ref" ]; then ref=$f; else cmp -s "$ref" "$f" || fail "tied $pm: $3/$4 differs from none"; fi
  done
done
/usr/bin/python3 - "$ref" <<'PY' || fail "the tied model's gradient file has an lm_head.weight (it should be tied)"
import json, struct, sys
b = open(sys.argv[1], "rb").read()
names = json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])
sys.exit("lm_head.weight" in names or "model.embed_tokens.weight" not in names)
PY

# Two micro-batches of 2 are the batch of 4 they split (the same rows): the
# same gradients and the same loss, the step's mean, in the file.
T=(--data "$WORK/data" --config "$WORK/cfg.json" --seq 32 --precision fp32)
"$LOOM" train "${T[@]}" --batch 4 --out "$WORK/b4" --dump-grads "$WORK/b4.st" 2>/dev/null
"$LOOM" train "${T[@]}" --batch 2 --grad-accum 2 --out "$WORK/b22" --dump-grads "$WORK/b22.st" 2>/dev/null
/usr/bin/python3 "$SRC/tests/python/compare_safetensors.py" "$WORK/b22.st" "$WORK/b4.st" --rtol 1e-5 >/dev/null ||
  fail "two micro-batches of 2 differ from one batch of 4"
echo "1 passed, 0 failed"
