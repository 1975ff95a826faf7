"""Exit policies checked against ground truth: checkpoints whose answer tokens have a known depth.

A checkpoint trained on multi-hop programs (training/hops.py) saves, beside its eval windows, the
hop count of every token (`ground_truth.safetensors`: "hops", N x (T + 1), 0 = no ground truth).
The token at window position t + 1 is the *target* of input position t, so a trace position's hop
count is hops[:, 1:]. Everything here is fast path (a policy's answer is the argmax at its exit
loop of the uniform trace; see recur_core.analysis.curves).

Terms:
  answer accuracy  share of answer tokens (hop count > 0) whose argmax is the right value.
  mean_loops       mean exit depth over the program's tokens (every position whose input or target
                   is not padding), the FLOP proxy; answers alone are a few percent of them.
  operating point  per policy family, the cheapest swept threshold whose answer accuracy is within
                   `tolerance` (1 point) of A0 at r_bar.
  best uniform     the smallest uniform depth whose answer accuracy reaches the same target.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..exits.policies import ConvergenceExit, LatentDiff, LinearRouter, Policy
from ..model.checkpoint import read_safetensors
from ..settings import SETTINGS
from .matching import cheapest
from .stats import Bootstrap
from .trace import Trace

GROUND_TRUTH = "ground_truth.safetensors"
TOLERANCE = 0.01  # "matches A0 at r_bar": answer accuracy within 1 point


def load_ground_truth(ckpt_path: str | Path) -> tuple[np.ndarray, int] | None:
    """(hops (N, T + 1) aligned with the eval windows, the largest hop count seen in training),
    or None for a checkpoint without ground truth."""
    path = Path(ckpt_path) / GROUND_TRUTH
    if not path.is_file():
        return None
    t = read_safetensors(path)
    return t["hops"].numpy(), int(t["max_train_hops"].item())


def answer_hops(tr: Trace, hops: np.ndarray) -> np.ndarray:
    """(N, T) hop count of each trace position's target (0 where it has none)."""
    return hops[:tr.n_windows, 1:tr.seq_len + 1]


def program_mask(tr: Trace, pad_id: int) -> np.ndarray:
    """(N, T) positions that belong to a program: not (padding predicting padding)."""
    return ~((tr.ids == pad_id) & (tr.targets == pad_id)) & tr.has_target


def correct_at(tr: Trace, depth: np.ndarray) -> np.ndarray:
    """(N, T) bool: the argmax at each token's exit depth is its target."""
    pred = np.take_along_axis(tr.argmax, (depth - 1)[..., None], axis=-1)[..., 0]
    return pred == tr.targets


def accuracy_by_hops(tr: Trace, ah: np.ndarray, depth: np.ndarray) -> dict[int, float]:
    """Answer accuracy per hop count at the given exit depths."""
    ok = correct_at(tr, depth)
    return {int(h): float(ok[ah == h].mean()) for h in np.unique(ah[ah > 0])}


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=np.float64)
    uniq, inverse = np.unique(v, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / np.bincount(inverse))[inverse]


def spearman_ci(depth: np.ndarray, ah: np.ndarray, boot: Bootstrap) -> dict:
    """Spearman(exit depth, hop count) over answer tokens; 95% CI by resampling programs (windows)."""
    rows = [(depth[w][ah[w] > 0], ah[w][ah[w] > 0]) for w in range(len(ah))]
    value = spearman(np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]))
    reps = []
    for counts in boot.weights[1:].astype(np.int64):  # each replicate's draw count per program
        idx = np.repeat(np.arange(len(rows)), counts)
        reps.append(spearman(np.concatenate([rows[w][0] for w in idx]), np.concatenate([rows[w][1] for w in idx])))
    reps = np.array(reps)
    reps = reps[~np.isnan(reps)]
    lo, hi = (np.quantile(reps, [(1 - boot.level) / 2, (1 + boot.level) / 2]) if len(reps) else (np.nan, np.nan))
    return {"value": value, "ci_low": float(lo), "ci_high": float(hi)}


def operating_point_families(r_max: int, probes: dict | None, eps_grid, tau_grid) -> dict[str, list[Policy]]:
    """The policies ground truth finds operating points for: A1 over eps, A2 over tau per probe label
    kind, and the latent rule over SETTINGS.delta_grid (A0 is the baseline, not a family here)."""
    fam = {"A1": [ConvergenceExit(e, r_max=r_max) for e in eps_grid],
           "latent": [LatentDiff(d, r_max=r_max) for d in SETTINGS.delta_grid]}
    for kind, probe in (probes or {}).items():
        fam[f"A2_{kind}"] = [LinearRouter(probe, t, r_max=r_max) for t in tau_grid]
    return fam


def _point(tr: Trace, ah: np.ndarray, program: np.ndarray, policy: Policy) -> dict:
    depth = policy.exit_depth(tr)
    answers = ah > 0
    return {"threshold": policy.threshold, "depth": depth,
            "answer_accuracy": float(correct_at(tr, depth)[answers].mean()),
            "mean_loops": float(depth[program].mean()), "answer_mean_loops": float(depth[answers].mean())}


def ground_truth_section(tr: Trace, hops: np.ndarray, max_train_hops: int, pad_id: int, r_max: int,
                         r_bar: int, boot: Bootstrap, probes: dict | None = None, eps_grid=(), tau_grid=(),
                         tolerance: float = TOLERANCE) -> dict:
    """The `ground_truth` section of report.json (keys: docs/REPORT_KEYS.md)."""
    ah = answer_hops(tr, hops)
    program = program_mask(tr, pad_id)
    r_max = min(r_max, tr.max_loops)
    hop_values = [int(h) for h in np.unique(ah[ah > 0])]
    shape = ah.shape
    uniform_acc = {}  # depth -> {hop: accuracy}
    overall = []
    for r in range(1, r_max + 1):
        depth = np.full(shape, r)
        uniform_acc[r] = accuracy_by_hops(tr, ah, depth)
        overall.append(float(correct_at(tr, depth)[ah > 0].mean()))
    target = overall[r_bar - 1] - tolerance
    best_uniform = next((r for r in range(1, r_max + 1) if overall[r - 1] >= target), None)

    policies, answer_exits = {}, {}
    for name, family in operating_point_families(r_max, probes, eps_grid, tau_grid).items():
        points = [_point(tr, ah, program, p) for p in family]
        op = cheapest(points, lambda p: p["answer_accuracy"] >= target, lambda p: p["mean_loops"])
        matched = op is not None
        op = op if matched else max(points, key=lambda p: p["answer_accuracy"])
        depth = op["depth"]
        answer_exits[name] = depth[ah > 0].tolist()
        policies[name] = {
            "threshold": op["threshold"], "matches_a0_rbar": matched,
            "answer_accuracy": op["answer_accuracy"], "mean_loops": op["mean_loops"],
            "answer_mean_loops": op["answer_mean_loops"],
            "accuracy_by_hops": {str(h): v for h, v in accuracy_by_hops(tr, ah, depth).items()},
            "exit_depth_by_hops": {str(h): _summary(depth[ah == h]) for h in hop_values},
            "spearman_exit_vs_hops": spearman_ci(depth, ah, boot),
            "vs_a0_rbar_loops_ratio": op["mean_loops"] / r_bar,
            "vs_best_uniform_loops_ratio": (op["mean_loops"] / best_uniform) if best_uniform else None,
            "curve": [{k: v for k, v in p.items() if k != "depth"} for p in points],
        }
    extra = [h for h in hop_values if h > max_train_hops]
    return {
        "max_train_hops": max_train_hops, "hop_counts": hop_values, "r_bar": r_bar, "r_max": r_max,
        "n_programs": int(shape[0]), "n_answers": int((ah > 0).sum()),
        "n_answers_by_hops": {str(h): int((ah == h).sum()) for h in hop_values},
        "uniform": {"loops": list(range(1, r_max + 1)), "answer_accuracy": overall,
                    "accuracy_by_hops": {str(h): [uniform_acc[r].get(h) for r in range(1, r_max + 1)]
                                         for h in hop_values}},
        "target_accuracy": target, "tolerance": tolerance, "best_uniform_depth": best_uniform,
        "policies": policies,
        "answers": {"hops": ah[ah > 0].tolist(), "program": np.nonzero(ah > 0)[0].tolist(),
                    "correct_at_r_bar": correct_at(tr, np.full(shape, r_bar))[ah > 0].tolist(),
                    "exit_depth": answer_exits},
        "extrapolation": {str(h): {"accuracy_at_r_bar": uniform_acc[r_bar].get(h),
                                   "accuracy_at_r_max": uniform_acc[r_max].get(h),
                                   "best_accuracy": max(uniform_acc[r].get(h) for r in range(1, r_max + 1)),
                                   "best_loops": max(range(1, r_max + 1), key=lambda r: (uniform_acc[r].get(h), -r))}
                          for h in extra},
    }


def _summary(v: np.ndarray) -> dict:
    if not len(v):
        return {"n": 0}
    q = np.quantile(v, [0.25, 0.5, 0.75])
    return {"n": int(len(v)), "mean": float(v.mean()), "q1": float(q[0]), "median": float(q[1]), "q3": float(q[2]),
            "min": int(v.min()), "max": int(v.max())}


def eos_id(tokenizer) -> int:
    """The padding token of hops windows (EOS)."""
    i = tokenizer.token_to_id("<|endoftext|>")
    if i is None:
        raise ValueError("a ground-truth checkpoint's tokenizer needs <|endoftext|> (its padding)")
    return i


def print_ground_truth(gt: dict, p) -> None:
    """The ground-truth tables of `python -m recur_core.analyze`."""
    hs, loops = gt["hop_counts"], gt["uniform"]["loops"]
    p(f"\nGround truth: answer accuracy by hop count (rows) x uniform loops; trained to {gt['max_train_hops']} hops, "
      f"{gt['n_programs']} programs, {gt['n_answers']} answers")
    shown = [r for r in loops if r in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32) or r == gt["r_bar"]]
    p("  hops " + "".join(f"{r:>6d}" for r in shown))
    for h in hs:
        row = gt["uniform"]["accuracy_by_hops"][str(h)]
        p(f"  {h:4d} " + "".join(f"{row[r - 1]:6.2f}" for r in shown))
    p(f"  target accuracy (A0 at r_bar {gt['r_bar']} - {100 * gt['tolerance']:.0f} pt): {gt['target_accuracy']:.3f}; "
      f"smallest uniform depth reaching it: {gt['best_uniform_depth']}")
    p("  policy      threshold  answer acc  mean loops  vs A0@r_bar  vs best uniform  Spearman(exit, hops) [95% CI]")
    for name, pol in gt["policies"].items():
        sp = pol["spearman_exit_vs_hops"]
        best = pol["vs_best_uniform_loops_ratio"]
        p(f"  {name:10s} {_fmt(pol['threshold'], '.3g'):>10s}  {pol['answer_accuracy']:10.3f}  "
          f"{pol['mean_loops']:10.2f}  {pol['vs_a0_rbar_loops_ratio']:10.2f}x  {_fmt(best, '.2f', 'x'):>15s}  "
          f"{_fmt(sp['value'], '.3f')} [{_fmt(sp['ci_low'], '.3f')}, {_fmt(sp['ci_high'], '.3f')}]")


def _fmt(x, spec: str, suffix: str = "") -> str:
    """A number of report.json, which may be None (NaN) or a string (inf)."""
    return "n/a" if x is None else (x if isinstance(x, str) else format(x, spec) + suffix)
