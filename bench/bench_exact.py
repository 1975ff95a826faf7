"""The exact allocation sweep: one batched harness pass against one harness run per policy.

The workload is `python -m recur_core.analyze`'s exact sweep on `checkpoints/demo` (A0 at r = 1..r_max,
A1 over analysis.EPS_GRID with the first check at loop 2, A2 over analysis.TAU_GRID for each of the
four probe label kinds), on the first --windows eval windows. Both variants run in this process, on
the same windows, with the same thread count; the per-policy loop is the baseline. Agreement is
reported: the fraction of tokens whose exit depth differs and the largest loss difference. They are
not bit-identical: batches of different shapes round differently, and at ε near float32 rounding of
the KL (1e-7) that moves a few exits by a loop. Work is also counted: lane-loops (one window through
one loop) of the sweep against the window-loops the per-policy runs actually took.

    python bench/bench_exact.py [--checkpoint checkpoints/demo] [--windows 2] [--threads N]
Last line: a JSON object with speedup_vs_per_policy and the work ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from recur_core import load_checkpoint  # noqa: E402
from recur_core.analysis import policy_families  # noqa: E402
from recur_core.harness import SweepWork, run_exact_sweep  # noqa: E402
from recur_core.probe import load_or_train_probes  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint)
    r_max = int(ckpt.meta["recipe"]["r_max"])
    probes = load_or_train_probes(ckpt, r_max, 0)
    policies = [pol for fam in policy_families(r_max, probes=probes).values() for pol in fam]
    windows = ckpt.windows("eval")[:args.windows]
    loops = max(32, r_max)

    work = SweepWork()
    t0 = time.perf_counter()
    swept = run_exact_sweep(ckpt, windows, policies, loops, 0, work=work)
    sweep_s = time.perf_counter() - t0
    single_work = SweepWork()
    t0 = time.perf_counter()
    single = [run_exact_sweep(ckpt, windows, [pol], loops, 0, work=single_work)[0] for pol in policies]
    single_s = time.perf_counter() - t0

    moved = np.mean([(a.exit_depth != b.exit_depth).mean() for a, b in zip(swept, single)])
    loss_diff = max(abs(float(np.nanmean(a.ce)) - float(np.nanmean(b.ce))) for a, b in zip(swept, single))
    print(f"{len(policies)} policies x {args.windows} windows x {windows.shape[1] - 1} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"  one run per policy  {single_s:8.1f} s   {single_work.lane_loops:6d} window-loops "
          f"(each run stops once all its tokens are frozen; {work.naive_window_loops} to every cap)")
    print(f"  batched sweep       {sweep_s:8.1f} s   {work.lane_loops:6d} lane-loops "
          f"({work.readout_lane_loops} with A1's readout, {work.live_token_loops / max(work.token_loops, 1):.0%} "
          "of positions run still unfrozen)")
    print(f"  agreement: {moved:.2%} of exits moved, largest loss difference {loss_diff:.1e} nats")
    out = {"policies": len(policies), "windows": args.windows, "threads": torch.get_num_threads(),
           "per_policy_s": single_s, "sweep_s": sweep_s, "speedup_vs_per_policy": single_s / sweep_s,
           "per_policy_window_loops": single_work.lane_loops, "work_ratio": single_work.lane_loops / work.lane_loops,
           "cpu_note": "wall seconds; see docs/BENCHMARKS.md for the load", "frac_exits_moved": float(moved),
           "max_loss_diff": loss_diff, **work.as_dict()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
