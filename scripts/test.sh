#!/usr/bin/env bash
# Install dependencies, build, and run the whole test suite (unit tests, gradient checks and the
# multi-rank parity tests under mpirun).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
cd build
ctest --output-on-failure -j1 "$@"
