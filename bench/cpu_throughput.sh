#!/usr/bin/env bash
# CPU training throughput: runs a config for a number of steps on 1 process and on a few layouts,
# and prints tokens/s (input tokens, padding included) from the steady-state steps of metrics.jsonl.
# Usage: bench/cpu_throughput.sh [config] [steps]     (build first: scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/addition.yaml}
STEPS=${2:-60}
OUT=$(mktemp -d)
MPIRUN="mpirun --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader"
measure() {  # name, launcher..., then ndtrain args
  local name=$1; shift
  "$@" --set train.steps="$STEPS" train.warmup_steps=1 train.eval_samples=1 train.log_every=1000 \
       train.out_dir="$OUT/$name" >/dev/null
  python3 - "$OUT/$name/metrics.jsonl" "$name" "$CONFIG" <<'PY'
import json, sys, re
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
cfg = open(sys.argv[3]).read()
gb = int(re.search(r"global_batch:\s*(\d+)", cfg).group(1)); sl = int(re.search(r"seq_len:\s*(\d+)", cfg).group(1))
steady = rows[len(rows) // 4:]  # skip warm-up steps
t = sum(r["step_seconds"] for r in steady)
print(f"{sys.argv[2]:<28} {len(steady) * gb * sl / t:>10.0f} tok/s  {1000 * t / len(steady):>8.1f} ms/step")
PY
}
echo "config $CONFIG, $STEPS steps, $(nproc) cores"
OMP_NUM_THREADS=$(nproc) measure "1 process, $(nproc) threads" ./build/ndtrain train --config "$CONFIG"
OMP_NUM_THREADS=1 measure "1 process, 1 thread" ./build/ndtrain train --config "$CONFIG"
export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
measure "dp2 (2 ranks)" $MPIRUN -np 2 ./build/ndtrain train --config "$CONFIG" --set parallel.dp=2
measure "tp2 (2 ranks)" $MPIRUN -np 2 ./build/ndtrain train --config "$CONFIG" --set parallel.tp=2
measure "tp2 dp2 (4 ranks)" $MPIRUN -np 4 ./build/ndtrain train --config "$CONFIG" --set parallel.tp=2 parallel.dp=2
rm -rf "$OUT"
