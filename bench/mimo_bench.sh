#!/usr/bin/env bash
# Multimodal benchmark (issue 16): a ~300M ViT encoder + ~1.1B LLM (configs/mimo-1b.yaml) trained on one
# GPU in bf16. Two runs of the same steps: (1) as users run it, for tokens/s; (2) with NDT_MIMO_TIMING=1,
# which synchronizes the device at each phase boundary, for the share of step time in the encoder's
# forward and backward and in the bridge (forward: encoder shard -> LLM shard; backward: replica sum and
# routing back). On more GPUs, LAYOUTS runs fan-in / fan-out layouts too (each "name ranks sets").
# Usage: bench/mimo_bench.sh OUTDIR   Environment: NDTRAIN (default build/ndtrain), STEPS=30, SETS, MPIRUN.
set -uo pipefail
OUT=${1:?usage: bench/mimo_bench.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
NDTRAIN=${NDTRAIN:-$REPO/build/ndtrain}
STEPS=${STEPS:-30}
MPIRUN=${MPIRUN:-mpirun --allow-run-as-root --oversubscribe --bind-to none}
[ -d "$REPO/.devlibs" ] && export LD_LIBRARY_PATH="$REPO/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
{
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1
} | tee "$OUT/env.txt"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
run() {  # name ranks timing sets...
  local name=$1 np=$2 timing=$3
  shift 3
  if ((np > gpus)); then
    echo "$name: needs $np GPUs, this machine has $gpus: not run" | tee -a "$OUT/summary.txt"
    return
  fi
  NDT_MIMO_TIMING=$timing $MPIRUN -np "$np" "$NDTRAIN" train -c "$REPO/configs/mimo-1b.yaml" --set \
    train.device=cuda train.steps="$STEPS" train.out_dir="$OUT/$name" ${SETS:-} "$@" > "$OUT/$name.log" 2>&1
  echo "== $name ($np GPU(s), timing sync $timing)" | tee -a "$OUT/summary.txt"
  grep -E "parameters|multimodal|step +$((STEPS - 1))/|mem|error" "$OUT/$name.log" | tail -5 | tee -a "$OUT/summary.txt"
}
run gpu1 1 0
run gpu1_phases 1 1
# Two GPUs: fan-in (encoder dp2 -> LLM tp2) and fan-out (encoder tp2 -> LLM dp2).
run gpu2_fanin 2 1 parallel.tp=2
run gpu2_fanout 2 1 parallel.dp=2 encoder.parallel.tp=2
