#!/usr/bin/env bash
# GPU benchmark (issue 6): ndtrain against PyTorch (eager and torch.compile, flash attention) on one GPU,
# for GPT-2 124M (configs/gpt2-124m.yaml, batch 16 x 1024), the Llama-style ~1B preset
# (configs/llama-1b.yaml, batch 8 x 2048 in microbatches of 4, parallel.* = 1) and, with MODELS=moe, the
# Mixture-of-Experts preset (configs/moe-1b.yaml: 1.22B parameters, 0.25B active, 16 experts top-2; batch
# 8 x 2048 in microbatches of 4; PyTorch side: torch._grouped_mm experts where available, see
# bench/torch_model.py), bf16 with fp32 master weights and AdamW on both sides, in one call:
#   1. bf16 matmul peak: torch.matmul 8192^3, best of 5 trials (the MFU denominator);
#   2. per model: a token shard from a random Markov chain (bench/make_markov_shard.py; GPT-2 / Llama
#      vocabulary ids, loss falls visibly within 50 steps);
#   3. ndtrain's initial weights: a 0-step run on the CPU writes them (model.safetensors);
#   4. ndtrain `train --set train.device=cuda train.precision=bf16 ...`, then bench/torch_model.py eager and
#      compile from those weights on the same batches (the same sample_index order);
#   5. bench/bench_report.py: tokens/s, median step time, MFU (6N + 6LHDS FLOPs per token; MoE: N = the
#      ACTIVE matmul weights, routed experts counted top_k / E), peak memory,
#      ratios ndtrain / torch, max |loss difference| over the first 50 steps; losses.csv, loss.svg/png.
# A failing trainer does not stop the others: its row says FAILED and the log is kept.
#
# Usage: bench/gpu_bench.sh OUTDIR           (from the repository root; OUTDIR receives logs and results)
# Environment (all optional):
#   NDTRAIN=path     ndtrain binary. Unset: build/bench/ndtrain, configured with cmake and built if absent
#                    (needs yaml-cpp, fmt, OpenBLAS, CLI11, nlohmann-json: the GPU machine of the device
#                    tool lacks them, so there build here, copy the binary into a carried folder with
#                    scripts/device_libs.sh .devlibs BINARY, and pass NDTRAIN=that/ndtrain; .devlibs in the
#                    repo root is put on LD_LIBRARY_PATH by this script)
#   MODELS="gpt2 llama"  (also: moe; tiny, tiny-moe: smoke tests)
#   STEPS=60  WARMUP=10 (steps left out of timing)  LOSS_STEPS=50
#   TORCH_MODES="eager compile"  PYTHON=python3  TIMEOUT=400 (seconds per training run); modes: eager,
#                    compile (both read the loss back every step, as ndtrain: "same semantics"), fastest
#                    (torch.compile with the loss read back every 10 steps, SDPA's own backend choice;
#                    TORCH_COMPILE_MODE sets its compile mode), autotune (the same as fastest under
#                    mode="max-autotune-no-cudagraphs": Inductor times Triton and cuBLAS choices per matmul,
#                    minutes of compiling; its runs get AUTOTUNE_TIMEOUT=1200 s). Pad the
#                    vocabulary for both sides with GPT2_SETS=model.vocab_size=50304.
#   SCRATCH=/tmp/ndtrain-bench   big files (shards, initial weights), removed per model unless KEEP=1
#   GPT2_SETS, LLAMA_SETS, MOE_SETS  extra `key=value` overrides for both trainers
#   LLAMA_BATCH=8 LLAMA_MICRO=4 LLAMA_SEQ=2048 LLAMA_RECOMPUTE=false
#   MOE_BATCH=8 MOE_MICRO=4 MOE_SEQ=2048 MOE_RECOMPUTE=false
#   NDT_TORCH_MOE_GEMM=auto|grouped|loop   the PyTorch MoE experts' path (auto: grouped if its probe passes)
#   NDTRAIN_EXTRA="native:NDT_ATTENTION=native"  more ndtrain rows, each "label:VAR=value" (an environment
#                    variable for that run; here: the built-in attention kernel instead of cuDNN's);
#                    "label:NDTRAIN=path" runs another ndtrain binary instead (a before/after pair);
#                    "label:SET=key=value" adds a config override (e.g. "step:SET=train.host_sync=step")
#   KERNEL_TRACE=20:22           the ndtrain row also writes a CUPTI kernel trace of those steps
#                    (MODEL/kernel_trace/kernels.rank0.{json,txt}; `ndtrain train --kernel-trace`)
#   NDTRAIN_LAUNCH               prefix for ndtrain (e.g. "mpirun -np 1 --allow-run-as-root"; default none)
#   CLOCKS=1         samples the GPU's SM and memory clocks, power, temperature and throttle reasons every
#                    100 ms during each training run (nvidia-smi) into MODEL/<run>.clocks.csv; the report
#                    gives each run's median SM clock and power over its timed steps and the share of samples
#                    with a power cap (the steps' Unix times: "time" in metrics.jsonl)
#   DEVICE=cuda PRECISION=bf16   MODELS=tiny DEVICE=cpu PRECISION=fp32 smoke-tests the script without a GPU
set -uo pipefail

OUT=${1:?usage: bench/gpu_bench.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
MODELS=${MODELS:-gpt2 llama}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-10}
LOSS_STEPS=${LOSS_STEPS:-50}
TORCH_MODES=${TORCH_MODES:-eager compile}
TIMEOUT=${TIMEOUT:-400}
SCRATCH=${SCRATCH:-/tmp/ndtrain-bench}
LAUNCH=${NDTRAIN_LAUNCH:-}

source "$REPO/bench/clocks.sh"  # CLOCKS=1: clocks_start STEM / clocks_stop around each training run
DEVICE=${DEVICE:-cuda}        # cpu (with PRECISION=fp32): a GPU-less dry run of the script (MODELS=tiny)
PRECISION=${PRECISION:-bf16}
mkdir -p "$SCRATCH"
[ -d "$REPO/.devlibs" ] && export LD_LIBRARY_PATH="$REPO/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
log() { echo "[gpu_bench $(date +%H:%M:%S)] $*" | tee -a "$OUT/bench.log"; }

# ---- ndtrain binary ----------------------------------------------------------------------------------
if [ "$DEVICE" = cpu ] && [ "$PRECISION" = bf16 ]; then PRECISION=fp32; fi
if [ -z "${NDTRAIN:-}" ]; then
  NDTRAIN=$REPO/build/bench/ndtrain
  if [ ! -x "$NDTRAIN" ]; then
    log "building ndtrain (cmake, Release) in build/bench"
    gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    { cmake -S "$REPO" -B "$REPO/build/bench" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DNDT_BUILD_TESTS=OFF &&
      cmake --build "$REPO/build/bench" --target ndtrain -j "$(nproc)"; } > "$OUT/build.log" 2>&1 ||
      log "ndtrain build FAILED (see build.log); continuing with the PyTorch runs"
  fi
fi
NDTRAIN=$(readlink -f "$NDTRAIN" 2>/dev/null || echo "$NDTRAIN")
[ -x "$NDTRAIN" ] || log "no ndtrain binary at $NDTRAIN: ndtrain rows will say FAILED"

{
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (+ local changes)')"
  echo "ndtrain: $NDTRAIN"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

# ---- 1. matmul peak ----------------------------------------------------------------------------------
log "bf16 matmul peak"
$PY bench/torch_model.py peak > "$OUT/peak.json" 2> "$OUT/peak.log" || log "peak measurement FAILED (see peak.log)"
cat "$OUT/peak.json"

# ---- per model ---------------------------------------------------------------------------------------
# run_model NAME CONFIG TITLE VOCAB TOKENIZER SET...
run_model() {
  local name=$1 cfg=$2 title=$3 vocab=$4 tokenizer=$5; shift 5
  local dir=$OUT/$name data=$SCRATCH/$name.bin
  mkdir -p "$dir"
  local sets=("$@")
  local gb seq
  gb=$(printf '%s\n' "${sets[@]}" | sed -n 's/^train.global_batch=//p' | tail -1)
  seq=$(printf '%s\n' "${sets[@]}" | sed -n 's/^data.seq_len=//p' | tail -1)
  # Two samples per step's worth of data beyond the run: the order is a permutation of the whole shard.
  local tokens=$(( 2 * STEPS * gb * seq + 1 ))
  log "$name: data ($tokens tokens, vocab $vocab)"
  $PY bench/make_markov_shard.py "$data" --vocab "$vocab" --tokens "$tokens" > "$dir/data.log" 2>&1 ||
    { log "$name: data generation FAILED"; cat "$dir/data.log"; return; }
  sets+=("data.path=$data" "data.tokenizer=$tokenizer")

  log "$name: ndtrain initial weights (0-step CPU run)"
  local init=$SCRATCH/$name-init
  rm -rf "$init"
  $LAUNCH "$NDTRAIN" train -c "$cfg" --set "${sets[@]}" train.steps=0 train.warmup_steps=0 train.device=cpu \
    "train.out_dir=$init" > "$dir/ndtrain_init.log" 2>&1
  local init_file=$init/model.safetensors
  if [ ! -f "$init_file" ]; then
    log "$name: no ndtrain initial weights (see ndtrain_init.log): torch runs start from their own init," \
        "the loss comparison is meaningless"
    init_file=""
  fi

  local failed=() runs=()
  log "$name: ndtrain train ($DEVICE, $PRECISION)"
  local trace=()
  [ -n "${KERNEL_TRACE:-}" ] && trace=(--kernel-trace "$dir/kernel_trace" --kernel-trace-steps "$KERNEL_TRACE")
  clocks_start "$dir/ndtrain"
  timeout "$TIMEOUT" $LAUNCH "$NDTRAIN" train -c "$cfg" "${trace[@]}" --set "${sets[@]}" train.device="$DEVICE" \
    train.precision="$PRECISION" "train.out_dir=$dir/ndtrain" > "$dir/ndtrain.log" 2>&1
  local rc=$?
  clocks_stop
  rm -f "$dir/ndtrain/model.safetensors"  # final weights: large and not needed
  tail -n 3 "$dir/ndtrain.log"
  [ $rc -ne 0 ] && { log "$name: ndtrain FAILED (exit $rc, see $name/ndtrain.log)"; failed+=(--failed "ndtrain=exit $rc, see ndtrain.log"); }
  runs+=(--run "ndtrain=$dir/ndtrain")
  for extra in ${NDTRAIN_EXTRA:-}; do  # "label:VAR=value": ndtrain again with that environment variable
    local label=${extra%%:*} envset=${extra#*:} bin=$NDTRAIN more=()
    [ "${envset%%=*}" = NDTRAIN ] && bin=$(readlink -f "${envset#NDTRAIN=}")  # another binary, same settings
    [ "${envset%%=*}" = SET ] && more=("${envset#SET=}") && envset=NDT_BENCH_LABEL=$label  # another setting
    log "$name: ndtrain $label ($envset ${more[*]})"
    clocks_start "$dir/ndtrain_$label"
    env "$envset" timeout "$TIMEOUT" $LAUNCH "$bin" train -c "$cfg" --set "${sets[@]}" "${more[@]}" train.device="$DEVICE" \
      train.precision="$PRECISION" "train.out_dir=$dir/ndtrain_$label" > "$dir/ndtrain_$label.log" 2>&1 ||
      failed+=(--failed "ndtrain $label=exit $?, see ndtrain_$label.log")
    clocks_stop
    rm -f "$dir/ndtrain_$label/model.safetensors"
    runs+=(--run "ndtrain $label=$dir/ndtrain_$label")
  done

  for mode in $TORCH_MODES; do
    log "$name: torch $mode"
    local how=(--mode "$mode") limit=$TIMEOUT
    local fast=(--mode compile --sync-every 10 --attention auto)
    case $mode in
      fastest) how=("${fast[@]}" --compile-mode "${TORCH_COMPILE_MODE:-}") ;;
      autotune) how=("${fast[@]}" --compile-mode max-autotune-no-cudagraphs) limit=${AUTOTUNE_TIMEOUT:-1200} ;;
    esac
    clocks_start "$dir/torch_$mode"
    timeout "$limit" $PY bench/torch_model.py train --config "$cfg" --set "${sets[@]}" ${init_file:+--init "$init_file"} \
      "${how[@]}" --device "$DEVICE" --precision "$PRECISION" --out "$dir/torch_$mode" > "$dir/torch_$mode.log" 2>&1
    rc=$?
    clocks_stop
    tail -n 2 "$dir/torch_$mode.log"
    [ $rc -ne 0 ] && { log "$name: torch $mode FAILED (exit $rc)"; failed+=(--failed "torch $mode=exit $rc, see torch_$mode.log"); }
    runs+=(--run "torch $mode=$dir/torch_$mode")
  done

  $PY bench/bench_report.py --config "$cfg" --set "${sets[@]}" --peak "$OUT/peak.json" "${runs[@]}" "${failed[@]}" \
    --out "$dir" --title "$title" --warmup "$WARMUP" --loss-steps "$LOSS_STEPS" | tee -a "$OUT/summary.md"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$init" "$data"
}

COMMON=(train.steps="$STEPS" train.warmup_steps=10 train.log_every=10 train.eval_every=0 train.checkpoint_every=0
        parallel.tp=1 parallel.dp=1 parallel.pp=1 parallel.cp=1 parallel.sequence_parallel=false parallel.zero1=false)
: > "$OUT/summary.md"
for m in $MODELS; do
  case $m in
    gpt2)
      # shellcheck disable=SC2086
      run_model gpt2 configs/gpt2-124m.yaml "GPT-2 124M" 50257 ids:50257 "${COMMON[@]}" train.global_batch=16 \
        train.micro_batch=16 data.seq_len=1024 ${GPT2_SETS:-} ;;
    llama)
      # shellcheck disable=SC2086
      run_model llama configs/llama-1b.yaml "Llama ~1B" 32000 ids:32000 "${COMMON[@]}" train.global_batch="${LLAMA_BATCH:-8}" \
        train.micro_batch="${LLAMA_MICRO:-4}" data.seq_len="${LLAMA_SEQ:-2048}" \
        train.recompute="${LLAMA_RECOMPUTE:-false}" ${LLAMA_SETS:-} ;;
    moe)
      # shellcheck disable=SC2086
      run_model moe configs/moe-1b.yaml "MoE 1.2B (0.25B active)" 32000 ids:32000 "${COMMON[@]}" parallel.ep=1 \
        train.global_batch="${MOE_BATCH:-8}" train.micro_batch="${MOE_MICRO:-4}" data.seq_len="${MOE_SEQ:-2048}" \
        train.recompute="${MOE_RECOMPUTE:-false}" ${MOE_SETS:-} ;;
    tiny)  # smoke test of this script (seconds; DEVICE=cpu PRECISION=fp32 runs it without a GPU)
      run_model tiny configs/tiny-gpt2.yaml "tiny GPT-2 (smoke test)" 259 byte "${COMMON[@]}" data.task=shards \
        train.global_batch=8 train.micro_batch=4 data.seq_len=32 ;;
    tiny-moe)  # smoke test of the MoE path (tiny Llama, 4 experts top-2, z-loss on; DEVICE=cpu PRECISION=fp32 works)
      run_model tiny-moe configs/tiny-llama.yaml "tiny Llama MoE (smoke test)" 259 byte "${COMMON[@]}" parallel.ep=1 \
        data.task=shards model.moe.num_experts=4 model.moe.top_k=2 model.moe.z_loss_coef=0.001 \
        train.global_batch=8 train.micro_batch=4 data.seq_len=32 ;;
    *) log "unknown model '$m' (gpt2, llama, moe, tiny, tiny-moe)" ;;
  esac
done
log "done: $OUT/summary.md"
