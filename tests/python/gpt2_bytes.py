"""GPT-2's byte alphabet, shared by the tests that spell byte-level BPE
vocabularies (gguf_check.py, hf_tokenizer_check.py)."""


def gpt2_byte_chars():
    """GPT-2's byte -> character table: printable Latin-1 bytes are
    themselves, the others 256, 257, ... in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out
