"""Exact decoding by the fixed point against token-by-token decoding and the fast path, in one run.

    python -m bench.bench_fixed_point [--targets demo hops huginn specimen] [--huginn-folder /tmp/full/huginn-0125]
        [--windows N] [--tokens T] [--eps 1e-3] [--threads N] [--skip-decode NAME ...] [--passes-only]
        [--device cuda]

Per target, A1 at ε (the app's first, 1e-3) under the "recompute" KV rule, on the same inputs:
  fast         the uniform trace to the cap plus the policy's fast face (what the app shows first:
               each token read off the uniform run at its exit loop; an upper bound on the saving)
  fixed point  teacher_forced(mode="fixed_point"): exact decoding by parallel passes
  seeded       the same, its first pass seeded with the fast exits (what the app runs once the fast
               strip is shown: its exact strip arrives after fast + seeded)
  decode       teacher_forced(mode="decode"): token by token, the reference
  passes only  with --passes-only: the fixed point without its switch to token-by-token decoding once
               that is cheaper than more passes (STEP_ROWS: the baseline of that switch)
Seconds, the ratios fixed point / fast and decode / fixed point, whether the exits are identical and
the largest |Δ logit|-driven loss difference, and the passes each batch took (its distribution).

Targets: demo and specimen (their first --windows eval windows, --tokens each), hops (its first --windows eval
programs, whole), huginn (a pasted text of --tokens random ids on the synthetic full-size
Huginn-0125 folder, bfloat16 as stored, the app's exact strip; the folder is written by
bench.synthetic when missing, about 7 GB). Last line: a JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from recur_core import load_checkpoint
from recur_core.analysis.trace import trace
from recur_core.decoding import fixed_point as fixed_point_module
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits.policies import ConvergenceExit
from recur_core.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def inputs_of(name: str, args) -> tuple:
    """(checkpoint, windows (N, T + 1))."""
    if name == "huginn":
        folder = args.huginn_folder
        if not (folder / "config.json").is_file():
            from .synthetic import write
            log(f"writing the synthetic Huginn-0125 folder to {folder} ...")
            write("huginn-0125", folder)
        ck = load_checkpoint(folder, device=args.device)
        g = torch.Generator().manual_seed(0)
        return ck, torch.randint(0, ck.config.vocab_size, (1, args.tokens + 1), generator=g)
    ck = load_checkpoint(ROOT / "checkpoints" / name, device=args.device)
    windows = ck.windows("eval")[:args.windows]
    return ck, windows if name == "hops" else windows[:, :args.tokens + 1]


@contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_target(name: str, args) -> dict:
    ck, windows = inputs_of(name, args)
    policy = ConvergenceExit(args.eps)
    cap = ck.recipe.r_max
    N, T = windows.shape[0], windows.shape[1] - 1
    log(f"{name}: {N} x {T} tokens, A1 eps {args.eps:g}, cap {cap}, {ck.model.embed.weight.dtype} on "
        f"{ck.model.embed.weight.device}")

    def fast():
        tr = trace(ck, windows, cap, SETTINGS.seed, cache=False)  # measured, not replayed from disk
        return policy.exits(tr).depth

    fast_exits, fast_s = timed(fast)
    fixed, fixed_s = timed(lambda: teacher_forced(ck, windows, policy, "recompute", seed=SETTINGS.seed, max_loops=cap,
                                                  batch_size=N, mode="fixed_point"))
    seeded, seeded_s = timed(lambda: teacher_forced(ck, windows, policy, "recompute", seed=SETTINGS.seed,
                                                    max_loops=cap, batch_size=N, mode="fixed_point", guess=fast_exits))
    row = {"target": name, "windows": N, "tokens": T, "cap": cap, "fast_s": fast_s, "fixed_point_s": fixed_s,
           "fixed_point_over_fast": fixed_s / fast_s, "passes": fixed.passes, "seeded_s": seeded_s,
           "seeded_passes": seeded.passes, "fast_then_seeded_over_fast": (fast_s + seeded_s) / fast_s,
           "seeded_exits_identical": bool(torch.equal(seeded.exit_loop, fixed.exit_loop)),
           "mean_loops_exact": fixed.mean_loops, "mean_loops_fast": float(fast_exits.mean())}
    if args.passes_only:
        with patched(fixed_point_module, "STEP_ROWS", float("inf")):
            alone, alone_s = timed(lambda: teacher_forced(ck, windows, policy, "recompute", seed=SETTINGS.seed,
                                                          max_loops=cap, batch_size=N, mode="fixed_point"))
        row.update(passes_only_s=alone_s, passes_only_passes=alone.passes)
    if name not in args.skip_decode:
        ref, decode_s = timed(lambda: teacher_forced(ck, windows, policy, "recompute", seed=SETTINGS.seed,
                                                     max_loops=cap, batch_size=N, mode="decode"))
        row.update(decode_s=decode_s, decode_over_fixed_point=decode_s / fixed_s,
                   exits_identical=bool(torch.equal(ref.exit_loop, fixed.exit_loop)),
                   max_abs_ce_diff=float((ref.ce - fixed.ce).abs().max()))
    return row


def passes_per_window(args) -> dict:
    """The passes each window needs alone (batch 1), over the first --windows windows of each shipped
    target: the distribution the issue asks for."""
    out = {}
    for name in ("demo", "hops"):
        if name not in args.targets:
            continue
        ck, windows = inputs_of(name, args)
        tf = teacher_forced(ck, windows, ConvergenceExit(args.eps), "recompute", seed=SETTINGS.seed,
                            max_loops=ck.recipe.r_max, batch_size=1, mode="fixed_point")
        out[name] = dict(sorted(Counter(tf.passes).items()))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.bench_fixed_point", description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["demo", "hops", "huginn"],
                   choices=["demo", "hops", "huginn", "specimen"])
    p.add_argument("--huginn-folder", type=Path, default=Path("/tmp/full/huginn-0125"))
    p.add_argument("--windows", type=int, default=8, help="eval windows of demo / programs of hops")
    p.add_argument("--tokens", type=int, default=128, help="tokens per demo window; of huginn's text (default 128; "
                                                            "the app's pasted-text figure uses 32)")
    p.add_argument("--eps", type=float, default=SETTINGS.default_eps)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="where the models run (cuda: bench/gpu_run.sh's step)")
    p.add_argument("--skip-decode", nargs="*", default=[], help="targets whose token-by-token reference is skipped")
    p.add_argument("--passes-only", action="store_true", help="also time the fixed point without its token-by-token "
                                                              "finish (the switch's baseline)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [run_target(name, args) for name in args.targets]
    print(f"{'target':8} {'N x T':>9} {'fast s':>8} {'fixed s':>8} {'seeded s':>9} {'decode s':>9} {'fixed/fast':>10} "
          f"{'(fast+seeded)/fast':>18} {'decode/fixed':>12} {'same exits':>10}  passes (seeded)")
    for r in rows:
        print(f"{r['target']:8} {r['windows']:>3} x {r['tokens']:<4} {r['fast_s']:8.1f} {r['fixed_point_s']:8.1f} "
              f"{r['seeded_s']:9.1f} {r.get('decode_s', float('nan')):9.1f} {r['fixed_point_over_fast']:10.2f} "
              f"{r['fast_then_seeded_over_fast']:18.2f} {r.get('decode_over_fixed_point', float('nan')):12.1f} "
              f"{str(r.get('exits_identical', '-')):>10}  {r['passes']} ({r['seeded_passes']})"
              + (f"; passes only {r['passes_only_s']:.1f} s, {r['passes_only_passes']} passes" if args.passes_only else "")
              + ("" if r["seeded_exits_identical"] else "; seeded exits differ (a threshold at float noise)"))
    per_window = passes_per_window(args)
    for name, dist in per_window.items():
        print(f"{name}: passes per window alone (passes: windows) {dist}")
    result = {"rows": rows, "passes_per_window": per_window, "threads": torch.get_num_threads(), "device": args.device}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
