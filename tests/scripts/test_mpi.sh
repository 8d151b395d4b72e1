#!/usr/bin/env bash
# Distributed training over Open MPI with 2 ranks: DP=2 vs DP=1 (also with
# loss masks), TP=2 vs TP=1 (every precision setting and recompute mode),
# ZeRO-1 vs plain DP (also with LoRA), checkpoint/resume with 2 ranks (and a
# 4-rank TP x ZeRO layout), and a dying rank ending the whole job.
source "$(dirname "$0")/lib.sh"
command -v mpirun >/dev/null || fail "mpirun not found: run scripts/setup.sh (openmpi-bin)"
# Open MPI's own allocations (its dlopened plugins) are never freed: in the
# sanitizer build, leak checking stays on for every other test but not here.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPI="mpirun -np 2 --oversubscribe"
PY=/usr/bin/python3
CMP="$PY $SRC/tests/python/compare_safetensors.py"
make_data "$WORK/data"
small_config "$WORK/cfg.json" 512
D=(--data "$WORK/data" --config "$WORK/cfg.json" --seq 16 --eval-every 0 --threads 1)
losses() { grep -o '"loss":[0-9.e+-]*' "$1/metrics.jsonl" | cut -d: -f2; }
# SETTINGS: the settings a loop runs, every one, or under the sanitizers
# (LOOM_TEST_SANITIZED, scripts/test.sh) the first only: the release build
# checks each one's numbers, the sanitizers the memory of the paths they share.
settings() {
  SETTINGS=("$@")
  if [ -n "${LOOM_TEST_SANITIZED:-}" ]; then SETTINGS=("$1"); fi
}
close() { # $1 $2 files of numbers, $3 relative tolerance
  paste "$1" "$2" | awk -v r="$3" '{ d = $1 - $2; if (d < 0) d = -d; if (d > r * ($2 < 0 ? -$2 : $2)) { print "loss " NR ": " $1 " vs " $2; bad = 1 } } END { exit bad }'
}

# The optimizer's found-inf rule with the gradients of 2 ranks summed
# (tests/dist/test_dist_optim.c: an fp16 sum that overflows is a skipped step).
timeout 120 $MPI "$LOOM_BINARY_DIR/tests/test_dist_optim" >"$WORK/dopt.log" 2>&1 ||
  { cat "$WORK/dopt.log"; fail "test_dist_optim under 2 ranks"; }
# Checkpoints through the optimizer's moments, tensor by tensor, with TP=2 and
# with ZeRO-1 (tests/dist/test_checkpoint_dist.c): exact round trips, and a
# save that fails on the writer leaves no rank waiting in a gather.
timeout 120 $MPI "$LOOM_BINARY_DIR/tests/test_checkpoint_dist" >"$WORK/ckd.log" 2>&1 ||
  { cat "$WORK/ckd.log"; fail "test_checkpoint_dist under 2 ranks"; }

# DP=2 equals DP=1 at the same global batch (5 fp32 steps, 1e-5 relative).
"$LOOM" train "${D[@]}" --batch 4 --steps 5 --precision fp32 --out "$WORK/dp1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${D[@]}" --batch 2 --steps 5 --precision fp32 --out "$WORK/dp2" 2>"$WORK/dp2.log"
close <(losses "$WORK/dp1") <(losses "$WORK/dp2") 1e-5 || fail "DP=2 differs from DP=1"
# and the first step's gradients (averaged over the ranks) and loss, dumped:
"$LOOM" train "${D[@]}" --batch 4 --precision fp32 --out "$WORK/gd1" --dump-grads "$WORK/gd1.st" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${D[@]}" --batch 2 --precision fp32 --out "$WORK/gd2" --dump-grads "$WORK/gd2.st" 2>/dev/null
$CMP "$WORK/gd2.st" "$WORK/gd1.st" --rtol 1e-5 >/dev/null || fail "DP=2 gradient dump differs from one process's"
[ "$(losses "$WORK/dp2" | wc -l)" -eq 5 ] || fail "DP=2 logged the wrong number of steps"

# Loss masks weigh by targets over the ranks: with rank 1's whole span
# masked, DP=2's gradients are those of rank 0's span alone (one process).
$PY - "$WORK" "$SRC" <<'PYEOF'
import os, sys
import numpy as np
w, src = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"{src}/tests/python")
import llama_ref as ref
os.makedirs(f"{w}/masked")
ref.write_shard(f"{w}/masked/train_000000.bin", np.random.default_rng(9).integers(0, 512, size=200))
mask = np.ones(200, dtype=np.uint8)
mask[17:33] = 0  # --batch 1 --seq 16: rank 1's targets are tokens 17..32
header = np.zeros(256, dtype="<i4")
header[:3] = [20261201, 1, 200]
open(f"{w}/masked/train_000000.mask", "wb").write(header.tobytes() + mask.tobytes())
PYEOF
M=(--data "$WORK/masked" --config "$WORK/cfg.json" --seq 16 --batch 1 --eval-every 0 --threads 1 --precision fp32)
"$LOOM" train "${M[@]}" --out "$WORK/m1" --dump-grads "$WORK/m1.st" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${M[@]}" --out "$WORK/m2" --dump-grads "$WORK/m2.st" 2>/dev/null
$CMP "$WORK/m2.st" "$WORK/m1.st" --rtol 1e-6 >/dev/null || fail "DP=2 with a masked rank differs from the other rank alone"

# ZeRO-1 equals plain data parallelism.
timeout 300 $MPI "$LOOM" train "${D[@]}" --batch 2 --steps 5 --precision fp32 --zero 1 --out "$WORK/z1" 2>"$WORK/z1.log"
close <(losses "$WORK/dp2") <(losses "$WORK/z1") 1e-6 || fail "ZeRO-1 differs from plain DP"

# ZeRO-1 with bf16 compute copies shards the fp32 masters too: each rank holds
# half of the masters and moments, and the run equals plain DP bit for bit.
# Gradient buckets started during backward (the overlap) change nothing, also
# with gradient accumulation and under each recompute mode.
weights_opt() { sed -n 's/.*weights \([0-9.]*\) MiB.*optimizer \([0-9.]*\) MiB.*/\1 \2/p' "$1"; }
# (fp32: the compute copies are the masters, so ZeRO-1 divides the moments
# only, and holds no master shard beside the whole masters)
read -r pw po <<<"$(weights_opt "$WORK/dp2.log")"
read -r zw zo <<<"$(weights_opt "$WORK/z1.log")"
awk -v pw="$pw" -v po="$po" -v zw="$zw" -v zo="$zo" 'BEGIN { exit !(zw == pw && zo <= 0.6 * po) }' ||
  fail "ZeRO-1 fp32: weights $zw MiB (plain $pw), optimizer $zo MiB (plain $po)"
Z=("${D[@]}" --batch 2 --steps 4 --precision bf16 --grad-accum 2 --bucket-size 5000)
settings "none nonreentrant" "full reentrant" "selective nonreentrant"
for rc in "${SETTINGS[@]}"; do
  set -- $rc
  R=(--recompute $1 --recompute-mode $2)
  timeout 300 $MPI "$LOOM" train "${Z[@]}" "${R[@]}" --overlap off --out "$WORK/p0" 2>"$WORK/p0.log"
  timeout 300 $MPI "$LOOM" train "${Z[@]}" "${R[@]}" --out "$WORK/p1" 2>"$WORK/p1.log"
  timeout 300 $MPI "$LOOM" train "${Z[@]}" "${R[@]}" --zero 1 --out "$WORK/z" 2>"$WORK/z.log"
  diff <(losses "$WORK/p0") <(losses "$WORK/p1") >/dev/null || fail "overlapped all-reduce changes the losses ($rc)"
  diff <(losses "$WORK/p0") <(losses "$WORK/z") >/dev/null || fail "ZeRO-1 (bf16) differs from plain DP ($rc)"
  # and the final weights are the same bytes, beyond the printed losses
  cmp -s "$WORK/p0/model/model.safetensors" "$WORK/p1/model/model.safetensors" ||
    fail "overlapped all-reduce changes the final weights ($rc)"
  cmp -s "$WORK/p0/model/model.safetensors" "$WORK/z/model/model.safetensors" ||
    fail "ZeRO-1 (bf16) final weights differ from plain DP's ($rc)"
  grep -Eq "gradients in ([0-9]+) buckets, 0 started during backward" "$WORK/p0.log" || fail "--overlap off overlapped"
  nb=$(sed -n 's/.*gradients in \([0-9]*\) buckets, \([0-9]*\) started.*/\1 \2/p' "$WORK/p1.log")
  set -- $nb
  [ "${1:-0}" -gt 2 ] && [ "$2" -eq "$1" ] || fail "buckets did not start during backward ($rc): ${nb:-none}"
  rm -rf "$WORK/p0" "$WORK/p1" "$WORK/z"
done
# The same with gradients kept in half precision (master-grad off: ZeRO-1
# rounds its shard of the fp32 sum as plain DP rounds the sum into each
# p->grad) and with fp16 loss scaling, skipped steps included.
settings "bf16 off" "fp16 on" "fp16 off"
for pm in "${SETTINGS[@]}"; do
  set -- $pm
  H=("${D[@]}" --batch 2 --steps 6 --grad-accum 2 --lr 0.3 --clip 0 --warmup 0 --precision $1 --master-grad $2)
  timeout 300 $MPI "$LOOM" train "${H[@]}" --overlap off --out "$WORK/h0" 2>/dev/null
  timeout 300 $MPI "$LOOM" train "${H[@]}" --zero 1 --out "$WORK/hz" 2>/dev/null
  cmp -s "$WORK/h0/model/model.safetensors" "$WORK/hz/model/model.safetensors" ||
    fail "ZeRO-1 final weights differ from plain DP's ($pm)"
  [ "$1" = bf16 ] || grep -q '"skipped":1' "$WORK/h0/metrics.jsonl" || fail "fp16: no skipped step to compare ($pm)"
  rm -rf "$WORK/h0" "$WORK/hz"
done
# LoRA: DP=2 trains the adapters as one process does at the same global
# batch (6 fp32 steps: from step 2 on, B is not zero and A's gradients
# count too): the same losses, and the same gradients at step 4 (dumped by
# a resume from step 3); ZeRO-1 shards the adapters' state and equals
# plain DP bit for bit (the frozen weights are whole on every rank and take
# no state).
LA=(--lora 4 --lora-alpha 8 --lora-targets q,v,down --lr 1e-2 --steps 6 --warmup 0 --precision fp32)
"$LOOM" train "${D[@]}" "${LA[@]}" --batch 4 --ckpt-every 3 --out "$WORK/l1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${D[@]}" "${LA[@]}" --batch 2 --ckpt-every 3 --out "$WORK/l2" 2>/dev/null
close <(losses "$WORK/l1") <(losses "$WORK/l2") 1e-5 || fail "LoRA: DP=2 losses differ from one process's"
"$LOOM" train "${D[@]}" "${LA[@]}" --batch 4 --resume "$WORK/l1/ckpt-00000003" --out "$WORK/lg1" \
  --dump-grads "$WORK/lg1.st" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${D[@]}" "${LA[@]}" --batch 2 --resume "$WORK/l2/ckpt-00000003" --out "$WORK/lg2" \
  --dump-grads "$WORK/lg2.st" 2>/dev/null
# (1e-4: three AdamW steps, whose normalised update turns the sums' order
# into relative differences of ~3e-5 in the adapters)
$CMP "$WORK/lg2.st" "$WORK/lg1.st" --rtol 1e-4 >/dev/null ||
  fail "LoRA: DP=2 gradients at step 4 differ from one process's"
$PY - "$WORK/lg1.st" "$SRC" <<'PYEOF' || fail "LoRA: the step-4 gradient dump has no nonzero A gradient"
import sys
sys.path.insert(0, sys.argv[2] + "/tests/python")
import llama_ref as ref
g, _ = ref.read_safetensors(sys.argv[1])
assert all(g[k].abs().max() > 0 for k in g if "lora_A" in k), "an A gradient is zero"
PYEOF
LZ=("${D[@]}" --lora 4 --lora-targets q,v,down --batch 2 --steps 4 --precision bf16 --lr 1e-2)
timeout 300 $MPI "$LOOM" train "${LZ[@]}" --out "$WORK/lp" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${LZ[@]}" --zero 1 --out "$WORK/lz" 2>/dev/null
cmp -s "$WORK/lp/model/model.safetensors" "$WORK/lz/model/model.safetensors" ||
  fail "LoRA: ZeRO-1 final weights differ from plain DP's"
cmp -s "$WORK/lp/adapter/adapter_model.safetensors" "$WORK/lz/adapter/adapter_model.safetensors" ||
  fail "LoRA: ZeRO-1 adapters differ from plain DP's"

# LoRA under TP=2, the adapters split as their weights (B's rows for q, k,
# v, gate and up; A's columns for o and down), trains as one process does:
#  - fp32: the same losses, the same adapter gradients at step 4 (dumped by
#    a resume from step 3: B is not zero by then, so A's count too), the
#    same PEFT adapters;
#  - bf16, whose frozen weights are split bf16 copies with no master: close
#    losses and the same first gradients (B's; A's are zero while B is).
#    Later ones are not compared: Adam's first steps move each adapter
#    value by about lr whatever its gradient's size, so bf16's rounding
#    flips the sign of some steps and the runs part by more than rounding;
#  - a TP=2 resume is exact (in bf16 through the split frozen weights);
#  - the gradients agree in every recompute mode.
LT=(--lora 4 --lora-alpha 8 --lora-targets all --lr 1e-2 --steps 6 --warmup 0 --batch 2)
# Runs that start apart compare their losses only: AdamW's first step moves
# each value by lr whatever its gradient's size, so an element whose
# gradient is near zero can step either way by the sums' order, which parts
# the runs (by how much depends on the corpus, this tree's sources); fp32
# losses stay within 1e-4 (a wrong split moves them by 1e-2 and more). The
# gradients, adapters and merged model are compared from one state: the
# one-process checkpoint at step 3, resumed by both (checkpoints are whole
# tensors, read on any layout).
for pt in "fp32 1e-4 1e-4" "bf16 2e-2 3e-2"; do
  set -- $pt
  "$LOOM" train "${D[@]}" "${LT[@]}" --precision $1 --ckpt-every 3 --out "$WORK/lt1" 2>/dev/null
  timeout 300 $MPI "$LOOM" train "${D[@]}" "${LT[@]}" --precision $1 --tp 2 --ckpt-every 3 --out "$WORK/lt2" \
    2>"$WORK/lt2.log" || { cat "$WORK/lt2.log"; fail "LoRA, TP=2, $1: training failed"; }
  close <(losses "$WORK/lt1") <(losses "$WORK/lt2") $2 || fail "LoRA, $1: TP=2 losses differ from one process's"
  from=(); [ $1 = fp32 ] && from=(--resume "$WORK/lt1/ckpt-00000003")
  "$LOOM" train "${D[@]}" "${LT[@]}" --precision $1 "${from[@]}" --out "$WORK/ltg1" --dump-grads "$WORK/ltg1.st" \
    2>/dev/null
  timeout 300 $MPI "$LOOM" train "${D[@]}" "${LT[@]}" --precision $1 --tp 2 "${from[@]}" --out "$WORK/ltg2" \
    --dump-grads "$WORK/ltg2.st" 2>/dev/null
  $PY - "$WORK/ltg1.st" "$SRC" $1 <<'PYEOF' || fail "LoRA, $1: no adapter gradients to compare"
import sys
sys.path.insert(0, sys.argv[2] + "/tests/python")
import llama_ref as ref
g, _ = ref.read_safetensors(sys.argv[1])
lora = [k for k in g if ".lora_" in k and (sys.argv[3] == "fp32" or ".lora_B" in k)]
assert len(lora) == (2 if sys.argv[3] == "fp32" else 1) * 7 * 2, sorted(lora)[:4]
assert all(g[k].abs().max() > 0 for k in lora), "an adapter gradient is zero"
PYEOF
  $CMP "$WORK/ltg2.st" "$WORK/ltg1.st" --rtol $3 >/dev/null || fail "LoRA, $1: TP=2 gradients differ"
  if [ $1 = fp32 ]; then # steps 4 to 6 from the one-process checkpoint, TP=2: its adapters and merged model
    timeout 300 $MPI "$LOOM" train "${D[@]}" "${LT[@]}" --precision $1 --tp 2 "${from[@]}" --out "$WORK/ltx" \
      2>/dev/null || fail "LoRA, TP=2: resuming the one-process checkpoint failed"
    $CMP "$WORK/ltx/adapter/adapter_model.safetensors" "$WORK/lt1/adapter/adapter_model.safetensors" --rtol $3 \
      >/dev/null || fail "LoRA, $1: TP=2 PEFT adapters differ from one process's"
    $CMP "$WORK/ltx/model/model.safetensors" "$WORK/lt1/model/model.safetensors" --rtol $3 >/dev/null ||
      fail "LoRA, $1: TP=2 merged model differs from one process's"
  fi
  timeout 300 $MPI "$LOOM" train "${D[@]}" "${LT[@]}" --precision $1 --tp 2 --resume "$WORK/lt2/ckpt-00000003" \
    --out "$WORK/ltr" 2>/dev/null
  cmp -s "$WORK/ltr/adapter/adapter_model.safetensors" "$WORK/lt2/adapter/adapter_model.safetensors" ||
    fail "LoRA, $1: a TP=2 resume differs from the uninterrupted run"
  [ $1 = fp32 ] && mv "$WORK/lt1" "$WORK/lf1" && mv "$WORK/lt2" "$WORK/lf2" && mv "$WORK/ltg1.st" "$WORK/lfg1.st"
  rm -rf "$WORK/lt1" "$WORK/lt2" "$WORK/ltg1" "$WORK/ltg2" "$WORK/ltr" "$WORK/ltx"
done
# Each recompute mode under TP=2, resumed from the one-process fp32 checkpoint at step 3 (B
# not zero: A's gradients and the adapters' own f and g run in the
# replays), gives one process's step-4 gradients.
settings "full reentrant" "full nonreentrant" "selective nonreentrant"
for rc in "${SETTINGS[@]}"; do
  set -- $rc
  timeout 300 $MPI "$LOOM" train "${D[@]}" "${LT[@]}" --precision fp32 --tp 2 --recompute $1 --recompute-mode $2 \
    --check-grads --resume "$WORK/lf1/ckpt-00000003" --out "$WORK/lr2" --dump-grads "$WORK/lr2.st" 2>"$WORK/lr2.log" ||
    { cat "$WORK/lr2.log"; fail "LoRA, TP=2, $rc: failed"; }
  $CMP "$WORK/lr2.st" "$WORK/lfg1.st" --rtol 1e-4 >/dev/null || fail "LoRA, TP=2, recompute $rc: gradients differ"
  rm -rf "$WORK/lr2"
done
# TP=2 x DP=2 with ZeRO-1 (4 ranks, a global batch of 2) trains as one
# process; a PEFT adapter given to a TP=2 run (--lora-init, each rank
# keeping its part) starts where one process starts.
timeout 300 mpirun -np 4 --oversubscribe "$LOOM" train "${D[@]}" "${LT[@]}" --precision fp32 --tp 2 --zero 1 \
  --batch 1 --out "$WORK/l4" 2>"$WORK/l4.log" || { cat "$WORK/l4.log"; fail "LoRA, TP=2 x ZeRO-1: failed"; }
close <(losses "$WORK/lf1") <(losses "$WORK/l4") 1e-4 || fail "LoRA, TP=2 x ZeRO-1: losses differ from one process's"
LI=(--data "$WORK/data" --seq 16 --eval-every 0 --threads 1 "${LT[@]}" --precision fp32 --steps 2 --init "$WORK/lf1/model"
    --lora-init "$WORK/lf1/adapter")
"$LOOM" train "${LI[@]}" --out "$WORK/li1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${LI[@]}" --tp 2 --out "$WORK/li2" 2>"$WORK/li2.log" ||
  { cat "$WORK/li2.log"; fail "LoRA, TP=2 --lora-init: failed"; }
close <(losses "$WORK/li1") <(losses "$WORK/li2") 1e-5 || fail "LoRA, TP=2 --lora-init: losses differ"
rm -rf "$WORK/lf1" "$WORK/lf2" "$WORK/l4" "$WORK/li1" "$WORK/li2"
# Dropout draws one process's masks under TP=2: whole inputs (q, k, v,
# gate, up) the same mask on every rank, split ones (o, down) each rank's
# columns of it (the losses from step 2 on depend on them: B is zero
# before).
LD=("${D[@]}" "${LT[@]}" --precision fp32 --lora-dropout 0.1 --steps 5)
"$LOOM" train "${LD[@]}" --out "$WORK/ld1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${LD[@]}" --tp 2 --out "$WORK/ld2" 2>"$WORK/ld.log" ||
  { cat "$WORK/ld.log"; fail "LoRA, TP=2: dropout failed"; }
close <(losses "$WORK/ld1") <(losses "$WORK/ld2") 1e-5 || fail "LoRA, TP=2: losses with dropout differ"
# and over data-parallel ranks, each drawing its rows of the global batch's
# masks: DP=2 and TP=2 x DP=2 (4 ranks) train as one process at the global
# batch (with one seed and no rows, each rank would draw the same masks).
timeout 300 $MPI "$LOOM" train "${LD[@]}" --batch 1 --out "$WORK/ld3" 2>"$WORK/ld.log" ||
  { cat "$WORK/ld.log"; fail "LoRA, DP=2: dropout failed"; }
close <(losses "$WORK/ld1") <(losses "$WORK/ld3") 1e-5 || fail "LoRA, DP=2: losses with dropout differ"
timeout 300 mpirun -np 4 --oversubscribe "$LOOM" train "${LD[@]}" --tp 2 --batch 1 --out "$WORK/ld4" 2>"$WORK/ld.log" ||
  { cat "$WORK/ld.log"; fail "LoRA, TP=2 x DP=2: dropout failed"; }
close <(losses "$WORK/ld1") <(losses "$WORK/ld4") 1e-5 || fail "LoRA, TP=2 x DP=2: losses with dropout differ"
# Attention dropout (the config's attention_dropout) draws one process's masks
# too: each rank its batch rows and query heads of the whole batch's, so TP=2
# and TP=2 x DP=2 (4 ranks) train as one process at the global batch.
config_plus "$WORK/adrop.json" "$WORK/cfg.json" '"attention_dropout": 0.1'
AD=(--data "$WORK/data" --config "$WORK/adrop.json" --seq 16 --eval-every 0 --threads 1 --precision fp32 --steps 4)
"$LOOM" train "${AD[@]}" --batch 2 --out "$WORK/ad1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${AD[@]}" --batch 2 --tp 2 --out "$WORK/ad2" 2>"$WORK/ad.log" ||
  { cat "$WORK/ad.log"; fail "attention dropout, TP=2: training failed"; }
close <(losses "$WORK/ad1") <(losses "$WORK/ad2") 1e-5 || fail "attention dropout, TP=2: losses differ"
timeout 300 mpirun -np 4 --oversubscribe "$LOOM" train "${AD[@]}" --tp 2 --batch 1 --out "$WORK/ad3" 2>"$WORK/ad.log" ||
  { cat "$WORK/ad.log"; fail "attention dropout, TP=2 x DP=2: training failed"; }
close <(losses "$WORK/ad1") <(losses "$WORK/ad3") 1e-5 || fail "attention dropout, TP=2 x DP=2: losses differ"
rm -rf "$WORK/ad1" "$WORK/ad2" "$WORK/ad3"
# DoRA trains under data parallelism (ZeRO-1 here) and under TP=2 as one
# process does: its magnitudes split as B's rows for q, k, v, gate and up,
# whole for o and down, whose norms sum the ranks' columns. The same losses
# from scratch, step 3's gradients (A, B and m) from the one-process
# checkpoint, and with dropout the same losses again.
LDO=("${D[@]}" --lora 4 --lora-dora --lora-targets all --lr 1e-2 --steps 4 --warmup 0 --precision fp32)
"$LOOM" train "${LDO[@]}" --batch 2 --ckpt-every 2 --out "$WORK/do1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${LDO[@]}" --batch 1 --zero 1 --out "$WORK/do2" 2>"$WORK/do.log" ||
  { cat "$WORK/do.log"; fail "DoRA, DP=2: training failed"; }
close <(losses "$WORK/do1") <(losses "$WORK/do2") 1e-4 || fail "DoRA, DP=2: losses differ from one process's"
timeout 300 $MPI "$LOOM" train "${LDO[@]}" --batch 2 --tp 2 --out "$WORK/do3" 2>"$WORK/do.log" ||
  { cat "$WORK/do.log"; fail "DoRA, TP=2: training failed"; }
close <(losses "$WORK/do1") <(losses "$WORK/do3") 1e-4 || fail "DoRA, TP=2: losses differ from one process's"
"$LOOM" train "${LDO[@]}" --batch 2 --resume "$WORK/do1/ckpt-00000002" --out "$WORK/dog1" \
  --dump-grads "$WORK/dog1.st" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${LDO[@]}" --batch 2 --tp 2 --resume "$WORK/do1/ckpt-00000002" --out "$WORK/dog2" \
  --dump-grads "$WORK/dog2.st" 2>"$WORK/do.log" || { cat "$WORK/do.log"; fail "DoRA, TP=2: the gradient dump failed"; }
$PY - "$WORK/dog1.st" "$SRC" <<'PYEOF' || fail "DoRA: no magnitude gradients to compare"
import sys
sys.path.insert(0, sys.argv[2] + "/tests/python")
import llama_ref as ref
g, _ = ref.read_safetensors(sys.argv[1])
mags = [k for k in g if k.endswith(".lora_magnitude_vector")]
assert len(mags) == 7 * 2 and all(g[k].abs().max() > 0 for k in mags), sorted(mags)[:3]
PYEOF
$CMP "$WORK/dog2.st" "$WORK/dog1.st" --rtol 1e-4 >/dev/null || fail "DoRA, TP=2: step 3's gradients differ"
"$LOOM" train "${LDO[@]}" --batch 2 --lora-dropout 0.1 --out "$WORK/do4" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${LDO[@]}" --batch 2 --lora-dropout 0.1 --tp 2 --out "$WORK/do5" 2>"$WORK/do.log" ||
  { cat "$WORK/do.log"; fail "DoRA, TP=2 with dropout: training failed"; }
close <(losses "$WORK/do4") <(losses "$WORK/do5") 1e-4 || fail "DoRA, TP=2: losses with dropout differ"

read -r pw po <<<"$(weights_opt "$WORK/p0.log")"
read -r zw zo <<<"$(weights_opt "$WORK/z.log")"
awk -v pw="$pw" -v po="$po" -v zw="$zw" -v zo="$zo" 'BEGIN { exit !(zw + zo <= 0.6 * (pw + po)) }' ||
  fail "ZeRO-1 does not divide the masters and moments: weights+optimizer $zw+$zo MiB vs $pw+$po MiB"

# TP=2 equals TP=1: logits, loss and every gradient, per precision and mode.
for prec in "fp32 on 1e-4" "bf16 on 3e-2" "bf16 off 3e-2"; do
  set -- $prec
  for rc in "none nonreentrant" "full nonreentrant" "full reentrant" "selective nonreentrant"; do
    set -- $prec $rc
    A=(--batch 2 --precision $1 --master-grad $2 --recompute $4 --recompute-mode $5)
    "$LOOM" train "${D[@]}" "${A[@]}" --out "$WORK/t1" --dump-grads "$WORK/g1.st" --dump-logits "$WORK/l1.st" \
      2>"$WORK/t1.log"
    timeout 300 $MPI "$LOOM" train "${D[@]}" "${A[@]}" --tp 2 --out "$WORK/t2" \
      --dump-grads "$WORK/g2.st" --dump-logits "$WORK/l2.st" 2>"$WORK/t2.log"
    n1=$(grep -o 'train: [0-9]* parameters' "$WORK/t1.log") n2=$(grep -o 'train: [0-9]* parameters' "$WORK/t2.log")
    [ -n "$n1" ] && [ "$n1" = "$n2" ] || fail "TP=2 reports '$n2', one process '$n1'"
    $CMP "$WORK/g2.st" "$WORK/g1.st" --rtol $3 >/dev/null || fail "TP=2 gradients differ ($*)"
    $CMP "$WORK/l2.st" "$WORK/l1.st" --rtol $3 >/dev/null || fail "TP=2 logits differ ($*)"
  done
done

# TP=2 recomputing some blocks (a replay runs the block's collectives
# again, so every rank must recompute the same ones): --recompute-blocks 1,
# and the plan of --recompute-budget halfway between the peaks the ranks
# measure, give one process's gradients.
A=(--batch 2 --precision fp32 --master-grad on)
"$LOOM" train "${D[@]}" "${A[@]}" --out "$WORK/t1" --dump-grads "$WORK/g1.st" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${D[@]}" "${A[@]}" --tp 2 --recompute full --recompute-blocks 1 --out "$WORK/tb" \
  --dump-grads "$WORK/gb.st" 2>"$WORK/tb.log" || { cat "$WORK/tb.log"; fail "TP=2 --recompute-blocks 1"; }
$CMP "$WORK/gb.st" "$WORK/g1.st" --rtol 1e-4 >/dev/null || fail "TP=2 --recompute-blocks 1 gradients differ"
if timeout 300 $MPI "$LOOM" train "${D[@]}" "${A[@]}" --tp 2 --recompute-budget 0.0001 --out "$WORK/tq" \
  2>"$WORK/tq.err"; then fail "TP=2 took a budget of 0.0001 MiB"; fi
all=$(sed -nE 's/.*takes \(([0-9.]+) MiB measured; ([0-9.]+) MiB with none.*/\1/p' "$WORK/tq.err" | head -1)
none=$(sed -nE 's/.*takes \(([0-9.]+) MiB measured; ([0-9.]+) MiB with none.*/\2/p' "$WORK/tq.err" | head -1)
[ -n "$all" ] && [ -n "$none" ] || { cat "$WORK/tq.err"; fail "TP=2: no measured peaks"; }
mid=$(awk -v a="$all" -v b="$none" 'BEGIN { printf "%.3f", (a + b) / 2 }')
timeout 300 $MPI "$LOOM" train "${D[@]}" "${A[@]}" --tp 2 --recompute-budget "$mid" --out "$WORK/tq" \
  --dump-grads "$WORK/gq.st" 2>"$WORK/tq.log" || { cat "$WORK/tq.log"; fail "TP=2 --recompute-budget $mid"; }
grep -qE "recompute of [12] of 2 blocks" "$WORK/tq.log" || fail "TP=2: no plan for $mid MiB: $(cat "$WORK/tq.log")"
$CMP "$WORK/gq.st" "$WORK/g1.st" --rtol 1e-4 >/dev/null || fail "TP=2 --recompute-budget gradients differ"

# The attention's biases (Qwen 2's on q, k and v: split as their weights'
# rows; LLaMA's attention_bias adds o's: whole, added once after the sum),
# drawn non-zero, heads of their own size (head_dim: q and o wider than
# the model), Granite's multipliers (the residual's on o's and down's
# reduced outputs), Phi-3's fused files, SmolLM3's NoPE blocks, Gemma 2's
# norms of the outputs and softcaps and Gemma 3's q/k norms (Qwen 3's
# path: whole on each rank, their gradient summed over the ranks' heads)
# and local RoPE base (both with Gemma's norms of 1 + weight, the
# replicated embeddings scaled, tied, the tanh GELU; Phi-3's and both
# Gemmas' with sliding windows shorter than the sequence): TP=2 gives one
# process's logits and gradients, with full recompute too, and passes the
# gradient audit. Under the sanitizers (LOOM_TEST_SANITIZED,
# scripts/test.sh) two families whose code paths cover the others' (Qwen
# 2's split biases, Gemma 3's norms, windows and RoPEs; Phi-3's fused
# files run there in test_cli_train): the numbers are the release build's
# to check, and the suite's time is bounded.
kinds=('"model_type": "qwen2"' '"head_dim": 24, "attention_bias": true'
       '"model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625, "logits_scaling": 8.0'
       '"model_type": "phi3", "sliding_window": 6' '"model_type": "smollm3", "no_rope_layer_interval": 2'
       '"model_type": "gemma2", "head_dim": 16, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 24, "sliding_window": 5'
       '"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 5, "sliding_window_pattern": 2')
if [ -n "${LOOM_TEST_SANITIZED:-}" ]; then kinds=("${kinds[0]}" "${kinds[6]}"); fi
for kind in "${kinds[@]}"; do
  config_plus "$WORK/bias.json" "$WORK/cfg.json" "$kind"
  rm -rf "$WORK/biased" "$WORK/b1" "$WORK/b2" "$WORK/ba"
  $PY - "$WORK/bias.json" "$WORK/biased" "$SRC/tests/python" <<'PYEOF' || fail "no biased model ($kind)"
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[3])
import llama_ref as ref
ref.make_model_dir(sys.argv[2], json.load(open(sys.argv[1])), np.random.default_rng(5))
PYEOF
  grep -q -e "q_proj.bias" -e "q_norm" -e "qkv_proj" "$WORK/biased/model.safetensors" ||
    [[ $kind == *gemma* || $kind == *granite* || $kind == *smollm3* ]] ||
    fail "the model has no biases ($kind)"
  BI=(--data "$WORK/data" --init "$WORK/biased" --seq 16 --eval-every 0 --threads 1 --batch 2 --precision fp32)
  # the later families against one process without recompute only: their full recompute under TP=2 is the
  # gradient audit's run below, and every mode is checked bit for bit in one process (test_llama_recompute)
  rcs="none full"
  case $kind in *gemma2*|*granite*|*phi3*|*smollm3*) rcs=none ;; esac
  for rc in $rcs; do
    rm -rf "$WORK/b1" "$WORK/b2"
    "$LOOM" train "${BI[@]}" --recompute $rc --out "$WORK/b1" --dump-grads "$WORK/bg1.st" --dump-logits "$WORK/bl1.st" \
      2>"$WORK/b1.log" || { cat "$WORK/b1.log"; fail "biases ($kind): one process"; }
    timeout 300 $MPI "$LOOM" train "${BI[@]}" --recompute $rc --tp 2 --out "$WORK/b2" --dump-grads "$WORK/bg2.st" \
      --dump-logits "$WORK/bl2.st" 2>"$WORK/b2.log" || { cat "$WORK/b2.log"; fail "biases ($kind): TP=2"; }
    $CMP "$WORK/bg2.st" "$WORK/bg1.st" --rtol 1e-4 >/dev/null || fail "biases ($kind, $rc): TP=2 gradients differ"
    $CMP "$WORK/bl2.st" "$WORK/bl1.st" --rtol 1e-4 >/dev/null || fail "biases ($kind, $rc): TP=2 logits differ"
  done
  timeout 300 $MPI "$LOOM" train "${BI[@]}" --steps 2 --tp 2 --recompute full --check-grads --out "$WORK/ba" \
    2>"$WORK/ba.log" || { cat "$WORK/ba.log"; fail "biases ($kind), TP=2: --check-grads failed"; }
done

# Phi-3's fused tensors written under TP=2 (q, k and v each gathered in
# turn into one qkv_proj) hold one process's weights.
config_plus "$WORK/phi3.json" "$WORK/cfg.json" '"model_type": "phi3"'
P3=(--data "$WORK/data" --config "$WORK/phi3.json" --seq 16 --eval-every 0 --threads 1 --batch 2 --steps 2 --precision fp32)
"$LOOM" train "${P3[@]}" --out "$WORK/p31" 2>/dev/null || fail "Phi-3: one process"
timeout 300 $MPI "$LOOM" train "${P3[@]}" --tp 2 --out "$WORK/p32" 2>"$WORK/p32.log" ||
  { cat "$WORK/p32.log"; fail "Phi-3: TP=2"; }
grep -q "qkv_proj" "$WORK/p32/model/model.safetensors" || fail "Phi-3: TP=2 wrote no fused qkv_proj"
$CMP "$WORK/p32/model/model.safetensors" "$WORK/p31/model/model.safetensors" --rtol 1e-4 >/dev/null ||
  fail "Phi-3: the model TP=2 saved differs from one process's"
# and LoRA on its fused q and v under TP=2: every rank finishes (none writes
# a PEFT adapter directory), the merged model saved
timeout 300 $MPI "$LOOM" train "${P3[@]}" --tp 2 --lora 4 --lora-targets q,v --out "$WORK/p3l" 2>"$WORK/p3l.log" ||
  { cat "$WORK/p3l.log"; fail "Phi-3: LoRA with TP=2"; }
[ -s "$WORK/p3l/model/model.safetensors" ] && [ ! -d "$WORK/p3l/adapter" ] || fail "Phi-3: LoRA with TP=2 wrote no model"
grep -q "no PEFT adapter directory is written" "$WORK/p3l.log" || fail "Phi-3: no note of the PEFT adapter"

# Tied embeddings (the embedding split by vocabulary under TP, and used
# again as the lm_head): TP=2 gradients equal one process's, ZeRO-1 equals
# plain DP byte for byte, and the gradient audit passes under TP=2 and
# ZeRO-1 in every recompute mode.
sed 's/"rms_norm_eps": 1e-5}/"rms_norm_eps": 1e-5, "tie_word_embeddings": true}/' "$WORK/cfg.json" > "$WORK/tied.json"
grep -q '"tie_word_embeddings": true' "$WORK/tied.json" || fail "no tied config"
TT=(--data "$WORK/data" --config "$WORK/tied.json" --seq 16 --eval-every 0 --threads 1 --batch 2)
"$LOOM" train "${TT[@]}" --precision fp32 --out "$WORK/tt1" --dump-grads "$WORK/tg1.st" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${TT[@]}" --precision fp32 --tp 2 --out "$WORK/tt2" --dump-grads "$WORK/tg2.st" 2>/dev/null
$CMP "$WORK/tg2.st" "$WORK/tg1.st" --rtol 1e-4 >/dev/null || fail "tied: TP=2 gradients differ from one process's"
timeout 300 $MPI "$LOOM" train "${TT[@]}" --steps 4 --overlap off --out "$WORK/tp0" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${TT[@]}" --steps 4 --zero 1 --out "$WORK/tz" 2>/dev/null
cmp -s "$WORK/tp0/model/model.safetensors" "$WORK/tz/model/model.safetensors" ||
  fail "tied: ZeRO-1 final weights differ from plain DP's"
for rc in "none nonreentrant" "full reentrant" "full nonreentrant" "selective nonreentrant"; do
  set -- $rc
  for layout in "--tp 2" "--zero 1"; do
    timeout 300 $MPI "$LOOM" train "${TT[@]}" --steps 2 --master-grad off $layout --recompute $1 --recompute-mode $2 \
      --check-grads --out "$WORK/ta" 2>"$WORK/ta.log" || { cat "$WORK/ta.log"; fail "tied, $layout, $rc: --check-grads failed"; }
    rm -rf "$WORK/ta"
  done
done

# Checkpoint and resume with 2 ranks (DP, TP and ZeRO) equal the uninterrupted run.
for layout in "--tp 1" "--tp 2" "--zero 1" "--zero 1 --precision bf16" \
              "--tp 2 --precision fp16 --grad-accum 2 --recompute full --lr 0.05"; do
  C=("${D[@]}" --batch 2 --steps 8 --precision fp32 $layout)
  timeout 300 $MPI "$LOOM" train "${C[@]}" --out "$WORK/full" 2>/dev/null
  timeout 300 $MPI "$LOOM" train "${C[@]}" --out "$WORK/part" --ckpt-every 4 --keep 3 2>/dev/null
  timeout 300 $MPI "$LOOM" train "${C[@]}" --out "$WORK/res" --resume "$WORK/part/ckpt-00000004" 2>/dev/null
  diff <(losses "$WORK/full" | tail -4) <(losses "$WORK/res") >/dev/null || fail "resume with 2 ranks ($layout) differs"
  cmp -s "$WORK/full/model/model.safetensors" "$WORK/res/model/model.safetensors" ||
    fail "resume with 2 ranks ($layout): final weights differ"
  rm -rf "$WORK/full" "$WORK/part" "$WORK/res"
done

# A ZeRO-1 checkpoint's state (each moment gathered to the writer tensor by
# tensor as the file is written) equals plain data parallelism's bit for bit,
# with 2 ranks and with 4 (TP=2 x DP=2, bf16: sharded masters, and each
# tensor gathered over DP, then TP); and the 4-rank ZeRO run resumes exactly.
for np_layout in "2:--tp 1" "4:--tp 2 --precision bf16"; do
  n=${np_layout%%:*} layout=${np_layout#*:}
  C=("${D[@]}" --batch 2 --steps 6 --precision fp32 $layout --ckpt-every 3 --keep 3)
  timeout 300 mpirun -np "$n" --oversubscribe "$LOOM" train "${C[@]}" --zero 0 --out "$WORK/zp" 2>/dev/null
  timeout 300 mpirun -np "$n" --oversubscribe "$LOOM" train "${C[@]}" --zero 1 --out "$WORK/zs" 2>/dev/null
  $CMP "$WORK/zs/ckpt-00000003/state.safetensors" "$WORK/zp/ckpt-00000003/state.safetensors" --rtol 0 >/dev/null ||
    fail "$n ranks ($layout): the ZeRO-1 checkpoint's state differs from plain DP's"
  if [ "$n" = 4 ]; then
    timeout 300 mpirun -np 4 --oversubscribe "$LOOM" train "${C[@]}" --zero 1 --out "$WORK/zr" \
      --resume "$WORK/zs/ckpt-00000003" 2>"$WORK/zr.log" || { cat "$WORK/zr.log"; fail "4 ranks ($layout), ZeRO-1: the resume failed"; }
    cmp -s "$WORK/zs/model/model.safetensors" "$WORK/zr/model/model.safetensors" ||
      fail "4 ranks ($layout), ZeRO-1: the resumed run's final weights differ"
  fi
  rm -rf "$WORK/zp" "$WORK/zs" "$WORK/zr"
done

# A checkpoint resumes on another layout (its tensors are whole): ZeRO-1's
# with 2 ranks in one process, one process's under ZeRO-1 with 2 ranks
# (bf16: sharded masters; each rank takes its part of every moment), and
# TP=2's in one process, at the same global batch, continue as the run
# they came from.
X=("${D[@]}" --precision bf16 --steps 8)
timeout 300 $MPI "$LOOM" train "${X[@]}" --batch 2 --zero 1 --ckpt-every 4 --out "$WORK/x2" 2>/dev/null
"$LOOM" train "${X[@]}" --batch 4 --resume "$WORK/x2/ckpt-00000004" --out "$WORK/x21" 2>/dev/null
close <(losses "$WORK/x2" | tail -4) <(losses "$WORK/x21") 2e-4 || fail "ZeRO-1 checkpoint resumed in one process differs"
"$LOOM" train "${X[@]}" --batch 4 --ckpt-every 4 --out "$WORK/x1" 2>/dev/null
timeout 300 $MPI "$LOOM" train "${X[@]}" --batch 2 --zero 1 --resume "$WORK/x1/ckpt-00000004" --out "$WORK/x12" \
  2>/dev/null
close <(losses "$WORK/x1" | tail -4) <(losses "$WORK/x12") 2e-4 || fail "one process's checkpoint resumed under ZeRO-1 differs"
timeout 300 $MPI "$LOOM" train "${X[@]}" --batch 2 --tp 2 --ckpt-every 4 --out "$WORK/x3" 2>/dev/null
"$LOOM" train "${X[@]}" --batch 2 --resume "$WORK/x3/ckpt-00000004" --out "$WORK/x31" 2>/dev/null
close <(losses "$WORK/x3" | tail -4) <(losses "$WORK/x31") 2e-4 || fail "a TP=2 checkpoint resumed in one process differs"
rm -rf "$WORK/x2" "$WORK/x21" "$WORK/x1" "$WORK/x12" "$WORK/x3" "$WORK/x31"

# A rank that fails (bad data on rank 1) ends the whole job with a message.
mkdir -p "$WORK/bad" && printf 'not a shard' > "$WORK/bad/train_000000.bin"
set +e
timeout 120 mpirun -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 50 --out "$WORK/x" : \
                    -np 1 "$LOOM" train --data "$WORK/bad" --config "$WORK/cfg.json" --seq 16 --eval-every 0 \
                    --threads 1 --batch 2 --steps 50 --out "$WORK/x" >/dev/null 2>"$WORK/err.log"
rc=$?
set -e
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$WORK/err.log"; fail "failing rank: exit $rc (124 = hang)"; }
grep -q "rank 1: loom train: .*train_000000.bin" "$WORK/err.log" || { cat "$WORK/err.log"; fail "no clear message from the failing rank"; }

config_plus "$WORK/q3.json" "$WORK/cfg.json" '"model_type": "qwen3", "head_dim": 16'
# Ranks whose --config files differ build different models: refused by
# name before training (under TP they would wait in collectives of
# different sizes). Here a TP group with and without Qwen 3's q/k norms.
set +e
timeout 120 mpirun -np 1 "$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --seq 16 --eval-every 0 \
                    --threads 1 --batch 2 --steps 2 --tp 2 --out "$WORK/dm" : \
                    -np 1 "$LOOM" train --data "$WORK/data" --config "$WORK/q3.json" --seq 16 --eval-every 0 \
                    --threads 1 --batch 2 --steps 2 --tp 2 --out "$WORK/dm" >/dev/null 2>"$WORK/err.log"
rc=$?
set -e
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$WORK/err.log"; fail "ranks with different models: exit $rc (124 = hang)"; }
grep -q "the ranks built different models" "$WORK/err.log" || { cat "$WORK/err.log"; fail "no message for ranks with different models"; }

# --help on one rank of an MPMD launch ends the job (status 2), not a hang:
# with status 0 the other rank would wait for it in MPI_Init forever.
set +e
timeout 120 mpirun -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 50 --out "$WORK/x" : \
                    -np 1 "$LOOM" train --help >"$WORK/out.log" 2>"$WORK/err.log"
rc=$?
set -e
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$WORK/err.log"; fail "--help on one rank: exit $rc (124 = hang)"; }
grep -q "usage: loom train" "$WORK/out.log" || fail "--help on one rank printed no help"
grep -q "help in a job of 2 processes" "$WORK/err.log" || { cat "$WORK/err.log"; fail "--help on one rank: no note"; }

# A rank killed mid-training (SIGKILL) ends the job, not a hang.
set +e
timeout 120 mpirun -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 100000 --out "$WORK/k" : \
                    -np 1 timeout -s KILL 3 "$LOOM" train "${D[@]}" --batch 2 --steps 100000 --out "$WORK/k" \
                    >/dev/null 2>"$WORK/err.log"
rc=$?
set -e
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$WORK/err.log"; fail "killed rank: exit $rc (124 = hang)"; }
# Ranks started differently: one error naming the flag, from every rank,
# never a hang (different --steps used to hang after the shorter run's end,
# different --zero or --bucket-size crashed in MPI, a different --seed
# trained two different models), and so for validation shards on one rank
# only (evaluate() is collective) and for different --init weights.
expect_mpi_error() { # $1 pattern, the rest: mpirun's arguments
  local pattern=$1 rc
  shift
  set +e
  timeout 120 mpirun "$@" >/dev/null 2>"$WORK/err.log"
  rc=$?
  set -e
  [ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$WORK/err.log"; fail "mismatched ranks: exit $rc (124 = hang): $*"; }
  grep -q -E -e "$pattern" "$WORK/err.log" || { cat "$WORK/err.log"; fail "no /$pattern/ for: $*"; }
}
"$LOOM" train "${D[@]}" --batch 2 --steps 2 --ckpt-every 1 --keep 5 --out "$WORK/h2" 2>/dev/null
for flag in "--steps 3:--steps 6" "--seed 1:--seed 2" "--zero 0:--zero 1" "--bucket-size 0:--bucket-size 9000"; do
  a=${flag%%:*}; b=${flag##*:}
  expect_mpi_error "rank 1 was started with $b where rank 0 has $a" \
    -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 3 $a --out "$WORK/mm" : \
    -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 3 $b --out "$WORK/mm"
done
expect_mpi_error "rank 1 was started with --resume no where rank 0 has --resume given" \
  -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 6 --resume "$WORK/h2/ckpt-00000002" --out "$WORK/mm" : \
  -np 1 "$LOOM" train "${D[@]}" --batch 2 --steps 6 --out "$WORK/mm"
mkdir -p "$WORK/noval" && cp "$WORK"/data/train_* "$WORK/data/tokenizer.json" "$WORK/noval/"
E=(--config "$WORK/cfg.json" --seq 16 --threads 1 --batch 2 --steps 3 --eval-every 2 --out "$WORK/mv")
expect_mpi_error "usable on some ranks only" -np 1 "$LOOM" train --data "$WORK/data" "${E[@]}" : \
  -np 1 "$LOOM" train --data "$WORK/noval" "${E[@]}"
"$LOOM" train "${D[@]}" --batch 2 --steps 1 --seed 5 --out "$WORK/i5" 2>/dev/null
I=(--data "$WORK/data" --seq 16 --eval-every 0 --threads 1 --batch 2 --steps 2 --out "$WORK/mi")
expect_mpi_error "hold different weights after setup" -np 1 "$LOOM" train "${I[@]}" --init "$WORK/h2/model" : \
  -np 1 "$LOOM" train "${I[@]}" --init "$WORK/i5/model"
# Different token shards on different machines: an extra shard, or the
# same shard with other tokens (reversed: same length, same vocabulary), or
# other validation shards.
reverse_tokens() { # $1 a shard: its tokens in reverse order (same length, same vocabulary)
  $PY - "$1" <<'PYEOF'
import sys
p = sys.argv[1]; b = open(p, "rb").read()
head, body = b[:1024], b[1024:]
size = 2 if int.from_bytes(b[0:4], "little") == 20240520 else 4  # uint16 or uint32 tokens
toks = [body[i:i + size] for i in range(0, len(body), size)]
open(p, "wb").write(head + b"".join(reversed(toks)))
PYEOF
}
swap_two_tokens() { # $1 a shard: two neighbouring, different tokens swapped, both before the second sampled one
  $PY - "$1" <<'PYEOF'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read())
size = 2 if int.from_bytes(b[0:4], "little") == 20240520 else 4
n = (len(b) - 1024) // size
tok = lambda i: b[1024 + i * size:1024 + (i + 1) * size]
i = next(i for i in range(1, (n - 1) // 63 - 1) if tok(i) != tok(i + 1))  # samples: k (n - 1) / 63
t1, t2 = 1024 + i * size, 1024 + (i + 1) * size
b[t1:t1 + size], b[t2:t2 + size] = b[t2:t2 + size], b[t1:t1 + size]
open(p, "wb").write(bytes(b))
PYEOF
}
mkdir -p "$WORK/extra" "$WORK/rewritten" "$WORK/valdiff" "$WORK/swapped"
cp "$WORK"/data/* "$WORK/extra/" && cp "$WORK/data/train_000000.bin" "$WORK/extra/train_000001.bin"
cp "$WORK"/data/* "$WORK/rewritten/" && reverse_tokens "$WORK/rewritten/train_000000.bin"
cp "$WORK"/data/* "$WORK/valdiff/" && reverse_tokens "$WORK/valdiff/val_000000.bin"
cp "$WORK"/data/* "$WORK/swapped/" && swap_two_tokens "$WORK/swapped/train_000000.bin"
cmp -s "$WORK/data/train_000000.bin" "$WORK/rewritten/train_000000.bin" && fail "the rewritten shard is unchanged"
cmp -s "$WORK/data/train_000000.bin" "$WORK/swapped/train_000000.bin" && fail "the swapped shard is unchanged"
R=(--config "$WORK/cfg.json" --seq 16 --threads 1 --batch 2 --steps 2 --out "$WORK/md")
for other in extra rewritten swapped; do
  expect_mpi_error "the ranks' --data differ: their training shards" \
    -np 1 "$LOOM" train --data "$WORK/data" "${R[@]}" --eval-every 0 : \
    -np 1 "$LOOM" train --data "$WORK/$other" "${R[@]}" --eval-every 0
done
expect_mpi_error "the ranks' --data differ: their validation shards" \
  -np 1 "$LOOM" train --data "$WORK/data" "${R[@]}" --eval-every 1 --eval-batches 1 : \
  -np 1 "$LOOM" train --data "$WORK/valdiff" "${R[@]}" --eval-every 1 --eval-batches 1

# SIGUSR1 to mpirun: forwarded to every rank at once (where SIGINT/SIGTERM
# get a SIGKILL a second later), which save a checkpoint and exit 138. Four
# times, the signal landing at different points of a step: delivered into a
# rank's overlapped all-reduce it used to corrupt that rank's heap about one
# time in ten (now every thread but one blocks the signals).
for try in 1 2 3 4; do
  rm -rf "$WORK/u"
  timeout 120 $MPI "$LOOM" train "${D[@]}" --batch 2 --grad-accum 100 --steps 1000 --out "$WORK/u" 2>"$WORK/u.log" &
  job=$!
  for i in $(seq 1 1000); do [ -s "$WORK/u/metrics.jsonl" ] && break; sleep 0.05; done
  sleep "0.$((try * 2))"
  pkill -USR1 -P $job -x mpirun
  rc=0
  wait $job || rc=$?
  [ $rc -eq 138 ] || { cat "$WORK/u.log"; fail "SIGUSR1 to mpirun (try $try): exit $rc, expected 138"; }
  grep -q "SIGUSR1 received" "$WORK/u.log" && ls -d "$WORK"/u/ckpt-* >/dev/null 2>&1 ||
    { cat "$WORK/u.log"; fail "SIGUSR1 to mpirun (try $try): no checkpoint"; }
done
echo "1 passed, 0 failed"
