#!/usr/bin/env bash
# Runs examples/lora_finetune: LoRA through the library (the model's own
# weights created frozen, adapters trained under full recompute, saved merged
# and as a PEFT adapter, the adapter applied to the base again); it exits
# non-zero when the loss did not fall, a frozen weight moved, or the
# reloaded adapter computes another loss.
source "$(dirname "$0")/lib.sh"
exe="$LOOM_BINARY_DIR/lora_finetune"
[ -x "$exe" ] || fail "$exe not found (build the examples)"
"$exe" "$WORK" >"$WORK/out.txt" 2>&1 || { cat "$WORK/out.txt"; fail "lora_finetune failed"; }
grep -q "optimizer 0.0[0-9]* MiB (the adapters' only)" "$WORK/out.txt" || { cat "$WORK/out.txt"; fail "no memory line"; }
[ -s "$WORK/merged/model.safetensors" ] && [ -s "$WORK/adapter/adapter_model.safetensors" ] ||
  fail "lora_finetune wrote no merged model or adapter"
