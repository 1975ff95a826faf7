"""`python -m bench.looped_dynamics WHAT CKPT...`: issue 48's figures on shipped checkpoints and fixtures.

  regimes CKPT...       the share of tokens settling / marginal / drifting and the hidden-state norm
                        (recur_core.analysis.dynamics) on the first --windows eval windows, traced to
                        max(32, r_max) loops; a folder without eval windows (the Huginn / Ouro
                        fixtures) reads the FineWeb-Edu fixture text in 64-token windows.
  overthinking CKPT     loss and answer accuracy from r_bar to 4 x r_max (at most 128) loops, the
                        7-10-hop answers apart, and the tokens' answer flips.
  accel CKPT            exact ground truth for A1 and Accel: each family's operating point (the cheapest
                        threshold within 1 point of A0@r_bar's answer accuracy) against the best uniform
                        depth.
  certified CKPT        the readout's measured Lipschitz bound L, the certified exit's exits at L on the
                        uniform trace, and its violations in real decoding (recompute) at --positions.
  gt_cost CKPT          the exact ground truth's work: each family's thresholds in the masking harness
                        (Accel's among them) and the certified exit's one decoding at its measured L.

Each prints its table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.analysis.certify import LIPSCHITZ_WINDOWS, measured_lipschitz, readout_lipschitz, violations
from recur_core.analysis.dynamics import REGIMES, dynamics, overthinking, overthinking_loops
from recur_core.analysis.exact import ExactPath
from recur_core.analysis.ground_truth import (
    Labels,
    answer_hops,
    eos_id,
    ground_truth_section,
    load_ground_truth,
    operating_point_families,
)
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.exits import catalogue
from recur_core.exits.policies import CertifiedExit
from recur_core.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_TEXT = ROOT / "tests" / "fixtures" / "fineweb-edu" / "validation.jsonl"


def open_checkpoint(path: str):
    ckpt = load_checkpoint(path)
    if not (Path(path) / "eval_windows.safetensors").is_file():
        text = " ".join(json.loads(line)["text"] for line in FIXTURE_TEXT.read_text().splitlines())
        ckpt.use_text(text, seq_len=64)
    return ckpt


def regimes(args) -> dict:
    out = {}
    for path in args.ckpt:
        t0 = time.perf_counter()
        ckpt = open_checkpoint(path)
        windows = ckpt.windows("eval")[:args.windows]
        tr = trace(ckpt, windows, SETTINGS.trace_loops(ckpt.recipe), SETTINGS.seed, topk=0, cache=False)
        dy = dynamics(tr, Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed))
        shares = {name: dy[f"share_{name}"] for name in REGIMES}
        out[path] = {"windows": tr.n_windows, "tokens": tr.seq_len, "loops": tr.max_loops, "shares": shares,
                     "norm_first": dy["mean_state_norm"][0], "norm_last": dy["mean_state_norm"][-1],
                     "norm_last_p10_p90": [dy["state_norm_p10"][-1], dy["state_norm_p90"][-1]]}
        print(f"{path}: {tr.n_windows} x {tr.seq_len} tokens, {tr.max_loops} loops: " + ", ".join(
            f"{n} {100 * s['value']:.1f}% [{100 * s['ci_low']:.1f}, {100 * s['ci_high']:.1f}]" for n, s in shares.items())
            + f"; mean ‖s‖ {dy['mean_state_norm'][0]:.4g} at loop 1, {dy['mean_state_norm'][-1]:.4g} at the last "
            f"(p10-p90 {dy['state_norm_p10'][-1]:.4g}-{dy['state_norm_p90'][-1]:.4g})  [{time.perf_counter() - t0:.0f} s]",
            flush=True)
    return out


def overthink(args) -> dict:
    path = args.ckpt[0]
    ckpt = load_checkpoint(path)
    r_max, r_bar = ckpt.recipe.r_max, round(ckpt.recipe.r_bar)
    loops = overthinking_loops(r_max)
    tr = trace(ckpt, ckpt.windows("eval")[:args.windows], loops, SETTINGS.seed, topk=0, cache=False, progress=True)
    hops = answer_hops(tr, load_ground_truth(path)[0])
    ov = overthinking(tr, Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed), r_max, hops)
    at = sorted({r_bar, r_max, 2 * r_max, 3 * r_max, loops})
    deep = (hops >= 7) & (hops <= 10)
    right = tr.argmax == tr.targets[..., None]
    out = {"loops": loops, "r_bar": r_bar, "r_max": r_max, "windows": tr.n_windows, "best_loop": ov["best_loop"],
           "loss": {r: ov["loss"][r - 1] for r in at}, "accuracy": {r: ov["answer_accuracy"][r - 1] for r in at},
           "accuracy_7_10": {r: float(right[deep][:, r - 1].mean()) for r in at} if deep.any() else None,
           "n_7_10": int(deep.sum()), "mean_flips": ov["mean_flips"], "flipping_past_r_max": ov["share_flipping_past_r_max"]}
    print(f"{path}: {tr.n_windows} programs, {loops} loops (r̄ {r_bar}, r_max {r_max}); best loss at loop {ov['best_loop']}")
    for r in at:
        deep_acc = "" if out["accuracy_7_10"] is None else f", 7-10 hops {100 * out['accuracy_7_10'][r]:.1f}%"
        print(f"  loop {r:3d}: loss {ov['loss'][r - 1]:.4f}, answers {100 * ov['answer_accuracy'][r - 1]:.1f}%{deep_acc}")
    print(f"  flips per token {ov['mean_flips']['value']:.3f}, last flip after r_max "
          f"{100 * ov['share_flipping_past_r_max']['value']:.2f}% ({out['n_7_10']} answers at 7-10 hops)")
    return out


def accel(args) -> dict:
    path = args.ckpt[0]
    ckpt = load_checkpoint(path)
    r_max, r_bar = ckpt.recipe.r_max, round(ckpt.recipe.r_bar)
    windows = ckpt.windows("eval")[:args.windows].numpy()
    tr = trace(ckpt, windows, SETTINGS.trace_loops(ckpt.recipe), SETTINGS.seed, cache=False, progress=True)
    hops, max_train = load_ground_truth(path)
    lip = measured_lipschitz(ckpt, SETTINGS.trace_loops(ckpt.recipe), SETTINGS.seed)
    families = {name: catalogue.sweep(name, r_max) for name in ("A1", "Accel")}
    families["Certified"] = [catalogue.make("Certified", lip["lipschitz"], r_max=r_max)]  # at its measured L
    gt = ground_truth_section(tr, Labels(hops, max_train, eos_id(ckpt.tokenizer())), r_max, r_bar,
                              Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed), families,
                              ExactPath(ckpt, windows, progress=True))
    out = {"windows": len(windows), "lipschitz": lip, "target_accuracy": gt["target_accuracy"], "best_uniform_depth": gt["best_uniform_depth"],
           "policies": {n: {k: p[k] for k in ("threshold", "answer_accuracy", "mean_loops", "vs_best_uniform_loops_ratio",
                                              "matches_a0_rbar", "evaluated_by")} for n, p in gt["policies"].items()}}
    print(f"{path}: {len(windows)} programs, exact; target accuracy {gt['target_accuracy']:.4f}, best uniform depth "
          f"{gt['best_uniform_depth']}")
    for n, p in out["policies"].items():
        print(f"  {n:9s} threshold {p['threshold']:.3g}: answers {100 * p['answer_accuracy']:.2f}%, {p['mean_loops']:.2f} "
              f"mean loops = {p['vs_best_uniform_loops_ratio']}x the best uniform depth ({p['evaluated_by']})")
    return out


def certified(args) -> dict:
    path = args.ckpt[0]
    ckpt = open_checkpoint(path)
    r_max = ckpt.recipe.r_max
    lip = readout_lipschitz(ckpt, ckpt.windows("probe")[:args.probe_windows], SETTINGS.trace_loops(ckpt.recipe),
                            SETTINGS.seed)
    windows = ckpt.windows("eval")[:args.windows]
    tr = trace(ckpt, windows, SETTINGS.trace_loops(ckpt.recipe), SETTINGS.seed, topk=2, cache=False)
    ex = CertifiedExit(lip["lipschitz"], r_max=r_max).exits(tr)
    positions = np.linspace(1, windows.shape[1] - 2, args.positions).astype(int).tolist()
    real = violations(ckpt, windows, lip["lipschitz"], r_max, 2 * r_max, positions, SETTINGS.seed)
    out = {"lipschitz": lip, "fast_mean_exit": float(ex.depth[tr.scored].mean()),
           "fast_certified_share": float(ex.converged[tr.scored].mean()), "positions": positions, "decoding": real}
    print(f"{path}: L = {lip['lipschitz']:.4g} (99th percentile {lip['p99']:.4g}, {lip['n_pairs']} secants, "
          f"{lip['windows']} probe windows x {lip['loops']} loops)")
    print(f"  uniform trace: mean exit {out['fast_mean_exit']:.2f} loops, certified before r_max "
          f"{100 * out['fast_certified_share']:.1f}% of tokens")
    print(f"  real decoding, {len(windows)} windows at positions {positions}, run on to {2 * r_max} loops: {real}")
    return out


def gt_cost(args) -> dict:
    """The exact ground truth's work per family: each family's thresholds in the masking harness (one
    batched run each, uncached), and the certified exit's one decoding at the measured L beside one
    decoding of A1 at its default ε."""
    path = args.ckpt[0]
    ckpt = load_checkpoint(path)
    r_max, loops = ckpt.recipe.r_max, SETTINGS.trace_loops(ckpt.recipe)
    windows = ckpt.windows("eval")[:args.windows].numpy()
    families = operating_point_families(r_max, None, SETTINGS.eps_grid, SETTINGS.tau_grid)
    out = {"windows": len(windows), "harness_s": {}, "thresholds": {}}
    for name, policies in families.items():
        t0 = time.perf_counter()
        ExactPath(ckpt, windows).results(policies, loops, SETTINGS.seed)
        out["harness_s"][name], out["thresholds"][name] = time.perf_counter() - t0, len(policies)
        print(f"{path}: {name:14s} {len(policies):2d} thresholds in the harness: {out['harness_s'][name]:.1f} s", flush=True)
    t0 = time.perf_counter()
    lip = measured_lipschitz(ckpt, loops, SETTINGS.seed)
    out["lipschitz"], out["lipschitz_s"] = lip["lipschitz"], time.perf_counter() - t0
    for name, threshold in (("Certified", lip["lipschitz"]), ("A1", None)):
        t0 = time.perf_counter()
        ExactPath(ckpt, windows).decoded(catalogue.make(name, threshold, r_max=r_max), loops, SETTINGS.seed)
        out[f"{name}_decoding_s"] = time.perf_counter() - t0
        print(f"  one decoding of {len(windows)} programs, {name} at {threshold or 'its default'}: "
              f"{out[f'{name}_decoding_s']:.1f} s", flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.looped_dynamics", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("regimes", "overthinking", "accel", "certified", "gt_cost"))
    p.add_argument("ckpt", nargs="+")
    p.add_argument("--windows", type=int, default=16, help="eval windows (default 16)")
    p.add_argument("--probe-windows", type=int, default=LIPSCHITZ_WINDOWS, help="certified: probe windows L is measured on")
    p.add_argument("--positions", type=int, default=8, help="certified: positions per window run past their exit")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {"regimes": regimes, "overthinking": overthink, "accel": accel, "certified": certified,
           "gt_cost": gt_cost}[args.what](args)
    print(json.dumps({"what": args.what, "result": out}, default=str))
    return out


if __name__ == "__main__":
    main()
