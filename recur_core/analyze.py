"""`python -m recur_core.analyze CKPT`: the paper's measurements on a checkpoint, as report.json.

Steps: train (or load from the cache) the A2 probes on the checkpoint's training-side windows,
trace the first --windows validation windows once to --max-loops (with the probes' chances), derive
elasticity, convergence, allocation curves (fast path), the matched-depth table and token classes
from that one trace, and optionally (--exact) rerun a few policies in the masking harness to
measure how far the fast path is from the exact one. Keys of report.json: docs/REPORT_KEYS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .analysis import (MOVING_KL, allocation, convergence, elasticity, fast_vs_exact, json_safe,
                       operating_threshold, token_classes, vocab_classes)
from .cache import TraceCache
from .checkpoint import load_checkpoint
from .policies import ConvergenceExit, LinearRouter, Uniform
from .probe import DEFAULT_LABEL_EPS, load_or_train_probes
from .settings import SETTINGS
from .stats import Bootstrap
from .trace import trace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recur_core.analyze", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="checkpoint directory (this project's, or a Huginn-0125-format folder)")
    p.add_argument("--text", default=None, help="take the eval / probe windows from this text file (needed when "
                   "the checkpoint ships none, e.g. Huginn); alternate windows go to eval and probe")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window with --text (default 128)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as stored)")
    p.add_argument("--windows", type=int, default=SETTINGS.windows,
                   help=f"validation windows to analyse (default {SETTINGS.windows})")
    p.add_argument("--max-loops", type=int, default=None,
                   help=f"loops of the uniform trace (default max({SETTINGS.min_trace_loops}, the recipe's r_max))")
    p.add_argument("--seed", type=int, default=SETTINGS.seed, help="seed of the noise and the bootstrap")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default: reports/<checkpoint id>)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward batch")
    p.add_argument("--n-boot", type=int, default=SETTINGS.n_boot, help="bootstrap replicates")
    p.add_argument("--probe-windows", type=int, default=SETTINGS.probe_windows,
                   help="training-side windows for the A2 probes")
    p.add_argument("--probe-tokens", type=int, default=SETTINGS.probe_tokens,
                   help="sampled positions per probe window")
    p.add_argument("--label-eps", type=float, default=DEFAULT_LABEL_EPS, help="threshold of A2's KL labels")
    p.add_argument("--exact", action="store_true", help="also run a few policies in the exact masking harness")
    p.add_argument("--exact-windows", type=int, default=SETTINGS.exact_windows,
                   help="windows for --exact (the first ones)")
    p.add_argument("--cache-dir", default=None, help="trace/probe cache (default $RECUR_CACHE_DIR or ~/.cache/recur_core)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--export-trace", action="store_true", help="also write trace.parquet (one row per token x loop)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    ckpt = load_checkpoint(args.checkpoint, args.device, args.dtype)
    if args.text:
        ckpt.use_text(Path(args.text).read_text(), args.seq_len)
    out = Path(args.out) if args.out else Path("reports") / ckpt.checkpoint_id
    out.mkdir(parents=True, exist_ok=True)
    cache = False if args.no_cache else TraceCache(args.cache_dir)
    recipe = ckpt.recipe
    max_loops = args.max_loops or SETTINGS.trace_loops(recipe)
    r_max = min(recipe.r_max, max_loops)
    r_bar = min(recipe.depth, r_max)
    timing = {}

    t0 = time.perf_counter()
    probes = load_or_train_probes(ckpt, r_max, args.seed, label_eps=args.label_eps, n_windows=args.probe_windows,
                                  tokens_per_window=args.probe_tokens, cache=cache, progress=True) if r_max >= 2 else {}
    timing["probes_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    windows = ckpt.windows("eval")[:args.windows]
    tr = trace(ckpt, windows, max_loops, args.seed, probes=list(probes.values()),
               batch_size=args.batch_size, cache=cache, progress=True)
    timing["trace_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    boot = Bootstrap(tr.n_windows, args.n_boot, args.seed)
    alloc = allocation(tr, boot, r_max, r_bar, probes=probes)
    a0_rbar_loss = alloc["curves"]["A0"].loss[0, r_bar - 1]
    class_eps = operating_threshold(alloc["curves"]["A1"], a0_rbar_loss, MOVING_KL)
    report = {
        "checkpoint": {"path": str(Path(args.checkpoint).resolve()), "checkpoint_id": ckpt.checkpoint_id,
                       "recipe": recipe.to_meta(), "recipe_defaulted": list(recipe.defaulted),
                       "step": ckpt.meta.get("step"), "n_params": ckpt.model.num_params()},
        "settings": {**SETTINGS.as_dict(), "windows": tr.n_windows, "seq_len": tr.seq_len, "max_loops": max_loops,
                     "seed": args.seed, "r_max": r_max, "r_bar": r_bar, "n_boot": args.n_boot, "ci_level": boot.level,
                     "label_eps": args.label_eps, "device": args.device, "path": "fast"},
        "elasticity": elasticity(tr, boot),
        "convergence": convergence(tr, boot),
        "allocation": {**alloc["report"], "probes": {k: p.metrics for k, p in probes.items()}},
        "token_classes": {"eps": class_eps, **token_classes(
            tr, vocab_classes(ckpt.tokenizer(), ckpt.config.vocab_size),
            ConvergenceExit(class_eps, r_max=r_max), boot)},
    }
    timing["analysis_s"] = time.perf_counter() - t0

    if args.exact:
        t0 = time.perf_counter()
        report["exact"] = exact_section(ckpt, windows, tr, alloc["curves"], probes, r_max, r_bar, class_eps,
                                        a0_rbar_loss, args)
        timing["exact_s"] = time.perf_counter() - t0
    if args.export_trace:
        tr.to_parquet(out / "trace.parquet")
    timing["total_s"] = time.perf_counter() - t_start
    report["timing"] = timing
    report = json_safe(report)
    (out / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print_tables(report, file=sys.stdout)
    print(f"\nwrote {out / 'report.json'} in {timing['total_s']:.0f} s", file=sys.stdout)
    return report


def exact_section(ckpt, windows, tr, curves, probes, r_max, r_bar, class_eps, a0_rbar_loss, args) -> dict:
    """Fast vs exact on the first --exact-windows windows: A0 at r_bar (a sanity check: the gap is
    0), A1 at the token-class eps and at 1e-3, and each A2 at its operating tau."""
    n = min(args.exact_windows, tr.n_windows)
    policies = [Uniform(r_bar), ConvergenceExit(class_eps, r_max=r_max)]
    if class_eps != MOVING_KL:
        policies.append(ConvergenceExit(MOVING_KL, r_max=r_max))
    for kind, probe in probes.items():
        tau = operating_threshold(curves[f"A2_{kind}"], a0_rbar_loss, 0.5)
        policies.append(LinearRouter(probe, tau, r_max=r_max))
    rows = fast_vs_exact(ckpt, windows[:n], tr.subset(range(n)), policies, Bootstrap(n, args.n_boot, args.seed),
                         progress=True)
    return {"windows": n, "points": rows}


# -- printing ---------------------------------------------------------------------------------------
def _ci(value, low, high, digits=4) -> str:
    if value is None:
        return "n/a"
    fmt = f"{{:.{digits}f}}"
    if low is None or high is None:
        return fmt.format(value)
    return f"{fmt.format(value)} [{fmt.format(low)}, {fmt.format(high)}]"


def _est(d: dict, digits=4) -> str:
    return _ci(d["value"], d["ci_low"], d["ci_high"], digits)


def _diff(d: dict) -> str:
    """A small signed difference with its interval, in scientific notation."""
    if d["value"] is None:
        return "n/a"
    parts = [format(d[k], "+.1e") if d[k] is not None else "n/a" for k in ("value", "ci_low", "ci_high")]
    return f"{parts[0]} [{parts[1]}, {parts[2]}]"


def print_tables(report: dict, file) -> None:
    p = lambda *a: print(*a, file=file)
    s = report["settings"]
    p(f"\n{report['checkpoint']['path']}  ({s['windows']} windows x {s['seq_len']} tokens, "
      f"{s['max_loops']} loops, r_bar {s['r_bar']}, r_max {s['r_max']}; 95% bootstrap CIs over windows)")
    el = report["elasticity"]
    p("\nTable 2. Elasticity: loss (nats/token) at uniform depth r")
    for r, v, lo, hi in zip(el["loops"], el["loss"], el["loss_ci_low"], el["loss_ci_high"]):
        p(f"  r = {r:2d}   {_ci(v, lo, hi)}")
    cv = report["convergence"]
    p(f"\nTable 3. Convergence: mean KL(p_i || p_(i-1)), tokens moving (KL > {cv['moving_threshold']:g}), "
      "relative state change")
    p("  loop   mean KL        moving     state change")
    for i, loop in enumerate(cv["loops"]):
        p(f"  {loop:4d}   {cv['mean_kl_prev'][i]:.3e}   {100 * cv['frac_moving'][i]:6.2f}%   "
          f"{cv['mean_state_change'][i]:.3e}")
    p(f"  median convergence loop: {_ci(cv['median_convergence_loop'], cv['median_convergence_loop_ci_low'], cv['median_convergence_loop_ci_high'], 1)}"
      f"  (never settled: {100 * cv['frac_never_settled']:.1f}%)")
    print_allocation(report["allocation"], p)
    tc = report["token_classes"]
    p(f"\nFig. 4. Mean exit depth by token class (A1, eps = {tc['eps']})")
    for name in ("whitespace", "numeral", "punctuation", "word", "other"):
        c = tc[name]
        p(f"  {name:12s} {_ci(c['mean_exit_depth'], c['ci_low'], c['ci_high'], 2)}   ({c['n_tokens']} tokens)")
    if "exact" in report:
        p(f"\nFast vs exact (masking harness) on {report['exact']['windows']} windows: gap = exact - fast")
        for row in report["exact"]["points"]:
            p(f"  {row['policy']}")
            p(f"    fast  loss {_est(row['fast']['loss'])}  loops {_est(row['fast']['mean_loops'], 2)}")
            p(f"    exact loss {_est(row['exact']['loss'])}  loops {_est(row['exact']['mean_loops'], 2)}")
            p(f"    gap   loss {_diff(row['gap_loss'])}  loops {_diff(row['gap_mean_loops'])}")


def print_allocation(al: dict, p) -> None:
    names = [n for n in ("A1", "A2_argmax", "A2_kl") if n in al]
    p("\nTable 4. Matched depth: loss at the same mean loops, and the difference from A0")
    p("  depth  A0                          " + "".join(f"{n + ' - A0':30s}" for n in names))
    for row in al["matched_depth"]:
        p(f"  {row['depth']:5d}  {_est(row['A0']):28s}" + "".join(f"{_diff(row[n + '_minus_A0']):30s}" for n in names))
    for n in names:
        m = al[f"{n.lower()}_loops_to_match_a0_rbar"]
        p(f"  {n} mean loops to reach A0's loss at r_bar = {m['a0_depth']}: {_est(m, 2)}")
    for kind, metrics in al.get("probes", {}).items():
        h = metrics["heldout"]
        p(f"  A2 probe ({kind} labels), held-out windows: accuracy {h['accuracy']:.3f}, AUC "
          f"{'n/a' if h['auc'] is None else format(h['auc'], '.3f')}, positive rate {h['positive_rate']:.3f}")
    for n in ("A1", *names[1:]):
        p(f"\n  {n} curve (fast path): threshold -> mean loops, loss")
        for pt in al[n]:
            thr = pt["threshold"]
            thr = thr if isinstance(thr, str) else f"{thr:g}"
            p(f"    {pt['threshold_name']} = {thr:>7s}   loops {pt['mean_loops']:6.2f}   loss {_ci(pt['loss'], pt['ci_low'], pt['ci_high'])}")


if __name__ == "__main__":
    main()
