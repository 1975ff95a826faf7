"""The paper's measurements, from traces: elasticity, convergence, curve algebra, token classes.

Everything here works on a uniform-depth `Trace` (recur_core.analysis.trace) and returns plain numbers,
numpy arrays, lists and dicts ready for JSON (`report.json`, the app). Uncertainty comes from one
`Bootstrap` over windows (recur_core.analysis.stats), shared by all statistics of a report, so differences
between policies are paired.

Conventions:
  loss        mean next-token cross-entropy in nats over scored tokens (those with a target).
  mean_loops  mean exit depth over the same tokens (the FLOP proxy of the paper).
  fast path   a policy's tokens are scored at their exit loop of the uniform run (instant; the
              app's sliders).
  exact path  the masking harness (recur_core.analysis.harness): frozen tokens stay in the context. The
              headline allocation numbers (report.json's `allocation`) are exact, on the points
              recur_core.analysis.allocation's exact plan runs; `fast_minus_exact` is the gap.
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass

import numpy as np

from ..exits.policies import Policy, Uniform
from ..exits.trace_type import Trace
from ..settings import SETTINGS
from .stats import Bootstrap

MOVING_KL = SETTINGS.moving_kl  # still moving at loop i while KL(p_i || p_{i-1}) > this
EPS_GRID, TAU_GRID = SETTINGS.eps_grid, SETTINGS.tau_grid  # A1's ε and A2's τ sweeps
Q_GRID = SETTINGS.q_grid  # GateExit's q sweep (models with a learned exit gate)
TOKEN_CLASSES = ("whitespace", "numeral", "punctuation", "word", "other")


# -- scoring a policy ---------------------------------------------------------------------------
@dataclass
class WindowSums:
    """Per-window sums (n_windows,) of a policy's outcome: what the bootstrap resamples."""

    loss: np.ndarray  # summed cross-entropy of scored tokens
    loops: np.ndarray  # summed exit depth of scored tokens
    converged: np.ndarray  # scored tokens whose rule held before the cap
    tokens: np.ndarray  # scored tokens

    @classmethod
    def of(cls, ce: np.ndarray, depth: np.ndarray, converged: np.ndarray, counted: np.ndarray) -> WindowSums:
        """counted: (N, T) bool, the positions that may be scored (a target, not padding)."""
        scored = counted & ~np.isnan(ce)
        return cls(np.where(scored, ce, 0.0).sum(1, dtype=np.float64), np.where(scored, depth, 0).sum(1),
                   (scored & converged).sum(1), scored.sum(1))

    @property
    def n_scored(self) -> int:
        return int(self.tokens.sum())

    @property
    def mean_loops(self) -> float:
        """Exit depth averaged over all scored tokens (pooled over windows)."""
        return float(self.loops.sum() / self.n_scored) if self.n_scored else float("nan")

    @property
    def mean_loss(self) -> float:
        """Cross-entropy in nats/token averaged over all scored tokens (pooled over windows)."""
        return float(self.loss.sum() / self.n_scored) if self.n_scored else float("nan")


def fast_sums(tr: Trace, policy: Policy) -> WindowSums:
    """Score a policy from the uniform trace: each token's ce at its exit loop."""
    exits = policy.exits(tr)
    ce = np.take_along_axis(tr.ce, exits.depth[..., None] - 1, axis=-1)[..., 0]
    return WindowSums.of(ce, exits.depth, exits.converged, tr.scored)


def smallest_uniform_depth(tr: Trace, loss: float, max_depth: int, tolerance: float = 1e-4) -> int | None:
    """The smallest uniform depth r <= max_depth whose loss on the trace (nats per scored token; exact
    for A0, which freezes no token early) is within `tolerance` (float noise between decoding and the
    trace) of `loss`, else None: the honest baseline of a per-token policy that reaches that loss."""
    return next((r for r in range(1, max_depth + 1) if fast_sums(tr, Uniform(r)).mean_loss <= loss + tolerance), None)


@dataclass
class Curve:
    """A policy family swept over its threshold, as bootstrap replicates.

    loss, mean_loops: (1 + n_boot, P) replicate values (row 0 = the data); frac_converged (P,).
    """

    name: str
    threshold_name: str
    thresholds: list[float]
    loss: np.ndarray
    mean_loops: np.ndarray
    frac_converged: np.ndarray

    def points(self, boot: Bootstrap) -> list[dict]:
        """JSON-ready points: threshold, mean_loops (+ CI), loss with ci_low / ci_high."""
        loss, loops = boot.summarise(self.loss), boot.summarise(self.mean_loops)
        return [{"threshold_name": self.threshold_name, "threshold": t,
                 "mean_loops": float(loops.value[p]), "mean_loops_ci_low": float(loops.ci_low[p]),
                 "mean_loops_ci_high": float(loops.ci_high[p]), "loss": float(loss.value[p]),
                 "ci_low": float(loss.ci_low[p]), "ci_high": float(loss.ci_high[p]),
                 "frac_converged": float(self.frac_converged[p])}
                for p, t in enumerate(self.thresholds)]


def sweep(name: str, policies: list[Policy], scores: list[WindowSums], boot: Bootstrap) -> Curve:
    """A Curve from already-scored policies (fast or exact)."""
    tokens = np.stack([s.tokens for s in scores], axis=1).astype(np.float64)
    loss = boot.ratio(np.stack([s.loss for s in scores], axis=1), tokens)
    loops = boot.ratio(np.stack([s.loops for s in scores], axis=1).astype(np.float64), tokens)
    frac = np.array([s.converged.sum() / max(s.tokens.sum(), 1) for s in scores])
    return Curve(name, policies[0].threshold_name, [p.threshold for p in policies], loss, loops, frac)


def fast_curve(tr: Trace, name: str, policies: list[Policy], boot: Bootstrap) -> Curve:
    return sweep(name, policies, [fast_sums(tr, p) for p in policies], boot)


# -- curve algebra (vectorised over bootstrap replicates) ------------------------------------------
def _sorted_rows(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(x, axis=1, kind="stable")
    return np.take_along_axis(x, order, 1), np.take_along_axis(y, order, 1)


def interp_rows(x_query: float, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row, y linearly interpolated at x_query along the points (x, y) sorted by x; NaN outside
    a row's range. x, y: (R, P) -> (R,)."""
    x, y = _sorted_rows(x, y)
    R, P = x.shape
    if P == 1:
        return np.where(x[:, 0] == x_query, y[:, 0], np.nan)
    j = np.clip((x <= x_query).sum(1), 1, P - 1)[:, None]
    x0, x1 = np.take_along_axis(x, j - 1, 1)[:, 0], np.take_along_axis(x, j, 1)[:, 0]
    y0, y1 = np.take_along_axis(y, j - 1, 1)[:, 0], np.take_along_axis(y, j, 1)[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(x1 > x0, (x_query - x0) / (x1 - x0), 1.0)
    inside = (x_query >= x[:, 0]) & (x_query <= x[:, -1])
    return np.where(inside, y0 + t * (y1 - y0), np.nan)


def loops_to_reach(target_loss: np.ndarray, loops: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Per row, the fewest mean loops at which the curve's loss first falls to target_loss, walking
    the points in order of mean loops and interpolating linearly in loss between the last point
    above the target and the first at or below it; NaN if never reached. (R,), (R, P) -> (R,)."""
    loops, loss = _sorted_rows(loops, loss)
    reached = loss <= target_loss[:, None]
    j = reached.argmax(1)[:, None]
    jp = np.maximum(j - 1, 0)
    x0, x1 = np.take_along_axis(loops, jp, 1)[:, 0], np.take_along_axis(loops, j, 1)[:, 0]
    y0, y1 = np.take_along_axis(loss, jp, 1)[:, 0], np.take_along_axis(loss, j, 1)[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(y0 > y1, (y0 - target_loss) / (y0 - y1), 1.0)
    return np.where(reached.any(1), x0 + t * (x1 - x0), np.nan)


def a0_loss_at(a0: Curve, depth: int) -> np.ndarray:
    """A0's (R,) replicate losses at uniform depth `depth`."""
    return a0.loss[:, a0.thresholds.index(depth)]


def matched_depth_table(a0: Curve, others: list[Curve], boot: Bootstrap) -> list[dict]:
    """Table 4: at each A0 depth r, every other policy's loss at mean loops = r and its difference
    from A0 (paired over the same bootstrap replicates); NaN where a curve does not reach r."""
    rows = []
    for r in a0.thresholds:
        base = a0_loss_at(a0, r)
        row = {"depth": int(r), "A0": boot.summarise(base).to_dict()}
        for curve in others:
            at_r = interp_rows(float(r), curve.mean_loops, curve.loss)
            row[curve.name] = boot.summarise(at_r).to_dict()
            row[f"{curve.name}_minus_A0"] = boot.summarise(at_r - base).to_dict()
        rows.append(row)
    return rows


def loops_to_match(curve: Curve, a0: Curve, depth: int, boot: Bootstrap) -> dict:
    """Mean loops the curve needs to reach A0's loss at `depth` (e.g. r_bar), with CI. Replicates
    whose curve never reaches the target count as "not reached" (+inf, i.e. more than `cap`, the
    largest depth swept), not dropped; `n_boot_not_reached` says how many of `n_boot` did so."""
    target = a0_loss_at(a0, depth)
    est, never = boot.summarise_reach(loops_to_reach(target, curve.mean_loops, curve.loss))
    return {**est.to_dict(), "n_boot": boot.n_boot, "n_boot_not_reached": never, "cap": int(max(a0.thresholds)),
            "a0_depth": int(depth), "a0_loss": float(target[0])}


# -- paired differences (what the charts compare) --------------------------------------------------
def difference_from_a0(curve: Curve, a0: Curve, boot: Bootstrap) -> dict:
    """The curve minus A0 at the same mean loops, at each of the curve's points: in every bootstrap
    replicate both losses are interpolated at the point's mean loops (row 0's), so both terms come
    from the same resampled windows and the window-to-window spread cancels (a paired band).
    NaN where A0's depths do not reach that mean loops."""
    x = curve.mean_loops[0]
    diff = np.stack([interp_rows(float(g), curve.mean_loops, curve.loss) - interp_rows(float(g), a0.mean_loops, a0.loss)
                     for g in x], axis=1)
    est = boot.summarise(diff)
    return {"name": curve.name, "threshold_name": curve.threshold_name, "thresholds": list(curve.thresholds),
            "mean_loops": x.tolist(), "diff": np.atleast_1d(est.value).tolist(),
            "ci_low": np.atleast_1d(est.ci_low).tolist(), "ci_high": np.atleast_1d(est.ci_high).tolist()}


def elasticity_curve(tr: Trace, boot: Bootstrap) -> Curve:
    """A0 at every depth 1 .. max_loops of a trace (the elasticity curve) as bootstrap replicates."""
    return fast_curve(tr, "A0", [Uniform(r) for r in range(1, tr.max_loops + 1)], boot)


def elasticity_difference(tr: Trace, reference: Trace, boot: Bootstrap) -> dict:
    """Loss of one checkpoint minus a reference checkpoint's at the same uniform depth, paired over
    the same windows (both traces must score the same windows; the same bootstrap resamples them)."""
    if tr.ids.shape != reference.ids.shape or not (np.array_equal(tr.ids, reference.ids)
                                                   and np.array_equal(tr.targets, reference.targets)):
        raise ValueError("a paired difference needs both checkpoints traced on the same windows")
    loops = min(tr.max_loops, reference.max_loops)
    a, b = (elasticity_curve(t, boot).loss[:, :loops] for t in (tr, reference))
    est = boot.summarise(a - b)
    return {"loops": list(range(1, loops + 1)), "diff": np.atleast_1d(est.value).tolist(),
            "ci_low": np.atleast_1d(est.ci_low).tolist(), "ci_high": np.atleast_1d(est.ci_high).tolist()}


# -- the paper's measurements ---------------------------------------------------------------------
def elasticity(tr: Trace, boot: Bootstrap) -> dict:
    """Loss at uniform depth 1 .. max_loops (Table 2 / Fig. 1)."""
    curve = elasticity_curve(tr, boot)
    est = boot.summarise(curve.loss)
    return {"loops": list(range(1, tr.max_loops + 1)), "loss": est.value.tolist(),
            "loss_ci_low": est.ci_low.tolist(), "loss_ci_high": est.ci_high.tolist()}


def settle_loop(kl_prev: np.ndarray, threshold: float = MOVING_KL) -> np.ndarray:
    """Per token (..., L) -> (...): the first loop from which KL(p_i || p_{i-1}) stays <= threshold
    through the last loop; max_loops + 1 for a token still moving at the last loop."""
    L = kl_prev.shape[-1]
    moving = kl_prev > threshold
    last_moving = np.where(moving.any(-1), L - 1 - moving[..., ::-1].argmax(-1), -1)  # 0-based
    return last_moving + 2


def weighted_median_rows(hist: np.ndarray) -> np.ndarray:
    """Median value of each row of a histogram (R, V) over values 1..V (lower median)."""
    cum = np.cumsum(hist, axis=1)
    return (cum < cum[:, -1:] / 2).sum(1) + 1.0


def convergence(tr: Trace, boot: Bootstrap, threshold: float = MOVING_KL) -> dict:
    """Table 3 / Fig. 2, over all tokens but padding (`Trace.weighted`): mean kl_prev, fraction
    moving (kl_prev > threshold), mean relative state change, per loop; and the median loop from
    which tokens stay still."""
    w = tr.weighted[..., None]  # (N, T, 1)
    n = w.sum(1, dtype=np.float64)  # (N, 1) tokens per window
    out = {"loops": list(range(1, tr.max_loops + 1)), "moving_threshold": threshold}
    per_loop = {"mean_kl_prev": np.where(w, tr.kl_prev, 0).sum(1, dtype=np.float64),
                "frac_moving": ((tr.kl_prev > threshold) & w).sum(1).astype(np.float64),
                "mean_state_change": np.where(w, tr.state_change, 0).sum(1, dtype=np.float64)}
    for name, sums in per_loop.items():
        est = boot.summarise(boot.ratio(sums, np.broadcast_to(n, sums.shape)))
        out.update({name: est.value.tolist(), f"{name}_ci_low": est.ci_low.tolist(),
                    f"{name}_ci_high": est.ci_high.tolist()})
    settle = np.where(tr.weighted, settle_loop(tr.kl_prev, threshold), 0)  # 0: padding, left out below
    hist = np.stack([np.bincount(w, minlength=tr.max_loops + 2)[1:] for w in settle]).astype(np.float64)
    median = boot.summarise(weighted_median_rows(boot.weights @ hist))
    out.update({"median_convergence_loop": median.value, "median_convergence_loop_ci_low": median.ci_low,
                "median_convergence_loop_ci_high": median.ci_high,
                "frac_never_settled": float((settle[tr.weighted] > tr.max_loops).mean())})
    return out


# -- token classes ----------------------------------------------------------------------------------
def classify_text(text: str) -> str:
    """Token class of a decoded token's text; surrounding whitespace is ignored except for
    "whitespace" itself. Rules, in order:
      other        empty text (special tokens) or a partial UTF-8 byte (U+FFFD in the text)
      whitespace   only whitespace characters
      numeral      only decimal digits (Unicode category Nd)
      punctuation  only punctuation or symbols (Unicode categories P* and S*)
      word         contains at least one letter (Unicode category L*)
      other        anything else (e.g. digits mixed with punctuation)
    """
    if not text or "\ufffd" in text:
        return "other"
    core = text.strip()
    if not core:
        return "whitespace"
    cats = [unicodedata.category(c) for c in core]
    if all(c == "Nd" for c in cats):
        return "numeral"
    if all(c[0] in "PS" for c in cats):
        return "punctuation"
    if any(c[0] == "L" for c in cats):
        return "word"
    return "other"


def vocab_classes(tokenizer, vocab_size: int) -> np.ndarray:
    """(vocab_size,) index into TOKEN_CLASSES of each token id, from its decoded text."""
    index = {name: i for i, name in enumerate(TOKEN_CLASSES)}
    return np.array([index[classify_text(tokenizer.decode([i]))] for i in range(vocab_size)])


def token_classes(tr: Trace, classes_of_vocab: np.ndarray, policy: Policy, boot: Bootstrap) -> dict:
    """Mean exit depth per class of the token at each position (the token whose state loops),
    over scored tokens, with CIs (Fig. 4)."""
    exits = policy.exits(tr)
    cls = classes_of_vocab[tr.ids]
    out = {"policy": repr(policy)}
    for i, name in enumerate(TOKEN_CLASSES):
        member = (cls == i) & tr.scored
        sums = np.where(member, exits.depth, 0).sum(1).astype(np.float64)
        counts = member.sum(1).astype(np.float64)
        est = boot.summarise(boot.ratio(sums, counts))
        out[name] = {"mean_exit_depth": est.value, "ci_low": est.ci_low, "ci_high": est.ci_high,
                     "n_tokens": int(counts.sum())}
    return out


def token_exit_table(tr: Trace, classes_of_vocab: np.ndarray, policy: Policy) -> dict[str, np.ndarray]:
    """One row per token id that occurs at a scored position: its class, count, mean exit depth and
    the fraction of its occurrences that converged before the cap (columns as arrays, sorted by
    class, then by count, descending)."""
    exits = policy.exits(tr)
    scored = tr.scored
    ids, depth, converged = tr.ids[scored], exits.depth[scored], exits.converged[scored]
    token_id, inverse, count = np.unique(ids, return_inverse=True, return_counts=True)
    mean_depth = np.bincount(inverse, weights=depth, minlength=len(token_id)) / count
    frac_converged = np.bincount(inverse, weights=converged, minlength=len(token_id)) / count
    cls = classes_of_vocab[token_id]
    order = np.lexsort((-count, cls))
    return {"class": np.array(TOKEN_CLASSES)[cls][order], "token_id": token_id[order], "count": count[order],
            "mean_exit_depth": mean_depth[order], "frac_converged": frac_converged[order]}


# -- the fast/exact gap ------------------------------------------------------------------------------
def fast_minus_exact(fast: dict[str, Curve], exact: dict[str, Curve], boot: Bootstrap) -> dict:
    """Per family, at each threshold the exact curve has: both paths' loss and mean loops and the
    paired gap fast − exact (same windows, same bootstrap replicates)."""
    out = {}
    for name, e in exact.items():
        f = fast[name]
        rows = []
        for p, t in enumerate(e.thresholds):
            q = f.thresholds.index(t)
            est = {k: boot.summarise(v).to_dict() for k, v in
                   (("fast_loss", f.loss[:, q]), ("exact_loss", e.loss[:, p]), ("fast_mean_loops", f.mean_loops[:, q]),
                    ("exact_mean_loops", e.mean_loops[:, p]), ("gap_loss", f.loss[:, q] - e.loss[:, p]),
                    ("gap_mean_loops", f.mean_loops[:, q] - e.mean_loops[:, p]))}
            rows.append({"threshold_name": e.threshold_name, "threshold": t, **est})
        out[name] = rows
    return out


def json_safe(obj):
    """A copy of obj that strict JSON accepts: numpy values become Python ones, NaN becomes None
    and +-inf the strings "inf" / "-inf" (JSON has neither)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf") if math.isinf(x) else x
    return obj
