#!/usr/bin/env bash
# End to end: tokenize, train a small model until validation loss is well
# below the unigram entropy, generate, export and reload.
source "$(dirname "$0")/lib.sh"
# A fixed corpus (Debian's fortunes, installed by scripts/setup.sh): loom's
# own sources change with every commit, and so would this test's margin.
F=/usr/share/games/fortunes
[ -f $F/computers ] || fail "no fortunes corpus in $F: run scripts/setup.sh"
"$LOOM" tokenize --train $F/computers $F/science $F/work --vocab 512 --in $F/computers $F/science $F/work \
  --doc-sep % --out "$WORK/data" --val-fraction 0.1 2>"$WORK/tokenize.log"
entropy=$(grep -o 'unigram entropy [0-9.]*' "$WORK/tokenize.log" | awk '{print $3}')
[ -n "$entropy" ] || fail "tokenize printed no unigram entropy"
small_config "$WORK/cfg.json" 512
"$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --out "$WORK/run" --steps 100 --batch 16 --seq 64 \
  --lr 3e-3 --warmup 5 --eval-every 50 --eval-batches 30 --precision bf16 2>"$WORK/train.log" \
  || { cat "$WORK/train.log"; fail "train"; }
val=$(grep val_loss "$WORK/run/metrics.jsonl" | tail -1 | sed 's/.*"val_loss":\([0-9.]*\).*/\1/')
echo "validation loss $val, unigram entropy $entropy"
awk -v v="$val" -v h="$entropy" 'BEGIN { exit !(v < h - 0.5) }' || fail "validation loss $val is not well below the unigram entropy $entropy"
# loom eval reads the batches the run validated on: the same loss, to the
# digit, from the saved model, 30 batches being more than one pass (both wrap
# around); one pass over the split by default.
ev=$("$LOOM" eval --model "$WORK/run/model" --data "$WORK/data" --batch 16 --seq 64 --batches 30 --precision bf16)
[ "$(echo "$ev" | sed 's/.* loss=\([0-9.]*\) .*/\1/')" = "$val" ] || fail "loom eval says '$ev'; the run's last val_loss is $val"
ev=$("$LOOM" eval --model "$WORK/run/model" --data "$WORK/data" --batch 16 --seq 64)
n=$(echo "$ev" | sed 's/.* batches=\([0-9]*\) .*/\1/')
want=0 # each val shard gives (tokens - 1) / (B*T) whole batches (2-byte tokens after a 1024-byte header)
for f in "$WORK"/data/val_*.bin; do want=$(( want + (($(stat -c %s "$f") - 1024) / 2 - 1) / (16 * 64) )); done
[ "$n" -eq "$want" ] || fail "one pass over the val shards is $want batches, not $n: $ev"
# --seq's default: the model's context (64 here), but at most 4096 (a model of 8192).
ev=$("$LOOM" eval --model "$WORK/run/model" --data "$WORK/data" --batch 2 --batches 1)
grep -q ' batches=1 tokens=128 ' <<<"$ev" || fail "eval's default --seq is not the context, 64: $ev"
sed 's/"max_position_embeddings": 64/"max_position_embeddings": 8192/' "$WORK/cfg.json" > "$WORK/cfg8k.json"
grep -q '"max_position_embeddings": 8192' "$WORK/cfg8k.json" || fail "cfg8k.json: $(cat "$WORK/cfg8k.json")"
"$LOOM" train --data "$WORK/data" --config "$WORK/cfg8k.json" --out "$WORK/run8k" --steps 1 --batch 2 --seq 16 \
  --eval-every 0 2>"$WORK/train8k.log" || { cat "$WORK/train8k.log"; fail "train, context 8192"; }
ev=$("$LOOM" eval --model "$WORK/run8k/model" --data "$WORK/data" --split train --batch 1 --batches 1)
grep -q ' batches=1 tokens=4096 ' <<<"$ev" || fail "eval's default --seq is not 4096 for a context of 8192: $ev"
# --schedule wsd reaches the optimizer: the logged learning rates are warmup
# (2 steps), stable, then linear to --min-lr over the last 25% (3 of 12
# steps), reaching it at the last step.
"$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --out "$WORK/wsd" --steps 12 --batch 2 --seq 16 \
  --lr 1e-3 --min-lr 1e-4 --warmup 2 --schedule wsd --decay-frac 0.25 --eval-every 0 2>"$WORK/wsd.log" \
  || { cat "$WORK/wsd.log"; fail "train --schedule wsd"; }
sed 's/.*"step":\([0-9]*\),.*"lr":\([0-9.e-]*\),.*/\1 \2/' "$WORK/wsd/metrics.jsonl" | awk '
  { s = $1 - 1  # the step the rate was used for, from 0
    if (s < 2) want = 1e-3 * (s + 1) / 2
    else if (s < 9) want = 1e-3
    else want = 1e-3 + (s - 8) / 3 * (1e-4 - 1e-3)
    if ((($2 - want) ^ 2) ^ 0.5 > 1e-6 * want) { print "step " $1 ": lr " $2 ", want " want; bad = 1 }
    n++ }
  END { exit bad || n != 12 }' || fail "the learning rates of --schedule wsd are not warmup, stable, decay"
for f in loss.svg metrics.jsonl model/config.json model/model.safetensors model/tokenizer.json; do
  [ -s "$WORK/run/$f" ] || fail "missing $f"
done
ls -d "$WORK"/run/ckpt-00000100 >/dev/null || fail "no final checkpoint"
text=$("$LOOM" generate --model "$WORK/run/model" --prompt "loom" --tokens 20 --temperature 0)
[ ${#text} -gt 4 ] || fail "generate printed too little: '$text'"
# Greedy decoding is deterministic.
[ "$text" = "$("$LOOM" generate --model "$WORK/run/model" --prompt "loom" --tokens 20 --temperature 0)" ] || fail "greedy differs"
# The run's directory given as --model: pointed to its model directory.
if "$LOOM" generate --model "$WORK/run" 2>"$WORK/gm.log"; then fail "generate took a run directory as a model"; fi
grep -q "looks like a training run's output; the model is --model $WORK/run/model" "$WORK/gm.log" ||
  { cat "$WORK/gm.log"; fail "no hint for a run directory given as --model"; }
# An empty prompt is a prompt (the start of a document), the same as none.
[ "$("$LOOM" generate --model "$WORK/run/model" --prompt "" --tokens 8 --temperature 0)" = \
  "$("$LOOM" generate --model "$WORK/run/model" --tokens 8 --temperature 0)" ] || fail "--prompt \"\" differs from no prompt"
"$LOOM" export --model "$WORK/run/model" --out "$WORK/hf" --dtype bf16 2>/dev/null
"$LOOM" generate --model "$WORK/hf" --prompt "the" --tokens 5 --seed 3 >/dev/null || fail "exported model does not load"
# Exporting a model that has no tokenizer over that directory removes the
# tokenizer that belonged to the earlier model.
"$LOOM" export --model "$WORK/run/model" --out "$WORK/hf2" 2>/dev/null
[ -f "$WORK/hf2/tokenizer.json" ] || fail "export did not copy the tokenizer"
mkdir -p "$WORK/notok" && cp "$WORK/run/model/config.json" "$WORK/run/model/model.safetensors" "$WORK/notok/"
"$LOOM" export --model "$WORK/notok" --out "$WORK/hf2" 2>/dev/null
[ -e "$WORK/hf2/tokenizer.json" ] && fail "export left another model's tokenizer.json"
grep -q '"torch_dtype": "bfloat16"' "$WORK/hf/config.json" || fail "export dtype not in config"
# The same model in Hugging Face's sharded layout (model.safetensors.index.json
# and two files, bf16 like most published checkpoints): generate gives the
# same text, export the same weights, and train --init starts from it.
mkdir -p "$WORK/sharded" && cp "$WORK/hf/config.json" "$WORK/hf/tokenizer.json" "$WORK/sharded/"
/usr/bin/python3 - "$WORK/hf/model.safetensors" "$WORK/sharded" <<'PY'
import json, struct, sys
src, out = sys.argv[1], sys.argv[2]
b = open(src, "rb").read()
n = struct.unpack("<Q", b[:8])[0]
header = json.loads(b[8:8 + n]); header.pop("__metadata__", None)
data = b[8 + n:]
names = sorted(header)
weight_map, parts = {}, [{}, {}]
for i, name in enumerate(names):
    parts[i % 2][name] = header[name]
for k, part in enumerate(parts):
    file = f"model-{k + 1:05d}-of-00002.safetensors"
    hdr, blobs, off = {}, [], 0
    for name, e in part.items():
        lo, hi = e["data_offsets"]
        hdr[name] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [off, off + hi - lo]}
        blobs.append(data[lo:hi]); off += hi - lo
        weight_map[name] = file
    h = json.dumps(hdr).encode(); h += b" " * (-len(h) % 8)
    open(f"{out}/{file}", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
json.dump({"metadata": {"total_size": len(data)}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"))
PY
[ "$("$LOOM" generate --model "$WORK/sharded" --prompt "loom" --tokens 12 --temperature 0)" = \
  "$("$LOOM" generate --model "$WORK/hf" --prompt "loom" --tokens 12 --temperature 0)" ] ||
  fail "the sharded model generates other text"
"$LOOM" export --model "$WORK/sharded" --out "$WORK/unsharded" --dtype bf16 2>/dev/null
cmp -s "$WORK/hf/model.safetensors" "$WORK/unsharded/model.safetensors" || fail "export of the sharded model differs"
"$LOOM" train --data "$WORK/data" --init "$WORK/sharded" --steps 1 --out "$WORK/from-sharded" 2>/dev/null ||
  fail "train --init from the sharded model failed"
# Qwen 2's model (biases on q, k and v), Qwen 3's (each query and key head
# normalized, heads of their own size) and Gemma's (norms of 1 + weight
# starting at 0, scaled embeddings, the tanh GELU, tied by default): trained
# from a config, the directory says which and holds those weights, which
# training moved; it evaluates, generates and exports as Hugging Face's
# layout (GGUF refused by name), and fine-tunes from that export.
for q in 'qwen2 "model_type": "qwen2", "tie_word_embeddings": true' \
         'qwen3 "model_type": "qwen3", "head_dim": 24, "tie_word_embeddings": true' \
         'gemma "model_type": "gemma", "head_dim": 24' \
         'granite "model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625, "logits_scaling": 8.0, "tie_word_embeddings": true' \
         'phi3 "model_type": "phi3", "tie_word_embeddings": true' \
         'smollm3 "model_type": "smollm3", "no_rope_layer_interval": 2' \
         'gemma2 "model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 24' \
         'gemma3_text "model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 2'; do
  v=${q%% *}
  config_plus "$WORK/$v.json" "$WORK/cfg.json" "${q#* }"
  "$LOOM" train --data "$WORK/data" --config "$WORK/$v.json" --steps 3 --batch 2 --seq 32 --lr 1e-2 \
    --out "$WORK/$v" 2>"$WORK/$v.log" || { cat "$WORK/$v.log"; fail "train a $v model"; }
  /usr/bin/python3 - "$WORK/$v/model" "$v" <<'PY' || fail "the $v model directory"
import json, struct, sys
d, v = sys.argv[1], sys.argv[2]
c = json.load(open(f"{d}/config.json"))
cls = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
       "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
       "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[v]
assert c["model_type"] == v and c["architectures"] == [cls], c
raw = open(f"{d}/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n])
def values(name):
    a, b = hdr[name]["data_offsets"]
    return struct.unpack("<%df" % ((b - a) // 4), raw[8 + n + a:8 + n + b])
assert "lm_head.weight" not in hdr
for l in range(c["num_hidden_layers"]):
    p = f"model.layers.{l}.self_attn."
    if v == "qwen2":
        for w in "qkv":
            assert any(x != 0 for x in values(p + f"{w}_proj.bias")), f"layer {l} {w}_proj.bias did not train"
        assert p + "o_proj.bias" not in hdr
    elif v == "qwen3":
        assert c["head_dim"] == 24 and hdr[p + "q_proj.weight"]["shape"] == [4 * 24, c["hidden_size"]]
        for w in "qk":
            assert any(x != 1 for x in values(p + f"{w}_norm.weight")), f"layer {l} {w}_norm did not train"
        assert p + "q_proj.bias" not in hdr
    elif v == "phi3":  # the files' fused projections: q, k, v rows in one tensor, gate and up in one
        C, F = c["hidden_size"], c["intermediate_size"]
        hs = C // c["num_attention_heads"]
        assert hdr[p + "qkv_proj.weight"]["shape"] == [C + 2 * c["num_key_value_heads"] * hs, C]
        assert hdr[f"model.layers.{l}.mlp.gate_up_proj.weight"]["shape"] == [2 * F, C]
        assert p + "q_proj.weight" not in hdr and f"model.layers.{l}.mlp.up_proj.weight" not in hdr
    elif v == "gemma2":  # its four norms a block, softcaps as Gemma2Config's
        assert (c["attn_logit_softcapping"], c["final_logit_softcapping"], c["query_pre_attn_scalar"]) == (50, 30, 24), c
        assert isinstance(c["query_pre_attn_scalar"], int), c  # as Gemma2Config's strict int field wants it
        for nm in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            assert any(x != 0 for x in values(f"model.layers.{l}.{nm}.weight")), f"layer {l} {nm} did not train"
    elif v == "gemma3_text":  # q/k norms of 1 + weight, trained; its window and bases as Gemma3TextConfig's
        assert c["sliding_window"] == 8 and c["sliding_window_pattern"] == 2 and c["rope_local_base_freq"] == 10000, c
        assert c["layer_types"] == ["sliding_attention", "full_attention"] and c["attn_logit_softcapping"] is None, c
        for w in "qk":
            assert any(x != 0 for x in values(p + f"{w}_norm.weight")), f"layer {l} {w}_norm did not train"
    elif v == "smollm3":
        assert c["no_rope_layers"] == [1, 0] and c["no_rope_layer_interval"] == 2 and c["tie_word_embeddings"], c
    elif v == "granite":
        assert (c["embedding_multiplier"], c["residual_multiplier"], c["attention_multiplier"], c["logits_scaling"]) \
            == (12.0, 0.22, 0.0625, 8.0), c
        assert p + "q_proj.bias" not in hdr and p + "q_norm.weight" not in hdr
    else:
        assert c["hidden_activation"] == "gelu_pytorch_tanh" and c["tie_word_embeddings"] and c["head_dim"] == 24
        assert p + "q_norm.weight" not in hdr and p + "q_proj.bias" not in hdr
        norm = values(f"model.layers.{l}.input_layernorm.weight")  # offsets from 1: start at 0, moved by training
        assert any(x != 0 for x in norm) and max(abs(x) for x in norm) < 0.5, f"layer {l}: {norm[:4]}"
PY
  "$LOOM" eval --model "$WORK/$v/model" --data "$WORK/data" --batch 2 --seq 32 >/dev/null 2>&1 ||
    fail "eval a $v model"
  "$LOOM" generate --model "$WORK/$v/model" --prompt "loom" --tokens 4 --temperature 0 >/dev/null 2>&1 ||
    fail "generate with a $v model"
  "$LOOM" export --model "$WORK/$v/model" --out "$WORK/$v-hf" 2>/dev/null || fail "export a $v model"
  cmp -s "$WORK/$v/model/config.json" "$WORK/$v-hf/config.json" || fail "the exported $v config differs"
  expect_error "GGUF export of a model with" "$LOOM" export --model "$WORK/$v/model" --format gguf \
    --out "$WORK/q.gguf"
  "$LOOM" train --data "$WORK/data" --init "$WORK/$v-hf" --steps 1 --batch 2 --seq 32 --out "$WORK/$v-ft" \
    2>/dev/null || fail "train --init a $v export"
done
# Gemma 3's multimodal layout (Gemma3ForConditionalGeneration, as the published
# files have it): the text model nested in text_config, its tensors
# under language_model., a vision tower beside them. loom reads the text
# model: the same greedy text as from the text model's own directory; LoRA
# from it writes an adapter named as that base names its modules, which
# applies to either directory alike.
/usr/bin/python3 - "$WORK/gemma3_text/model" "$WORK/g3mm" "$SRC" <<'PY' || fail "make a Gemma 3 multimodal directory"
import json, os, shutil, sys, torch
d, out, src = sys.argv[1:4]
sys.path.insert(0, os.path.join(src, "tests", "python"))
import llama_ref as ref
os.makedirs(out, exist_ok=True)
c = json.load(open(f"{d}/config.json"))
c.pop("architectures", None)
json.dump({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": c,
           "vision_config": {"model_type": "siglip_vision_model"}, "mm_tokens_per_image": 256}, open(f"{out}/config.json", "w"))
t, meta = ref.read_safetensors(f"{d}/model.safetensors")
t = {"language_model." + k: v for k, v in t.items()}
t["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
ref.write_safetensors(f"{out}/model.safetensors", t, meta)
shutil.copy(f"{d}/tokenizer.json", out)
PY
g_text=$("$LOOM" generate --model "$WORK/gemma3_text/model" --prompt "loom" --tokens 8 --temperature 0 2>/dev/null)
g_mm=$("$LOOM" generate --model "$WORK/g3mm" --prompt "loom" --tokens 8 --temperature 0 2>/dev/null) ||
  fail "generate with a Gemma 3 multimodal directory"
[ -n "$g_text" ] && [ "$g_text" = "$g_mm" ] || fail "Gemma 3 multimodal: '$g_mm', its text model: '$g_text'"
"$LOOM" train --data "$WORK/data" --init "$WORK/g3mm" --lora 2 --lora-targets q,down --lr 1e-2 --steps 2 --batch 2 \
  --seq 32 --out "$WORK/g3lora" 2>"$WORK/g3lora.log" || { cat "$WORK/g3lora.log"; fail "LoRA from Gemma 3 multimodal"; }
/usr/bin/python3 - "$WORK/g3lora/adapter" <<'PY' || fail "the adapter of a Gemma 3 multimodal base"
import json, struct, sys
d = sys.argv[1]
c = json.load(open(f"{d}/adapter_config.json"))
assert c["target_modules"] == \
    r"(language_model\.model|model\.language_model)\.layers\.[0-9]+\.(self_attn|mlp)\.(q_proj|down_proj)", c
raw = open(f"{d}/adapter_model.safetensors", "rb").read()
names = [k for k in json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]]) if k != "__metadata__"]
assert names and all(k.startswith("base_model.model.language_model.model.layers.") for k in names), names
PY
e_mm=$("$LOOM" eval --model "$WORK/g3mm" --adapter "$WORK/g3lora/adapter" --data "$WORK/data" --batch 2 --seq 32 \
       --batches 2 2>/dev/null) || fail "eval a Gemma 3 multimodal base with its adapter"
e_text=$("$LOOM" eval --model "$WORK/gemma3_text/model" --adapter "$WORK/g3lora/adapter" --data "$WORK/data" \
         --batch 2 --seq 32 --batches 2 2>/dev/null) || fail "eval the text model with that adapter"
[ "${e_mm#* loss=}" = "${e_text#* loss=}" ] || fail "with the adapter: '$e_mm' against '$e_text'"
# LoRA on Phi-3's fused q, k, v: the merged model is written, and a note
# says why there is no PEFT adapter directory (PEFT adapts qkv_proj whole).
"$LOOM" train --data "$WORK/data" --init "$WORK/phi3-hf" --lora 4 --lora-targets q,v --steps 1 --batch 2 \
  --seq 32 --out "$WORK/phi3-lora" 2>"$WORK/phi3-lora.log" || { cat "$WORK/phi3-lora.log"; fail "LoRA on Phi-3"; }
grep -q "no PEFT adapter directory is written" "$WORK/phi3-lora.log" || { cat "$WORK/phi3-lora.log"; fail "no note"; }
[ -d "$WORK/phi3-lora/adapter" ] && fail "a PEFT adapter directory for Phi-3's fused q, k, v"
"$LOOM" eval --model "$WORK/phi3-lora/model" --data "$WORK/data" --batch 2 --seq 32 >/dev/null 2>&1 ||
  fail "eval the merged Phi-3 model"
# A build without MPI started as one of several processes refuses, instead of
# every process training alone into the same --out.
if grep -q "MPI: no" <<<"$("$LOOM" --version)"; then
  expect_error "built without MPI" env OMPI_COMM_WORLD_SIZE=2 "$LOOM" train --data "$WORK/data" \
    --config "$WORK/cfg.json" --steps 1 --out "$WORK/lonely"
  [ -e "$WORK/lonely" ] && fail "a refused run wrote its output directory"
fi
echo "1 passed, 0 failed"
