#!/usr/bin/env bash
# Runs examples/fused_linear_recompute: a user-defined fused linear trained
# in bf16 with master-grad under every recompute mode; it exits non-zero when
# the main_grad checksums (or losses) differ across modes.
set -u
exe="${LOOM_BINARY_DIR:?LOOM_BINARY_DIR is not set}/fused_linear_recompute"
if [ ! -x "$exe" ]; then
    echo "test_example_fused_linear: $exe not found (build the examples)" >&2
    exit 1
fi
"$exe"
status=$?
if [ "$status" -ne 0 ]; then
    echo "test_example_fused_linear: fused_linear_recompute exited with status $status" >&2
    exit 1
fi
