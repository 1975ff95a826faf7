"""`python -m bench.bench_analyze [CKPT]`: the wall time of `python -m recur_core.analyze` from a cold
cache (a fresh temporary cache folder: probes, trace and every exact round are computed), by stage,
against the issue-26 budget of 300 s for `checkpoints/demo --windows 128 --max-loops 32` on a 2-core
CPU; with how many thresholds the exact plan ran, against the grid a full exact sweep would run.
Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from recur_core.analyze import main as analyze

BUDGET_S = 300.0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", default="checkpoints/demo")
    p.add_argument("--windows", type=int, default=128)
    p.add_argument("--max-loops", type=int, default=32)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = analyze([args.checkpoint, "--windows", str(args.windows), "--max-loops", str(args.max_loops),
                          "--cache-dir", os.path.join(tmp, "cache"), "--out", os.path.join(tmp, "out")])
    timing = report["timing"]
    exact, fast = report["allocation"], report["allocation_fast"]
    points = {name: (len(exact["exact_points"][name]), len(fast[name])) for name in exact["exact_points"]}
    print(f"\n{args.checkpoint}, {args.windows} windows x {args.max_loops} loops, cold cache "
          f"(path {exact['path']}, {os.cpu_count()} CPUs)")
    for stage, seconds in timing.items():
        print(f"  {stage:16s} {seconds:8.1f} s")
    print(f"  total against the {BUDGET_S:.0f} s budget: {timing['total_s'] / BUDGET_S:.2f}x")
    for name, (n_exact, n_grid) in points.items():
        print(f"  {name:14s} exact points {n_exact:3d} of {n_grid} on the grid")
    result = {"checkpoint": args.checkpoint, "windows": args.windows, "max_loops": args.max_loops,
              "timing": timing, "budget_s": BUDGET_S, "within_budget": timing["total_s"] < BUDGET_S,
              "exact_points": points, "path": exact["path"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
