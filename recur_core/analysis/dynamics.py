"""How a token's state moves across loops, read off a uniform trace (no model run): the hidden-state
norm ‖s_i‖ per loop and the per-token regime of its step sizes.

Step size δ_i = ‖s_i − s_{i−1}‖ (`Trace.state_step`). A token's contraction rate over the trace's
last RATE_LOOPS loops is the geometric mean of δ_i / δ_{i−1} there, ρ = (δ_L / δ_{L−k})^(1/k); a token
whose steps have reached exactly 0 at both ends is at a fixed point (ρ = 0), one whose step grew
from exactly 0 is drifting (ρ = ∞). A token whose last relative step ‖s_L − s_{L−1}‖ / ‖s_L‖ is at most
PRECISION has converged as far as float32 resolves (its steps are rounding noise of a few ulps, whose
ratio says nothing): it counts as settling. Its regime:
  settling   ρ < MARGINAL[0]               the steps shrink geometrically: the state converges;
  marginal   MARGINAL[0] <= ρ <= MARGINAL[1]  the steps neither shrink nor grow ("freezes without
                                           converging");
  drifting   ρ > MARGINAL[1]               the steps grow.

Overthinking: a trace far past the trained depth (`overthinking_loops`: 4 × r_max, at most 128,
never fewer than the analysis' own trace) shows loss, and on a checkpoint with ground truth answer
accuracy, against loops, and per token its answer flips: how often the argmax of p_i changes from
one loop to the next, and the last loop at which it did.
"""
from __future__ import annotations

import numpy as np

from ..exits.trace_type import Trace
from ..settings import SETTINGS
from .curves import elasticity
from .stats import Bootstrap

RATE_LOOPS = 4  # the contraction rate is measured over the trace's last 4 loops
MARGINAL = (0.95, 1.05)  # ρ within 5% of 1: neither settling nor drifting
PRECISION = 1e-6  # a last relative step this small (about 8 float32 ulps of the norm) is converged
REGIMES = ("settling", "marginal", "drifting")
OVERTHINK_FACTOR, OVERTHINK_MAX = 4, 128  # the overthinking sweep: 4 x r_max loops, at most 128


def contraction_rate(step: np.ndarray, loops: int = RATE_LOOPS) -> np.ndarray:
    """(...,) ρ from step sizes (..., L): the geometric mean of δ_i / δ_{i−1} over the last `loops`
    loops (fewer when L − 1 is fewer)."""
    k = min(loops, step.shape[-1] - 1)
    if k < 1:
        raise ValueError("a contraction rate needs at least 2 loops of step sizes")
    last, first = step[..., -1].astype(np.float64), step[..., -1 - k].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = (last / first) ** (1.0 / k)
    return np.where(first == 0, np.where(last == 0, 0.0, np.inf), rate)


def regime(rate: np.ndarray) -> np.ndarray:
    """Index into REGIMES of each contraction rate."""
    return np.where(rate < MARGINAL[0], 0, np.where(rate <= MARGINAL[1], 1, 2)).astype(np.int8)


def token_regimes(tr: Trace) -> np.ndarray:
    """(N, T) index into REGIMES of every token of a trace (converged to float32 resolution: settling)."""
    rate = contraction_rate(_steps(tr))
    return regime(np.where(tr.state_change[..., -1] <= PRECISION, 0.0, rate))


def dynamics(tr: Trace, boot: Bootstrap) -> dict:
    """report.json's "dynamics" over all tokens but padding (`Trace.weighted`): the mean hidden-state
    norm per loop with its bootstrap CI and the 10th / 90th percentiles over tokens (the spread), and
    the share of tokens in each regime with CIs (keys: docs/REPORT_KEYS.md)."""
    w = tr.weighted
    n = w.sum(1, dtype=np.float64)[:, None]
    norm = _norms(tr)
    est = boot.summarise(boot.ratio(np.where(w[..., None], norm, 0).sum(1, dtype=np.float64),
                                    np.broadcast_to(n, (tr.n_windows, tr.max_loops))))
    p10, p90 = np.percentile(norm[w], [10, 90], axis=0)
    out = {"loops": list(range(1, tr.max_loops + 1)), "mean_state_norm": est.value.tolist(),
           "mean_state_norm_ci_low": est.ci_low.tolist(), "mean_state_norm_ci_high": est.ci_high.tolist(),
           "state_norm_p10": p10.tolist(), "state_norm_p90": p90.tolist(),
           "rate_loops": min(RATE_LOOPS, tr.max_loops - 1), "marginal_band": list(MARGINAL), "precision": PRECISION}
    codes = token_regimes(tr)
    for i, name in enumerate(REGIMES):
        share = boot.summarise(boot.ratio(((codes == i) & w).sum(1, dtype=np.float64), n[:, 0]))
        out[f"share_{name}"] = share.to_dict()
    return out


def overthinking_loops(r_max: int) -> int:
    """Depth of the overthinking sweep: 4 × r_max, at most 128, at least the analysis trace's depth."""
    return max(SETTINGS.min_trace_loops, r_max, min(OVERTHINK_FACTOR * r_max, OVERTHINK_MAX))


def answer_flips(tr: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(N, T) per token: how many times the argmax changes between consecutive loops 1..L, and the
    last loop i whose argmax differs from loop i − 1's (0: it never changes)."""
    flips = tr.argmax[..., 1:] != tr.argmax[..., :-1]  # (N, T, L - 1): index j is loop j + 2
    last = np.where(flips.any(-1), tr.max_loops - np.argmax(flips[..., ::-1], axis=-1), 0)
    return flips.sum(-1), last


def overthinking(tr: Trace, boot: Bootstrap, r_max: int, hops: np.ndarray | None = None) -> dict:
    """report.json's "overthinking" from a trace past r_max (keys: docs/REPORT_KEYS.md): loss per loop
    (the elasticity curve of the deeper trace) with the best loop and the loss at r_max and at the
    last loop; per scored token the mean number of answer flips and the share whose last flip comes
    after r_max; with hops ((N, T) hop count of each token's target, 0 = none: a ground-truth
    checkpoint's `answer_hops`) the answer accuracy per loop over every answer (with CIs) and per
    hop count. CIs: bootstrap over windows."""
    out = {"r_max": r_max, **elasticity(tr, boot)}
    loss = np.asarray(out["loss"])
    out.update(best_loop=int(np.nanargmin(loss)) + 1, loss_at_r_max=float(loss[min(r_max, tr.max_loops) - 1]),
               loss_at_last=float(loss[-1]))
    n_flips, last = answer_flips(tr)
    scored = tr.scored
    n = scored.sum(1, dtype=np.float64)
    out["mean_flips"] = boot.summarise(boot.ratio(np.where(scored, n_flips, 0).sum(1, dtype=np.float64), n)).to_dict()
    out["share_flipping_past_r_max"] = boot.summarise(boot.ratio(((last > r_max) & scored).sum(1, dtype=np.float64),
                                                                 n)).to_dict()
    if hops is not None:
        right = tr.argmax == tr.targets[..., None]  # (N, T, L)
        answers = hops > 0
        correct = right & answers[..., None]
        acc = boot.summarise(boot.ratio(correct.sum(1, dtype=np.float64),
                                        np.broadcast_to(answers.sum(1, dtype=np.float64)[:, None], correct.shape[::2])))
        out.update(answer_accuracy=acc.value.tolist(), answer_accuracy_ci_low=acc.ci_low.tolist(),
                   answer_accuracy_ci_high=acc.ci_high.tolist(),
                   answer_accuracy_by_hops={str(h): right[hops == h].mean(0).tolist() for h in np.unique(hops[answers])})
    return out


def _steps(tr: Trace) -> np.ndarray:
    if tr.state_step is None:
        raise ValueError("this trace holds no step sizes (state_step): trace it again")
    return tr.state_step


def _norms(tr: Trace) -> np.ndarray:
    if tr.state_norm is None:
        raise ValueError("this trace holds no state norms (state_norm): trace it again")
    return tr.state_norm
