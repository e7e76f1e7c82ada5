#!/usr/bin/env bash
# Decode benchmark (issue 14): ndtrain's generation engine against Hugging Face transformers generate() on
# one GPU, from the same weights (a seed-initialised Llama-style model exported as a LlamaForCausalLM
# directory), the same prompts, bf16, a fixed number of new tokens per prompt.
#   1. bench/decode_bench.cpp (ndtrain_decode_bench): init, export, refit (timed), warm-up, timed decode;
#   2. bench/hf_generate.py: transformers generate() with the default dynamic cache, a static cache, and a
#      static cache under generate()'s own torch.compile;
#   3. a table: tokens/s, ms per decode step, ratios, greedy agreement of the first tokens.
# Usage: bench/decode_bench.sh OUTDIR
# Environment: BENCH=path to ndtrain_decode_bench (default build/ndtrain_decode_bench; on the device machine
#   carry a local build and its libraries, see bench/gpu_bench.sh), CONFIG=configs/llama-1b.yaml, BATCH=64,
#   PROMPT=32, NEW=256, REPEATS=3, MODES=dynamic,static,compile, TEMPERATURE=0, PYTHON=python3,
#   SETS (extra key=value overrides), SCRATCH=/tmp/ndtrain-decode, KERNEL_TRACE=1 (one more ndtrain generate()
#   call, untimed, traced kernel by kernel: OUTDIR/trace/decode_kernels.{txt,json}, per decode step).
set -uo pipefail
OUT=${1:?usage: bench/decode_bench.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BENCH=${BENCH:-$REPO/build/ndtrain_decode_bench}
CONFIG=${CONFIG:-configs/llama-1b.yaml}
BATCH=${BATCH:-64} PROMPT=${PROMPT:-32} NEW=${NEW:-256} REPEATS=${REPEATS:-3}
MODES=${MODES:-dynamic,static,compile} TEMPERATURE=${TEMPERATURE:-0} PY=${PYTHON:-python3}
SCRATCH=${SCRATCH:-/tmp/ndtrain-decode}
mkdir -p "$SCRATCH"
[ -d "$REPO/.devlibs" ] && export LD_LIBRARY_PATH="$REPO/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
RES=$OUT/decode.jsonl
: > "$RES"
{
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (+ local changes)')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
} | tee "$OUT/env.txt"
# The model config's data section is not used; a byte tokenizer keeps validation from looking for files.
"$BENCH" --config "$CONFIG" --set train.device=cuda train.precision=bf16 data.task=addition \
  data.tokenizer=byte ${SETS:-} --batch "$BATCH" --prompt-len "$PROMPT" --new "$NEW" --repeats "$REPEATS" \
  --temperature "$TEMPERATURE" --hf-out "$SCRATCH/hf" --prompts-out "$SCRATCH/prompts.json" \
  --tokens-out "$SCRATCH/ndtrain_tokens.json" --json "$RES" ${KERNEL_TRACE:+--kernel-trace "$OUT/trace"} 2>&1 |
  tee "$OUT/ndtrain.log"
$PY bench/hf_generate.py --model "$SCRATCH/hf" --prompts "$SCRATCH/prompts.json" --new "$NEW" \
  --repeats "$REPEATS" --modes "$MODES" --temperature "$TEMPERATURE" --tokens "$SCRATCH/ndtrain_tokens.json" \
  --json "$RES" 2>&1 | grep -v Warning | tee "$OUT/hf.log"
$PY - "$RES" <<'PYEOF' | tee "$OUT/table.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ours = next((r for r in rows if r["engine"] == "ndtrain"), None)
hf = [r for r in rows if r["engine"].startswith("hf_")]
print("| engine | tokens/s | ms / step | ndtrain / this | same first token | same first 8 |")
print("|---|---|---|---|---|---|")
for r in rows:
    ratio = f'{ours["tokens_per_s"] / r["tokens_per_s"]:.2f}x' if ours else "-"
    print(f'| {r["engine"]} | {r["tokens_per_s"]:,.0f} | {r["ms_per_step"]:.2f} | {ratio} | '
          f'{r.get("same_first_1", "-")} | {r.get("same_first_8", "-")} |')
if ours:
    print(f'\nrefit of the weights: from full host fp32 tensors (load_full) {ours["refit_seconds"]:.2f} s; '
          f'from a whole training store on the GPU (refit_from) {ours.get("refit_device_seconds", -1):.3f} s')
    if hf:
        best = max(hf, key=lambda r: r["tokens_per_s"])
        print(f'ndtrain / fastest HF ({best["engine"]}): {ours["tokens_per_s"] / best["tokens_per_s"]:.2f}x')
PYEOF
