#!/usr/bin/env bash
# loom export --format gguf (tests/python/gguf_check.py): the file against the
# GGUF format, its vocabulary against the tokenizer, and llama.cpp's "llama"
# math on its weights against the Hugging Face forward on the model's. Needs
# Debian's python3-torch; a missing torch is a failure, not a skip.
source "$(dirname "$0")/lib.sh"
require_torch
"$PY_TORCH" "$SRC/tests/python/gguf_check.py" --loom "$LOOM" --workdir "$WORK"
echo "1 passed, 0 failed"
