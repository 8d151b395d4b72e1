# Shared helpers for the script tests (sourced).
set -euo pipefail
LOOM=${LOOM_BINARY_DIR:?}/loom
SRC=${LOOM_SOURCE_DIR:?}
WORK=$(mktemp -d /tmp/loom-test.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# The PyTorch oracle's interpreter: a missing torch is a failure, not a skip.
PY_TORCH=/usr/bin/python3
require_torch() {
  "$PY_TORCH" -c "import torch, numpy" 2>/dev/null || fail "$PY_TORCH cannot import torch and numpy; install them \
with scripts/setup.sh (Debian packages python3-torch, python3-numpy)"
}
# A small corpus of real English-ish text that every checkout has: loom's own
# documentation and sources.
corpus() { ls "$SRC"/README.md "$SRC"/src/*/*.c "$SRC"/include/loom/*.h; }
# A small model config (Hugging Face names).
small_config() { # $1 path, $2 vocab
  cat > "$1" <<JSON
{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "intermediate_size": 128, "vocab_size": $2, "max_position_embeddings": 64,
 "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
JSON
}
# small_config's file $2 with more fields ($3, JSON members), written to $1.
config_plus() {
  sed "s/\"rms_norm_eps\": 1e-5}/\"rms_norm_eps\": 1e-5, $3}/" "$2" > "$1"
  grep -qF "$3" "$1" || fail "config_plus: $2 is not small_config's"
}
make_data() { # $1 dir
  "$LOOM" tokenize --train $(corpus) --vocab 512 --in $(corpus) --out "$1" --val-fraction 0.1 2>"$WORK/tokenize.log"
}
# Expect a command to fail cleanly (exit 1 or 2, not a signal) with a message
# matching $1; its exit code is left in $last_rc.
expect_error() {
  local pattern=$1; shift
  set +e
  "$@" >"$WORK/out.log" 2>"$WORK/err.log"
  local rc=$?
  set -e
  last_rc=$rc
  if [ $rc -eq 0 ]; then fail "expected failure: $*"; fi
  if [ $rc -gt 2 ]; then cat "$WORK/err.log" >&2; fail "exit code $rc (crash?) for: $*"; fi
  grep -q -E -e "$pattern" "$WORK/err.log" || { cat "$WORK/err.log" >&2; fail "message does not match /$pattern/ for: $*"; }
}
# The same, and the exit code must be 2: a usage error (a flag or value refused).
expect_usage() {
  expect_error "$@"
  [ "$last_rc" -eq 2 ] || fail "exit code $last_rc, not 2 (usage), for: ${*:2}"
}
