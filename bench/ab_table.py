#!/usr/bin/env python3
"""Summarise bench/ab.sh output: per cell, each side's GB/s runs and the median of its ratio to the
run's own baseline (memcpy or raw TCP), then B's median ratio over A's. Reads stdin."""
import json
import statistics
import sys

runs = {"A": [], "B": []}
for line in sys.stdin:
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    tag, _, body = line.partition(" ")
    runs[tag].append(json.loads(body))

def cells(side):
    out = {}
    for run in runs[side]:
        for row in run["rows"]:
            key = (row["path"], row["op"], row["value_bytes"])
            out.setdefault(key, []).append(row)
    return out

a, b = cells("A"), cells("B")
print("| path | op | value | A GB/s | B GB/s | A ratio (median) | B ratio (median) | B/A |")
print("|---|---|---|---|---|---|---|---|")
for key in a:
    ra = statistics.median(r["ratio"] for r in a[key])
    rb = statistics.median(r["ratio"] for r in b.get(key, [])) if key in b else float("nan")
    size = f"{key[2] // 1024} KiB" if key[2] < 1 << 20 else f"{key[2] >> 20} MiB"
    ga = ", ".join(f"{r['pool_gbps']:.1f}" for r in a[key])
    gb = ", ".join(f"{r['pool_gbps']:.1f}" for r in b.get(key, []))
    print(f"| {key[0]} | {key[1]} | {size} | {ga} | {gb} | {ra:.2f} | {rb:.2f} | {rb / ra:.2f} |")
for side in ("A", "B"):
    p50 = " / ".join(f"{r['latency']['p50_us']:.0f}" for r in runs[side])
    p99 = " / ".join(f"{r['latency']['p99_us']:.0f}" for r in runs[side])
    print(f"\n{side}: single 64 KiB remote get p50 {p50} µs, p99 {p99} µs")
