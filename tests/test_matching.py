"""recur_core.analysis.matching: the one home of "the cheapest threshold that meets a target"."""
import math

from recur_core.analysis.matching import cheapest, match_threshold


def test_cheapest_takes_the_least_cost_among_those_that_meet():
    points = [{"th": 0.1, "loops": 3.0, "acc": 0.9}, {"th": 0.3, "loops": 2.0, "acc": 0.95},
              {"th": 1.0, "loops": 1.0, "acc": 0.5}]
    best = cheapest(points, lambda p: p["acc"] >= 0.9, lambda p: p["loops"])
    assert best["th"] == 0.3
    assert cheapest(points, lambda p: p["acc"] > 0.99, lambda p: p["loops"]) is None


def test_cheapest_breaks_ties_by_the_cost_tuple():
    points = [(2.0, 0.3), (2.0, 0.1), (3.0, 0.01)]
    assert cheapest(points, lambda p: True, lambda p: p) == (2.0, 0.1)
    assert cheapest(points, lambda p: True, lambda p: p[0]) == (2.0, 0.3)  # else the first


def test_match_threshold_walks_down_the_grid_then_bisects_towards_the_boundary():
    """Quality meets the target below threshold 0.05; the grid brackets it between 0.1 and 0.01."""
    calls = []

    def evaluate(policy):
        calls.append(policy)
        return policy

    match = match_threshold(evaluate, make=lambda th: th, grid=(1.0, 0.1, 0.01, 0.001),
                            meets=lambda th: th <= 0.05, bisect_steps=6)
    assert match.matched and 0.01 <= match.threshold <= 0.05
    assert match.threshold > 0.04  # bisection moved it up from the grid's 0.01 towards 0.05
    assert match.policy == match.result == match.threshold
    assert calls[:3] == [1.0, 0.1, 0.01] and len(calls) == 3 + 6


def test_match_threshold_unmatched_returns_the_grid_end():
    match = match_threshold(lambda p: p, lambda th: th, (1.0, 0.1), lambda th: False, bisect_steps=3)
    assert not match.matched and match.threshold == 0.1 and match.result == 0.1
    assert math.isfinite(match.threshold)
