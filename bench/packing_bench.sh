#!/usr/bin/env bash
# Packing vs padding on a skewed length distribution: lm task, sample lengths drawn log-uniformly from
# 16 to 1024 tokens, the same samples trained padded (every sample padded to 1024) and packed (THD,
# token budget = micro_batch x seq_len). Prints loss-bearing tokens per second (padding never counts) from
# the steady-state steps of metrics.jsonl, and the speed-up.
# Usage: bench/packing_bench.sh [steps] [extra --set overrides...]     (build first: scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-8}
shift || true
OUT=$(mktemp -d)
COMMON=(--config configs/lm.yaml --set model.d_model=128 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2
        model.max_seq_len=1024 data.seq_len=1024 data.min_seq_len=16 train.global_batch=16 train.micro_batch=4
        train.steps="$STEPS" train.warmup_steps=1 train.eval_samples=0 train.eval_every=0 train.log_every=1000 "$@")
run() {  # name, extra overrides
  local name=$1; shift
  OMP_NUM_THREADS=$(nproc) ./build/ndtrain train "${COMMON[@]}" train.out_dir="$OUT/$name" "$@" >/dev/null
  python3 - "$OUT/$name/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
steady = rows[len(rows) // 4:]
t = sum(r["step_seconds"] for r in steady)
print(f'{sum(r["loss_tokens"] for r in steady) / t:.1f} {1000 * t / len(steady):.1f} {sum(r["loss"] for r in rows)/len(rows):.9f}')
PY
}
read -r pad_tps pad_ms pad_loss < <(run padded --set data.packing=false)
read -r pack_tps pack_ms pack_loss < <(run packed --set data.packing=true)
echo "lengths log-uniform in [16, 1024], global batch 16, $STEPS steps, $(nproc) cores"
printf "%-8s %14s %12s %16s\n" mode "loss tok/s" "ms/step" "mean loss"
printf "%-8s %14s %12s %16s\n" padded "$pad_tps" "$pad_ms" "$pad_loss"
printf "%-8s %14s %12s %16s\n" packed "$pack_tps" "$pack_ms" "$pack_loss"
python3 -c "print(f'packing speed-up: {$pack_tps / $pad_tps:.2f}x (same samples, same losses: {abs($pack_loss - $pad_loss):.1e} apart)')"
rm -rf "$OUT"
