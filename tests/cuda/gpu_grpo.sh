#!/usr/bin/env bash
# GRPO on one GPU in bf16 (issue 14): a short SFT run, then GRPO steps whose rollouts come from the
# generation engine (bf16 KV-cache decode, device sampling, CUDA graphs) and whose logprobs come from the
# trainer's bf16 forward on the same tokens. Their disagreement, gen_kl_error (docs/posttraining.md),
# must stay <= 1e-3 at every step. Prints each step's metrics (time split included).
# With 2 GPUs, or SHARE_GPU=1 on one (ranks sharing it over train.device_comm=mpi), the same GRPO steps
# also run on 2 ranks laid out for training as tp2 and dp2, refitting into generation with gen_tp 1 and 2:
# every step the refit gathers TP shards (or re-splits replicas) into the generation layout.
# Usage: gpu_grpo.sh NDTRAIN [OUTDIR] [MPIRUN]. Exit 77 (skipped) without a GPU.
set -euo pipefail
ndt=$1
out=${2:-$(mktemp -d)}
mpirun=${3:-mpirun}
cd "$(dirname "$0")/../.."
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_grpo: no GPU on this machine: skipped"
  exit 77
fi
# Head dim 64 (the CUDA attention kernels take 64 or 128).
sets=(model.n_heads=2 model.n_kv_heads=2 train.device=cuda train.precision=bf16)  # kv heads 2: tp2 divides them
"$ndt" train --config configs/addition-sft.yaml --set "${sets[@]}" train.steps=300 train.log_every=100 \
  train.out_dir="$out/sft"
"$ndt" train --config configs/grpo-addition.yaml --set "${sets[@]}" posttrain.init="$out/sft" train.steps=8 train.warmup_steps=0 \
  train.log_every=1 train.eval_every=0 posttrain.eval_samples=200 train.out_dir="$out/grpo"
check() {  # RUN-DIR NAME: the largest gen_kl_error of the run within 1e-3
  local worst
  worst=$(grep -o '"gen_kl_error":[^,}]*' "$1/metrics.jsonl" | cut -d: -f2 | sort -g | tail -1)
  echo "gpu_grpo $2: largest gen_kl_error over the steps: $worst (limit 1e-3)"
  grep '"step"' "$1/metrics.jsonl" | tail -1
  awk -v w="$worst" 'BEGIN { exit !(w != "" && w + 0 <= 1e-3) }'
}
check "$out/grpo" "1 GPU"
gpus=$(nvidia-smi -L | grep -c '^GPU' || true)
if [[ ${SHARE_GPU:-0} == 1 || $gpus -ge 2 ]]; then
  multi=()
  if [[ $gpus -lt 2 ]]; then multi+=(train.device_comm=mpi); fi
  for layout in "tp2_gen_tp2 parallel.tp=2 posttrain.gen_tp=2" "tp2_gen_tp1 parallel.tp=2 posttrain.gen_tp=1" \
                "dp2_gen_tp2 parallel.dp=2 train.micro_batch=32 posttrain.gen_tp=2"; do
    read -r name lsets <<<"$layout"
    # shellcheck disable=SC2086
    "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$ndt" train --config configs/grpo-addition.yaml \
      --set "${sets[@]}" "${multi[@]}" $lsets posttrain.init="$out/sft" train.steps=8 train.warmup_steps=0 \
      train.log_every=1 train.eval_every=0 posttrain.eval_samples=200 train.out_dir="$out/grpo_$name" \
      > "$out/grpo_$name.log" 2>&1 || { tail -20 "$out/grpo_$name.log"; exit 1; }
    check "$out/grpo_$name" "2 ranks, $name${multi[*]:+ (shared GPU)}"
  done
fi
