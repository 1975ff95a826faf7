"""Matching a policy to a quality target: "the cheapest threshold that meets it", in one place.

  cheapest(points, meets, cost)   among points already evaluated (a swept curve), the cheapest one
                                  that meets the target (report.json's operating points, the
                                  matched ε of A2's KL labels, ground truth's operating points).
  match_threshold(...)            the same question when every evaluation runs the model: a walk
                                  down a descending grid, then log-scale bisection (the decoding
                                  benches' calibration).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

Point = TypeVar("Point")


def cheapest(points: Iterable[Point], meets: Callable[[Point], bool], cost: Callable[[Point], object]) -> Point | None:
    """The point of least cost(point) among those that meet the target; None if none does.
    Ties go to the first such point (make cost a tuple to break them otherwise)."""
    ok = [p for p in points if meets(p)]
    return min(ok, key=cost) if ok else None


@dataclass(frozen=True)
class Match:
    """A threshold search's outcome: the threshold, its policy, the policy's result, and whether it met the target."""
    threshold: float
    policy: object
    result: object
    matched: bool


def match_threshold(evaluate, make, grid, meets, bisect_steps: int) -> Match:
    """Largest threshold on `grid` (descending: fewest loops first) whose result meets the target,
    then bisected on a log scale between it and the last miss above it.

    evaluate(policy) -> result; make(threshold) -> policy; meets(result) -> bool.
    Unmatched: the grid's last threshold and its result."""
    best_th, best_res, miss = None, None, None
    for th in grid:
        res = evaluate(make(th))
        if meets(res):
            best_th, best_res = th, res
            break
        miss = th
    if best_th is None:
        last = make(grid[-1])
        return Match(grid[-1], last, evaluate(last), False)
    if miss is not None and miss > 0 and best_th > 0:
        lo, hi = best_th, miss
        for _ in range(bisect_steps):
            mid = math.sqrt(lo * hi)
            res = evaluate(make(mid))
            if meets(res):
                lo, best_th, best_res = mid, mid, res
            else:
                hi = mid
    return Match(best_th, make(best_th), best_res, True)
