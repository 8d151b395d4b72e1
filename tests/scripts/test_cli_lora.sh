#!/usr/bin/env bash
# loom train --lora end to end: fine-tuning a trained model's adapters only
# (the weights not adapted stay the same bytes), the memory it saves, every
# recompute mode giving the same final model, stop-and-resume equal to the
# uninterrupted run, generation from the merged model, and the refusals.
# (The math against PyTorch is in crosscheck.py, the unit tests in
# tests/nn/test_lora.c.)
source "$(dirname "$0")/lib.sh"
make_data "$WORK/data"
small_config "$WORK/cfg.json" 512
PY=/usr/bin/python3
common=(--data "$WORK/data" --batch 4 --seq 32 --eval-every 0)
"$LOOM" train "${common[@]}" --config "$WORK/cfg.json" --steps 15 --lr 3e-3 --out "$WORK/base" 2>/dev/null
L=(--init "$WORK/base/model" --lora 4 --lora-alpha 8 --lora-targets q,v,down --lr 1e-2)

# Fine-tune: only q, v and down move; norms, embeddings and the other
# linears are the base model's bytes.
"$LOOM" train "${common[@]}" "${L[@]}" --precision fp32 --steps 12 --out "$WORK/a" 2>"$WORK/a.log"
grep -q "LoRA rank 4, alpha 8 on q,v,down, dropout 0: 3328 trainable parameters" "$WORK/a.log" ||
  { cat "$WORK/a.log"; fail "no LoRA summary line (or the wrong count: 2 layers x (4x64+64x4 q, 4x64+32x4 v, 4x128+64x4 down))"; }
# The adapters alone, in PEFT's layout: the base plus alpha/r B A of them is
# the merged model.
$PY - "$WORK/base/model" "$WORK/a" "$SRC" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[3] + "/tests/python")
import llama_ref as ref
base, tuned, lora, cfg = ref.read_lora_run(sys.argv[1], sys.argv[2])
assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["lora_dropout"] == 0, cfg
assert cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"], cfg["target_modules"]
import os
assert cfg["base_model_name_or_path"] == os.path.realpath(sys.argv[1]), cfg["base_model_name_or_path"]
assert set(base) == set(tuned), "the saved model's tensors are not the base model's (adapters saved in it?)"
adapted = ("q_proj", "v_proj", "down_proj")
n_adapted = 0
for name, w in base.items():
    same = bool((tuned[name] == w).all())
    if not any(a in name for a in adapted):
        assert same, f"{name} is frozen but changed"
        continue
    assert not same, f"{name} is adapted but did not change"
    stem = "base_model.model." + name[:-len(".weight")]
    a, b = lora[stem + ".lora_A.weight"], lora[stem + ".lora_B.weight"]
    assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4), (stem, a.shape, b.shape)
    merged = w.double() + 2.0 * (b.double() @ a.double())
    err = (tuned[name].double() - merged).abs().max().item() / merged.abs().max().item()
    assert err < 1e-6, f"{name}: the saved model is not base + alpha/r B A of the adapter files ({err:.3g})"
    n_adapted += 1
assert n_adapted == 6 and len(lora) == 12, (n_adapted, len(lora))
PYEOF
[ $? -eq 0 ] || fail "the LoRA run's saved model is not the base with q, v and down merged"

# The adapter applied to the base by export, eval and generate: export's
# merge is the run's saved model, tensor for tensor; eval's loss with the
# adapter unmerged is the merged model's.
"$LOOM" export --model "$WORK/base/model" --adapter "$WORK/a/adapter" --out "$WORK/merged" 2>/dev/null ||
  fail "export --adapter failed"
$PY - "$WORK/merged/model.safetensors" "$WORK/a/model/model.safetensors" "$SRC" <<'PYEOF' ||
import sys, torch
sys.path.insert(0, sys.argv[3] + "/tests/python")
import llama_ref as ref
a, _ = ref.read_safetensors(sys.argv[1])
b, _ = ref.read_safetensors(sys.argv[2])
assert set(a) == set(b), sorted(set(a) ^ set(b))
for k in a:
    assert torch.equal(a[k], b[k]), k
PYEOF
  fail "export --adapter differs from the LoRA run's merged model"
ev1() { "$LOOM" eval "$@" --data "$WORK/data" --batches 4 2>&1 | sed -n 's/.* loss=\([0-9.]*\) .*/\1/p'; }
# $1 a run's directory, $2 what it trained: eval of the base with the run's
# adapter applied is eval of its merged model
evals_as_merged() {
  local l1 l2
  l1=$(ev1 --model "$WORK/base/model" --adapter "$1/adapter"); l2=$(ev1 --model "$1/model")
  awk -v a="$l1" -v b="$l2" 'BEGIN { d = a - b; exit !(a != "" && b != "" && d < 1e-5 && d > -1e-5) }' ||
    fail "eval with the $2 ($l1) is not the merged model's ($l2)"
}
evals_as_merged "$WORK/a" adapter
"$LOOM" generate --model "$WORK/base/model" --adapter "$WORK/a/adapter" --prompt "loom" --tokens 4 \
  --temperature 0 >/dev/null 2>&1 || fail "generate --adapter failed"
# rsLoRA (--lora-rslora, PEFT's use_rslora): alpha / sqrt(r), here 8 / 2. The
# merged model is the base plus 4 B A of the adapter files, which say
# use_rslora; eval applies the adapter as the merge does; --lora-init takes
# the setting with the adapter, and a plain adapter refuses the flag.
"$LOOM" train "${common[@]}" "${L[@]}" --lora-rslora --precision fp32 --steps 4 --out "$WORK/rs" 2>"$WORK/rs.log" ||
  { cat "$WORK/rs.log"; fail "--lora-rslora failed"; }
grep -q "LoRA rank 4, alpha 8 (rsLoRA) on q,v,down" "$WORK/rs.log" || fail "no rsLoRA in the LoRA summary line"
$PY - "$WORK/base/model" "$WORK/rs" "$SRC" <<'PYEOF' || fail "the rsLoRA run's model is not the base plus alpha/sqrt(r) B A"
import sys
sys.path.insert(0, sys.argv[3] + "/tests/python")
import llama_ref as ref
base, tuned, lora, cfg = ref.read_lora_run(sys.argv[1], sys.argv[2])
assert cfg["use_rslora"] is True and cfg["r"] == 4 and cfg["lora_alpha"] == 8, cfg
name = "model.layers.1.mlp.down_proj.weight"
stem = "base_model.model." + name[:-len(".weight")]
delta = lora[stem + ".lora_B.weight"].double() @ lora[stem + ".lora_A.weight"].double()
got = tuned[name].double() - base[name].double()
err = (got - 4.0 * delta).abs().max().item() / (4.0 * delta).abs().max().item()
assert err < 1e-5, f"merged - base is not 4 B A ({err:.3g}; 2 B A would be plain LoRA's)"
PYEOF
evals_as_merged "$WORK/rs" "rsLoRA adapter"
"$LOOM" train "${common[@]}" --init "$WORK/base/model" --lora-init "$WORK/rs/adapter" --steps 1 \
  --out "$WORK/rsi" 2>"$WORK/rsi.log" || { cat "$WORK/rsi.log"; fail "--lora-init of an rsLoRA adapter failed"; }
grep -q "alpha 8 (rsLoRA)" "$WORK/rsi.log" || fail "--lora-init did not take the adapter's use_rslora"
expect_usage "lora flags differ from the adapter" "$LOOM" train "${common[@]}" --init "$WORK/base/model" \
  --lora-init "$WORK/a/adapter" --lora-rslora --out "$WORK/x"
expect_usage "lora-rslora applies to LoRA" "$LOOM" train "${common[@]}" --lora-rslora --out "$WORK/x"
# DoRA (--lora-dora, PEFT's use_dora): the adapter files hold each linear's
# magnitudes m beside A and B, and the merged model is the base's rows plus
# 2 B A, each row scaled to m; eval applies the adapter as the merge does,
# --lora-init takes the setting, a checkpoint resumes with the flag.
"$LOOM" train "${common[@]}" "${L[@]}" --lora-dora --precision fp32 --steps 4 --ckpt-every 2 --out "$WORK/do" \
  2>"$WORK/do.log" || { cat "$WORK/do.log"; fail "--lora-dora failed"; }
grep -q "DoRA rank 4, alpha 8 on q,v,down, dropout 0: 3648 trainable parameters" "$WORK/do.log" ||
  { cat "$WORK/do.log"; fail "no DoRA summary line (or the wrong count: LoRA's 3328 and 2 x (64 + 32 + 64) magnitudes)"; }
$PY - "$WORK/base/model" "$WORK/do" "$SRC" <<'PYEOF' || fail "the DoRA run's model is not the base with DoRA merged"
import sys
sys.path.insert(0, sys.argv[3] + "/tests/python")
import llama_ref as ref
base, tuned, lora, cfg = ref.read_lora_run(sys.argv[1], sys.argv[2])
assert cfg["use_dora"] is True and cfg["use_rslora"] is False, cfg
assert len(lora) == 18, sorted(lora)
for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
    stem = "base_model.model." + name[:-len(".weight")]
    m = lora[stem + ".lora_magnitude_vector"].double()
    v = base[name].double() + 2.0 * (lora[stem + ".lora_B.weight"].double() @ lora[stem + ".lora_A.weight"].double())
    want = v * (m / v.norm(dim=1)).unsqueeze(1)
    err = (tuned[name].double() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-5, f"{name}: {err:.3g}"
    assert (m - base[name].double().norm(dim=1)).abs().max() > 1e-4, "the magnitudes did not train"
PYEOF
evals_as_merged "$WORK/do" "DoRA adapter"
"$LOOM" train "${common[@]}" --init "$WORK/base/model" --lora-init "$WORK/do/adapter" --steps 1 \
  --out "$WORK/doi" 2>"$WORK/doi.log" || { cat "$WORK/doi.log"; fail "--lora-init of a DoRA adapter failed"; }
grep -q "DoRA rank 4" "$WORK/doi.log" || fail "--lora-init did not take the adapter's use_dora"
"$LOOM" train "${common[@]}" "${L[@]}" --lora-dora --precision fp32 --steps 4 --resume "$WORK/do/ckpt-00000002" \
  --out "$WORK/dor" 2>/dev/null || fail "a DoRA checkpoint does not resume"
cmp -s "$WORK/do/adapter/adapter_model.safetensors" "$WORK/dor/adapter/adapter_model.safetensors" ||
  fail "a resumed DoRA run differs from the uninterrupted one"
expect_error "the checkpoint trained LoRA adapters \(.*--lora-dora\)" "$LOOM" train "${common[@]}" "${L[@]}" \
  --precision fp32 --steps 4 --resume "$WORK/do/ckpt-00000002" --out "$WORK/x"
expect_usage "lora-dora applies to LoRA" "$LOOM" train "${common[@]}" --lora-dora --out "$WORK/x"

# its checkpoint resumes with the flag, and names it to a run without
expect_error "the checkpoint trained LoRA adapters \(.*--lora-rslora\)" "$LOOM" train "${common[@]}" "${L[@]}" \
  --precision fp32 --steps 5 --resume "$WORK/rs/ckpt-00000004" --out "$WORK/rsr"
"$LOOM" train "${common[@]}" "${L[@]}" --lora-rslora --precision fp32 --steps 5 --resume "$WORK/rs/ckpt-00000004" \
  --out "$WORK/rsr" 2>/dev/null || fail "an rsLoRA checkpoint does not resume with --lora-rslora"

# --lora-init: training starts from the adapter. Its first step's loss is
# the loss of the base with that adapter on the same batch (eval reads the
# first batch as training does), and the setting is the adapter's.
"$LOOM" train "${common[@]}" --init "$WORK/base/model" --lora-init "$WORK/a/adapter" --precision fp32 --steps 2 \
  --out "$WORK/li" 2>"$WORK/li.log" || { cat "$WORK/li.log"; fail "--lora-init failed"; }
grep -q "LoRA rank 4, alpha 8 on q,v,down" "$WORK/li.log" || fail "--lora-init did not take the adapter's setting"
first=$(grep -o '"step":1,"loss":[0-9.]*' "$WORK/li/metrics.jsonl" | cut -d: -f3)
want=$("$LOOM" eval --model "$WORK/base/model" --adapter "$WORK/a/adapter" --data "$WORK/data" --split train \
  --batch 4 --seq 32 --batches 1 2>&1 | sed -n 's/.* loss=\([0-9.]*\) .*/\1/p')
awk -v a="$first" -v b="$want" 'BEGIN { d = a - b; exit !(a != "" && b != "" && d < 1e-5 && d > -1e-5) }' ||
  fail "--lora-init: the first step's loss ($first) is not the adapted base's ($want)"
expect_usage "lora flags differ from the adapter" "$LOOM" train "${common[@]}" --init "$WORK/base/model" \
  --lora-init "$WORK/a/adapter" --lora 8 --out "$WORK/x"
expect_usage "give the base model the adapter was trained on, --init DIR" "$LOOM" train "${common[@]}" \
  --config "$WORK/cfg.json" --lora-init "$WORK/a/adapter" --out "$WORK/x"
# the dropout is a training setting: --lora-dropout changes the adapter's
"$LOOM" train "${common[@]}" --init "$WORK/base/model" --lora-init "$WORK/a/adapter" --lora-dropout 0.1 \
  --steps 1 --out "$WORK/ld" 2>"$WORK/ld.log" || { cat "$WORK/ld.log"; fail "--lora-init with --lora-dropout failed"; }
grep -q "LoRA rank 4, alpha 8 on q,v,down, dropout 0.1:" "$WORK/ld.log" || fail "--lora-dropout did not apply"

# Memory: gradients and optimizer state for the adapters only.
mem() { sed -n 's/.*gradients \([0-9.]*\) MiB, optimizer \([0-9.]*\) MiB.*/\1 \2/p' "$1"; }
"$LOOM" train "${common[@]}" --init "$WORK/base/model" --precision fp32 --steps 1 --out "$WORK/full" 2>"$WORK/full.log"
read -r fg fo <<<"$(mem "$WORK/full.log")"
read -r lg lo <<<"$(mem "$WORK/a.log")"
awk -v fg="$fg" -v fo="$fo" -v lg="$lg" -v lo="$lo" 'BEGIN { exit !(lg * 10 < fg && lo * 10 < fo) }' ||
  fail "LoRA keeps gradients $lg MiB and optimizer $lo MiB, full fine-tuning $fg and $fo: not a tenth"

# Every recompute mode, also of the first block only, bf16 with fp32
# main_grad, the default alpha (the rank: a scale of 1) on every linear,
# the gradient audit on: the same final model.
R=(--init "$WORK/base/model" --lora 4 --lr 1e-2 --precision bf16 --steps 4 --check-grads)
for rc in "full reentrant 0" "full nonreentrant 0" "selective nonreentrant 0" "full nonreentrant 1" \
          "none nonreentrant 0"; do
  set -- $rc
  "$LOOM" train "${common[@]}" "${R[@]}" --recompute $1 --recompute-mode $2 --recompute-blocks $3 \
    --out "$WORK/r-$1-$2-$3" 2>"$WORK/r.log" || { cat "$WORK/r.log"; fail "LoRA with recompute $rc failed"; }
  cmp -s "$WORK/r-full-reentrant-0/model/model.safetensors" "$WORK/r-$1-$2-$3/model/model.safetensors" ||
    fail "LoRA with recompute $rc: the final model differs from full reentrant's"
done
grep -q "LoRA rank 4, alpha 4 on q,k,v,o,gate,up,down" "$WORK/r.log" || fail "the default alpha is not the rank"
# fp16 (loss scaling; the frozen weights keep their fp32 masters) trains too.
"$LOOM" train "${common[@]}" "${L[@]}" --precision fp16 --steps 4 --out "$WORK/h" 2>/dev/null ||
  fail "LoRA in fp16 failed"
[ -s "$WORK/h/adapter/adapter_model.safetensors" ] || fail "LoRA in fp16: no adapter written"

# bf16: the model's own weights are held as bf16, and saved as such (the
# unadapted ones as BF16 tensors, the bf16 roundings of the base's).
$PY - "$WORK/base/model/model.safetensors" "$WORK/r-none-nonreentrant-0/model/model.safetensors" "$SRC" <<'PYEOF' ||
import sys, torch
sys.path.insert(0, sys.argv[3] + "/tests/python")
import llama_ref as ref
base, _ = ref.read_safetensors(sys.argv[1])
tuned, _ = ref.read_safetensors(sys.argv[2])
for name, w in base.items():
    if "proj" in name:
        assert tuned[name].dtype == torch.float32, f"{name}: the merged weight is not fp32"
    else:
        assert tuned[name].dtype == torch.bfloat16, f"{name}: {tuned[name].dtype}, not bf16"
        assert torch.equal(tuned[name], w.to(torch.bfloat16)), f"{name}: not the base's bf16 rounding"
PYEOF
  fail "the bf16 LoRA run's saved model does not hold the base's bf16 weights"

# Stop at step 8 and resume: the same losses and final bytes as the run without a stop.
losses() { grep -o '"step":[0-9]*,"loss":[0-9.e+-]*' "$1/metrics.jsonl"; }
"$LOOM" train "${common[@]}" "${L[@]}" --precision fp32 --steps 12 --ckpt-every 4 --keep 5 --out "$WORK/b" 2>/dev/null
"$LOOM" train "${common[@]}" "${L[@]}" --precision fp32 --steps 12 --resume "$WORK/b/ckpt-00000008" \
  --out "$WORK/c" 2>/dev/null
diff <(losses "$WORK/a" | tail -4) <(losses "$WORK/c") || fail "resumed LoRA losses differ"
cmp -s "$WORK/a/model/model.safetensors" "$WORK/c/model/model.safetensors" ||
  fail "the resumed LoRA run's final model differs from the uninterrupted run's"
# The adapter's config too: its base_model_name_or_path is the first run's --init, which the checkpoint kept.
cmp -s "$WORK/a/adapter/adapter_config.json" "$WORK/c/adapter/adapter_config.json" ||
  fail "the resumed run's adapter_config.json: $(cat "$WORK/c/adapter/adapter_config.json")"
# The same under bf16, where the frozen weights have no fp32 master and the
# checkpoint keeps them as bf16.
"$LOOM" train "${common[@]}" "${L[@]}" --precision bf16 --steps 6 --out "$WORK/ba" 2>/dev/null
"$LOOM" train "${common[@]}" "${L[@]}" --precision bf16 --steps 6 --ckpt-every 3 --keep 5 --out "$WORK/bb" 2>/dev/null
"$LOOM" train "${common[@]}" "${L[@]}" --precision bf16 --steps 6 --resume "$WORK/bb/ckpt-00000003" \
  --out "$WORK/bc" 2>/dev/null
cmp -s "$WORK/ba/model/model.safetensors" "$WORK/bc/model/model.safetensors" ||
  fail "bf16: the resumed LoRA run's final model differs from the uninterrupted run's"
# With dropout on the adapters' inputs: the resumed run draws the same
# masks (the RNG is in the checkpoint), and the dropout shows (another
# model than without it); PEFT's config says it.
DR=("${common[@]}" "${L[@]}" --precision bf16 --steps 6 --lora-dropout 0.2)
"$LOOM" train "${DR[@]}" --out "$WORK/da" 2>/dev/null
"$LOOM" train "${DR[@]}" --ckpt-every 3 --keep 5 --out "$WORK/db" 2>/dev/null
"$LOOM" train "${DR[@]}" --resume "$WORK/db/ckpt-00000003" --out "$WORK/dc" 2>/dev/null
cmp -s "$WORK/da/model/model.safetensors" "$WORK/dc/model/model.safetensors" ||
  fail "LoRA dropout: the resumed run's final model differs from the uninterrupted run's"
cmp -s "$WORK/da/model/model.safetensors" "$WORK/ba/model/model.safetensors" &&
  fail "LoRA dropout: the same model as without dropout"
$PY -c "import json, sys; d = json.load(open(sys.argv[1]))['lora_dropout']; sys.exit(abs(d - 0.2) > 1e-6)" \
  "$WORK/da/adapter/adapter_config.json" || fail "LoRA dropout: not 0.2 in adapter_config.json"
expect_error "lora-dropout 0.2" "$LOOM" train "${common[@]}" "${L[@]}" --precision bf16 --steps 6 \
  --resume "$WORK/db/ckpt-00000003" --out "$WORK/x"

# The merged model evaluates like any other, and fits what it was trained on
# better than the base model did: one batch, the one every step reads (a
# corpus of this tree's sources changes with every edit, and whether a few
# steps over as many batches lower their loss depends on the day's sources).
mkdir -p "$WORK/one" && cp "$WORK/data/tokenizer.json" "$WORK/one/"
$PY - "$WORK/data/train_000000.bin" "$WORK/one/train_000000.bin" "$SRC" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[3] + "/tests/python")
import llama_ref as ref
ref.write_shard(sys.argv[2], ref.read_shard(sys.argv[1])[:4 * 32 + 1])
PYEOF
"$LOOM" train --data "$WORK/one" --batch 4 --seq 32 --eval-every 0 "${L[@]}" --precision fp32 --steps 12 \
  --out "$WORK/fit" 2>/dev/null || fail "LoRA on one batch failed"
ev() { "$LOOM" eval --model "$1" --data "$WORK/one" --split train --batch 4 --seq 32 --batches 1 2>&1 |
  sed -n 's/.* loss=\([0-9.]*\) .*/\1/p'; }
before=$(ev "$WORK/base/model"); after=$(ev "$WORK/fit/model")
awk -v a="$before" -v b="$after" 'BEGIN { exit !(a != "" && b != "" && b < a - 0.05) }' ||
  fail "LoRA training did not lower the training loss (base ${before:-?}, tuned ${after:-?})"
"$LOOM" generate --model "$WORK/a/model" --prompt "loom" --tokens 8 --temperature 0 >"$WORK/gen.txt" 2>/dev/null ||
  fail "generate from the LoRA model failed"
[ -s "$WORK/gen.txt" ] || fail "generate from the LoRA model printed nothing"

# Refusals.
expect_usage "lora-alpha applies to LoRA" "$LOOM" train "${common[@]}" --lora-alpha 8 --out "$WORK/x"
expect_usage "lora-targets applies to LoRA" "$LOOM" train "${common[@]}" --lora-targets q --out "$WORK/x"
expect_usage "rank >= 1" "$LOOM" train "${common[@]}" --lora -2 --out "$WORK/x"
expect_usage "\"qq\" is not one of q, k, v" "$LOOM" train "${common[@]}" --lora 4 --lora-targets q,qq --out "$WORK/x"
expect_usage "lora-alpha must be above 0" "$LOOM" train "${common[@]}" --lora 4 --lora-alpha -1 --out "$WORK/x"
expect_usage "lora-alpha must be above 0" "$LOOM" train "${common[@]}" --lora 4 --lora-alpha 0 --out "$WORK/x"
expect_usage "lora-dropout must be in \[0, 1\)" "$LOOM" train "${common[@]}" --lora 4 --lora-dropout 1 --out "$WORK/x"
expect_usage "lora-dropout applies to LoRA" "$LOOM" train "${common[@]}" --lora-dropout 0.1 --out "$WORK/x"
expect_usage "LoRA rank 65: must be 1..64" "$LOOM" train "${common[@]}" --init "$WORK/base/model" --lora 65 --out "$WORK/x"
# A LoRA checkpoint resumed without its flags, or with others: named.
expect_error "trained LoRA adapters \(--lora 4 --lora-alpha 8 --lora-targets q,v,down\) but this run has none" \
  "$LOOM" train "${common[@]}" --steps 12 --resume "$WORK/b/ckpt-00000008" --out "$WORK/x"
expect_error "this run has --lora 4 --lora-alpha 8 --lora-targets q" "$LOOM" train "${common[@]}" --steps 12 \
  --lora 4 --lora-alpha 8 --lora-targets q --resume "$WORK/b/ckpt-00000008" --out "$WORK/x"
echo "lora: ok"
