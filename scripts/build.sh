#!/usr/bin/env bash
# Configures and builds loom into build/ (Release with warnings as errors).
# Usage: scripts/build.sh [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WERROR=ON "$@" >/dev/null
ninja -C build
