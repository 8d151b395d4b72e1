#!/usr/bin/env bash
# Stop-and-resume equals the uninterrupted run: the same losses, bit for bit,
# whether the stop is a scheduled checkpoint or SIGTERM.
source "$(dirname "$0")/lib.sh"
make_data "$WORK/data"
small_config "$WORK/cfg.json" 512
common=(--data "$WORK/data" --config "$WORK/cfg.json" --batch 4 --seq 32 --steps 12 --eval-every 0 --lr 2e-3)
losses() { grep -o '"step":[0-9]*,"loss":[0-9.e+-]*' "$1/metrics.jsonl"; }
for prec in fp32 fp16; do
  "$LOOM" train "${common[@]}" --precision $prec --out "$WORK/a-$prec" 2>/dev/null
  "$LOOM" train "${common[@]}" --precision $prec --out "$WORK/b-$prec" --ckpt-every 5 --keep 2 2>/dev/null
  # Resume from the step-10 checkpoint into a fresh directory and finish.
  [ -d "$WORK/b-$prec/ckpt-00000010" ] || fail "no step-10 checkpoint"
  "$LOOM" train "${common[@]}" --precision $prec --out "$WORK/c-$prec" --resume "$WORK/b-$prec/ckpt-00000010" 2>/dev/null
  diff <(losses "$WORK/a-$prec" | tail -2) <(losses "$WORK/c-$prec") || fail "$prec: resumed losses differ"
  # Bit for bit beyond the printed losses: the final weights are the same bytes.
  cmp -s "$WORK/a-$prec/model/model.safetensors" "$WORK/c-$prec/model/model.safetensors" ||
    fail "$prec: the resumed run's final weights differ from the uninterrupted run's"
  [ "$(losses "$WORK/c-$prec" | head -1 | cut -d, -f1)" = '"step":11' ] || fail "$prec: resume did not start at step 11"
done
# Resume meets recompute, micro-batches, half-precision gradients, fp16
# skipped steps, validation and attention dropout (its masks drawn on from
# the checkpoint's RNG): resumed at step 2 and at step 6, the same final
# weights and the same validation losses as the run without a stop.
vals() { grep -o '"step":[0-9]*,"val_loss":[0-9.e+-]*' "$1/metrics.jsonl"; }
config_plus "$WORK/adrop.json" "$WORK/cfg.json" '"attention_dropout": 0.2'
for s in "fp16 on full nonreentrant" "fp16 off full reentrant" "bf16 off selective nonreentrant"; do
  set -- $s
  M=(--data "$WORK/data" --config "$WORK/adrop.json" --batch 2 --seq 32 --grad-accum 2 --steps 9 --warmup 0
     --lr 0.3 --clip 0 --eval-every 3 --eval-batches 2 --precision $1 --master-grad $2 --recompute $3
     --recompute-mode $4)
  "$LOOM" train "${M[@]}" --out "$WORK/m" --ckpt-every 2 --keep 5 2>/dev/null
  [ "$1" = bf16 ] || [ "$(grep -c '"skipped":1' "$WORK/m/metrics.jsonl")" -ge 1 ] || fail "$s: no skipped step"
  [ "$(vals "$WORK/m" | wc -l)" -eq 3 ] || fail "$s: not 3 validation losses"
  for k in 2 6; do
    "$LOOM" train "${M[@]}" --out "$WORK/mr$k" --resume "$WORK/m/ckpt-0000000$k" 2>/dev/null
    cmp -s "$WORK/m/model/model.safetensors" "$WORK/mr$k/model/model.safetensors" ||
      fail "$s: resumed at step $k, the final weights differ"
    diff <(vals "$WORK/m" | tail -n "$(vals "$WORK/mr$k" | wc -l)") <(vals "$WORK/mr$k") >/dev/null ||
      fail "$s: resumed at step $k, the validation losses differ"
  done
  rm -rf "$WORK/m" "$WORK/mr2" "$WORK/mr6"
done
# A crash after steps 11-12 were logged but before their checkpoint:
# resuming at step 10 drops those lines, so metrics.jsonl reads like the
# uninterrupted run's.
mkdir -p "$WORK/d" && cp -r "$WORK/b-fp32/ckpt-00000010" "$WORK/d/" && cp "$WORK/b-fp32/metrics.jsonl" "$WORK/d/"
"$LOOM" train "${common[@]}" --precision fp32 --out "$WORK/d" --resume "$WORK/d" 2>/dev/null
diff <(losses "$WORK/a-fp32") <(losses "$WORK/d") || fail "resume after a crash: metrics.jsonl differs from the uninterrupted run's"
# Its loss plot covers the whole run, not only the steps after the resume.
points=$(grep -o '<polyline[^>]*points="[^"]*"' "$WORK/d/loss.svg" | head -1 | sed 's/.*points="//; s/"$//' | wc -w)
[ "$points" -eq 12 ] || fail "the resumed run's loss plot has $points training points, not 12"
# Resuming the final checkpoint: nothing to train, said so, the model and plot written.
"$LOOM" train "${common[@]}" --precision fp32 --out "$WORK/d" --resume "$WORK/d" 2>"$WORK/d2.log" ||
  { cat "$WORK/d2.log"; fail "resuming the final checkpoint failed"; }
grep -q "no step to take" "$WORK/d2.log" || { cat "$WORK/d2.log"; fail "resuming the final checkpoint: no note"; }
[ -s "$WORK/d/loss.svg" ] && [ -s "$WORK/d/model/model.safetensors" ] || fail "resuming the final checkpoint: no plot or model"
# --steps below the checkpoint's step, and --dump-logits (a first step's) with --resume: refused.
expect_error "at step 10, past --steps 5: give --steps above 10" "$LOOM" train "${common[@]}" --steps 5 \
  --out "$WORK/f" --resume "$WORK/b-fp32/ckpt-00000010"
expect_error "dump-logits.*drop --resume" "$LOOM" train "${common[@]}" --out "$WORK/f" \
  --resume "$WORK/b-fp32/ckpt-00000010" --dump-logits "$WORK/f.safetensors"
# A crash that tore the last line (no newline): the line is dropped, and
# every line of the resumed file is whole JSON.
mkdir -p "$WORK/t" && cp -r "$WORK/b-fp32/ckpt-00000010" "$WORK/t/" && head -10 "$WORK/b-fp32/metrics.jsonl" > "$WORK/t/metrics.jsonl"
printf '{"st' >> "$WORK/t/metrics.jsonl"
"$LOOM" train "${common[@]}" --precision fp32 --out "$WORK/t" --resume "$WORK/t" 2>/dev/null
/usr/bin/python3 -c 'import json,sys; [json.loads(l) for l in open(sys.argv[1])]' "$WORK/t/metrics.jsonl" ||
  fail "resume after a torn line: metrics.jsonl is not one JSON record per line"
diff <(losses "$WORK/a-fp32") <(losses "$WORK/t") || fail "resume after a torn line: metrics.jsonl differs from the uninterrupted run's"
# Another batch size than the checkpoint's run: it continues, and says so.
"$LOOM" train "${common[@]}" --precision fp32 --batch 2 --out "$WORK/bs" --resume "$WORK/b-fp32/ckpt-00000010" 2>"$WORK/bs.log"
grep -q "the checkpoint's run used --batch 4 --seq 32 --grad-accum 1 on 1 data-parallel rank(s), this one --batch 2" \
  "$WORK/bs.log" || { cat "$WORK/bs.log"; fail "changed batch: no note"; }
grep -q "other settings" "$WORK/bs.log" && { cat "$WORK/bs.log"; fail "a note on optimizer settings that did not change"; }
# Other optimizer settings than the checkpoint's run: it continues, and names them.
"$LOOM" train "${common[@]}" --precision fp32 --lr 3e-3 --steps 14 --schedule wsd --out "$WORK/lr" \
  --resume "$WORK/b-fp32/ckpt-00000010" 2>"$WORK/lr.log" || { cat "$WORK/lr.log"; fail "resume with another --lr"; }
grep -q "other settings (--steps 12 -> 14, --lr 0.002 -> 0.003, --min-lr 0.0002 -> 0.0003, --schedule cosine -> wsd)" \
  "$WORK/lr.log" || { cat "$WORK/lr.log"; fail "changed --lr, --steps, --schedule: no note naming them"; }
# A larger batch than the checkpoint's, resumed near a shard's end where the
# saved position leaves less than the new step: it goes on where a step fits
# (here the next epoch), as a step that ran off the end would.
"$LOOM" tokenize --train "$SRC/README.md" --vocab 512 --in "$SRC/README.md" --out "$WORK/one" --val-fraction 0.1 2>/dev/null
tokens=$(( ($(stat -c %s "$WORK/one/train_000000.bin") - 1024) / 2 ))
k=$(( (tokens - 1) / 128 - 1 )) # the last step of 128 tokens before the end; fewer than 257 are left after it
one=(--data "$WORK/one" --config "$WORK/cfg.json" --seq 32 --eval-every 0 --lr 2e-3)
"$LOOM" train "${one[@]}" --batch 4 --steps $k --out "$WORK/e" 2>/dev/null
"$LOOM" train "${one[@]}" --batch 8 --steps $((k + 2)) --out "$WORK/e8" --resume "$WORK/e" 2>"$WORK/e8.log" ||
  { cat "$WORK/e8.log"; fail "larger batch near a shard's end: the resume was refused"; }
[ "$(losses "$WORK/e8" | cut -d, -f1 | tr '\n' ' ')" = "\"step\":$((k + 1)) \"step\":$((k + 2)) " ] ||
  fail "larger batch near a shard's end: not steps $((k + 1)) and $((k + 2))"
# --resume without --out continues in the resumed run's directory (not ./out).
mkdir -p "$WORK/noout" "$WORK/cwd" && cp -r "$WORK/b-fp32/ckpt-00000010" "$WORK/noout/"
(cd "$WORK/cwd" && "$LOOM" train "${common[@]}" --precision fp32 --resume "$WORK/noout/ckpt-00000010/" 2>"$WORK/noout.log") ||
  { cat "$WORK/noout.log"; fail "resume without --out"; }
[ -d "$WORK/noout/ckpt-00000012" ] && [ -s "$WORK/noout/model/model.safetensors" ] || fail "resume without --out: not in the run's directory"
[ -e "$WORK/cwd/out" ] && fail "resume without --out wrote ./out"
[ -e "$WORK/noout/ckpt-00000010/model" ] && fail "resume without --out (a trailing slash) wrote into the checkpoint"
# A checkpoint of an fp16 run resumed in fp32: the loss scaler starts afresh
# (disabled), it does not carry the fp16 scale over.
"$LOOM" train "${common[@]}" --precision fp32 --out "$WORK/p" --resume "$WORK/b-fp16/ckpt-00000010" 2>"$WORK/p.log"
grep -q "trained with fp16 loss scaling; the loss scaler starts afresh" "$WORK/p.log" || { cat "$WORK/p.log"; fail "precision change: no note"; }
# SIGTERM: checkpoint, exit 143 (128 + SIGTERM: stopped early, resumable), resume to the end, same losses.
# SIGUSR2 (like SIGUSR1, the one to send through mpirun): the same, exit 140.
stop_with() { # $1 signal, $2 expected exit status, $3 --out
  "$LOOM" train "${common[@]}" --steps 120 --out "$3" 2>"$3.log" &
  local pid=$! rc=0
  for i in $(seq 1 1000); do
    [ -s "$3/metrics.jsonl" ] && [ "$(wc -l < "$3/metrics.jsonl")" -ge 3 ] && break
    sleep 0.02
  done
  kill -"$1" $pid
  wait $pid || rc=$?
  [ $rc -eq "$2" ] || fail "SIG$1: exit $rc, expected $2"
  grep -q "SIG$1 received" "$3.log" || fail "no SIG$1 message"
  ls -d "$3"/ckpt-* >/dev/null 2>&1 || fail "no checkpoint after SIG$1"
}
stop_with USR2 140 "$WORK/s2"
stop_with TERM 143 "$WORK/s"
"$LOOM" train "${common[@]}" --steps 120 --out "$WORK/full" 2>/dev/null &
full=$!
wait $full
"$LOOM" train "${common[@]}" --steps 120 --out "$WORK/s" --resume "$WORK/s" 2>/dev/null
diff <(losses "$WORK/full") <(losses "$WORK/s") || fail "SIGTERM resume: losses differ"
echo "1 passed, 0 failed"
