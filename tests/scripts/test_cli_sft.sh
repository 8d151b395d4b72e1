#!/usr/bin/env bash
# Supervised fine-tuning data: loom tokenize --jsonl-prompt-key writes a loss
# mask beside each shard, and the loss of a step leaves the prompts out.
#  - The masks, read here with an independent decoder of the tokenizer (its
#    merges), split every document into exactly its prompt (mask 0) and its
#    completion (mask 1), with the separator a target.
#  - The loss loom reports for a first step (--dump-logits) is the mean
#    cross-entropy of its dumped logits over the unmasked targets only (and
#    is not the mean over all of them).
source "$(dirname "$0")/lib.sh"
require_torch
py=$PY_TORCH
"$py" - "$WORK" <<'PY'
import json, random, sys
random.seed(7)
w = sys.argv[1]
words = "the a cat dog sat ran on under mat log quickly slowly red blue".split()
with open(f"{w}/sft.jsonl", "w") as f:
    for i in range(80):
        p = "Q: " + " ".join(random.choice(words) for _ in range(random.randint(3, 9))) + "?\n"
        c = "A: " + " ".join(random.choice(words) for _ in range(random.randint(2, 12))) + "."
        f.write(json.dumps({"prompt": p, "completion": c}) + "\n")
PY
"$LOOM" tokenize --train "$WORK/sft.jsonl" --jsonl-prompt-key prompt --jsonl-key completion --vocab 320 \
  --in "$WORK/sft.jsonl" --val-fraction 0.1 --out "$WORK/data" 2>"$WORK/tok.log" || { cat "$WORK/tok.log"; fail "tokenize"; }
grep -q "loss masks beside the shards" "$WORK/tok.log" || { cat "$WORK/tok.log"; fail "no note on the loss masks"; }
for f in train_000000.mask val_000000.mask; do [ -s "$WORK/data/$f" ] || fail "no $f"; done
"$py" - "$WORK" <<'PY' || fail "the masks do not split the documents into prompt and completion"
import json, struct, sys
w = sys.argv[1]
pairs = [json.loads(l) for l in open(f"{w}/sft.jsonl")]
want = {(p["prompt"], p["completion"]) for p in pairs}
tok = json.load(open(f"{w}/data/tokenizer.json"))
spell = [bytes([i]) for i in range(256)]
for a, b in tok["merges"]:
    spell.append(spell[a] + spell[b])
eot = tok["special"]["<|endoftext|>"]
def read(path, width):
    blob = open(path, "rb").read()
    magic, version, n = struct.unpack_from("<3i", blob)
    return magic, list(struct.unpack_from(f"<{n}{width}", blob, 1024))
for split in ("train", "val"):
    _, ids = read(f"{w}/data/{split}_000000.bin", "H")
    magic, mask = read(f"{w}/data/{split}_000000.mask", "B")
    assert magic == 20261201 and len(mask) == len(ids), (magic, len(mask), len(ids))
    docs, cur = [], None
    for t, m in zip(ids, mask):
        if t == eot:
            assert m == 1, "the separator must be a target"
            cur = [b"", b""]
            docs.append(cur)
        else:
            cur[m] += spell[t]
    got = {(p.decode(), c.decode()) for p, c in docs}
    assert got <= want and len(docs) == {"train": 72, "val": 8}[split], (split, len(docs), list(got - want)[:2])
print("masks: every document is its prompt (0) then its completion (1)")
PY
small_config "$WORK/cfg.json" 320
"$LOOM" train --data "$WORK/data" --config "$WORK/cfg.json" --out "$WORK/run" --steps 1 --batch 4 --seq 32 \
  --precision fp32 --eval-every 0 --dump-logits "$WORK/logits.safetensors" 2>"$WORK/train.log" \
  || { cat "$WORK/train.log"; fail "train on the masked data"; }
grep -q "loss masks on 1 of the 1 training shards" "$WORK/train.log" || { cat "$WORK/train.log"; fail "no note on masks"; }
"$py" - "$WORK" "$SRC" <<'PY' || fail "the loss is not the mean over the unmasked targets"
import struct, sys
import numpy as np
w, src = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"{src}/tests/python")
import llama_ref as ref
lg, meta = ref.read_safetensors(f"{w}/logits.safetensors")
logits = lg["logits"].double().numpy().reshape(4 * 32, -1)
blob = open(f"{w}/data/train_000000.bin", "rb").read()
ids = np.frombuffer(blob, dtype=np.uint16, offset=1024)[:4 * 32 + 1].astype(np.int64)
mask = np.frombuffer(open(f"{w}/data/train_000000.mask", "rb").read(), dtype=np.uint8, offset=1024)[1:4 * 32 + 1]
targets = ids[1:]
lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
ce = lse - logits[np.arange(len(targets)), targets]
masked, every = ce[mask == 1].mean(), ce.mean()
loss = float(meta["loss"])
print(f"loss {loss:.6f}: over the {int(mask.sum())} unmasked of {len(mask)} targets {masked:.6f}, over all {every:.6f}")
assert 0 < mask.sum() < len(mask)
assert abs(loss - masked) <= 1e-5 * abs(masked) and abs(loss - every) > 1e-3
PY
# eval leaves the prompts out too: its loss on the masked shard differs from
# the one on the same tokens without the mask.
a=$("$LOOM" eval --model "$WORK/run/model" --data "$WORK/data/train_000000.bin" --batch 4 --seq 32 --batches 3)
cp "$WORK/data/train_000000.bin" "$WORK/nomask.bin"
b=$("$LOOM" eval --model "$WORK/run/model" --data "$WORK/nomask.bin" --batch 4 --seq 32 --batches 3)
[ "${a#* loss=}" != "${b#* loss=}" ] || fail "eval gives the same loss with and without the mask: $a"
# Micro-batches weigh by their targets: with --grad-accum 2, where the
# second micro-batch's targets are all masked, the gradients are exactly
# those of the first micro-batch alone (equal weights would halve them); and
# a step with no target at all is skipped, leaving the weights as they were.
"$py" - "$WORK" "$SRC" <<'PY'
import os, sys
import numpy as np
w, src = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"{src}/tests/python")
import llama_ref as ref
rng = np.random.default_rng(3)
os.makedirs(f"{w}/weigh")
toks = rng.integers(0, 320, size=400)
ref.write_shard(f"{w}/weigh/train_000000.bin", toks)
mask = np.ones(400, dtype=np.uint8)
mask[17:33] = 0      # B=2, T=8: micro-batch 1's targets are tokens 17..32
mask[33 + 16:] = 0   # and every target after step 2's first micro-batch
header = np.zeros(256, dtype="<i4")
header[:3] = [20261201, 1, 400]
with open(f"{w}/weigh/train_000000.mask", "wb") as f:
    f.write(header.tobytes() + mask.tobytes())
PY
W=(--data "$WORK/weigh" --config "$WORK/cfg.json" --batch 2 --seq 8 --precision fp32 --eval-every 0 --seed 5)
"$LOOM" train "${W[@]}" --grad-accum 2 --steps 1 --out "$WORK/w2" --dump-grads "$WORK/g2.safetensors" 2>/dev/null
"$LOOM" train "${W[@]}" --grad-accum 1 --steps 1 --out "$WORK/w1" --dump-grads "$WORK/g1.safetensors" 2>/dev/null
cmp -s "$WORK/g1.safetensors" "$WORK/g2.safetensors" || fail "a micro-batch without targets changed the gradients"
"$LOOM" train "${W[@]}" --grad-accum 2 --steps 3 --out "$WORK/w3" 2>"$WORK/w3.log" || { cat "$WORK/w3.log"; fail "train"; }
sed -n 3p "$WORK/w3/metrics.jsonl" | grep -q '"loss":null.*"skipped":1' || \
  { cat "$WORK/w3/metrics.jsonl"; fail "a step without targets is not logged as skipped"; }
"$LOOM" train "${W[@]}" --grad-accum 2 --steps 2 --out "$WORK/w4" 2>/dev/null
cmp -s "$WORK/w3/model/model.safetensors" "$WORK/w4/model/model.safetensors" || \
  fail "a step without targets changed the weights"
# Tokenizing the same directory again without prompts drops the masks; the
# prompt and the completion must be two fields.
"$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" --in "$WORK/sft.jsonl" --jsonl-key completion \
  --out "$WORK/data" 2>/dev/null
ls "$WORK"/data/*.mask 2>/dev/null && fail "masks of the earlier data are left beside the new shards"
expect_usage "name the same field 'completion'" "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" \
  --in "$WORK/sft.jsonl" --jsonl-key completion --jsonl-prompt-key completion --out "$WORK/x"
expect_usage "name the same field 'text'" "$LOOM" tokenize --tokenizer "$WORK/data/tokenizer.json" \
  --in "$WORK/sft.jsonl" --jsonl-prompt-key text --out "$WORK/x"
echo "1 passed, 0 failed"
