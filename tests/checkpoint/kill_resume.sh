#!/usr/bin/env bash
# Crash and resume (issue 18): an NP-rank training run (dp=NP with ZeRO-1, 1500 steps, a checkpoint every 50)
# is killed at KILLS moments, each time restarted with `--resume auto`, then run to the end; its final weights
# must be byte-identical to an uninterrupted run's, and its metrics.jsonl must hold each train step once with
# the same loss. Every third restart dies DURING a save instead (NDT_CHECKPOINT_CRASH_AFTER_SHARDS: rank 0
# exits after the shards are written, before the index: a torn checkpoint); the others get SIGKILL at a
# random moment. Usage: kill_resume.sh NDTRAIN MPIRUN_WORDS... (NP=4, KILLS=10 by default). Prints how many
# kills landed while the run was alive and how many saves were torn.
set -uo pipefail
ndt=$1; shift
mpirun=("$@")
kills=${KILLS:-10}
np=${NP:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$(dirname "$0")/../.."
common=(train --config configs/tiny-llama.yaml --set parallel.dp=$np parallel.zero1=true train.steps=1500
        train.checkpoint_every=50 train.keep_last=2 train.log_every=1 train.eval_every=0 train.warmup_steps=2)
export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
"${mpirun[@]}" -np "$np" "$ndt" "${common[@]}" train.out_dir="$work/ref" > "$work/ref.log" 2>&1 || {
  cat "$work/ref.log"; exit 1; }
landed=0 torn=0
for i in $(seq 1 "$kills"); do
  if ((i % 3 == 0)); then  # dies inside its first save, after the shards and before the index
    NDT_CHECKPOINT_CRASH_AFTER_SHARDS=1 "${mpirun[@]}" -np "$np" "$ndt" "${common[@]}" train.out_dir="$work/run" \
      --resume auto > "$work/kill$i.log" 2>&1
    if ls -d "$work"/run/checkpoints.tmp-* > /dev/null 2>&1; then torn=$((torn + 1)); fi
    continue
  fi
  setsid "${mpirun[@]}" -np "$np" "$ndt" "${common[@]}" train.out_dir="$work/run" --resume auto \
    > "$work/kill$i.log" 2>&1 &
  pid=$!
  sleep "$(awk -v s="$RANDOM" 'BEGIN { srand(s); printf "%.2f", 1.0 + 4.0 * rand() }')"
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL -- "-$pid" 2>/dev/null
    landed=$((landed + 1))
  fi
  wait "$pid" 2>/dev/null
  pkill -KILL -f "train.out_dir=$work/run" 2>/dev/null
done
"${mpirun[@]}" -np "$np" "$ndt" "${common[@]}" train.out_dir="$work/run" --resume auto > "$work/final.log" 2>&1 || {
  cat "$work/final.log"; exit 1; }
grep -h "resume auto\|resumed from" "$work"/kill*.log "$work/final.log" | sed 's|'"$work"'|RUN|g'
if ! cmp -s "$work/ref/model.safetensors" "$work/run/model.safetensors"; then
  echo "kill_resume: final weights differ from the uninterrupted run"; exit 1
fi
losses() { grep '"type":"train"' "$1" | sed 's/.*"loss":\([^,]*\).*"step":\([0-9]*\).*/\2 \1/' | sort -n; }
if ! diff <(losses "$work/ref/metrics.jsonl") <(losses "$work/run/metrics.jsonl") > "$work/diff.txt"; then
  echo "kill_resume: train metrics differ:"; head "$work/diff.txt"; exit 1
fi
echo "kill_resume: $np ranks, $landed SIGKILLs landed during the run, $torn saves torn mid-write (of $kills restarts); final weights byte-identical, $(losses "$work/run/metrics.jsonl" | wc -l) train records equal"
