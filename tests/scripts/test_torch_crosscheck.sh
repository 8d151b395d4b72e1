#!/usr/bin/env bash
# loom against PyTorch (tests/python/crosscheck.py): logits, loss and every
# gradient of one step in fp32 and bf16, and a 20-step fp32 loss curve, on
# random Hugging Face model directories. Needs Debian's python3-torch; a
# missing torch is a failure, not a skip (scripts/setup.sh installs it).
source "$(dirname "$0")/lib.sh"
require_torch
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
"$PY_TORCH" "$SRC/tests/python/crosscheck.py" --loom "$LOOM" --workdir "$WORK"
