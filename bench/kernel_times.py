#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel durations (ncu --csv --metrics gpu__time_duration.sum) by kernel name:
time share of each kernel over the profiled launches. Usage: kernel_times.py ncu.csv [steps]"""
import csv
import sys
from collections import defaultdict

rows = list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"')))
steps = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
tot, cnt = defaultdict(float), defaultdict(int)
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "nsecond")
    v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
    name = r["Kernel Name"][:90]
    tot[name] += v
    cnt[name] += 1
all_us = sum(tot.values())
print(f"{len(rows)} launches, {all_us:.0f} us total, {all_us / steps:.0f} us per step")
for name, us in sorted(tot.items(), key=lambda x: -x[1])[:25]:
    print(f"{us / steps:9.1f} us/step {100 * us / all_us:5.1f}%  n={cnt[name] / steps:5.1f}/step  {name}")
