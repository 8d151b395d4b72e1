#!/usr/bin/env bash
# compare_peer.sh — loom bench and the PyTorch peer (../shared/peers/torch_llama.py)
# side by side: the same model shape, batch, sequence, threads and precision,
# one configuration at a time, back to back; prints both and the ratios.
#
# Usage: bench/compare_peer.sh [--preset tiny|small] [--threads N] [--batch B]
#                              [--seq T] [--steps N] [--peer-steps N] [--repeat R]
#                              [CONFIG ...]
# CONFIG is PRECISION:LOOM_RECOMPUTE:PEER_RECOMPUTE, e.g. bf16:none:none,
# fp32:none:none, bf16:full:reentrant (the default list is those three).
# loom runs `--master-grad on`; the peer's bf16 is torch.autocast(bfloat16).
# Each side runs in its own process, so peak RSS (getrusage maxrss) is per
# configuration. --repeat R runs each configuration R times (loom, peer,
# loom, peer, ...) and ends with the median of the R speedups and their range:
# on a shared machine one pair can be off by 20%. The peer takes 9 fp32 steps
# by default (--peer-steps sets it for every configuration): it drops only
# its first, and on small its steps 1 and 2 are still 20-35% slower than its
# steady state, so with 3 steps its median was a warm-up step. On a CPU
# without bf16 hardware its bf16 steps take minutes each, so bf16
# configurations default to 3 peer steps; where the CPU has AVX-512 BF16 its
# bf16 is fast, and --peer-steps 9 gives it the fp32 count. The steadier
# comparison of speed is bench/lockstep_peer.py, which alternates single
# steps of both. Both run with OMP_WAIT_POLICY=passive (loom's own default;
# spinning OpenMP threads collapse on a machine shared with other work)
# unless the environment sets it, and the peer with its AVX-512 kernels
# where the CPU has them (bench/peer_env.py: OpenBLAS's SkylakeX, torch's
# avx512; PEER_ENV=keep leaves the environment as it is). Environment: LOOM (default build/loom),
# PEER (default ../shared/peers/torch_llama.py), PYTHON (default
# /usr/bin/python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
loom=${LOOM:-$root/build/loom}
peer=${PEER:-$root/../shared/peers/torch_llama.py}
python=${PYTHON:-/usr/bin/python3}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
eval "$("$python" "$root/bench/peer_env.py")"  # the peer's AVX-512 kernels where the CPU has them
preset=tiny threads=2 batch=8 steps=5 peer_steps='' seq='' repeat=1
configs=()
while [ $# -gt 0 ]; do
  case $1 in
    --preset) preset=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --peer-steps) peer_steps=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    -*) echo "compare_peer: unknown flag $1" >&2; exit 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(bf16:none:none fp32:none:none bf16:full:reentrant)
[[ $repeat =~ ^[1-9][0-9]*$ ]] || { echo "compare_peer: --repeat takes a positive count, not '$repeat'" >&2; exit 2; }
for v in "$steps" ${peer_steps:+"$peer_steps"}; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "compare_peer: --steps and --peer-steps take a positive count, not '$v'" >&2; exit 2; }
done
# The peer reports times[len // 2] of its steps: with an even count, the slower middle one.
[ -z "$peer_steps" ] || [ $((peer_steps % 2)) -eq 1 ] || echo "compare_peer: note: --peer-steps $peer_steps is even; the peer's step time is then the slower of its two middle steps (use an odd count)" >&2
[ -x "$loom" ] || { echo "compare_peer: $loom not built (scripts/build.sh)" >&2; exit 1; }
[ -f "$peer" ] || { echo "compare_peer: peer script $peer not found (set PEER)" >&2; exit 1; }

case $preset in  # the shapes of loom's presets (src/nn/llama.c)
  tiny) shape="--dim 288 --layers 6 --heads 6 --kv-heads 6 --ffn 768 --vocab 4096"; seq=${seq:-256} ;;
  small) shape="--dim 512 --layers 8 --heads 8 --kv-heads 8 --ffn 1376 --vocab 8192"; seq=${seq:-512} ;;
  *) echo "compare_peer: --preset tiny or small" >&2; exit 2 ;;
esac

field() { sed -n "s/.*[ ]$1=\([0-9.]*\).*/\1/p" | head -n 1; }

echo "# $(date -u +%Y-%m-%dT%H:%MZ)  preset=$preset batch=$batch seq=$seq threads=$threads loom_steps=$steps peer_steps=${peer_steps:-9 (fp32), 3 (bf16)}"
echo "# $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; peer: OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-} ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-}"
printf '%-22s %10s %10s %7s %11s %11s %9s %9s %9s\n' config loom_tok/s peer_tok/s speedup loom_ms peer_ms loom_rss peer_rss rss_ratio
summary=()
for c in "${configs[@]}"; do
  IFS=: read -r prec lrec prec_peer <<<"$c"
  psteps=${peer_steps:-$([ "$prec" = bf16 ] && echo 3 || echo 9)}
  ratios=()
  for ((r = 0; r < repeat; r++)); do
    out=$("$loom" bench --preset "$preset" --precision "$prec" --master-grad on --recompute "$lrec" \
          --threads "$threads" --batch "$batch" --seq "$seq" --steps "$steps" --warmup 1 --no-header --gemm-peak 1,1)
    ltok=$(field 'tok\/s' <<<"$out"); lms=$(field step_ms <<<"$out"); lrss=$(field rss_MiB <<<"$out")
    pout=$(OMP_NUM_THREADS=$threads "$python" "$peer" $shape --seq "$seq" --batch "$batch" --steps "$psteps" \
           --threads "$threads" --precision "$prec" --recompute "$prec_peer")
    ptok=$(sed -n 's/.*tok\/s=\([0-9.]*\).*/\1/p' <<<"$pout")
    pms=$(sed -n 's/.*step_median=\([0-9.]*\)ms.*/\1/p' <<<"$pout")
    prss=$(sed -n 's/.*maxrss=\([0-9.]*\)MiB.*/\1/p' <<<"$pout")
    awk -v c="$prec loom:$lrec peer:$prec_peer" -v lt="$ltok" -v pt="$ptok" -v lm="$lms" -v pm="$pms" \
        -v lr="$lrss" -v pr="$prss" 'BEGIN {
      printf "%-22s %10.0f %10.0f %6.1fx %11.1f %11.1f %9.0f %9.0f %8.0f%%\n", c, lt, pt, lt / pt, lm, pm, lr, pr, 100 * lr / pr }'
    ratios+=("$(awk -v a="$ltok" -v b="$ptok" 'BEGIN { printf "%.3f", a / b }')")
  done
  if [ "$repeat" -gt 1 ]; then
    summary+=("$(printf '%s\n' "${ratios[@]}" | sort -n | awk -v c="$prec loom:$lrec peer:$prec_peer" '
      { v[NR] = $1 } END { m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        printf "%-30s median speedup %.2fx over %d pairs (range %.2f-%.2fx)", c, m, NR, v[1], v[NR] }')")
  fi
done
for line in "${summary[@]}"; do echo "$line"; done
