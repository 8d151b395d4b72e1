#!/usr/bin/env python3
"""loom reading Hugging Face tokenizer.json files, against an encoder
written here, apart from loom's code, from the format's rules.

A tokenizer loom trains is written out in Hugging Face's format seven times:
  gpt2:   loom's ids, ByteLevel pre-tokenizer with GPT-2's expression, merges
          as "a b" strings, <|endoftext|> as the only added token;
  starcoder: the same with a Digits pre-tokenizer (each digit a piece) first,
          as StarCoder and SmolLM have;
  llama3: the ids shuffled, a Split pre-tokenizer on Llama 3's expression then
          ByteLevel without its own, merges as ["a", "b"], ignore_merges with
          whole words in the vocabulary that no merge makes, added tokens
          <|begin_of_text|> (the template's first token), <|end_of_text|> and
          a reserved one;
  llama2: SentencePiece-style, as Llama 2's file is: byte fallback (<0xXX>
          tokens), a normalizer that prepends U+2581 and turns spaces into
          it, no pre-tokenizer; the whole text is one piece of characters,
          merged in Hugging Face's order (the lowest-ranked pair, the leftmost
          among equals, one at a time);
  gpt2_nfc, gpt2_nfkd, llama2_nfkc_nfd: those with Unicode normal forms in
          the normalizer (Qwen 2's NFC; NFKC before llama2's steps, NFD
          after), the reference normalizing with Python's unicodedata.
Each file is encoded by `loom tokenize --tokenizer` and by the reference
below; the shards must hold exactly the reference's ids, documents framed as
loom frames them (begin-of-text first, end-of-text last when it is another
token). The reference: split the text by each expression (matches and the
gaps between them are pieces), spell each piece's UTF-8 bytes in GPT-2's
alphabet, take a piece the vocabulary holds whole when ignore_merges, else
merge the lowest-ranked adjacent pair (every occurrence, left to right) until
no pair has a rank.
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import unicodedata

import regex

from gpt2_bytes import gpt2_byte_chars

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


ALPHA = gpt2_byte_chars()


def spell(bs):
    return "".join(ALPHA[b] for b in bs)


def reference_encode(text, patterns, vocab, ranks, ignore_merges):
    pieces = [text]
    for pat in patterns:
        out = []
        for p in pieces:
            pos = 0
            for m in regex.finditer(pat, p):
                if m.start() > pos:
                    out.append(p[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    ids = []
    for p in pieces:
        s = spell(p.encode("utf-8"))
        if ignore_merges and s in vocab:
            ids.append(vocab[s])
            continue
        word = list(s)
        while len(word) > 1:
            pairs = [(ranks.get((word[i], word[i + 1])), i) for i in range(len(word) - 1)]
            pairs = [(r, i) for r, i in pairs if r is not None]
            if not pairs:
                break
            best = min(pairs)[0]
            a, b = next((word[i], word[i + 1]) for r, i in pairs if r == best)
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [vocab[w] for w in word]
    return ids


def read_shard(path):
    with open(path, "rb") as f:
        head = struct.unpack("<256i", f.read(1024))
        data = f.read()
    width = {20240520: 2, 20240801: 4}[head[0]]
    n = head[2]
    assert len(data) == n * width, (path, len(data), n)
    return list(struct.unpack("<%d%s" % (n, "H" if width == 2 else "I"), data))


def hf_files(loom_tok):
    """The Hugging Face variants of a loom tokenizer: (name, json, patterns,
    vocab spelling->id, ranks (a, b)->r, ignore_merges, bos, eot[, the
    normal forms its normalizer applies, in order])."""
    merges = loom_tok["merges"]
    tok_bytes = [bytes([b]) for b in range(256)]
    for a, b in merges:
        tok_bytes.append(tok_bytes[a] + tok_bytes[b])
    n = len(tok_bytes)
    eot_loom = loom_tok["special"]["<|endoftext|>"]
    assert eot_loom == n
    spellings = [spell(t) for t in tok_bytes]
    variants = []

    # gpt2: loom's ids
    vocab = {s: i for i, s in enumerate(spellings)}
    vocab["<|endoftext|>"] = n
    ranks = {(spellings[a], spellings[b]): r for r, (a, b) in enumerate(merges)}
    j = {
        "version": "1.0",
        "added_tokens": [{"id": n, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": ["%s %s" % (spellings[a], spellings[b]) for a, b in merges]},
    }
    variants.append(("gpt2", j, [GPT2], vocab, ranks, False, n, n))

    # starcoder: StarCoder's and SmolLM's chain, each digit a piece before GPT-2's expression
    j = json.loads(json.dumps(j))
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    variants.append(("starcoder", j, [r"\p{N}", GPT2], vocab, ranks, False, n, n))

    # llama3: shuffled ids, whole words only ignore_merges reaches, three added tokens
    rng = random.Random(7)
    # pieces of the texts that the merges do not make whole: only ignore_merges gives them one id
    words = []
    for d in TEXTS:
        for m in regex.finditer(LLAMA3, d):
            w = spell(m.group().encode("utf-8"))
            if len(w) >= 3 and w not in spellings and w not in words and len(words) < 6:
                words.append(w)
    order = list(range(n + len(words)))
    rng.shuffle(order)
    all_spell = spellings + words
    vocab = {all_spell[k]: order[k] for k in range(len(all_spell))}
    base = len(all_spell)
    added = [(base, "<|begin_of_text|>"), (base + 1, "<|end_of_text|>"), (base + 2, "<|reserved_special_token_0|>")]
    for i, c in added:
        vocab[c] = i
    j = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in added],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [base],
                                                      "tokens": ["<|begin_of_text|>"]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [[spellings[a], spellings[b]] for a, b in merges]},
    }
    variants.append(("llama3", j, [LLAMA3], vocab, ranks, True, base, base + 1))

    # llama2: SentencePiece-style, as Hugging Face writes Llama 2's: byte fallback, a normalizer that
    # prepends "▁" and makes spaces "▁", no pre-tokenizer; the loom tokens that are whole
    # UTF-8 strings (spaces as "▁"), the merges among them, and <0x00>..<0xFF>
    def sp(t):
        try:
            w = t.decode("utf-8").replace(" ", "▁")
        except UnicodeDecodeError:
            return None
        return None if "\x00" in w else w  # JSON object keys cannot hold NUL (nor do real files')
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    for t in tok_bytes:
        w = sp(t)
        if w is not None and w not in vocab:
            vocab[w] = len(vocab)
    sp_merges = [(sp(tok_bytes[a]), sp(tok_bytes[b])) for a, b in merges
                 if None not in (sp(tok_bytes[a]), sp(tok_bytes[b]), sp(tok_bytes[a] + tok_bytes[b]))]
    j = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for c, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "vocab": vocab, "merges": ["%s %s" % m for m in sp_merges]},
    }
    ranks = {m: r for r, m in enumerate(sp_merges)}
    variants.append(("llama2", j, "sp", vocab, ranks, False, 1, 2))

    # Unicode's normal forms before the rest: gpt2 with Qwen 2's NFC, with NFKD; llama2 with NFKC first
    # (U+00A0 becomes a space, then "▁") and NFD last
    for name, base, steps in (("gpt2_nfc", 0, [{"type": "NFC"}]),
                              ("gpt2_nfkd", 0, [{"type": "Sequence", "normalizers": [{"type": "NFKD"}]}]),
                              ("llama2_nfkc_nfd", 3, [{"type": "NFKC"}] + j["normalizer"]["normalizers"] +
                               [{"type": "NFD"}])):
        name0, j0, patterns, vocab0, ranks0, ignore, bos, eot = variants[base]
        jn = dict(j0, normalizer=steps[0] if len(steps) == 1 else {"type": "Sequence", "normalizers": steps})
        forms = [f["type"] for st in steps for f in ([st] if st["type"] != "Sequence" else st["normalizers"])
                 if f["type"].startswith("NF")]
        variants.append((name, jn, patterns, vocab0, ranks0, ignore, bos, eot, forms))
    return variants


def reference_encode_sp(text, vocab, ranks, forms=()):
    """SentencePiece-style: normalize (a first normal form before the
    Prepend and Replace, a second after), characters (unknown ones as their
    bytes' tokens), then merge the lowest-ranked adjacent pair, the leftmost
    among equals, one at a time."""
    if forms:
        text = unicodedata.normalize(forms[0], text)
    s = "▁" + text.replace(" ", "▁") if text else ""
    if len(forms) > 1:
        s = unicodedata.normalize(forms[1], s)
    word = []
    for ch in s:
        word += [ch] if ch in vocab else ["<0x%02X>" % b for b in ch.encode("utf-8")]
    while True:
        best = min(((ranks[(word[i], word[i + 1])], i) for i in range(len(word) - 1)
                    if (word[i], word[i + 1]) in ranks), default=None)
        if best is None:
            break
        i = best[1]
        word[i:i + 2] = [word[i] + word[i + 1]]
    return [vocab[w] for w in word]


TEXTS = [
    "Hello world! I'm here, you're there; they'll've DON'T Can't WE'RE.\n",
    "Numbers: 1 12 123 1234 1234567 3.14159 and 0x1F, 2026-12-01.\n\n\n  indented\tline\r\nCRLF\r\n",
    "naïve café résumé, Ελληνικά, русский текст, 日本語のテキスト, 한국어, emoji 🙂🚀 and ‘quotes’ — dashes…\n",
    "The Hugging Face tokenizer loom's encoder reads: tokenizer, tokenizers, Face.\n",
    "x" * 300 + " " + " " * 200 + "end\n",
    "   leading spaces and trailing spaces   \n\n",
    "Unicode spaces: x \u00a0y, \u2003\u2003z, a\u00a0b\u3000c\u2003d\u2028e \u00a0 f\u3000\u3000g and digits \u0663\u0664\u0665 \uff11\uff12\n",
    "Normal forms: cafe\u0301 caf\u00e9 A\u030a \u212b \u1100\u1161\u11a8 \uac01 q\u0307\u0323 \ufb01ne \uff21\uff22 "
    "\u2460 x\u00b2 \u00bd \u2126 \u1e9b\u0323 \ufdfa \u3300 n\u0303o\u0308\n",
]
# First, and not in the tokenizer's training text: NFKC and NFKD make 33 bytes
# of each 3, more ids than bytes (tokenize makes room for one id per byte, then
# encodes again in the room the text asked for)
GROWS = "\ufdfa" * 40 + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--corpus", nargs="+", default=[])
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    docs = [GROWS] + TEXTS
    for path in args.corpus:
        with open(path, encoding="utf-8") as f:
            docs.append(f.read())
    train = os.path.join(args.workdir, "train.txt")
    with open(train, "w", encoding="utf-8") as f:
        f.write("".join(docs[1:]))
    tok_path = os.path.join(args.workdir, "loom_tok.json")
    subprocess.run([args.loom, "tokenize", "--train", train, "--vocab", "1500", "--out", tok_path], check=True,
                   stderr=subprocess.DEVNULL)
    with open(tok_path) as f:
        loom_tok = json.load(f)
    doc_files = []
    for k, d in enumerate(docs):
        p = os.path.join(args.workdir, "doc%02d.txt" % k)
        with open(p, "w", encoding="utf-8") as f:
            f.write(d)
        doc_files.append(p)
    failures = 0
    for name, j, patterns, vocab, ranks, ignore, bos, eot, *forms in hf_files(loom_tok):
        forms = forms[0] if forms else []
        hf_path = os.path.join(args.workdir, name + ".json")
        with open(hf_path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        # the SentencePiece-style reference merges in O(n^2): the short texts only
        n_docs = 1 + len(TEXTS) if patterns == "sp" else len(docs)
        out = os.path.join(args.workdir, "shards_" + name)
        subprocess.run([args.loom, "tokenize", "--tokenizer", hf_path, "--in"] + doc_files[:n_docs] +
                       ["--out", out, "--val-fraction", "0"], check=True, stderr=subprocess.DEVNULL)
        got = read_shard(os.path.join(out, "train_000000.bin"))
        want = []
        whole = 0
        for d in docs[:n_docs]:
            if patterns == "sp":
                ids = reference_encode_sp(d, vocab, ranks, forms)
            else:
                ids = reference_encode(unicodedata.normalize(forms[0], d) if forms else d, patterns, vocab, ranks,
                                       ignore)
            want += [bos] + ids + ([eot] if eot != bos else [])
        if ignore:
            extra = set(vocab[w] for w in vocab if len(w) > 1 and w not in {a + b for a, b in ranks} and
                        not w.startswith("<|"))
            whole = sum(1 for i in want if i in extra)
        if got != want:
            first = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
            print("FAIL %s: loom's %d ids differ from the reference's %d at %d: loom %s, reference %s" %
                  (name, len(got), len(want), first, got[first:first + 8], want[first:first + 8]))
            failures += 1
        else:
            print("ok %s: %d ids over %d documents equal the reference's%s" %
                  (name, len(got), n_docs, " (%d whole words by ignore_merges)" % whole if ignore else ""))
        if forms and all(unicodedata.normalize(f, d) == d for f in forms for d in docs[:n_docs]):
            print("FAIL %s: no text changes under %s: the test does not reach the normalizer" % (name, forms))
            failures += 1
        if ignore and whole == 0:
            print("FAIL %s: no whole word came from ignore_merges: the test does not reach it" % name)
            failures += 1
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
