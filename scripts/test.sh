#!/usr/bin/env bash
# The test command: builds loom with -Wall -Wextra -Werror and runs the ctest
# suite, then builds with AddressSanitizer + UndefinedBehaviorSanitizer and
# runs the suite again, and checks that a build without MPI still trains in
# one process, and that a build without oneDNN (loom's own GEMM) passes the kernel,
# autograd and recompute tests and trains. Exits non-zero on any failure.
# ctest runs as many tests at a time as there are cores: most of a test's
# time that is not loom's threads (process starts, Python's imports, the
# scripts) then overlaps another test's (but for the kernel tests of the
# build without oneDNN, each of which keeps both cores busy).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# The test executables of some layers (tests/<layer>/test_*.c): what the
# builds without MPI and without oneDNN need beside loom.
tests_of() { for d in "$@"; do for f in tests/"$d"/test_*.c; do basename "$f" .c; done; done; }
echo "== release build (-Werror)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WERROR=ON >/dev/null
ninja -C build -j "$jobs"
(cd build && ctest --output-on-failure -j "$jobs")
echo "== ASan + UBSan build"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_WERROR=ON -DLOOM_SANITIZE=ON >/dev/null
ninja -C build-asan -j "$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 LOOM_TEST_SANITIZED=1 \
   ctest --output-on-failure -j "$jobs" -E 'scripts/test_(bench|torch_crosscheck)')
# (timing a sanitized build measures nothing; the cross-check compares numbers with PyTorch's, which the
# release build does, on code paths the sanitized unit and CLI tests run too)
echo "== build without MPI (one process)"
cmake -S . -B build-nompi -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WERROR=ON -DLOOM_WITH_MPI=OFF >/dev/null
ninja -C build-nompi -j "$jobs" loom $(tests_of autograd)
(cd build-nompi && ctest --output-on-failure -j "$jobs" -R 'scripts/test_cli_train|autograd/')
echo "== build without oneDNN (the portable GEMM)"
cmake -S . -B build-nodnn -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WERROR=ON -DLOOM_WITH_ONEDNN=OFF >/dev/null
ninja -C build-nodnn -j "$jobs" loom $(tests_of kernels autograd recompute)
(cd build-nodnn && ctest --output-on-failure -j 1 -R 'kernels/|autograd/|recompute/|scripts/test_cli_train')
