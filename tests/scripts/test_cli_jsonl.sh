#!/usr/bin/env bash
# loom tokenize reads JSON Lines (.jsonl): the shards of documents given as
# .jsonl lines are those of the same documents in a text file split at a
# separator line; a tokenizer trained on .jsonl documents is the one trained
# on the same documents as files of their own; a bad line is an error naming
# the file and the line.
source "$(dirname "$0")/lib.sh"
/usr/bin/python3 - "$WORK" <<'PY'
import json, os, sys
w = sys.argv[1]
docs = ["The cat sat on the mat.\nIt was happy.\n", "Quotes \"here\", a tab\tand a backslash \\.\n",
        "Unicode: caf\u00e9, \u65e5\u672c, \U0001F600.\n", "A NUL \u0000 inside.\n", "short\n"] * 6
docs = [d.replace("cat", f"cat{i}") for i, d in enumerate(docs)]
with open(f"{w}/docs.txt", "w", encoding="utf-8", newline="") as f:
    f.write("%\n".join(docs))
with open(f"{w}/docs.jsonl", "w", encoding="utf-8", newline="") as f:
    for i, d in enumerate(docs):
        f.write(json.dumps({"id": i, "text": d}) + ("\r\n" if i % 2 else "\n"))
        if i == 3:
            f.write("   \n")  # a blank line is no document
with open(f"{w}/content.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"content": d}) + "\n")
os.makedirs(f"{w}/each")
for i, d in enumerate(docs):
    with open(f"{w}/each/{i:03d}.txt", "w", encoding="utf-8", newline="") as f:
        f.write(d)
with open(f"{w}/bad.jsonl", "w") as f:
    f.write('{"text": "fine"}\n{"text": "fine"}\n{"text": broken}\n')
with open(f"{w}/nokey.jsonl", "w") as f:
    f.write('{"text": "fine"}\n{"body": "no text field"}\n')
with open(f"{w}/notstr.jsonl", "w") as f:
    f.write('{"text": 5}\n')
PY
"$LOOM" tokenize --train "$WORK/docs.txt" --vocab 300 --out "$WORK/tok.json" 2>/dev/null
"$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$WORK/docs.txt" --doc-sep % --val-fraction 0.2 --out "$WORK/a" \
  2>"$WORK/a.log" || { cat "$WORK/a.log"; fail "tokenize of the text file"; }
"$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$WORK/docs.jsonl" --val-fraction 0.2 --out "$WORK/b" \
  2>"$WORK/b.log" || { cat "$WORK/b.log"; fail "tokenize of the .jsonl file"; }
grep -q "30 documents (6 for validation)" "$WORK/b.log" || { cat "$WORK/b.log"; fail "the .jsonl file is not 30 documents"; }
for f in train_000000.bin val_000000.bin; do
  cmp -s "$WORK/a/$f" "$WORK/b/$f" || fail "$f of the .jsonl documents differs from the text file's"
done
"$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$WORK/content.jsonl" --jsonl-key content --val-fraction 0.2 \
  --out "$WORK/c" 2>/dev/null
cmp -s "$WORK/a/train_000000.bin" "$WORK/c/train_000000.bin" || fail "--jsonl-key content reads other documents"
# Training: each .jsonl document is a text of its own, as a file of its own is.
"$LOOM" tokenize --train "$WORK/docs.jsonl" --vocab 320 --out "$WORK/tj.json" 2>/dev/null
"$LOOM" tokenize --train "$WORK"/each/*.txt --vocab 320 --out "$WORK/te.json" 2>/dev/null
cmp -s "$WORK/tj.json" "$WORK/te.json" || fail "the tokenizer trained on .jsonl documents differs"
cmp -s "$WORK/tj.json" "$WORK/tok.json" && fail "the check cannot tell documents from one text"
# Bad input
expect_error "bad.jsonl:3: not JSON" "$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$WORK/bad.jsonl" --out "$WORK/x"
expect_error "nokey.jsonl:2: no string field \"text\"" "$LOOM" tokenize --tokenizer "$WORK/tok.json" \
  --in "$WORK/nokey.jsonl" --out "$WORK/x"
expect_error "notstr.jsonl:1: no string field" "$LOOM" tokenize --train "$WORK/notstr.jsonl" --out "$WORK/x.json"
expect_usage "no file given ends in .jsonl" "$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$WORK/docs.txt" \
  --jsonl-key body --out "$WORK/x"
[ -e "$WORK/x/train_000000.bin" ] && fail "a failed tokenize wrote shards"
echo "1 passed, 0 failed"
