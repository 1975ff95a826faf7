"""The threshold search every benchmark calibrates with: the cheapest exit threshold whose quality
meets a target (loss at most A0@r_bar's + tolerance, or answer accuracy at least A0@r_bar's - tolerance)."""
from __future__ import annotations

import math


def match_threshold(evaluate, make, grid, meets, bisect_steps: int):
    """Largest threshold on `grid` (descending: fewest loops first) whose result meets the target,
    then bisected on a log scale between it and the last miss above it.

    evaluate(policy) -> result; make(threshold) -> policy; meets(result) -> bool.
    Returns (threshold, result, matched); unmatched: the grid's last threshold and its result."""
    best, fail = None, None
    for th in grid:
        res = evaluate(make(th))
        if meets(res):
            best = (th, res)
            break
        fail = th
    if best is None:
        return grid[-1], evaluate(make(grid[-1])), False
    if fail is not None and fail > 0 and best[0] > 0:
        lo, hi = best[0], fail
        for _ in range(bisect_steps):
            mid = math.sqrt(lo * hi)
            res = evaluate(make(mid))
            if meets(res):
                lo, best = mid, (mid, res)
            else:
                hi = mid
    return best[0], best[1], True
