#!/usr/bin/env bash
# Layouts across the GPUs of one host (issues 13, 14, 17, 20), one GPU per rank over NCCL, bf16, the
# embedded toy-grammar task (byte ids), nothing downloaded. Each run's median step_seconds over steps >= 4
# (metrics.jsonl); layouts that need more GPUs than the host has are skipped. Sections (SECTIONS="..."):
#   cp     the 1B Llama on 8192-token sequences over 1, 2 and 4 GPUs of context parallelism (ring and
#          all-gather attention); strong scaling: "of GPUs x 1 GPU" is tokens/s over GPUs x one GPU's
#   llama  configs/llama-1b.yaml, 8 x 2048 tokens per model replica: 1 GPU, tp2 + SP (with and without
#          parallel.tp_comm_overlap), pp2 (8 microbatches
#          of 1, 1F1B), dp2 (and dp2 with the embedding table all-reduced, parallel.dp_embedding_grad), and on 4 GPUs tp2 + SP x dp2, pp2 x dp2, dp4; efficiency = tokens/s against
#          (GPUs x the 1-GPU run); the pipeline rows add the measured and theoretical bubble
#   moe    configs/moe-1b.yaml, 8 x 2048 tokens per GPU (weak scaling): 1 GPU, ep2 (dp2), ep4 (dp4); then
#          NDT_CUDA_PROFILE phases of 1 GPU and ep2 (the dispatch/combine phase holds the all-to-alls)
#   refit  GRPO steps of the 1.10B Llama shape (addition task, 16 prompts x 8 samples, random weights,
#          partial-match reward): refit_seconds and the step's time split, 1 GPU and training layout ->
#          generation layout tp2 -> gen_tp 2, dp2 -> gen_tp 1, dp2 -> gen_tp 2, pp2 -> gen_tp 2
# Usage: bench/multi_gpu.sh NDTRAIN OUTDIR     (SECTIONS="llama moe refit" by default)
# KERNEL_TRACE=A:B also traces steps A to B of the llama, cp and moe runs (`ndtrain train --kernel-trace`;
# the window must lie within every run's steps, e.g. 6:7; the refit section is not traced): per run
# OUTDIR/<run>.kernels.txt (rank 0's table) and, under the report's tables, each run's exposed
# communication per step (the share of a step that waits for NCCL with no compute beside it).
set -uo pipefail
nd=${1:?usage: multi_gpu.sh NDTRAIN OUTDIR}
out=${2:?usage: multi_gpu.sh NDTRAIN OUTDIR}
src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
report=$out/multi_gpu.md
: >"$report"
med() {  # metrics.jsonl first-step key -> median of the train records
  python3 - "$@" <<'EOF'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
s = [r[sys.argv[3]] for r in recs if r.get("type") == "train" and sys.argv[3] in r and r["step"] >= int(sys.argv[2])]
print(f"{statistics.median(s):.6f}" if s else "nan")
EOF
}
# run NAME RANKS ARGS...: one ndtrain run; sets $step (median s) and $bubble; the log stays in $out
run() {
  local name=$1 np=$2
  shift 2
  step=nan bubble=""
  if ((np > have)); then
    echo "$name: needs $np GPUs, $have here: skipped"
    return 1
  fi
  local dir=$out/$name trace=()
  [[ -n ${KERNEL_TRACE:-} ]] && trace=(--kernel-trace "$dir.trace" --kernel-trace-steps "$KERNEL_TRACE")
  timeout 300 mpirun --allow-run-as-root --bind-to none -np "$np" "$nd" train "${trace[@]}" "$@" \
    "train.out_dir=$dir" >"$dir.log" 2>&1
  local rc=$?
  if [[ $rc != 0 || ! -f $dir/metrics.jsonl ]]; then
    echo "$name: FAILED (exit $rc, $dir.log)"
    tail -5 "$dir.log"
    rm -rf "$dir"
    return 1
  fi
  step=$(med "$dir/metrics.jsonl" 4 step_seconds)  # nan for post-training runs (no step_seconds)
  bubble=$(grep -m1 -o 'measured [0-9.]*%, theoretical [0-9.]*%' "$dir.log" || true)
  cp "$dir/metrics.jsonl" "$dir.metrics.jsonl"
  rm -rf "$dir"
  if [[ -f $dir.trace/kernels.rank0.txt ]]; then
    cp "$dir.trace/kernels.rank0.txt" "$dir.kernels.txt"
    rm -rf "$dir.trace"
    traced+=("$name: $(head -1 "$dir.kernels.txt")")
  fi
}
traced=()  # one line per traced run, printed under the report
row() {  # NAME GPUS TOKENS_PER_STEP: a table row against the section's 1-GPU tokens/s ($base)
  python3 - "$1" "$2" "$3" "$step" "$base" "$bubble" >>"$report" <<'EOF'
import sys
name, gpus, tokens, step, base, bubble = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5] or 0), sys.argv[6]
tps = tokens / step
eff = f"{100 * tps / (gpus * base):.1f}%" if base else "-"
print(f"| {name} | {gpus} | {1e3 * step:.1f} | {tps:,.0f} | {eff} | {bubble or '-'} |")
EOF
}
header() { printf '\n%s\n\n| run | GPUs | step ms | tokens/s | of GPUs x 1 GPU | bubble |\n|---|---|---|---|---|---|\n' "$1" >>"$report"; }
sections=${SECTIONS:-llama moe refit}

if [[ " $sections " == *" llama "* ]]; then
  header "Llama 1B (configs/llama-1b.yaml), bf16, 8 x 2048 tokens per replica"
  L=(--config "$src/configs/llama-1b.yaml" --set data.task=lm data.tokenizer=byte train.device=cuda
     train.precision=bf16 parallel.tp=1 parallel.dp=1 parallel.pp=1 parallel.sequence_parallel=false
     parallel.zero1=false train.steps=12 train.warmup_steps=5 train.log_every=1 train.eval_every=0
     train.eval_samples=8 train.collective_timeout_s=60)
  base=0
  run llama_1gpu 1 "${L[@]}" train.micro_batch=4 train.global_batch=8 && row 1gpu 1 16384 &&
    base=$(python3 -c "print(16384 / $step)")
  run llama_tp2_sp 2 "${L[@]}" parallel.tp=2 parallel.sequence_parallel=true train.micro_batch=4 \
    train.global_batch=8 && row tp2_sp 2 16384
  run llama_tp2_sp_serial 2 "${L[@]}" parallel.tp=2 parallel.sequence_parallel=true \
    parallel.tp_comm_overlap=false train.micro_batch=4 train.global_batch=8 && row tp2_sp_no_overlap 2 16384
  run llama_pp2 2 "${L[@]}" parallel.pp=2 train.micro_batch=1 train.global_batch=8 && row pp2_m8 2 16384
  run llama_dp2 2 "${L[@]}" parallel.dp=2 train.micro_batch=4 train.global_batch=16 && row dp2 2 32768
  run llama_dp2_table_all_reduce 2 "${L[@]}" parallel.dp=2 parallel.dp_embedding_grad=all_reduce \
    train.micro_batch=4 train.global_batch=16 && row dp2_table_all_reduce 2 32768
  run llama_tp2_sp_dp2 4 "${L[@]}" parallel.tp=2 parallel.dp=2 parallel.sequence_parallel=true \
    train.micro_batch=4 train.global_batch=16 && row tp2_sp_dp2 4 32768
  run llama_pp2_dp2 4 "${L[@]}" parallel.pp=2 parallel.dp=2 train.micro_batch=1 train.global_batch=16 &&
    row pp2_dp2_m8 4 32768
  run llama_dp4 4 "${L[@]}" parallel.dp=4 train.micro_batch=4 train.global_batch=32 && row dp4 4 65536
fi

if [[ " $sections " == *" cp "* ]]; then
  # Long sequences: the 1B model on 8192-token sequences, one per step per model replica, over 1, 2, 4
  # GPUs of context parallelism (ring attention; each GPU holds 8192 / cp tokens of every layer).
  header "Llama 1B, 8192-token sequences (1 per step), context parallel, bf16"
  C=(--config "$src/configs/llama-1b.yaml" --set data.task=lm data.tokenizer=byte train.device=cuda
     train.precision=bf16 parallel.tp=1 parallel.dp=1 parallel.pp=1 parallel.sequence_parallel=false
     parallel.zero1=false data.seq_len=8192 model.max_seq_len=8192 train.micro_batch=1 train.global_batch=1 train.steps=12
     train.warmup_steps=5 train.log_every=1 train.eval_every=0 train.eval_samples=2 train.collective_timeout_s=60)
  base=0
  run llama8k_1gpu 1 "${C[@]}" && row 1gpu_8k 1 8192 && base=$(python3 -c "print(8192 / $step)")
  run llama8k_cp2 2 "${C[@]}" parallel.cp=2 && row cp2_8k 2 8192
  run llama8k_cp4 4 "${C[@]}" parallel.cp=4 && row cp4_8k 4 8192
  run llama8k_cp4_ag 4 "${C[@]}" parallel.cp=4 parallel.cp_attention=allgather && row cp4_allgather_8k 4 8192
fi

if [[ " $sections " == *" moe "* ]]; then
  header "MoE 1.2B / 0.25B active (configs/moe-1b.yaml), bf16, 8 x 2048 tokens per GPU"
  M=(--config "$src/configs/moe-1b.yaml" --set data.task=lm data.tokenizer=byte train.device=cuda
     train.precision=bf16 train.steps=16 train.warmup_steps=5 train.log_every=1 train.eval_every=0
     train.eval_samples=8 train.collective_timeout_s=60 train.micro_batch=4)
  base=0
  run moe_1gpu 1 "${M[@]}" train.global_batch=8 && row 1gpu 1 16384 && base=$(python3 -c "print(16384 / $step)")
  run moe_ep2 2 "${M[@]}" parallel.dp=2 parallel.ep=2 train.global_batch=16 && row ep2_dp2 2 32768
  run moe_ep4 4 "${M[@]}" parallel.dp=4 parallel.ep=4 train.global_batch=32 && row ep4_dp4 4 65536
  for n in 1 2; do
    sets=(train.global_batch=$((8 * n)) train.steps=8)
    ((n > 1)) && sets+=("parallel.dp=$n" "parallel.ep=$n")
    NDT_CUDA_PROFILE=1 run moe_ep${n}_phases "$n" "${M[@]}" "${sets[@]}" &&
      { echo; echo "GPU phases, ep$n, steps 4-7 (rank 0):"; grep -h "gpu phases, step [4-7]" "$out/moe_ep${n}_phases.log"; } >>"$report"
  done
fi

if [[ " $sections " == *" refit "* ]]; then
  printf '\nGRPO step of the 1.10B Llama shape (median of steps 2-6, seconds)\n\n| layout | refit | generate | logprobs | train | gen_kl_error |\n|---|---|---|---|---|---|\n' >>"$report"
  G=(--config "$src/configs/grpo-addition.yaml" --set posttrain.init= model.style=llama model.d_model=2048
     model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.d_ff=8192 train.device=cuda train.precision=bf16
     posttrain.prompts_per_step=16 posttrain.dynamic_sampling=false posttrain.reward=partial_match
     train.micro_batch=32 train.steps=6 train.warmup_steps=0 train.log_every=1 train.eval_every=0
     posttrain.eval_samples=0)
  for spec in "1gpu 1" "tp2_gen2 2 parallel.tp=2 posttrain.gen_tp=2" "dp2_gen1 2 parallel.dp=2 posttrain.gen_tp=1" \
    "dp2_gen2 2 parallel.dp=2 posttrain.gen_tp=2" "pp2_gen2 2 parallel.pp=2 posttrain.gen_tp=2"; do
    read -r name np sets <<<"$spec"
    # shellcheck disable=SC2086
    KERNEL_TRACE='' run "refit_$name" "$np" "${G[@]}" $sets || true
    f=$out/refit_$name.metrics.jsonl
    [[ -f $f ]] || continue
    echo "| $name | $(med "$f" 2 refit_seconds) | $(med "$f" 2 time_generate) | $(med "$f" 2 time_logprobs) |" \
      "$(med "$f" 2 time_train) | $(med "$f" 2 gen_kl_error) |" >>"$report"
  done
fi
if ((${#traced[@]})); then
  printf '\nKernel traces (rank 0, steps %s; OUTDIR/<run>.kernels.txt):\n\n' "$KERNEL_TRACE" >>"$report"
  printf -- '- %s\n' "${traced[@]}" >>"$report"
fi
cat "$report"
