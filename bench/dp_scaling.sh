#!/usr/bin/env bash
# Data-parallel scaling on the GPUs of one host (issue 20): GPT-2 124M (configs/gpt2-124m.yaml, the
# embedded toy-grammar task, byte ids in the 50304-row vocabulary), 16 x 1024 tokens per GPU per step
# (weak scaling), bf16, one GPU per rank over NCCL, plain DP and ZeRO-1, on 1, 2, 4, ... GPUs up to the
# number present. Per run: median step_seconds over the steps after WARMUP (metrics.jsonl), tokens/s, and
# the efficiency against the 1-GPU run: tokens/s(n) / (n * tokens/s(1)).
# Usage: bench/dp_scaling.sh NDTRAIN OUTDIR        (STEPS=30 WARMUP=10 GPUS="1 2 4" by default)
# EMBEDDING_GRAD="auto all_reduce" runs each multi-GPU row with each parallel.dp_embedding_grad (default: auto).
# GRAD_WINDOW="true false" likewise with each parallel.dp_grad_window (default: true).
# DP_REDUCTION="nccl copy_engine" likewise with each parallel.dp_reduction (default: nccl; with ZeRO-1 the
# copy engines reduce to the owners).
# MODEL=llama measures the 1B Llama instead (configs/llama-1b.yaml, no TP/PP, 8 x 2048 tokens per GPU in
# microbatches of 4; STEPS=12 WARMUP=4 by default).
# EXTRA_SETS="train.host_sync=step" adds config overrides to every run (space-separated).
# KERNEL_TRACE=20:22 also records those steps' kernels (`ndtrain train --kernel-trace`): per run,
# OUTDIR/<run>.kernels.txt (rank 0's table: exposed communication, per-kernel times) and
# OUTDIR/<run>/kernel_trace/kernels.rank*.json (Chrome traces).
# CLOCKS=1 samples GPU 0's (rank 0's) SM clock and power every 100 ms beside each run (OUTDIR/<run>.clocks.csv,
# bench/clocks.sh) and adds their medians over the timed steps to the table: on H200s the steps run at the
# board's power cap, so a run's clock follows the energy its work needs (docs/performance.md, session 46).
set -uo pipefail
ndtrain=${1:?usage: dp_scaling.sh NDTRAIN OUTDIR}
out=${2:?usage: dp_scaling.sh NDTRAIN OUTDIR}
src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
case ${MODEL:-gpt2} in
  gpt2) config=gpt2-124m.yaml micro=16 per_gpu=16 seq=1024 model_sets=() dsteps=30 dwarm=10 ;;
  llama)
    config=llama-1b.yaml micro=4 per_gpu=8 seq=2048 dsteps=12 dwarm=4
    model_sets=(parallel.tp=1 parallel.pp=1 parallel.sequence_parallel=false)
    ;;
  *) echo "dp_scaling: MODEL must be gpt2 or llama, got '$MODEL'" >&2 && exit 2 ;;
esac
steps=${STEPS:-$dsteps} warmup=${WARMUP:-$dwarm}
embs=${EMBEDDING_GRAD:-auto}
wins=${GRAD_WINDOW:-true}
reds=${DP_REDUCTION:-nccl}
have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
gpus=${GPUS:-}
if [[ -z $gpus ]]; then
  gpus=1
  for n in 2 4 8; do ((n <= have)) && gpus+=" $n"; done
fi
median_step() {  # metrics.jsonl -> median step_seconds of steps >= warmup
  python3 - "$1" "$warmup" <<'EOF'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"step_seconds"' in l]
s = [r["step_seconds"] for r in recs if r.get("type", "train") == "train" and r["step"] >= int(sys.argv[2])]
print(statistics.median(s) if s else "nan")
EOF
}
source "$src/bench/clocks.sh"
clock_cell() {  # RUN_DIR -> GPU 0's median SM clock and power over the timed steps (CLOCKS=1), else "–"
  python3 - "$1" "$warmup" "$src/bench" <<'EOF'
import sys
sys.path.insert(0, sys.argv[3])
from bench_report import clock_stats, read_metrics
c = clock_stats(sys.argv[1], read_metrics(sys.argv[1] + "/metrics.jsonl"), int(sys.argv[2]))
print(f"{c['sm_mhz_median']:.0f} MHz, {c['power_w_median']:.0f} W" if c else "–")
EOF
}
base=0  # tokens/s of the 1-GPU run
printf '| GPUs | ZeRO-1 | embedding grad | grad window | reduction | step ms (median) | tokens/s | efficiency vs 1 GPU | GPU 0 clock, power |\n|---|---|---|---|---|---|---|---|---|\n' >"$out/dp_scaling.md"
for zero1 in false true; do
  for n in $gpus; do
   for emb in $embs; do
   for win in $wins; do
   for red in $reds; do
    [[ $zero1 == true && $n == 1 ]] && continue
    [[ $n == 1 && ( $emb != "${embs%% *}" || $win != "${wins%% *}" || $red != "${reds%% *}" ) ]] && continue  # (one GPU: nothing to reduce)
    dir=$out/dp${n}_zero1_${zero1}_emb_${emb}_win_${win}_red_$red
    [[ $embs == auto && $wins == true && $reds == nccl ]] && dir=$out/dp${n}_zero1_$zero1
    trace=()
    [[ -n ${KERNEL_TRACE:-} ]] && trace=(--kernel-trace "$dir/kernel_trace" --kernel-trace-steps "$KERNEL_TRACE")
    clocks_start "$dir"
    timeout 300 mpirun --allow-run-as-root -np "$n" "$ndtrain" train "${trace[@]}" --config "$src/configs/$config" \
      --set data.task=lm data.tokenizer=byte train.device=cuda train.precision=bf16 parallel.dp="$n" "${model_sets[@]}" \
      parallel.zero1=$zero1 parallel.dp_embedding_grad="$emb" parallel.dp_grad_window="$win" parallel.dp_reduction="$red" train.micro_batch=$micro train.global_batch=$((per_gpu * n)) train.steps="$steps" \
      train.warmup_steps=5 train.log_every=10 train.eval_every=0 ${EXTRA_SETS:-} "train.out_dir=$dir" >"$dir.log" 2>&1
    rc=$?
    clocks_stop
    med=nan
    [[ $rc == 0 && -f $dir/metrics.jsonl ]] && med=$(median_step "$dir/metrics.jsonl")
    rm -f "$dir/model.safetensors"
    [[ -f $dir/kernel_trace/kernels.rank0.txt ]] && cp "$dir/kernel_trace/kernels.rank0.txt" "$dir.kernels.txt"
    if [[ $med == nan ]]; then
      echo "| $n | $zero1 | $emb | $win | $red | FAILED (exit $rc, $(basename "$dir").log) | | | |" >>"$out/dp_scaling.md"
      tail -5 "$dir.log"
      continue
    fi
    read -r tps eff <<<"$(python3 -c "
t = $per_gpu * $seq * $n / $med; b = $base
print(f'{t:.0f}', f'{t / ($n * b):.3f}' if b else '1.000')")"
    [[ $n == 1 ]] && base=$tps
    printf '| %s | %s | %s | %s | %s | %.2f | %s | %s | %s |\n' "$n" "$zero1" "$emb" "$win" "$red" "$(python3 -c "print(1e3 * $med)")" "$tps" \
      "$eff" "$(clock_cell "$dir")" >>"$out/dp_scaling.md"
   done
   done
   done
  done
done
cat "$out/dp_scaling.md"
