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
with open(f"{w}/content.jsonl", "w", encoding="utf-8-sig") as f:  # with a byte order mark
    for d in docs:
        f.write(json.dumps({"content": d, "n": 10 ** 30}) + "\n")  # an integer too big for int64: valid JSON
# Training texts without trailing whitespace, so that documents kept apart
# and documents joined into one text learn different merges.
tdocs = [f"{('red', 'green', 'blue')[i % 3]} fox {('jumps', 'runs', 'sleeps', 'eats')[i % 4]}" for i in range(40)]
with open(f"{w}/train.jsonl", "w") as f:
    for d in tdocs:
        f.write(json.dumps({"text": d}) + "\n")
with open(f"{w}/joined.txt", "w") as f:
    f.write("".join(tdocs))
os.makedirs(f"{w}/each")
for i, d in enumerate(tdocs):
    with open(f"{w}/each/{i:03d}.txt", "w") as f:
        f.write(d)
bad = {"bad": '{"text": "fine"}\n\n{"text": broken}\n', "nokey": '{"text": "fine"}\n{"body": "no text field"}\n',
       "notstr": '{"text": 5}\n', "array": '["text", "fine"]\n', "blank": "\n  \n\n"}
for name, text in bad.items():
    with open(f"{w}/{name}.jsonl", "w") as f:
        f.write(text)
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
"$LOOM" tokenize --train "$WORK/train.jsonl" --vocab 1000 --out "$WORK/tj.json" 2>/dev/null
"$LOOM" tokenize --train "$WORK"/each/*.txt --vocab 1000 --out "$WORK/te.json" 2>/dev/null
"$LOOM" tokenize --train "$WORK/joined.txt" --vocab 1000 --out "$WORK/tjoined.json" 2>/dev/null
cmp -s "$WORK/tj.json" "$WORK/te.json" || fail "the tokenizer trained on .jsonl documents differs"
cmp -s "$WORK/tj.json" "$WORK/tjoined.json" && fail "the check cannot tell documents kept apart from one text"
# Bad input
T=(--tokenizer "$WORK/tok.json" --out "$WORK/x")
expect_error "bad.jsonl:3: cannot parse the line as JSON" "$LOOM" tokenize "${T[@]}" --in "$WORK/bad.jsonl"
expect_error "nokey.jsonl:2: the line has no field \"text\"" "$LOOM" tokenize "${T[@]}" --in "$WORK/nokey.jsonl"
expect_error "notstr.jsonl:1: the line has a field \"text\" that is not a string" "$LOOM" tokenize \
  --train "$WORK/notstr.jsonl" --out "$WORK/x.json"
expect_error "array.jsonl:1: the line is not a JSON object" "$LOOM" tokenize "${T[@]}" --in "$WORK/array.jsonl"
expect_error "the --in files hold no text" "$LOOM" tokenize "${T[@]}" --in "$WORK/blank.jsonl"
expect_error "the --train files hold no text" "$LOOM" tokenize --train "$WORK/blank.jsonl" --out "$WORK/x.json"
[ -e "$WORK/x.json" ] && fail "a failed tokenizer training wrote a tokenizer"
expect_usage "every --in file is .jsonl" "$LOOM" tokenize "${T[@]}" --in "$WORK/docs.jsonl" --doc-sep %
expect_usage "no file given ends in .jsonl" "$LOOM" tokenize --tokenizer "$WORK/tok.json" --in "$WORK/docs.txt" \
  --jsonl-key body --out "$WORK/x"
[ -e "$WORK/x/train_000000.bin" ] && fail "a failed tokenize wrote shards"
echo "1 passed, 0 failed"
