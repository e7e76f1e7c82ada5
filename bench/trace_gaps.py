#!/usr/bin/env python3
"""Idle time between consecutive GPU activities of a kernel trace (`ndtrain train --kernel-trace DIR`:
DIR/kernels.rank<r>.json), grouped by who ends before and who starts after each gap: ndtrain's own kernels
("ndt"), cuBLAS ("cublas"), cuDNN ("cudnn"), NCCL ("nccl"), CUB ("cub") and copies/fills ("copy/fill").
Gaps under 50 us (launch and dependency gaps) are summed per pair in ms per step; longer ones (host waits)
are listed. Usage: trace_gaps.py kernels.rank0.json STEPS"""
import json
import sys
from collections import defaultdict


def who(e):
    n = e["name"]
    if e.get("cat") in ("copy", "fill"):
        return "copy/fill"
    low = n.lower()
    if "nccl" in low:
        return "nccl"
    if "cudnn" in low:
        return "cudnn"
    if low.startswith("cub::"):
        return "cub"
    if any(k in n for k in ("nvjet", "xmma", "cutlass", "gemm", "Kernel2")):
        return "cublas"
    return "ndt"


def main():
    events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
    steps = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    events.sort(key=lambda e: e["ts"])
    small, count, large = defaultdict(float), defaultdict(int), []
    end, prev = events[0]["ts"] + events[0]["dur"], events[0]
    for e in events[1:]:
        gap = e["ts"] - end  # us
        if gap > 0:
            if gap < 50:
                key = f"{who(prev)} -> {who(e)}"
                small[key] += gap
                count[key] += 1
            else:
                large.append((gap, prev["name"][:60], e["name"][:60]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    print(f"{len(events) / steps:.0f} activities a step; gaps under 50 us: "
          f"{sum(small.values()) / 1e3 / steps:.3f} ms a step")
    print(f"{'ms/step':>8} {'per step':>8} {'mean us':>8}  before -> after")
    for key, us in sorted(small.items(), key=lambda kv: -kv[1]):
        print(f"{us / 1e3 / steps:8.3f} {count[key] / steps:8.1f} {us / count[key]:8.2f}  {key}")
    for gap, a, b in sorted(large, reverse=True)[:10]:
        print(f"gap of {gap / 1e3:.3f} ms: {a} -> {b}")


if __name__ == "__main__":
    main()
