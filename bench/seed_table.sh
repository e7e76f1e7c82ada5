#!/usr/bin/env bash
# The MoE seed table (issue 15): SFT, DPO and GRPO for 3 optimizer steps on a MoE model, one
# `ndtrain verify` per (algorithm, layout), each against the single-process run of the same config, seed
# and data; prints one markdown table (first-step loss and grad norm of the layout, their relative
# difference to the single-process baseline, the worst relative difference over the steps, the rollout
# reward and gen_kl_error of GRPO, the weight difference after the last step, verify's verdict).
#
#   CPU (default): configs/tiny-moe.yaml on 8 ranks: EP=8, CP=2 EP=4, CP=2 EP=4 packed, PP=2 EP=4,
#                  PP=2 CP=2 EP=4 packed; fp32, verify's default tolerances (1e-5 relative on loss and
#                  grad norm per step); both model styles (llama, gpt2). One thread per rank; about a
#                  minute on 2 cores.
#   --gpu:         configs/small-moe.yaml on 2 GPUs (train.device=cuda, one GPU per rank): EP=2,
#                  CP=2 EP=2 packed, PP=2; bf16 and fp32 (bf16 compared within 1%).
#
# DPO and GRPO start from a short single-process SFT run of the same preset (made first, ~200 steps);
# SFT rows train the preset's task (1-digit addition, loss on the answer) from the initial weights.
# The CI rows parity_seed_* (tests/parity/CMakeLists.txt) run the CPU rows with the same settings.
# Usage: bench/seed_table.sh [--gpu] [--build DIR] [--out DIR]      (build first: scripts/build.sh)
#        STYLES="llama" bench/seed_table.sh      (one style only)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build OUT="" GPU=0
read -r -a STYLE_LIST <<<"${STYLES:-llama gpt2}"
while [[ $# -gt 0 ]]; do
  case $1 in
    --gpu) GPU=1 ;;
    --build) BUILD=$2; shift ;;
    --out) OUT=$2; shift ;;
    *) echo "usage: $0 [--gpu] [--build DIR] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
NDT=$BUILD/ndtrain
[[ -x $NDT ]] || { echo "$NDT not found: build first" >&2; exit 1; }
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
MPI=(mpirun --oversubscribe --allow-run-as-root --bind-to none)

# Post-training settings (kept equal to tests/parity/CMakeLists.txt, NDT_SEED_*).
PT=(train.lr=1e-4 train.min_lr=1e-4 train.warmup_steps=0 posttrain.eval_samples=0)  # + posttrain.init
GRPO=(posttrain.algo=grpo posttrain.prompts_per_step=4 posttrain.samples_per_prompt=4 posttrain.max_new_tokens=4
      posttrain.epochs=2 posttrain.kl_coef=0.05)
DPO=(posttrain.algo=dpo posttrain.pairs_per_step=8 posttrain.dpo_sft_coef=0.1)

if [[ $GPU == 1 ]]; then
  CONFIG=configs/small-moe.yaml NP=2
  #       name                label                overrides
  LAYOUTS=("ep2                EP=2                 parallel.dp=2 parallel.ep=2"
           "cp2_ep2_packed     CP=2_EP=2_packed     parallel.cp=2 parallel.ep=2 data.packing=true"
           "pp2                PP=2                 parallel.pp=2")
  PRECISIONS=(bf16 fp32)
else
  CONFIG=configs/tiny-moe.yaml NP=8
  LAYOUTS=("ep8                EP=8                 parallel.dp=8 parallel.ep=8"
           "cp2_ep4            CP=2_EP=4            parallel.cp=2 parallel.dp=4 parallel.ep=4"
           "cp2_ep4_packed     CP=2_EP=4_packed     parallel.cp=2 parallel.dp=4 parallel.ep=4 data.packing=true"
           "pp2_ep4            PP=2_EP=4            parallel.pp=2 parallel.dp=4 parallel.ep=4"
           "pp2_cp2_ep4_packed PP=2_CP=2_EP=4_packed parallel.pp=2 parallel.cp=2 parallel.dp=2 parallel.ep=4 data.packing=true")
  PRECISIONS=(fp32)
fi

start=$(date +%s)
for style in "${STYLE_LIST[@]}"; do
for prec in "${PRECISIONS[@]}"; do
  DEV=(model.style="$style") TOL=()
  if [[ $GPU == 1 ]]; then
    DEV+=(train.device=cuda train.precision="$prec")
    # bf16: the design's GPU bound (1%); the generator and trainer run different kernels on GPUs.
    if [[ $prec == bf16 ]]; then TOL=(--tol-loss 1e-2 --tol-weights 5e-2 --tol-logprob 5e-2 --tol-gen-kl 1e-2);
    else TOL=(--tol-gen-kl 1e-3); fi
  fi
  # The post-training starting point: a short single-process SFT run of the preset.
  init=$OUT/init-$style-$prec
  if [[ ! -f $init/model.safetensors ]]; then
    "$NDT" train --config "$CONFIG" --set train.eval_samples=0 train.log_every=1000 "${DEV[@]}" \
      train.out_dir="$init" > "$init.log" 2>&1
  fi
  for algo in sft dpo grpo; do
    SETS=()
    [[ $algo == grpo ]] && SETS=(posttrain.init="$init" "${PT[@]}" "${GRPO[@]}")
    # gpt2 GRPO: the CI rows' prompts (data.seed 1; tests/parity/CMakeLists.txt says why).
    [[ $algo == grpo && $style == gpt2 && $GPU == 0 ]] && SETS+=(data.seed=1)
    [[ $algo == dpo ]] && SETS=(posttrain.init="$init" "${PT[@]}" "${DPO[@]}")
    for i in "${!LAYOUTS[@]}"; do
      read -r name label sets <<<"${LAYOUTS[$i]}"
      log=$OUT/${style}_${prec}_${algo}_${name}.log
      t0=$(date +%s.%N)
      # shellcheck disable=SC2086
      "${MPI[@]}" -np "$NP" "$NDT" verify --config "$CONFIG" --steps 3 "${TOL[@]}" \
        --set "${SETS[@]}" "${DEV[@]}" $sets > "$log" 2>&1 || true
      echo "$(date +%s.%N) - $t0" | bc > "$log.seconds"
      echo "$style $prec $algo $i $label $NP" > "$log.row"
    done
  done
done
done
total=$(( $(date +%s) - start ))

python3 - "$OUT" "$total" "$CONFIG" <<'PY'
import glob, os, re, sys
out, total, config = sys.argv[1], int(sys.argv[2]), sys.argv[3]
num = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?)"
step_re = re.compile(rf"^\s*(\d+)\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s*(<-- FAIL)?$")
pt_re = re.compile(r"^\s*(\d+)\s+((?:reward_mean|reward_margin|gen_kl_error) .*)$")
print(f"config {config}, 3 optimizer steps per row (GRPO: 2 per rollout step, 6 in all), the baseline is verify's"
      " single-process reference; rel = |x - ref| / |ref| (post-training losses: / max(|ref|, 1)); reward: GRPO"
      " mean reward of rollout step 1, DPO reward margin after step 3 (0 at step 1: policy = reference)")
print()
print("| style | precision | algo | layout | ranks | loss step 1 | rel | grad norm step 1 | rel | worst rel, all steps |"
      " vs baseline row: loss, grad norm | reward | gen_kl_error step 1 | weights | verify | seconds |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
order = {"sft": 0, "dpo": 1, "grpo": 2}
rows = []
for meta in glob.glob(os.path.join(out, "*.log.row")):
    style, prec, algo, idx, label, np_ = open(meta).read().split()
    rows.append((style, prec, order[algo], int(idx), algo, label, np_, meta[:-4]))
fails = 0
for style, prec, _, idx, algo, label, np_, log in sorted(rows):
    text = open(log).read().splitlines()
    steps, pt = [], {}
    for line in text:
        m = step_re.match(line)
        if m:
            steps.append([float(x) for x in m.groups()[1:7]])
        m = pt_re.match(line)
        if m:
            for k, v, ref in re.findall(r"(\w+) ([-0-9.e+]+) \(ref ([-0-9.e+]+)\)", m.group(2)):
                if int(m.group(1)) == 0 or k == "reward_margin":  # margin: the last step's
                    pt[k] = (float(v), float(ref))
    w = next((l for l in text if l.startswith("weights after")), "")
    w = re.search(r"= ([0-9.e+-]+)", w)
    verdict = "PASS" if "verify: PASS" in text else "FAIL"
    fails += verdict != "PASS"
    secs = float(open(log + ".seconds").read())
    name = label.replace("_", " ")
    if not steps:
        print(f"| {style} | {prec} | {algo} | {name} | {np_} | no result ({log}) | | | | | | | | FAIL | {secs:.1f} |")
        continue
    lr, l, rl, gr, g, rg = steps[0]
    worst = max(max(s[2], s[5]) for s in steps)
    reward = pt.get("reward_mean") or pt.get("reward_margin")
    kl = pt.get("gen_kl_error")
    fmt_r = lambda v: f"{v:.4f}" if reward else "-"
    if idx == 0:
        kb = f"{kl[1]:.1e}" if kl else "-"
        base = (lr, gr)
        print(f"| {style} | {prec} | {algo} | single process (baseline) | 1 | {lr:.8f} | | {gr:.6f} | | | |"
              f" {fmt_r(reward[1]) if reward else '-'} | {kb} | | | |")
    # Against the baseline row (the first layout's reference, unpacked; from the printed digits): packed
    # rows' own reference packs the same samples into the same microbatches, so it differs from the
    # baseline by fp32 summation order only.
    div = max(abs(base[0]), 1.0) if algo != "sft" else abs(base[0])
    vb = f"{abs(l - base[0]) / div:.1e}, {abs(g - base[1]) / abs(base[1]):.1e}"
    ks = f"{kl[0]:.1e}" if kl else "-"
    ws = f"{float(w.group(1)):.1e}" if w else "-"
    print(f"| {style} | {prec} | {algo} | {name} | {np_} | {l:.8f} | {rl:.1e} | {g:.6f} | {rg:.1e} | {worst:.1e} | {vb} |"
          f" {fmt_r(reward[0]) if reward else '-'} | {ks} | {ws} | {verdict} | {secs:.1f} |")
print()
print(f"{len(rows)} verify runs ({fails} failed) in {total} s, including the SFT starting points; logs in {out}")
sys.exit(1 if fails else 0)
PY
