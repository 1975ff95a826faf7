"""`python -m recur_core.analyze CKPT`: the paper's measurements on a checkpoint, as report.json.

Steps (recur_core.analysis.study, the pipeline the app shares): train (or load from the cache) the A2 probes on the checkpoint's training-side windows (four
label kinds; the KL labels' ε tied to A1's matched ε there, on answer accuracy where the windows have
ground truth), trace the first --windows validation windows once to --max-loops (with the probes'
chances) for elasticity, convergence, token classes and the fast allocation curves, then run the
exact plan in the masking harness (recur_core.analysis.allocation: the points that decide every
headline number, one batched pass per round). The headline numbers (`allocation`, and on a
checkpoint with ground truth `ground_truth`) are exact; `allocation_fast` / `ground_truth_fast` hold
the fast path's and `fast_minus_exact` the gap. --fast-only skips the harness. Keys of report.json:
docs/REPORT_KEYS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .analysis.allocation import operating_threshold
from .analysis.cache import TraceCache
from .analysis.curves import (
    MOVING_KL,
    convergence,
    elasticity,
    fast_minus_exact,
    json_safe,
    token_classes,
    vocab_classes,
)
from .analysis.dynamics import REGIMES, dynamics
from .analysis.ground_truth import operating_point_gaps, print_ground_truth
from .analysis.harness import SweepWork
from .analysis.parallel import keep_freed_memory
from .analysis.probe import LABEL_EPS_A1
from .analysis.study import Study, StudySettings
from .exits import catalogue
from .exits.policies import ConvergenceExit
from .model.formats import load_checkpoint
from .settings import SETTINGS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recur_core.analyze", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="checkpoint directory (this project's, or a Huginn-0125 / Ouro folder)")
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
    p.add_argument("--batch-size", type=int, default=16, help="windows (lanes in the harness) per forward batch")
    p.add_argument("--n-boot", type=int, default=SETTINGS.n_boot, help="bootstrap replicates")
    p.add_argument("--probe-windows", type=int, default=SETTINGS.probe_windows,
                   help="training-side windows for the A2 probes")
    p.add_argument("--probe-tokens", type=int, default=SETTINGS.probe_tokens,
                   help="sampled positions per probe window")
    p.add_argument("--label-eps", default=LABEL_EPS_A1,
                   help="ε of A2's KL labels: a number, or 'a1' (default) for A1's matched ε on the probe windows")
    p.add_argument("--a1-first-check", type=int, choices=(1, 2), default=ConvergenceExit.FIRST_CHECK,
                   help="first loop at which A1 may exit: 2 (default, the paper's) or 1 (KL against the noise readout)")
    p.add_argument("--fast-only", action="store_true",
                   help="skip the masking harness: allocation and ground truth from the trace (fast path) only")
    p.add_argument("--cache-dir", default=None, help="trace/probe cache (default $RECUR_CACHE_DIR or ~/.cache/recur_core)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--export-trace", action="store_true", help="also write trace.parquet (one row per token x loop)")
    p.add_argument("--overthinking", action="store_true",
                   help="also trace the windows to 4 x r_max loops (at most 128): quality past the trained depth")
    args = p.parse_args(argv)
    if args.label_eps != LABEL_EPS_A1:
        try:
            args.label_eps = float(args.label_eps)
        except ValueError:
            p.error(f"--label-eps must be a number or '{LABEL_EPS_A1}', got {args.label_eps!r}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    keep_freed_memory()  # a batch job: reuse freed pages (recur_core.analysis.parallel)
    ckpt = load_checkpoint(args.checkpoint, args.device, args.dtype)
    if args.text:
        ckpt.use_text(Path(args.text).read_text(), args.seq_len)
    out = Path(args.out) if args.out else Path("reports") / ckpt.checkpoint_id
    out.mkdir(parents=True, exist_ok=True)
    study = Study(ckpt, StudySettings(windows=args.windows, max_loops=args.max_loops, seed=args.seed, n_boot=args.n_boot,
                                      probe_windows=args.probe_windows, probe_tokens=args.probe_tokens,
                                      label_eps=args.label_eps, a1_first_check=args.a1_first_check,
                                      batch_size=args.batch_size),
                  cache=False if args.no_cache else TraceCache(args.cache_dir))
    r_max, r_bar, timing = study.r_max, study.r_bar, {}
    t0 = time.perf_counter()
    probes = study.probes(progress=True)
    timing["probes_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tr = study.trace(progress=True)
    timing["trace_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    boot = study.boot
    fast = study.allocation()
    timing["analysis_s"] = time.perf_counter() - t0
    exact, work = None, SweepWork()
    if not args.fast_only:
        t0 = time.perf_counter()
        exact = study.allocation(study.exact_path(progress=True, work=work))
        timing["exact_s"] = time.perf_counter() - t0
    headline = exact or fast
    a0_rbar_loss = fast["curves"]["A0"].loss[0, r_bar - 1]
    class_eps = operating_threshold(fast["curves"]["A1"], a0_rbar_loss, MOVING_KL)
    label_eps = next(iter(probes.values())).label_eps if probes else None
    report = {
        "checkpoint": {"path": str(Path(args.checkpoint).resolve()), "checkpoint_id": ckpt.checkpoint_id,
                       "recipe": ckpt.recipe.to_meta(), "recipe_defaulted": list(ckpt.recipe.defaulted),
                       "step": ckpt.meta.get("step"), "n_params": ckpt.model.num_params()},
        "settings": {**SETTINGS.as_dict(), "windows": tr.n_windows, "seq_len": tr.seq_len,
                     "max_loops": study.max_loops, "seed": args.seed, "r_max": r_max, "r_bar": r_bar,
                     "n_boot": args.n_boot, "ci_level": boot.level, "label_eps": label_eps,
                     "label_eps_rule": next(iter(probes.values())).metrics.get("label_eps_rule") if probes else None,
                     "a1_first_check": args.a1_first_check, "moving_threshold": MOVING_KL, "device": args.device,
                     "path": headline["path"], "torch_threads": _threads()},
        "elasticity": elasticity(tr, boot),
        "convergence": convergence(tr, boot),
        "dynamics": dynamics(tr, boot),
        "allocation": {**headline["report"], "path": headline["path"],
                       "probes": {k: {**p.metrics, "label_eps": p.label_eps} for k, p in probes.items()},
                       "probes_refused": probes.refused},
        "allocation_fast": {**fast["report"], "path": "fast"},
        "token_classes": {"eps": class_eps, "path": "fast", **token_classes(
            tr, vocab_classes(ckpt.tokenizer(), ckpt.config.vocab_size),
            catalogue.make("A1", class_eps, r_max=r_max), boot)},
    }
    report["certified_lipschitz"] = study.lipschitz
    if study.labels is not None:  # a checkpoint whose answer tokens have known hop counts
        t0 = time.perf_counter()
        fast_gt = study.ground_truth()
        report["ground_truth"] = fast_gt if args.fast_only else study.ground_truth(study.exact_path(progress=True))
        if not args.fast_only:
            report["ground_truth_fast"] = {**fast_gt, "fast_minus_exact": operating_point_gaps(fast_gt,
                                                                                              report["ground_truth"])}
        timing["ground_truth_s"] = time.perf_counter() - t0
    if args.overthinking:
        t0 = time.perf_counter()
        report["overthinking"] = study.overthinking(progress=True)
        timing["overthinking_s"] = time.perf_counter() - t0
    if exact is not None:
        report["fast_minus_exact"] = fast_minus_exact(fast["curves"], exact["curves"], boot)
        report["exact_work"] = work.as_dict()
    if args.export_trace:
        tr.to_parquet(out / "trace.parquet")
    timing["total_s"] = time.perf_counter() - t_start
    report["timing"] = timing
    report = json_safe(report)
    (out / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print_tables(report, file=sys.stdout)
    print(f"\nwrote {out / 'report.json'} in {timing['total_s']:.0f} s", file=sys.stdout)
    return report


def _threads() -> dict:
    import torch
    return {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


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
    for r, v, lo, hi in zip(el["loops"], el["loss"], el["loss_ci_low"], el["loss_ci_high"], strict=True):
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
    print_dynamics(report["dynamics"], p)
    if "overthinking" in report:
        print_overthinking(report["overthinking"], p)
    print_allocation(report["allocation"], p)
    tc = report["token_classes"]
    p(f"\nFig. 4. Mean exit depth by token class (A1, eps = {tc['eps']})")
    for name in ("whitespace", "numeral", "punctuation", "word", "other"):
        c = tc[name]
        p(f"  {name:12s} {_ci(c['mean_exit_depth'], c['ci_low'], c['ci_high'], 2)}   ({c['n_tokens']} tokens)")
    if "ground_truth" in report:
        print_ground_truth(report["ground_truth"], p, report.get("ground_truth_fast"))
    if "fast_minus_exact" in report:
        print_gaps(report, p)


def print_dynamics(dy: dict, p) -> None:
    p("\nHidden-state norm ||s_i|| per loop (mean [95% CI], 10th - 90th percentile over tokens)")
    for i in sorted({0, 1, 3, 7, 15, len(dy["loops"]) - 1} & set(range(len(dy["loops"])))):
        p(f"  loop {dy['loops'][i]:3d}   {_ci(dy['mean_state_norm'][i], dy['mean_state_norm_ci_low'][i], dy['mean_state_norm_ci_high'][i], 3)}"
          f"   {dy['state_norm_p10'][i]:.3f} - {dy['state_norm_p90'][i]:.3f}")
    low, high = dy["marginal_band"]
    p(f"Regimes (contraction rate rho of the step size over the last {dy['rate_loops']} loops: settling rho < {low:g}, "
      f"marginal {low:g}..{high:g}, drifting > {high:g}): "
      + ", ".join(f"{name} {_est(dy[f'share_{name}'], 3)}" for name in REGIMES))


def print_overthinking(ov: dict, p) -> None:
    p(f"\nOverthinking: loss to loop {ov['loops'][-1]} (r_max {ov['r_max']}): best at loop {ov['best_loop']}, "
      f"{ov['loss_at_r_max']:.4f} at r_max, {ov['loss_at_last']:.4f} at the last loop; answer flips per token "
      f"{_est(ov['mean_flips'], 2)}, last flip after r_max {_est(ov['share_flipping_past_r_max'], 3)}")
    if "answer_accuracy" in ov:
        acc = ov["answer_accuracy"]
        p("  answer accuracy at loops " + ", ".join(f"{r}: {100 * acc[r - 1]:.1f}%" for r in sorted(
            {1, ov["r_max"], 2 * ov["r_max"], len(acc)}) if r <= len(acc)))


def print_gaps(report: dict, p) -> None:
    w = report["exact_work"]
    p(f"\nFast (trace) vs exact (masking harness), all {report['settings']['windows']} windows: gap = fast - exact "
      f"(paired). The harness ran {w['lane_loops']} lane-loops for the whole sweep, against "
      f"{w['naive_window_loops']} window-loops for one run per policy.")
    for name, rows in report["fast_minus_exact"].items():
        p(f"  {name}")
        for r in rows:
            thr = r["threshold"] if isinstance(r["threshold"], str) else f"{r['threshold']:g}"
            p(f"    {r['threshold_name']} = {thr:>7s}  exact loops {r['exact_mean_loops']['value']:6.2f} loss "
              f"{r['exact_loss']['value']:.4f} | fast loops {r['fast_mean_loops']['value']:6.2f} loss "
              f"{r['fast_loss']['value']:.4f} | gap loss {_diff(r['gap_loss'])}  loops {_diff(r['gap_mean_loops'])}")
    ex, fa = report["allocation"], report["allocation_fast"]
    for key in (k for k in ex if k.endswith("_loops_to_match_a0_rbar")):
        p(f"  {key}: exact {_reach(ex[key])}, fast {_reach(fa[key])}")


def _reach(m: dict) -> str:
    """Loops to match: the estimate with "> cap" for an end that is not reached, and the count of
    bootstrap replicates that never reached the target."""
    fmt = lambda x: f"> {m['cap']}" if x == "inf" else "n/a" if x is None else f"{x:.2f}"
    return (f"{fmt(m['value'])} [{fmt(m['ci_low'])}, {fmt(m['ci_high'])}]"
            f" ({m['n_boot_not_reached']} of {m['n_boot']} replicates never reach it)")


def print_allocation(al: dict, p) -> None:
    names = [n for n in al if n.startswith(("A1", "A2_", "Gate")) and isinstance(al[n], list)]
    p(f"\nTable 4. Matched depth ({al['path']} path): loss at the same mean loops, and the difference from A0")
    p("  depth  A0                          " + "".join(f"{n + ' - A0':30s}" for n in names))
    for row in al["matched_depth"]:
        p(f"  {row['depth']:5d}  {_est(row['A0']):28s}" + "".join(f"{_diff(row[n + '_minus_A0']):30s}" for n in names))
    for n in names:
        m = al[f"{n.lower()}_loops_to_match_a0_rbar"]
        p(f"  {n} mean loops to reach A0's loss at r_bar = {m['a0_depth']}: {_reach(m)}")
    p("\n  A2 label kinds side by side (held-out probe windows; loops to match A0 at r_bar):")
    for kind, metrics in al.get("probes", {}).items():
        h = metrics["heldout"]
        eps = f", label ε {metrics['label_eps']:.2g}" if kind.startswith("kl") else ""
        p(f"    {kind:11s} accuracy {h['accuracy']:.3f}, AUC {'n/a' if h['auc'] is None else format(h['auc'], '.3f')}, "
          f"positive rate {h['positive_rate']:.3f}{eps}; loops {_reach(al[f'a2_{kind}_loops_to_match_a0_rbar'])}")
    for n in names:
        p(f"\n  {n} curve ({al['path']} path): threshold -> mean loops, loss")
        for pt in al[n]:
            thr = pt["threshold"]
            thr = thr if isinstance(thr, str) else f"{thr:g}"
            p(f"    {pt['threshold_name']} = {thr:>7s}   loops {pt['mean_loops']:6.2f}   loss {_ci(pt['loss'], pt['ci_low'], pt['ci_high'])}")


def cli() -> None:
    """The `recur-analyze` console script: main() without its return value (which would be the exit status)."""
    main()


if __name__ == "__main__":
    main()
