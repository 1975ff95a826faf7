"""Depth allocation (the paper's Table 4): A0 / A1 / A2 curves, fast or exact, and which thresholds
of a sweep the exact path runs. On a model with a learned exit gate (Ouro) the family "Gate"
(GateExit over the q grid, capped at the gate's trained steps) stands beside them: a learned
predictor of convergence trained with the model, against A1's reading of it.

Fast path: every threshold of every family is read off the uniform trace (instant; the app's
sliders). Exact path: the masking harness, where frozen tokens stay in the context with their exit
state, as in real decoding. Running every threshold exact costs minutes per checkpoint on a CPU, so
the exact path runs a *plan* of points, chosen so that every headline number is exact:
  * spread    SPREAD_POINTS thresholds per family, spread over its fast mean loops (both ends of the
              grid, then greedily the point farthest from those chosen; a flat stretch of the grid,
              e.g. every eps that exits at the first check, takes one point);
  * refined   then, in rounds (one batched harness pass per round), bisection on the grid between
              the two exact points that bracket, in mean loops, (a) the loops to match A0 at r_bar
              and its CI ends, until they are grid neighbours, and (b) each A0 depth d (the
              matched-depth table), until they are at most TABLE_STEPS grid steps apart or the
              loss changes across them by at most TABLE_TOL of the row's CI width (linear
              interpolation between them cannot then move the row by more than that).
So "loops to match A0 at r_bar" and its CI ends interpolate only between exact grid neighbours, the
resolution the fast path has, and each matched-depth row between exact points that are close on the
grid or on a stretch where the curve is flat within the row's uncertainty (the rows are many and A1's
points each cost a readout per loop, so this keeps a 128-window report within minutes on a CPU).
A policy that halts no token before its cap on the traced windows (every A0 depth, A1 at eps = 0)
freezes nothing early, so its exact run is the uniform trace itself (`uniform_run_result`): it costs
no harness pass. The fast curves stay dense; report.json says which points are exact (`exact_points`).
"""
from __future__ import annotations

import numpy as np

from ..exits import catalogue
from ..exits.policies import ConvergenceExit, Policy
from ..exits.trace_type import Trace
from .curves import (
    EPS_GRID,
    Q_GRID,
    TAU_GRID,
    Curve,
    WindowSums,
    a0_loss_at,
    fast_curve,
    interp_rows,
    loops_to_match,
    matched_depth_table,
    sweep,
)
from .exact import ExactPath
from .harness import ExactResult
from .matching import cheapest
from .stats import Bootstrap
from .trace import weighted_positions

SPREAD_POINTS = 8  # exact points per family spread over its fast mean loops, before refinement
MAX_ROUNDS = 8  # refinement rounds (a 35-point grid needs at most 6 to reach neighbours)
TABLE_STEPS = 2  # the matched-depth table's brackets: at most this many grid steps apart...
TABLE_TOL = 0.25  # ...unless the loss changes across them by at most this fraction of the row's CI width


def allocation_families(r_max: int, eps_grid=EPS_GRID, tau_grid=TAU_GRID, probes: dict | None = None,
                        a1_min_loops: int = ConvergenceExit.FIRST_CHECK, gate=None,
                        q_grid=Q_GRID) -> dict[str, list[Policy]]:
    """The policies of the allocation curves (the catalogue's CURVES): A0 at r = 1..r_max, A1 over
    eps_grid (first check at a1_min_loops), A2 over tau_grid for each probe label kind, the latent rule
    and Accel over their catalogue sweeps, and with gate = (the model's gate_lambda, its trained
    steps) GateExit over q_grid, capped at min(steps, r_max)."""
    return catalogue.sweeps(catalogue.CURVES, r_max, grids={"A1": eps_grid, "A2": tau_grid, "Gate": q_grid},
                            probes=probes, gate=gate, min_loops={"A1": min(a1_min_loops, r_max)})


def model_gate(ckpt) -> tuple | None:
    """(gate_lambda, trained steps) of a checkpoint whose model has a learned exit gate (Ouro: its
    total_ut_steps, the recipe's r_bar), else None: what allocation's `gate` takes."""
    model = ckpt.model
    return None if model.exit_gate is None else (model.gate_lambda, ckpt.recipe.depth)


def allocation_report(curves: dict[str, Curve], boot: Bootstrap, r_bar: int) -> dict:
    """JSON-ready curve points, the matched-depth table and loops to match A0 at r_bar."""
    a0, others = curves["A0"], [c for name, c in curves.items() if name != "A0"]
    report = {name: c.points(boot) for name, c in curves.items()}
    report["matched_depth"] = matched_depth_table(a0, others, boot)
    for c in others:
        report[f"{c.name.lower()}_loops_to_match_a0_rbar"] = loops_to_match(c, a0, r_bar, boot)
    return report


def allocation(tr: Trace, boot: Bootstrap, r_bar: int, families: dict[str, list[Policy]],
               exact: ExactPath | None = None) -> dict:
    """Allocation curves of `families` (`allocation_families`), the matched-depth table and loops to
    match A0 at r_bar.

    Fast path (exact=None): every policy read off the trace, which must hold the chances of their
    probes (trace(..., probes=...)) and, for a gate family, the gate's lambdas. Exact path: `exact`
    holds the traced windows; the plan's points run in the masking harness (`exact_plan`).
    Returns {"curves": {name: Curve}, "report": JSON-ready dict, "path": "fast" | "exact"}, or None
    when exact.cache_only and the plan is not cached; the exact report also has "exact_points"
    {family: thresholds run exact}.
    """
    fast = {name: fast_curve(tr, name, policies, boot) for name, policies in families.items()}
    if exact is None:
        return {"curves": fast, "report": allocation_report(fast, boot, r_bar), "path": "fast"}
    curves = exact_plan(exact, families, fast, r_bar, tr, boot)
    if curves is None:
        return None
    report = allocation_report(curves, boot, r_bar)
    report["exact_points"] = {name: list(c.thresholds) for name, c in curves.items()}
    return {"curves": curves, "report": report, "path": "exact"}


def exact_is_cached(tr: Trace, boot: Bootstrap, r_bar: int, families: dict[str, list[Policy]], exact: ExactPath) -> bool:
    """Whether allocation(tr, boot, r_bar, families, exact) would be served from the disk cache
    (no harness run): the plan's rounds, replayed with cache_only."""
    fast = {name: fast_curve(tr, name, policies, boot) for name, policies in families.items()}
    exact = ExactPath(exact.model, exact.ids, exact.cache, cache_only=True)
    return exact_plan(exact, families, fast, r_bar, tr, boot) is not None


def operating_threshold(curve: Curve, target_loss: float, default: float) -> float:
    """The cheapest swept threshold whose (point-estimate) loss is at most target_loss (ties: the
    smaller threshold); default if none is."""
    best = cheapest(range(len(curve.thresholds)), lambda p: curve.loss[0, p] <= target_loss,
                    lambda p: (curve.mean_loops[0, p], curve.thresholds[p]))
    return default if best is None else curve.thresholds[best]


# -- the exact plan -----------------------------------------------------------------------------------
def exact_plan(exact: ExactPath, families: dict[str, list[Policy]], fast: dict[str, Curve], r_bar: int,
               tr: Trace, boot: Bootstrap, rounds: int = MAX_ROUNDS) -> dict[str, Curve] | None:
    """Exact curves on the plan's points (module doc): one batched harness pass per round; tr: the
    uniform trace of the same windows (exact.ids), whose fast curves `fast` are. None with
    exact.cache_only if any round is not cached."""
    weighted = weighted_positions(exact.model, exact.ids)  # padding is not scored (recur_core.analysis.trace)
    if weighted.shape != tr.ids.shape:
        raise ValueError(f"the trace's windows {tr.ids.shape} are not the exact path's {weighted.shape}")
    done: dict[str, dict[int, ExactResult]] = {name: {} for name in families}
    pending = {name: (set(range(len(policies))) if name == "A0" else _seed_points(fast[name]))
               for name, policies in families.items()}
    curves: dict[str, Curve] = {}
    for _ in range(rounds):
        batch = [(name, i) for name in families for i in sorted(pending[name])]
        if not batch:
            break
        results = exact.results([families[n][i] for n, i in batch], tr.max_loops, tr.seed, uniform=tr)
        if results is None:
            return None
        for (name, i), result in zip(batch, results, strict=True):
            done[name][i] = result
        curves = {name: _exact_curve(name, families[name], done[name], boot, weighted) for name in families}
        pending = {name: (set() if name == "A0" else _refine(curves[name], done[name], curves["A0"], r_bar, boot))
                   for name in families}
    return curves


def _exact_curve(name: str, policies: list[Policy], done: dict[int, ExactResult], boot: Bootstrap,
                 weighted: np.ndarray) -> Curve:
    """The family's curve over its exact points; weighted (N, T): the positions that are not padding."""
    at = sorted(done)
    return sweep(name, [policies[i] for i in at],
                 [WindowSums.of(r.ce, r.exit_depth, r.converged, r.has_target & weighted) for r in (done[i] for i in at)],
                 boot)


def _seed_points(curve: Curve) -> set[int]:
    """Grid indices of the first round: both ends of the grid, then greedily the index farthest (in
    fast mean loops; ties: in grid steps) from those chosen, until SPREAD_POINTS."""
    n, loops = len(curve.thresholds), curve.mean_loops[0]
    chosen = sorted({0, n - 1})

    def distance(i: int) -> tuple[float, int]:  # to the nearest chosen point: in mean loops, then in grid steps
        return min((abs(float(loops[i] - loops[j])), abs(i - j)) for j in chosen)
    while len(chosen) < min(SPREAD_POINTS, n):
        chosen.append(max((i for i in range(n) if i not in chosen), key=distance))
    return set(chosen)


def _refine(curve: Curve, done: dict[int, ExactResult], a0: Curve, r_bar: int, boot: Bootstrap) -> set[int]:
    """Grid indices that halve each bracket not yet fine enough, in mean loops: around the loops to
    match A0 at r_bar and its CI ends (to grid neighbours), and around each A0 depth (to TABLE_STEPS,
    or a loss change across it within TABLE_TOL of the row's CI width)."""
    at = np.array(sorted(done))  # grid index of each point of `curve`, in curve order
    loops, loss = curve.mean_loops[0], curve.loss[0]
    order = np.argsort(loops, kind="stable")
    new = set()
    match = loops_to_match(curve, a0, r_bar, boot)
    for x in (match["value"], match["ci_low"], match["ci_high"]):  # the estimate and its CI ends
        lo, hi = _bracket(loops[order], x)
        if lo is not None:
            new |= _midpoint(at[order[lo]], at[order[hi]], 1)
    for d in a0.thresholds:
        lo, hi = _bracket(loops[order], d)
        if lo is not None:
            lo, hi = order[lo], order[hi]
            row = boot.summarise(interp_rows(float(d), curve.mean_loops, curve.loss) - a0_loss_at(a0, d))
            if not abs(loss[hi] - loss[lo]) <= TABLE_TOL * (row.ci_high - row.ci_low):  # NaN width: refine
                new |= _midpoint(at[lo], at[hi], TABLE_STEPS)
    return new - set(done)


def _bracket(sorted_loops: np.ndarray, x) -> tuple[int | None, int | None]:
    """(i - 1, i) with i the first point at or above mean loops x (x a finite number), else (None, None)."""
    if not isinstance(x, (int, float)) or not np.isfinite(x):
        return None, None
    above = np.flatnonzero(sorted_loops >= x)
    return (int(above[0]) - 1, int(above[0])) if len(above) and above[0] > 0 else (None, None)


def _midpoint(i: int, j: int, steps: int) -> set[int]:
    """The grid index halfway between i and j, if they are more than `steps` grid steps apart."""
    lo, hi = sorted((int(i), int(j)))
    return {(lo + hi) // 2} if hi - lo > steps else set()
