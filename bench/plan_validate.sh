#!/usr/bin/env bash
# Checks `ndtrain plan`'s memory model against the GPU (docs/planner.md, "Validation"): for each layout,
# the predicted peak_mem_gib_per_rank (`ndtrain plan --as-configured --json`) next to the one a short
# training run measures (the last train record of its metrics.jsonl), per world rank, with the relative
# error (predicted - measured) / measured. Ends with a markdown table for docs/planner.md.
#
# Usage: bench/plan_validate.sh NDTRAIN CONFIG LAYOUT [LAYOUT ...]
#   LAYOUT: one layout's --set strings in one argument, e.g. "parallel.tp=2 parallel.dp=4 train.recompute=true"
#   (the rank count is the layout's tp * cp * dp * pp).
# Environment:
#   EXTRA_SET    --set strings added to every prediction and run, after the layout's (e.g. synthetic data
#                and several ranks on one GPU: "data.task=lm data.tokenizer=byte train.device_comm=mpi")
#   STEPS        training steps per run (3)
#   DEVICE       train.device of the runs (cuda); cpu runs measure no device memory (checks the plumbing)
#   MPIRUN       launcher for more than one rank ("mpirun --oversubscribe --allow-run-as-root --bind-to none")
#   OUT          directory for plans, runs and logs (a new temporary one)
#   TOL          relative tolerance (0.10)
#   GPU_MEM_GIB  memory of one GPU for the prediction's fit check (80)
#   SKIP_TRAIN=1 compare with the runs already in OUT (OUT/layout-N/run/metrics.jsonl) instead of training
# Exit status: 0 when every measured rank is within TOL (or nothing was measured), 1 otherwise.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
NDT=$1 CONFIG=$2
shift 2
[[ -x $NDT ]] || { echo "plan_validate: $NDT is not an executable" >&2; exit 2; }
STEPS=${STEPS:-3} DEVICE=${DEVICE:-cuda} TOL=${TOL:-0.10} GPU_MEM_GIB=${GPU_MEM_GIB:-80}
read -r -a MPI <<<"${MPIRUN:-mpirun --oversubscribe --allow-run-as-root --bind-to none}"
read -r -a EXTRA <<<"${EXTRA_SET:-}"
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
RESULTS=$OUT/results.tsv
: >"$RESULTS"
echo "plan_validate: $CONFIG, $# layout(s), $STEPS step(s) on $DEVICE, tolerance $TOL, output in $OUT"

i=0
for layout in "$@"; do
  i=$((i + 1))
  dir=$OUT/layout-$i
  mkdir -p "$dir"
  read -r -a sets <<<"$layout"
  echo
  echo "layout $i: $layout${EXTRA_SET:+ (+ $EXTRA_SET)}"
  if ! "$NDT" plan "$CONFIG" --as-configured --json --gpu-mem-gib "$GPU_MEM_GIB" --set "${sets[@]}" "${EXTRA[@]}" \
      >"$dir/plan.json" 2>"$dir/plan.err"; then
    echo "  prediction failed: $(cat "$dir/plan.err")"
    printf '%s\t%s\tplan-error\n' "$i" "$layout" >>"$RESULTS"
    continue
  fi
  ranks=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gpus"])' "$dir/plan.json")
  status=$(python3 -c 'import json,sys; l=json.load(open(sys.argv[1]))["layouts"][0]; print(l["status"])' \
    "$dir/plan.json")
  if [[ $status == invalid ]]; then
    echo "  the trainer refuses this layout: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["layouts"][0]["reason"])' "$dir/plan.json")"
    printf '%s\t%s\tinvalid\n' "$i" "$layout" >>"$RESULTS"
    continue
  fi
  if [[ ${SKIP_TRAIN:-0} != 1 ]]; then
    cmd=("$NDT" train --config "$CONFIG" --set "train.steps=$STEPS" train.warmup_steps=0 train.log_every=1
      train.eval_every=0 train.eval_samples=0 train.checkpoint_every=0 "train.device=$DEVICE"
      "train.out_dir=$dir/run" "${sets[@]}" "${EXTRA[@]}")
    [[ $ranks -gt 1 ]] && cmd=("${MPI[@]}" -np "$ranks" "${cmd[@]}")
    echo "  run: ${cmd[*]}"
    if ! "${cmd[@]}" >"$dir/train.log" 2>&1; then
      echo "  training failed (last lines of $dir/train.log):"
      tail -5 "$dir/train.log" | sed 's/^/    /'
      printf '%s\t%s\ttrain-error\n' "$i" "$layout" >>"$RESULTS"
      continue
    fi
  fi
  python3 - "$dir/plan.json" "$dir/run/metrics.jsonl" "$i" "$layout" "$TOL" "$RESULTS" <<'PY'
import json, sys
plan_path, metrics_path, index, layout, tol, results = sys.argv[1:7]
tol = float(tol)
out = open(results, "a")
l = json.load(open(plan_path))["layouts"][0]
predicted = l["peak_mem_gib_per_rank"]
measured = None
try:
    for line in open(metrics_path):
        rec = json.loads(line)
        if rec.get("type") == "train" and rec.get("peak_mem_gib_per_rank"):
            measured = rec["peak_mem_gib_per_rank"]
except FileNotFoundError:
    pass
where = {s["pp_rank"]: s["peak_at"] for s in l["stages"]}
print(f"  predicted peak {l['peak_gib']:.3f} GiB on world rank {l['peak_world_rank']} "
      f"(pp rank {l['peak_pp_rank']}: {where[l['peak_pp_rank']]})")
if measured is None:
    print("  measured: none (no peak_mem_gib_per_rank in metrics.jsonl: CPU runs do not report device memory)")
    print(f"{index}\t{layout}\tunmeasured", file=out)
    sys.exit(0)
print(f"  {'rank':>4}  {'predicted GiB':>13}  {'measured GiB':>12}  {'rel err':>8}")
for r, (p, m) in enumerate(zip(predicted, measured)):
    err = (p - m) / m if m > 0 else float("inf")
    print(f"  {r:>4}  {p:>13.3f}  {m:>12.3f}  {err:>+8.1%}{'' if abs(err) <= tol else '  OUTSIDE'}")
    print(f"{index}\t{layout}\t{r}\t{p:.4f}\t{m:.4f}\t{err:.4f}", file=out)
PY
done

# Summary and the markdown rows for docs/planner.md (one row per layout: its worst rank).
python3 - "$RESULTS" "$TOL" <<'PY'
import sys
rows, tol = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()], float(sys.argv[2])
measured = [r for r in rows if len(r) == 6]
problems = [r for r in rows if len(r) == 3 and r[2] != "unmeasured"]
print()
if not measured:
    print("no device memory measured (CPU runs report none): nothing to compare")
else:
    inside = sum(abs(float(r[5])) <= tol for r in measured)
    worst = max(abs(float(r[5])) for r in measured)
    print(f"{inside} of {len(measured)} rank(s) within {tol:.0%} (worst |rel err| {worst:.1%})")
    print()
    print("| layout | ranks | worst rank | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|")
    by_layout = {}
    for r in measured:
        by_layout.setdefault((r[0], r[1]), []).append(r)
    for (index, layout), rs in by_layout.items():
        w = max(rs, key=lambda r: abs(float(r[5])))
        print(f"| `{layout}` | {len(rs)} | {w[2]} | {float(w[3]):.3f} | {float(w[4]):.3f} | {float(w[5]):+.1%} |")
for r in problems:
    print(f"layout {r[0]} ({r[1]}): {r[2]}")
sys.exit(1 if problems or (measured and inside < len(measured)) else 0)
PY
