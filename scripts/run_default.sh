#!/usr/bin/env bash
# The default job: install dependencies, build, then train a small Llama-style model on the embedded
# addition task (no download) and print its exact-match accuracy on held-out problems.
# Extra arguments go to `ndtrain train` (e.g. --set train.steps=500).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec ./build/ndtrain train --config configs/addition.yaml "$@"
