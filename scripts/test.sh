#!/usr/bin/env bash
# Install dependencies, build, and run the whole test suite (unit tests, gradient checks and the
# multi-rank parity tests under mpirun), then every parser's fuzz target for 20 s (libFuzzer) and the unit
# tests under AddressSanitizer + UndefinedBehaviorSanitizer (one clang build, build-asan, shared by both).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
phase() {  # NAME COMMAND...: run it, then say how long it took (CI's budget is ~30 minutes in all)
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  echo "test.sh: $name took $(($(date +%s) - start)) s ($(($(date +%s) - t0)) s so far)"
}
phase "install_deps" scripts/install_deps.sh --test
phase "build" scripts/build.sh
phase "ctest" ctest --test-dir build --output-on-failure -j1 "$@"
phase "fuzz" scripts/fuzz.sh
phase "sanitize" scripts/sanitize.sh
