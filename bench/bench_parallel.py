"""Window batches on worker threads (recur_core.analysis.parallel) against batches one after another using
torch's intra-op threads, for the tracer and the exact harness, in one process.

Both variants run on the same windows with the same torch thread count (--threads); the serial
baseline is RECUR_WORKERS=1 (every batch in the caller, ops split over torch's threads). Each
variant runs --repeats times, interleaved; the best wall time counts. Agreement is reported: the
largest |difference| of the trace's KL and loss, and the fraction of exit depths that differ.

    python -m bench.bench_parallel [--checkpoint checkpoints/demo] [--windows 16] [--threads 2] [--loops N]
Last line: a JSON object with trace_speedup and sweep_speedup (serial time / parallel time).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.analysis.allocation import allocation_families
from recur_core.analysis.harness import run_exact_sweep
from recur_core.analysis.trace import trace
from recur_core.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, workers: str | None):
    """(seconds, result) of fn() with RECUR_WORKERS=workers (None: unset)."""
    saved = os.environ.pop("RECUR_WORKERS", None)
    if workers is not None:
        os.environ["RECUR_WORKERS"] = workers
    try:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    finally:
        os.environ.pop("RECUR_WORKERS", None)
        if saved is not None:
            os.environ["RECUR_WORKERS"] = saved


def compare(name: str, fn, repeats: int) -> tuple[float, float, object, object]:
    """Best wall seconds of the serial and the parallel variant (interleaved) and one result of each."""
    serial, parallel = [], []
    for _ in range(repeats):
        serial.append(timed(fn, "1"))
        parallel.append(timed(fn, None))
    s, p = min(t for t, _ in serial), min(t for t, _ in parallel)
    print(f"{name:12s} serial {s:7.2f} s   worker threads {p:7.2f} s   speedup {s / p:5.2f}x", flush=True)
    return s, p, serial[0][1], parallel[0][1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--loops", type=int, default=None, help="trace depth and loop cap (default: SETTINGS.trace_loops)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint)
    recipe = ckpt.recipe
    loops = args.loops or SETTINGS.trace_loops(recipe)
    windows = ckpt.windows("eval")[:args.windows]
    policies = [pol for fam in allocation_families(min(recipe.r_max, loops)).values() for pol in fam]  # A0 and A1
    print(f"{args.checkpoint}: {args.windows} windows x {windows.shape[1] - 1} tokens, {args.threads} torch "
          f"threads; trace to {loops} loops; exact sweep of {len(policies)} policies (A0, A1)")
    t_s, t_p, tr_s, tr_p = compare("trace", lambda: trace(ckpt, windows, loops, SETTINGS.seed, cache=False),
                                   args.repeats)
    e_s, e_p, ex_s, ex_p = compare("exact sweep", lambda: run_exact_sweep(ckpt, windows, policies, loops, SETTINGS.seed),
                                   args.repeats)
    agree = dict(trace_max_abs_kl=float(np.nanmax(np.abs(tr_s.kl_prev - tr_p.kl_prev))),
                 trace_max_abs_ce=float(np.nanmax(np.abs(tr_s.ce - tr_p.ce))),
                 exit_depth_differs=float(np.mean([(a.exit_depth != b.exit_depth).mean()
                                                   for a, b in zip(ex_s, ex_p, strict=True)])))
    print(f"agreement: trace |ΔKL| ≤ {agree['trace_max_abs_kl']:.2e}, |Δce| ≤ {agree['trace_max_abs_ce']:.2e}; "
          f"exit depths differ for {100 * agree['exit_depth_differs']:.3f}% of tokens")
    out = dict(checkpoint=args.checkpoint, windows=args.windows, threads=args.threads, repeats=args.repeats,
               trace_serial_s=t_s, trace_parallel_s=t_p, trace_speedup=t_s / t_p,
               sweep_serial_s=e_s, sweep_parallel_s=e_p, sweep_speedup=e_s / e_p, **agree)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
