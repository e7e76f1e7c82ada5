#!/usr/bin/env bash
# train.host_sync on GPUs: `ndtrain train` with the end of each step decided on the device and the steps read
# back every log step (log, the default on cuda) against the host deciding after every step (step), one GPU
# per rank over NCCL: the final weights byte for byte and every step's loss, norm and skip flag
# (tests/parity/host_sync_same.cmake). fp32 with the built-in attention, which reproduce themselves bit for bit.
# Rows needing more GPUs than this machine has are listed as not run; no GPU at all: exit 77 (skip).
# Usage: gpu_host_sync.sh NDTRAIN [MPIRUN]     (ONLY=regex runs the rows whose style_name matches)
set -uo pipefail
ndtrain=$(readlink -f "${1:?usage: gpu_host_sync.sh NDTRAIN [MPIRUN]}")
mpirun=${2:-mpirun}
src=$(cd "$(dirname "$0")/../.." && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ ${gpus:-0} -lt 1 ]]; then
  echo "gpu_host_sync: no CUDA device on this machine: skipped"
  exit 77
fi
base="model.d_model=256|model.n_heads=4|model.max_seq_len=64|data.seq_len=64|train.device=cuda|train.precision=fp32"
base+="|train.attention=native|train.adam_eps=1e-6|train.steps=9|train.log_every=4|train.eval_samples=2|train.grad_clip=0.5"
rows=(
  "one 1 train.nonfinite=skip|debug.fault=nan_grad@step=5"
  "dp2 2 parallel.dp=2|train.nonfinite=skip|debug.fault=nan_grad@step=5,rank=1"
  "dp2_zero1 2 parallel.dp=2|parallel.zero1=true"
  "tp2_sp 2 parallel.tp=2|parallel.sequence_parallel=true"
  "pp2 2 parallel.pp=2|train.micro_batch=2"
  "cp2_packed 2 parallel.cp=2|data.packing=true|data.min_seq_len=3"
  "pp2_dp2_zero1 4 parallel.pp=2|parallel.dp=2|parallel.zero1=true|train.micro_batch=2"
)
pass=0 fail=0 skipped=()
work=$(mktemp -d)
for style in llama gpt2; do
  for row in "${rows[@]}"; do
    read -r name np sets <<<"$row"
    [[ -n ${ONLY:-} && ! ${style}_${name} =~ $ONLY ]] && continue
    if ((np > gpus)); then
      skipped+=("${style}_${name}")
      continue
    fi
    log=$work/${style}_${name}.log
    timeout "${ROW_TIMEOUT:-180}" cmake -DNDTRAIN="$ndtrain" -DMPIRUN="$mpirun|--allow-run-as-root|--oversubscribe" \
      -DNP="$np" "-DARGS=train|--config|$src/configs/tiny-$style.yaml|--set|$base|$sets" \
      -DDIR="$work/${style}_${name}" -P "$src/tests/parity/host_sync_same.cmake" >"$log" 2>&1
    if [[ $? == 0 ]]; then
      pass=$((pass + 1))
      echo "PASS ${style}_${name} ($np ranks): $(grep -o 'host_sync: .*' "$log")"
    else
      fail=$((fail + 1))
      echo "FAIL ${style}_${name} ($np ranks):"
      tail -25 "$log"
    fi
  done
done
rm -rf "$work"
echo "gpu_host_sync: $pass passed, $fail failed on $gpus GPU(s); not run (GPUs needed): ${skipped[*]:-none}"
((fail == 0))
