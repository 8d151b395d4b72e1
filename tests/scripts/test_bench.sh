#!/usr/bin/env bash
# test_bench.sh — `loom bench` end to end on small shapes: one configuration
# (text and JSON, every field present, no malloc and no new oneDNN primitive
# once two steps have warmed the caches), the interleaved comparison of recompute modes (with
# the time their replays took), the
# standard matrix (six lines, one process each), the GEMM floor (--gemms),
# bench_kernels, --lockstep, bad flags; and bench/compare_peer.sh, bench/lockstep_peer.py and
# bench/peer_gemms.py against the
# PyTorch peer when it and torch are present. No timing is asserted.
set -euo pipefail
src=${LOOM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
bin=${LOOM_BINARY_DIR:-$src/build}
loom=$bin/loom
fail() { echo "FAIL: $*" >&2; exit 1; }
small=(--preset tiny --batch 1 --seq 32 --steps 2 --warmup 2 --gemm-peak 100,100)

out=$("$loom" bench "${small[@]}" --precision bf16 --recompute none)
line=$(grep '^bench preset=' <<<"$out") || fail "no result line: $out"
for f in precision=bf16 master_grad=on recompute=none 'tok/s=' step_ms= gflops= mfu= peak_act_MiB= rss_MiB= \
         'buffer_allocs/step=0.0' 'gemm_primitives/step=0.0' 'replay_ms=0.00 '; do
  grep -q "$f" <<<"$line" || fail "missing $f in: $line"
done
grep -q '^bench flops: 6\*N\*tokens' <<<"$out" || fail "no FLOP formula in: $out"
# The kernels' level is part of the result; LOOM_SIMD caps it.
grep -qE "kernels=$("$loom" --version | sed -E 's/.*kernels: ([a-z0-9-]+).*/\1/') " <<<"$line" || fail "no kernels= in: $line"
grep -q 'recompute_blocks=0 ' <<<"$line " || fail "no recompute_blocks= in: $line"
some=$("$loom" bench "${small[@]}" --precision bf16 --recompute full --recompute-blocks 2 --no-header)
grep -q 'recompute=full .*recompute_blocks=2$' <<<"$some" || fail "--recompute-blocks 2 not in: $some"
if "$loom" bench "${small[@]}" --recompute full --recompute-blocks 7 >/dev/null 2>"$bin/rb.err"; then
  fail "--recompute-blocks 7 on tiny's 6 blocks accepted"
fi
grep -q "recompute-blocks expects 0 (every block) to 6" "$bin/rb.err" || fail "bad --recompute-blocks message: $(cat "$bin/rb.err")"
capped=$(LOOM_SIMD=portable "$loom" bench "${small[@]}" --precision bf16 --recompute none --no-header)
grep -q 'kernels=portable ' <<<"$capped" || fail "LOOM_SIMD=portable not in: $capped"

json=$("$loom" bench "${small[@]}" --precision fp32 --recompute full --recompute-mode reentrant --json --no-header)
python3 - "$json" <<'PY' || fail "bad JSON: $json"
import json, sys
r = json.loads(sys.argv[1])
for k in ("tok_s", "step_ms", "gflops", "mfu", "peak_act_MiB", "rss_MiB", "buffer_allocs_per_step",
          "gemm_primitives_per_step", "replay_ms", "warmup", "gemm_peak", "kernels", "recompute_blocks"):
    assert k in r, k
assert r["precision"] == "fp32" and r["recompute"] == "full" and r["recompute_mode"] == "reentrant"
assert r["tok_s"] > 0 and r["rss_MiB"] > 0 and r["buffer_allocs_per_step"] == 0 and r["gemm_peak"] == "given"
assert r["gemm_primitives_per_step"] == 0
assert 0 < r["replay_ms"] < r["step_ms"]  # full recompute replays every block inside the step
PY

inter=$("$loom" bench "${small[@]}" --precision bf16 --recompute none,selective,full --no-header)
[ "$(grep -c '^bench preset=' <<<"$inter")" -eq 3 ] || fail "interleaved: $inter"
grep -q 'recompute=selective.*rss_MiB=n/a' <<<"$inter" || fail "interleaved rss: $inter"
# Only the recomputing modes replay, and each replay is part of its step.
grep -q 'recompute=none .*replay_ms=0.00 ' <<<"$inter" || fail "replay without recompute: $inter"
for r in selective full; do
  grep -qE "recompute=$r .*replay_ms=[0-9]*\.?[0-9]*[1-9]" <<<"$inter" || fail "no replay time for $r: $inter"
done

matrix=$("$loom" bench --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 --gemm-peak 100,100)
# The matrix measures the peak once and hands it to its children: their lines
# say measured (given only when --gemm-peak came from the user).
mj=$("$loom" bench --json --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 --threads 1)
[ "$(grep -c '"gemm_peak":"measured"' <<<"$mj")" -eq 7 ] || fail "matrix peak provenance: $mj"
[ "$(grep -c '^bench preset=' <<<"$matrix")" -eq 6 ] || fail "matrix: $matrix"
for p in fp32 bf16; do for r in none selective full; do
  grep -q "precision=$p master_grad=on recompute=$r " <<<"$matrix" || fail "matrix lacks $p $r: $matrix"
done; done

# --gemms: every linear shape of the step (fwd, dX, dW), then their sum.
g=$("$loom" bench --gemms --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 --precision bf16)
for l in q k v o gate up down lm_head; do
  grep -qE "^bench gemm $l +rows=16 .* fwd_ms=[0-9.]+ dx_ms=[0-9.]+ dw_ms=[0-9.]+ gflops=" <<<"$g" ||
    fail "--gemms lacks $l: $g"
done
grep -qE '^bench gemm lm_head +rows=16 out=4096 in=288 count=1 ' <<<"$g" || fail "--gemms lm_head shape: $g"
grep -qE '^bench gemm down +rows=16 out=288 in=768 count=6 ' <<<"$g" || fail "--gemms down shape: $g"
grep -qE '^bench gemms preset=tiny precision=bf16 master_grad=on step_gemm_ms=[0-9.]*[1-9]' <<<"$g" ||
  fail "--gemms sum: $g"
gj=$("$loom" bench --gemms --json --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 --precision fp32)
[ "$(grep -c '"gemm":' <<<"$gj")" = 8 ] || fail "--gemms --json: $gj"
grep -q '"step_gemm_ms":' <<<"$gj" || fail "--gemms --json sum: $gj"
if "$loom" bench --gemms --recompute full >/dev/null 2>&1; then fail "--gemms with --recompute accepted"; fi

# bench_kernels: each kernel's line with best and mean, for both dtypes; bad flags refused.
for dt in f32 bf16; do
  k=$("$bin/bench_kernels" --batch 1 --reps 1 --threads 1 --dtype "$dt")
  grep -q "^bench_kernels preset=tiny batch=1 dtype=$dt threads=1 reps=1 " <<<"$k" || fail "bench_kernels header: $k"
  for n in attention rmsnorm rope swiglu; do
    grep -qE "^$n +fwd=[0-9.]+ bwd=[0-9.]+  mean fwd=[0-9.]+ bwd=[0-9.]+  \(" <<<"$k" || fail "bench_kernels lacks $n: $k"
  done
done
# a sliding window and a sequence length of the caller's
k=$("$bin/bench_kernels" --batch 1 --reps 1 --threads 1 --seq 96 --window 16)
grep -qE "^attention +fwd=[0-9.]+ .*T=96 .*window=16\)" <<<"$k" || fail "bench_kernels --seq --window: $k"
for bad in "--preset huge" "--dtype f64" "--reps 0" "--batch" "--frobnicate 1" "--window -1" "--seq -2"; do
  if "$bin/bench_kernels" $bad >/dev/null 2>&1; then fail "bench_kernels accepted $bad"; fi
done

# bench/ab_attention.sh: this tree's attention against a revision's, in one
# process; against HEAD in a clean checkout the results are the same bits.
if git -C "$src" rev-parse HEAD >/dev/null 2>&1; then
  for preset in tiny small; do
    ab=$(LOOM_BINARY_DIR=$bin bash "$src/bench/ab_attention.sh" HEAD 2 1 $preset)
    grep -qE "this tree / the other = [0-9.]+ \(summed time\); max difference: output [0-9.e+-]+, gradients" <<<"$ab" ||
      fail "ab_attention $preset: $ab"
    if git -C "$src" diff --quiet HEAD -- src/kernels; then
      grep -q "output 0, gradients 0" <<<"$ab" || fail "ab_attention $preset against HEAD differs: $ab"
    fi
  done
  grep -q "head_size=64" <<<"$ab" || fail "ab_attention small ran another shape: $ab" # the loop's last
  if LOOM_BINARY_DIR=$bin bash "$src/bench/ab_attention.sh" HEAD 2 1 huge >/dev/null 2>&1; then
    fail "ab_attention accepted an unknown preset"
  fi
fi

# build/step_mallocs (not in sanitizer builds): every allocator call of a
# step, per recompute mode; AdamW's step makes none.
if [ -x "$bin/step_mallocs" ]; then
  sm=$("$bin/step_mallocs" --preset tiny --steps 2)
  [ "$(grep -cE '^step_mallocs preset=tiny recompute=.* forward=[1-9][0-9]* backward=[1-9][0-9]* optimizer=0 total=[0-9]+ calloc_free_ms=[0-9.]+' <<<"$sm")" -eq 4 ] ||
    fail "step_mallocs: $sm"
  if "$bin/step_mallocs" --steps 1 >/dev/null 2>&1; then fail "step_mallocs accepted --steps 1"; fi
fi

# --lockstep: one step per line on stdin, each reported; input that ends early
# is an error, and so is a configuration that would run the GEMM peak or
# several modes between the driver's turns.
ls_flags=(--preset tiny --batch 1 --seq 16 --steps 2 --warmup 1 --precision fp32 --recompute none --gemm-peak 1,1)
lk=$(printf '\n\n\n' | "$loom" bench "${ls_flags[@]}" --lockstep --no-header)
[ "$(grep -cE '^lockstep step=[1-3] warmup=[01] ms=[0-9.]+$' <<<"$lk")" -eq 3 ] || fail "lockstep steps: $lk"
grep -q '^lockstep step=1 warmup=1 ' <<<"$lk" && grep -q '^lockstep step=3 warmup=0 ' <<<"$lk" || fail "lockstep order: $lk"
grep -q '^bench preset=tiny ' <<<"$lk" || fail "lockstep result line: $lk"
if err=$(printf '\n' | "$loom" bench "${ls_flags[@]}" --lockstep 2>&1); then fail "lockstep ran past its input: $err"; fi
grep -q 'standard input ended before step 2 of 3' <<<"$err" || fail "lockstep early end: $err"
# Refused before any step (exit 2, usage), with endless input on stdin that
# a build without the checks would run on.
refused() { # MESSAGE ARGS...: loom bench ARGS must exit 2 naming MESSAGE
  local msg=$1 rc=0 err
  shift
  err=$(yes '' | "$loom" bench --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 "$@" 2>&1 >/dev/null) || rc=$?
  [ "$rc" -eq 2 ] && grep -q -- "$msg" <<<"$err" || fail "bench $* gave exit $rc: $err"
}
refused '--lockstep takes a single recompute mode' --precision fp32 --recompute none,full --gemm-peak 1,1 --lockstep
refused '--lockstep takes a single recompute mode and --gemm-peak' --precision fp32 --recompute none --lockstep
refused '--lockstep times one configuration' --gemm-peak 1,1 --lockstep

if "$loom" bench --preset huge >/dev/null 2>&1; then fail "unknown preset accepted"; fi
if "$loom" bench --recompute sometimes >/dev/null 2>&1; then fail "unknown recompute mode accepted"; fi
if "$loom" bench --precision bf16 --recompute none,full --profile >/dev/null 2>&1; then
  fail "--profile with several modes accepted"
fi

peer=$src/../shared/peers/torch_llama.py
if [ -f "$peer" ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  cmp=$(LOOM=$loom "$src/bench/compare_peer.sh" --preset tiny --batch 1 --seq 16 --steps 1 --peer-steps 1 --repeat 2 \
        bf16:none:none)
  [ "$(grep -cE '^bf16 loom:none peer:none +[0-9]+ +[0-9]+ +[0-9.]+x ' <<<"$cmp")" = 2 ] || fail "compare_peer: not two pairs: $cmp"
  # The peer gets OpenBLAS's and torch's AVX-512 kernels exactly where the CPU has
  # AVX-512 F, BW, DQ and VL, whatever the environment says, unless PEER_ENV=keep.
  if grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -cxE 'avx512(f|bw|dq|vl)' | grep -qx 4; then
    want='OPENBLAS_CORETYPE=SkylakeX ATEN_CPU_CAPABILITY=avx512'
    [ "$(python3 "$src/bench/peer_env.py" | tr '\n' ' ')" = "export OPENBLAS_CORETYPE=SkylakeX export ATEN_CPU_CAPABILITY=avx512 " ] ||
      fail "peer_env: $(python3 "$src/bench/peer_env.py")"
  else
    want='OPENBLAS_CORETYPE=[^ ]* ATEN_CPU_CAPABILITY=[^ ]*'
    [ -z "$(python3 "$src/bench/peer_env.py")" ] || fail "peer_env without AVX-512: $(python3 "$src/bench/peer_env.py")"
  fi
  grep -q "; peer: $want\$" <<<"$cmp" || fail "compare_peer: the peer's kernels: $cmp"
  [ -z "$(PEER_ENV=keep python3 "$src/bench/peer_env.py")" ] || fail "peer_env with PEER_ENV=keep"
  grep -q '^bf16 loom:none peer:none .*median speedup [0-9.]*x over 2 pairs (range ' <<<"$cmp" ||
    fail "compare_peer: no median line: $cmp"
  pg=$(/usr/bin/python3 "$src/bench/peer_gemms.py" --batch 1 --seq 16 --steps 1 --warmup 0)
  [ "$(grep -c '^peer gemm ' <<<"$pg")" = 8 ] || fail "peer_gemms: $pg"
  grep -qE '^peer gemms .*step_gemm_ms=[0-9.]*[1-9]' <<<"$pg" || fail "peer_gemms sum: $pg"
  # lockstep_peer.py: loom and the peer alternate single steps; a line per pair and the median.
  lp=$(/usr/bin/python3 "$src/bench/lockstep_peer.py" --loom "$loom" --batch 1 --seq 16 --steps 3 --warmup 1 \
       --floor 2)
  [ "$(grep -cE '^pair [1-3] first=(loom|peer) loom_ms=[0-9.]+ peer_ms=[0-9.]+ speedup=[0-9.]+$' <<<"$lp")" = 3 ] ||
    fail "lockstep_peer pairs: $lp"
  grep -q "^# .* lockstep .* torch=[^ ]* $want\$" <<<"$lp" || fail "lockstep_peer: the peer's kernels: $lp"
  grep -qE '^lockstep preset=tiny precision=fp32 loom_step_ms=[0-9.]+ peer_step_ms=[0-9.]+ .*speedup_median=[0-9.]+ range=[0-9.]+-[0-9.]+ pairs=3$' <<<"$lp" ||
    fail "lockstep_peer summary: $lp"
  # --floor: two rounds of both sides' GEMMs alone, the lower of each kept, and what is left of each step.
  /usr/bin/python3 - "$lp" <<'PY' || fail "lockstep_peer --floor: $lp"
import re, sys
out = sys.argv[1]
rounds = re.findall(r"^floor round [12] loom_gemm_ms=([0-9.]+) peer_gemm_ms=([0-9.]+)$", out, re.M)
assert len(rounds) == 2, rounds
step = dict(re.findall(r"(loom_step_ms|peer_step_ms)=([0-9.]+)", out))
f = re.search(r"^floor preset=tiny precision=fp32 loom_gemm_ms=([0-9.]+) peer_gemm_ms=([0-9.]+) "
              r"loom_rest_ms=(-?[0-9.]+) peer_rest_ms=(-?[0-9.]+) speedup_if_loom_were_gemms_alone=([0-9.]+)$",
              out, re.M)
lg, pg, lr, pr, bound = map(float, f.groups())
assert lg == min(float(l) for l, _ in rounds) and pg == min(float(p) for _, p in rounds), (lg, pg, rounds)
ls, ps = float(step["loom_step_ms"]), float(step["peer_step_ms"])
assert abs(lr - (ls - lg)) < 0.15 and abs(pr - (ps - pg)) < 0.15, (lr, pr)
assert abs(bound - ps / lg) < 0.002 * bound + 0.001, bound
PY
  if /usr/bin/python3 "$src/bench/lockstep_peer.py" --loom "$loom" --steps 0 >/dev/null 2>&1; then
    fail "lockstep_peer accepted --steps 0"
  fi
  if /usr/bin/python3 "$src/bench/lockstep_peer.py" --loom "$loom" --floor -1 >/dev/null 2>&1; then
    fail "lockstep_peer accepted --floor -1"
  fi
  if LOOM=$loom "$src/bench/compare_peer.sh" --repeat 0 bf16:none:none >/dev/null 2>&1; then
    fail "compare_peer accepted --repeat 0"
  fi
else
  echo "skip compare_peer: no peer or torch"
fi
echo "test_bench: ok"
