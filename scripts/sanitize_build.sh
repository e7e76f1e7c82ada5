#!/usr/bin/env bash
# The clang build that scripts/sanitize.sh and scripts/fuzz.sh share, in build-asan: NDT_CUDA=OFF,
# everything compiled with ASan + UBSan (every report aborts), and NDT_FUZZ=ON, which adds libFuzzer's
# coverage instrumentation to ndtrain_lib so that the fuzz targets link against the same library as the
# unit tests (one library build instead of two). Debug information is line tables only: enough for the
# reports' file:line stacks, and ~15% less compile time than -g. Configures it, then builds the targets named.
# Usage: scripts/sanitize_build.sh TARGET...     (JOBS: build parallelism, default the number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."
FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-asan -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DNDT_CUDA=OFF -DNDT_FUZZ=ON >/dev/null
ninja -C build-asan -j"${JOBS:-$(nproc)}" "$@"
