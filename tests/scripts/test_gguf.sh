#!/usr/bin/env bash
# loom export --format gguf (tests/python/gguf_check.py): the file against the
# GGUF format, its vocabulary against the tokenizer, and llama.cpp's "llama"
# math on its weights against the Hugging Face forward on the model's. Needs
# Debian's python3-torch; a missing torch is a failure, not a skip.
set -euo pipefail
src=${LOOM_SOURCE_DIR:?set LOOM_SOURCE_DIR to the loom source tree}
bin=${LOOM_BINARY_DIR:?set LOOM_BINARY_DIR to the loom build tree}
py=/usr/bin/python3
if ! "$py" -c "import torch, numpy" 2>/dev/null; then
  echo "test_gguf: FAIL: $py cannot import torch and numpy;" \
       "install them with scripts/setup.sh (Debian packages python3-torch, python3-numpy)" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" "$src/tests/python/gguf_check.py" --loom "$bin/loom" --workdir "$work"
echo "1 passed, 0 failed"
