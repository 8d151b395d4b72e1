#!/usr/bin/env bash
# loom against PyTorch (tests/python/crosscheck.py): logits, loss and every
# gradient of one step in fp32 and bf16, and a 20-step fp32 loss curve, on
# random Hugging Face model directories. Needs Debian's python3-torch; a
# missing torch is a failure, not a skip (scripts/setup.sh installs it).
set -euo pipefail
src=${LOOM_SOURCE_DIR:?set LOOM_SOURCE_DIR to the loom source tree}
bin=${LOOM_BINARY_DIR:?set LOOM_BINARY_DIR to the loom build tree}
py=/usr/bin/python3
if ! "$py" -c "import torch, numpy" 2>/dev/null; then
  echo "test_torch_crosscheck: FAIL: $py cannot import torch and numpy;" \
       "install them with scripts/setup.sh (Debian packages python3-torch, python3-numpy)" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
"$py" "$src/tests/python/crosscheck.py" --loom "$bin/loom" --workdir "$work"
