#!/usr/bin/env bash
# --dump-grads files from --recompute none, selective and full (both modes)
# are byte-identical for the same seed and precision.
source "$(dirname "$0")/lib.sh"
make_data "$WORK/data"
small_config "$WORK/cfg.json" 512
for prec in fp32 bf16 fp16; do
  for mg in on off; do
    ref=""
    for rc in "none nonreentrant" "selective nonreentrant" "full nonreentrant" "full reentrant"; do
      set -- $rc
      f="$WORK/g-$prec-$mg-$1-$2.safetensors"
      "$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --out "$WORK/o" --batch 4 --seq 32 \
        --precision $prec --master-grad $mg --recompute $1 --recompute-mode $2 --dump-grads "$f" 2>/dev/null
      [ -s "$f" ] || fail "no gradient file for $prec $mg $1 $2"
      if [ -z "$ref" ]; then ref=$f; else cmp -s "$ref" "$f" || fail "$prec master-grad=$mg: $1/$2 differs from none"; fi
    done
  done
done
echo "1 passed, 0 failed"
