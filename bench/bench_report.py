#!/usr/bin/env python3
"""Table, loss CSV and loss plot for one model of the GPU benchmark (bench/gpu_bench.sh).

Reads each run's metrics.jsonl (ndtrain's, or bench/torch_model.py's, which writes the same fields):
records {"type": "train", "step", "loss", "step_seconds", "elapsed_seconds", "peak_mem_gib"}, one per step.
  tokens/s   global_batch * seq_len * (steps after the warm-up) / (their wall time, from elapsed_seconds)
  step time  median step_seconds over the steps after the warm-up
  MFU        tokens/s * flops_per_token / measured bf16 matmul peak, flops_per_token = 6 N + 6 L H D S
             (N: weights in matmuls incl. the output head; causal attention; ndt_common.flops_per_token).
             Mixture-of-Experts models: N counts the ACTIVE weights, those one token meets: attention, router,
             shared experts and output head in full, the routed experts' weights times top_k / E
             (ndt_common.matmul_params(active=True)); the header line also gives the total and active
             parameter counts (ndt_common.param_counts)
  loss       max |loss_ndtrain - loss_torch| over the first --loss-steps steps (same init, same batches)
  clocks     where gpu_bench.sh sampled them (CLOCKS=1: DIR.clocks.csv), the SM clock and power over the
             timed steps (placed by the records' "time"), the share of samples with a power-cap reason set,
             and the energy of a step (median power x the timed wall time per step)

  bench_report.py --config CFG [--set k=v ...] --peak peak.json --run LABEL=DIR ... [--failed LABEL=WHY ...]
                  --out DIR --title TITLE [--warmup 10] [--loss-steps 50]
Writes DIR/summary.md, DIR/summary.json, DIR/losses.csv, DIR/loss.svg (and DIR/loss.png with matplotlib).
Python standard library only.
"""
import argparse
import csv
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ndt_common import flops_per_token, matmul_params, param_counts, read_config  # noqa: E402

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"]


def read_metrics(path):
    recs = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                r = json.loads(line)
                if r.get("type") == "train" and r.get("loss") is not None:
                    recs.append(r)
    except (OSError, ValueError):
        return []
    by_step = {r["step"]: r for r in recs}  # a resumed file may repeat steps: keep the last
    return [by_step[s] for s in sorted(by_step)]


def run_stats(recs, tokens_per_step, warmup, fpt, peak_tflops):
    steady = [r for r in recs if r["step"] >= warmup]
    if len(steady) < 2:
        return None
    before = [r for r in recs if r["step"] < warmup]
    t0 = before[-1]["elapsed_seconds"] if before else steady[0]["elapsed_seconds"] - steady[0]["step_seconds"]
    wall = steady[-1]["elapsed_seconds"] - t0
    tps = tokens_per_step * len(steady) / wall
    st = {
        "steps": len(recs), "steady_steps": len(steady), "tokens_per_s": tps,
        "step_ms_median": 1e3 * statistics.median(r["step_seconds"] for r in steady),
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0.0) for r in recs),
        "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
    }
    st["mfu"] = tps * fpt / (peak_tflops * 1e12) if peak_tflops else None
    return st


def clock_stats(run_dir, recs, warmup):
    """CLOCKS=1 (gpu_bench.sh): the nvidia-smi samples (RUN_DIR.clocks.csv) taken during the timed steps, as
    the records' Unix times ("time") place them: median SM clock and power, and the share of samples with a
    power-cap reason. None without those times (a sampler start plus elapsed_seconds would be late by the
    process's start-up, ~20 s for the 1B Llama, and pick idle samples)."""
    steady = [r for r in recs if r["step"] >= warmup]
    if len(steady) < 2 or "time" not in steady[0] or "time" not in steady[-1]:
        return None
    try:
        rows = list(csv.reader(open(run_dir + ".clocks.csv")))
    except OSError:
        return None
    lo, hi = steady[0]["time"] - steady[0]["step_seconds"], steady[-1]["time"]
    mhz, watts, capped = [], [], 0
    for row in rows[1:]:  # timestamp, SM clock, memory clock, power, temperature[, reasons]
        try:
            t = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time
            if not lo <= t <= hi:
                continue
            mhz.append(float(row[1].split()[0]))
            watts.append(float(row[3].split()[0]))
            # 0x4 software power cap, 0x80 hardware power brake
            capped += len(row) > 5 and (int(row[5], 16) & 0x84) != 0
        except (ValueError, IndexError):
            continue
    if not mhz:
        return None
    return {"sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz),
            "power_w_median": statistics.median(watts), "power_capped_share": capped / len(mhz),
            "samples": len(mhz)}


def max_abs_diff(a, b, n):
    la, lb = {r["step"]: r["loss"] for r in a}, {r["step"]: r["loss"] for r in b}
    common = [s for s in range(n) if s in la and s in lb]
    if not common:
        return None, 0
    return max(abs(la[s] - lb[s]) for s in common), len(common)


def write_svg(path, series, title, n_steps):
    W, H, L, R, T, B = 760, 420, 70, 170, 40, 50
    pts = [(s, v) for _, recs in series for s, v in recs]
    if not pts:
        return
    xmax = max(1, max(s for s, _ in pts))
    ymin, ymax = min(v for _, v in pts), max(v for _, v in pts)
    pad = 0.05 * (ymax - ymin or 1.0)
    ymin, ymax = ymin - pad, ymax + pad

    def X(s):
        return L + (W - L - R) * s / xmax

    def Y(v):
        return T + (H - T - B) * (1 - (v - ymin) / (ymax - ymin))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">step</text>',
           f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">train loss</text>']
    for i in range(6):
        v = ymin + (ymax - ymin) * i / 5
        out.append(f'<line x1="{L - 4}" y1="{Y(v):.1f}" x2="{W - R}" y2="{Y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 8}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i in range(6):
        s = round(xmax * i / 5)
        out.append(f'<text x="{X(s):.1f}" y="{H - B + 18}" text-anchor="middle">{s}</text>')
    for k, (label, recs) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        dash = ' stroke-dasharray="6 4"' if k > 0 else ""
        d = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in recs)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6"{dash} points="{d}"/>')
        out.append(f'<line x1="{W - R + 12}" y1="{T + 18 * k + 6}" x2="{W - R + 36}" y2="{T + 18 * k + 6}" '
                   f'stroke="{c}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{W - R + 42}" y="{T + 18 * k + 10}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_png(path, series, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 (matplotlib is optional)
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, (label, recs) in enumerate(series):
        ax.plot([s for s, _ in recs], [v for _, v in recs], label=label, linestyle="-" if k == 0 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def fmt(v, spec, none="—"):
    return none if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--peak", default="", help="JSON with peak_tflops (torch_model.py peak)")
    ap.add_argument("--run", action="append", default=[], help="LABEL=DIR holding metrics.jsonl (first = ndtrain)")
    ap.add_argument("--failed", action="append", default=[], help="LABEL=reason for a run that did not finish")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (allocation, compile)")
    ap.add_argument("--loss-steps", type=int, default=50)
    a = ap.parse_args()

    cfg = read_config(a.config, a.set)
    S, gb = cfg["data.seq_len"], cfg["train.global_batch"]
    fpt = flops_per_token(cfg, S)
    peak = None
    if a.peak:
        try:
            peak = json.load(open(a.peak))["peak_tflops"]
        except (OSError, ValueError, KeyError):
            peak = None
    failed = dict(kv.split("=", 1) for kv in a.failed)
    runs = []
    for kv in a.run:
        label, d = kv.split("=", 1)
        recs = read_metrics(os.path.join(d, "metrics.jsonl"))
        st = run_stats(recs, gb * S, a.warmup, fpt, peak)
        if st is not None:
            st["clocks"] = clock_stats(d, recs, a.warmup)
            if st["clocks"]:  # at a power cap the step's energy, not its idle time, sets the speed
                st["clocks"]["joules_per_step"] = st["clocks"]["power_w_median"] * gb * S / st["tokens_per_s"]
        runs.append((label, recs, st))
    os.makedirs(a.out, exist_ok=True)

    title = a.title or cfg["model.style"]
    total_params, active_params = param_counts(cfg)
    if cfg.moe:
        weights = (f"MoE {cfg['model.moe.num_experts']} experts top-{cfg['model.moe.top_k']}: "
                   f"{total_params / 1e6:.1f}M parameters, {active_params / 1e6:.1f}M active; "
                   f"N = {matmul_params(cfg) / 1e6:.1f}M active matmul weights "
                   f"(of {matmul_params(cfg, active=False) / 1e6:.1f}M)")
    else:
        weights = f"{matmul_params(cfg) / 1e6:.1f}M matmul weights"
    lines = [f"### {title}: batch {gb} x {S} tokens, {weights}, "
             f"{fpt / 1e9:.3f} GFLOP/token (6N + 6LHDS)",
             f"bf16 matmul peak (torch.matmul 8192^3, best of 5): {fmt(peak, '.1f')} TFLOP/s; "
             f"timing over steps >= {a.warmup}", "",
             "| run | tokens/s | step ms (median) | MFU | peak mem GiB | steps | loss step 0 → last |",
             "|---|---|---|---|---|---|---|"]
    summary = {"title": title, "config": a.config, "overrides": a.set, "peak_tflops": peak,
               "flops_per_token": fpt, "matmul_params": matmul_params(cfg), "params_total": total_params,
               "params_active": active_params, "runs": {}}
    for label, recs, st in runs:
        if st is None:
            why = failed.get(label, f"no usable metrics ({len(recs)} steps)")
            lines.append(f"| {label} | FAILED: {why} | | | | {len(recs)} | |")
            summary["runs"][label] = {"failed": why, "steps": len(recs)}
            continue
        lines.append(f"| {label} | {st['tokens_per_s']:,.0f} | {st['step_ms_median']:.1f} | "
                     f"{fmt(st['mfu'] and 100 * st['mfu'], '.1f')}{'%' if st['mfu'] else ''} | {st['peak_mem_gib']:.1f} | {st['steps']} | "
                     f"{st['first_loss']:.3f} → {st['last_loss']:.3f} |")
        summary["runs"][label] = st
    lines.append("")
    ref_label, ref_recs, ref_st = runs[0] if runs else (None, [], None)
    for label, recs, st in runs[1:]:
        ratio = ref_st["tokens_per_s"] / st["tokens_per_s"] if ref_st and st else None
        diff, n = max_abs_diff(ref_recs, recs, a.loss_steps)
        lines.append(f"- {ref_label} / {label}: tokens/s ratio **{fmt(ratio, '.3f')}**; "
                     f"max |loss difference| over the first {n} steps: {fmt(diff, '.4f')}")
        summary["runs"][label]["ratio_ndtrain_over_this"] = ratio
        summary["runs"][label]["max_abs_loss_diff_vs_ndtrain"] = diff
    if len(runs) >= 3 and runs[1][2] and runs[2][2]:
        lines.append(f"- {runs[2][0]} / {runs[1][0]}: tokens/s ratio "
                     f"{runs[2][2]['tokens_per_s'] / runs[1][2]['tokens_per_s']:.3f}")
    if len(runs) >= 3:  # two torch runs: their own difference is the bf16 noise level to compare against
        diff, n = max_abs_diff(runs[1][1], runs[2][1], a.loss_steps)
        lines.append(f"- reference noise, {runs[1][0]} vs {runs[2][0]}: max |loss difference| over {n} steps: "
                     f"{fmt(diff, '.4f')}")
        summary["torch_vs_torch_max_abs_loss_diff"] = diff
    for label, _, st in runs:
        c = st and st.get("clocks")
        if c:
            lines.append(f"- clocks over the timed steps, {label}: SM {c['sm_mhz_median']:.0f} MHz median "
                         f"({c['sm_mhz_min']:.0f}–{c['sm_mhz_max']:.0f}), {c['power_w_median']:.0f} W median "
                         f"(about {c['joules_per_step']:.1f} J a step), "
                         f"power cap in {100 * c['power_capped_share']:.0f}% of {c['samples']} samples")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    steps = sorted({r["step"] for _, recs, _ in runs for r in recs})
    with open(os.path.join(a.out, "losses.csv"), "w") as f:
        f.write("step," + ",".join(label.replace(",", " ") for label, _, _ in runs) + "\n")
        for s in steps:
            row = [next((f"{r['loss']:.6f}" for r in recs if r["step"] == s), "") for _, recs, _ in runs]
            f.write(f"{s}," + ",".join(row) + "\n")
    series = [(label, [(r["step"], r["loss"]) for r in recs]) for label, recs, _ in runs if recs]
    write_svg(os.path.join(a.out, "loss.svg"), series, f"{title}: train loss", len(steps))
    write_png(os.path.join(a.out, "loss.png"), series, f"{title}: train loss")


if __name__ == "__main__":
    main()
