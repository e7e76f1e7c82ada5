#!/usr/bin/env bash
# Install dependencies, build, and run the whole test suite (unit tests, gradient checks and the
# multi-rank parity tests under mpirun), then every parser's fuzz target for 20 s (libFuzzer) and the unit
# tests under AddressSanitizer + UndefinedBehaviorSanitizer (one clang build, build-asan, shared by both).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --test
scripts/build.sh
(cd build && ctest --output-on-failure -j1 "$@")
scripts/fuzz.sh
scripts/sanitize.sh
