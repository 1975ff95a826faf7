"""The exact allocation sweep: one batched harness pass against one harness run per policy.

The workload is `python -m recur_core.analyze`'s exact sweep on `checkpoints/demo` (A0 at r = 1..r_max,
A1 over analysis.EPS_GRID with the first check at loop 2, A2 over analysis.TAU_GRID for each of the
four probe label kinds), on the first --windows eval windows. Both variants run in this process, on
the same windows, with the same thread count; the per-policy loop is the baseline. Agreement is
reported: the fraction of tokens whose exit depth differs and the largest loss difference. They are
not bit-identical: batches of different shapes round differently, and at ε near float32 rounding of
the KL (1e-7) that moves a few exits by a loop. Work is also counted: lane-loops (one window through
one loop) of the sweep against the window-loops the per-policy runs actually took.

It also prints a floor under any implementation of the sweep: the FLOPs the lanes must compute
(`floor_flops`, from the positions they ran), the rate the batched sweep reached, and the seconds
the whole 128-window sweep would need at this CPU's matmul peak, measured in the same process.

    python -m bench.bench_exact [--checkpoint checkpoints/demo] [--windows 2] [--threads N] [--sweep-only]
Last line: a JSON object with speedup_vs_per_policy (absent with --sweep-only), the work ratio and
the floor figures.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.analysis.allocation import allocation_families
from recur_core.analysis.harness import SweepWork, run_exact_sweep
from recur_core.analysis.probe import load_or_train_probes

ROOT = Path(__file__).resolve().parents[1]


def floor_flops(cfg, work: SweepWork) -> float:
    """FLOPs the sweep's lanes cannot avoid, counted from the positions they ran (2 per MAC).

    Every position run: the adapter, every core block but the last, and the last block's keys and
    values (a frozen position's are read by later ones, and change while an earlier one loops).
    Every unfrozen position: the rest of the last block. In A1's lanes, every position: the last coda
    block's keys and values (earlier coda blocks whole); every unfrozen one: that block's rest and one
    LM-head matmul (the previous loop's head, which the harness also recomputes, is not counted).
    Attention: 2 MACs per (query, key) pair and query dim, in the core blocks before the last only
    (the last block's and the coda's attention of the unfrozen positions is left out: an undercount).
    """
    d, qd, kvd = cfg.d_model, cfg.n_heads * cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim
    kv = d * kvd
    rest = d * qd + qd * d + 3 * d * cfg.ffn_dim  # q, o, SwiGLU
    attn = 2 * qd  # per (query, key) pair
    macs = (work.token_loops * (2 * d * d + (cfg.n_core - 1) * (kv + rest) + kv)
            + work.live_token_loops * rest
            + work.attention_pairs * attn * (cfg.n_core - 1)
            + work.readout_token_loops * ((cfg.n_coda - 1) * (kv + rest) + kv)
            + work.readout_live_token_loops * (rest + cfg.vocab_size * d))
    return 2.0 * macs


def matmul_peak_gflops(d: int, ffn: int, seconds: float = 1.0) -> float:
    """Best GFLOP/s of (4096, d) @ (d, ffn) in this process (its thread count)."""
    a, b = torch.randn(4096, d), torch.randn(d, ffn)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * 4096 * d * ffn / (time.perf_counter() - t) / 1e9)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sweep-only", action="store_true", help="skip the per-policy baseline (the floor only)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint)
    r_max = int(ckpt.meta["recipe"]["r_max"])
    probes = load_or_train_probes(ckpt, r_max, 0)
    policies = [pol for fam in allocation_families(r_max, probes=probes).values() for pol in fam]
    windows = ckpt.windows("eval")[:args.windows]
    loops = max(32, r_max)

    work = SweepWork()
    t0 = time.perf_counter()
    swept = run_exact_sweep(ckpt, windows, policies, loops, 0, work=work)
    sweep_s = time.perf_counter() - t0
    threads = torch.get_num_threads()
    print(f"{len(policies)} policies x {args.windows} windows x {windows.shape[1] - 1} tokens, {threads} threads")
    print(f"  batched sweep       {sweep_s:8.1f} s   {work.lane_loops:6d} lane-loops "
          f"({work.readout_lane_loops} with A1's readout, {work.live_token_loops / max(work.token_loops, 1):.0%} "
          "of positions run still unfrozen)")
    out = {"policies": len(policies), "windows": args.windows, "threads": threads, "sweep_s": sweep_s,
           **work.as_dict(), **floor_report(ckpt.config, work, sweep_s, args.windows, threads)}
    if not args.sweep_only:
        single_work = SweepWork()
        t0 = time.perf_counter()
        single = [run_exact_sweep(ckpt, windows, [pol], loops, 0, work=single_work)[0] for pol in policies]
        single_s = time.perf_counter() - t0
        moved = np.mean([(a.exit_depth != b.exit_depth).mean() for a, b in zip(swept, single, strict=True)])
        loss_diff = max(abs(float(np.nanmean(a.ce)) - float(np.nanmean(b.ce)))
                        for a, b in zip(swept, single, strict=True))
        print(f"  one run per policy  {single_s:8.1f} s   {single_work.lane_loops:6d} window-loops "
              f"(each run stops once all its tokens are frozen; {work.naive_window_loops} to every cap)")
        print(f"  agreement: {moved:.2%} of exits moved, largest loss difference {loss_diff:.1e} nats")
        out.update(per_policy_s=single_s, speedup_vs_per_policy=single_s / sweep_s,
                   per_policy_window_loops=single_work.lane_loops,
                   work_ratio=single_work.lane_loops / work.lane_loops, frac_exits_moved=float(moved),
                   max_loss_diff=loss_diff)
    print(json.dumps(out))
    return out


def floor_report(cfg, work: SweepWork, sweep_s: float, n_windows: int, threads: int, full: int = 128) -> dict:
    """Print and return the floor: FLOPs, the rate reached, and seconds at peak for `full` windows."""
    flops = floor_flops(cfg, work)
    peak = matmul_peak_gflops(cfg.d_model, cfg.ffn_dim)
    rate = flops / sweep_s / 1e9
    at_peak_s = flops * full / n_windows / (peak * 1e9)
    print(f"  floor: {flops / 1e12:.3f} TFLOP here, {flops * full / n_windows / 1e12:.1f} TFLOP for {full} windows; "
          f"the sweep ran at {rate:.1f} GFLOP/s ({rate / peak:.0%} of this process's matmul peak, {peak:.1f} GFLOP/s "
          f"on {threads} threads); at that peak {full} windows need >= {at_peak_s:.0f} s")
    return {"floor_tflop": flops / 1e12, "floor_tflop_full": flops * full / n_windows / 1e12,
            "achieved_gflops": rate, "matmul_peak_gflops": peak, "floor_s_full_at_peak": at_peak_s}


if __name__ == "__main__":
    main()
