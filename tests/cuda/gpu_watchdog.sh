#!/usr/bin/env bash
# The collective watchdog on the GPU (issue 18; docs/reliability.md). Each case injects a hang and expects
# the job to end within train.collective_timeout_s + 10 s with exit code 124 and the watchdog's message
# naming the wait, the step and the rank:
#   gpu_hang_1rank      one GPU rank whose GPU hangs (debug.fault gpu_hang: a kernel that never ends) at
#                       step 2: the host's wait for the step's results is the stuck call;
#   gpu_hang_dp2_nccl   (2 GPUs) dp2 over NCCL, rank 1's GPU hangs: rank 0's gradient all-reduce never
#                       completes; its NCCL communicator names the operation and is aborted;
#   hang_dp2_shared     (SHARE_GPU=1, one GPU) dp2 over train.device_comm=mpi, rank 1's process hangs:
#                       rank 0 is stuck in the staged MPI all-reduce.
# Usage: gpu_watchdog.sh NDTRAIN [MPIRUN]. No GPU: exit 77 (skipped).
set -uo pipefail
ndtrain=${1:?usage: gpu_watchdog.sh NDTRAIN [MPIRUN]}
mpirun=${2:-mpirun}
src=$(cd "$(dirname "$0")/../.." && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ ${gpus:-0} -lt 1 ]]; then
  echo "gpu_watchdog: no CUDA device on this machine: skipped"
  exit 77
fi
tmp=$(mktemp -d)
timeout_s=3
base=(model.d_model=128 model.n_heads=2 train.device=cuda train.steps=20 train.log_every=1
      train.collective_timeout_s=$timeout_s)
fail=0
# case NAME RANKS EXPECTED-REGEX OVERRIDES...
case_run() {
  local name=$1 np=$2 want=$3
  shift 3
  local t0 t1 rc
  t0=$(date +%s.%N)
  if ((np == 1)); then
    timeout --signal=KILL 120 "$ndtrain" train -c "$src/configs/tiny-llama.yaml" --set "${base[@]}" train.out_dir="$tmp/$name" \
      "$@" > "$tmp/$name.log" 2>&1
  else
    timeout --signal=KILL 120 "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$ndtrain" train \
      -c "$src/configs/tiny-llama.yaml" --set "${base[@]}" train.out_dir="$tmp/$name" "$@" > "$tmp/$name.log" 2>&1
  fi
  rc=$?
  t1=$(date +%s.%N)
  local took
  took=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [[ $rc -eq 0 ]] || ! grep -Eq "$want" "$tmp/$name.log" ||
      awk -v t="$took" -v lim=$((timeout_s + 10 + 20)) 'BEGIN { exit !(t > lim) }'; then
    echo "gpu_watchdog $name: FAIL (exit $rc after $took s)"
    tail -15 "$tmp/$name.log"
    fail=1
  else
    echo "gpu_watchdog $name: PASS (exit $rc after $took s, start-up included)"
    grep -E "watchdog" "$tmp/$name.log" | head -3 | sed 's/^/    /'
  fi
}
case_run gpu_hang_1rank 1 "watchdog: (device synchronize|device-to-host copy|host-to-device copy) .* at step 2" debug.fault=gpu_hang@step=2
if ((gpus >= 2)); then
  case_run gpu_hang_dp2_nccl 2 "watchdog: NCCL all_reduce.*has not completed; aborting" parallel.dp=2 \
    debug.fault=gpu_hang@step=2,rank=1
else
  echo "gpu_watchdog gpu_hang_dp2_nccl: needs 2 GPUs, this machine has $gpus: not run"
fi
if [[ ${SHARE_GPU:-0} == 1 || $gpus -ge 2 ]]; then
  case_run hang_dp2_shared 2 "watchdog: [a-z_ ]+ on a group of 2 rank\(s\) .* at step 2" parallel.dp=2 \
    train.device_comm=mpi debug.fault=hang@step=2,rank=1
fi
rm -rf "$tmp"
exit $fail
