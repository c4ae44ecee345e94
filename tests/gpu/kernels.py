#!/usr/bin/env python3
"""Per-step kernel times from an Nsight Compute raw CSV (`ncu --csv --page raw --metrics
gpu__time_duration.sum`), for tests/gpu/profile.sh. Standard library only.

Kernels are listed in launch order; a step begins at each embedding kernel (every forward pass of
a first stage launches one first). For every run of steps with the same kernel sequence it prints
the number of steps, the kernels per step and the device time per step, then the kernels of one
such step grouped by name (count, microseconds), largest first.

  kernels.py CSV [--top N] [--json OUT]
"""
import argparse
import csv
import json
import sys


def read_kernels(path):
    """[(name, grid, block, microseconds)] in launch order."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    # ncu prints its own log lines before the table: the header is the row that names the columns.
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "gpu__time_duration.sum" in r)
    cols = rows[head]
    name_i, time_i = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    grid_i = cols.index("Grid Size") if "Grid Size" in cols else None
    block_i = cols.index("Block Size") if "Block Size" in cols else None
    units = rows[head + 1][time_i] if len(rows) > head + 1 else "ns"
    scale = {"ns": 1e-3, "nsecond": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(units, None)
    body = rows[head + 1:] if scale is None else rows[head + 2:]
    scale = 1e-3 if scale is None else scale
    out = []
    for r in body:
        if len(r) <= max(name_i, time_i):
            continue
        try:
            t = float(r[time_i].replace(",", "")) * scale
        except ValueError:
            continue
        out.append((r[name_i], r[grid_i] if grid_i is not None else "", r[block_i] if block_i is not None else "", t))
    return out


def short(name):
    """The kernel's function name without its namespace, template arguments and parameters."""
    base = name.split("(")[0]
    depth, cut = 0, len(base)
    for i, ch in enumerate(base):
        if ch == "<":
            if depth == 0:
                cut = min(cut, i)
            depth += 1
        elif ch == ">":
            depth -= 1
    base = base[:cut]
    return base.split("::")[-1].strip() or name[:60]


def split_steps(kernels):
    steps, cur = [], []
    for k in kernels:
        if "Embedding" in k[0] and cur:
            steps.append(cur)
            cur = []
        cur.append(k)
    if cur:
        steps.append(cur)
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    kernels = read_kernels(a.csv)
    if not kernels:
        print("kernels.py: no kernel rows in " + a.csv)
        return 1
    steps = split_steps(kernels)
    # Runs of consecutive steps with the same sequence of kernel names.
    runs = []
    for s in steps:
        sig = tuple(short(k[0]) for k in s)
        if runs and runs[-1]["sig"] == sig:
            runs[-1]["steps"].append(s)
        else:
            runs.append({"sig": sig, "steps": [s]})
    report = []
    print(f"{len(kernels)} kernels, {len(steps)} steps, {sum(k[3] for k in kernels) / 1e3:.2f} ms of device time")
    for i, r in enumerate(runs):
        totals = sorted(sum(k[3] for k in s) for s in r["steps"])
        median = totals[len(totals) // 2]
        groups = {}
        for k in r["steps"][len(r["steps"]) // 2]:
            g = groups.setdefault(short(k[0]), [0, 0.0, k[1], k[2]])
            g[0] += 1
            g[1] += k[3]
        top = sorted(groups.items(), key=lambda kv: -kv[1][1])[: a.top]
        print(f"-- run {i}: {len(r['steps'])} step(s), {len(r['sig'])} kernels/step, median {median:.1f} us/step")
        for name, (n, us, grid, block) in top:
            print(f"   {name:40s} x{n:4d} {us:9.1f} us  ({us / max(median, 1e-9):5.1%})  grid {grid} block {block}")
        report.append({"steps": len(r["steps"]), "kernels_per_step": len(r["sig"]), "median_us_per_step": median,
                       "top": [{"kernel": n, "count": c, "us": us, "grid": g, "block": b}
                               for n, (c, us, g, b) in top]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kernels": len(kernels), "runs": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
