"""The exact plan's choice of points (recur_core.analysis.allocation): where the first round goes and
which brackets later rounds halve, on hand-made curves (no model)."""
import numpy as np

from recur_core.analysis.allocation import SPREAD_POINTS, TABLE_STEPS, _refine, _seed_points
from recur_core.analysis.curves import Curve
from recur_core.analysis.stats import Bootstrap

N_BOOT = 200


def curve(name: str, mean_loops, loss, noise: float = 0.0, seed: int = 0) -> Curve:
    """A curve whose bootstrap replicates are the data plus Gaussian noise of the loss (same for all points)."""
    mean_loops, loss = np.asarray(mean_loops, float), np.asarray(loss, float)
    shift = np.random.default_rng(seed).normal(0, noise, size=(N_BOOT, 1))
    return Curve(name, "eps", list(range(len(loss))), np.vstack([loss, loss + shift]),
                 np.tile(mean_loops, (N_BOOT + 1, 1)), np.zeros(len(loss)))


def a0(losses, noise: float = 0.0) -> Curve:
    depths = list(range(1, len(losses) + 1))
    c = curve("A0", depths, losses, noise, seed=1)
    c.thresholds = depths
    return c


def test_the_first_round_spreads_over_mean_loops_and_a_flat_stretch_takes_one_point():
    loops = [16, 7, 6.5, 6, 5, 4, 3, 2, 2, 2, 2, 2]  # every threshold from index 7 on exits at loop 2
    seeds = _seed_points(curve("A1", loops, np.zeros(len(loops))))
    assert len(seeds) == SPREAD_POINTS and {0, len(loops) - 1} <= seeds
    assert len(seeds & set(range(7, len(loops)))) == 1


def test_a_wholly_flat_grid_still_gets_spread_points_by_grid_steps():
    seeds = _seed_points(curve("A1", np.full(30, 3.0), np.zeros(30)))
    assert len(seeds) == SPREAD_POINTS and {0, 29} <= seeds
    even = 29 / (SPREAD_POINTS - 1)  # greedy farthest points leave no gap over twice the even spacing
    assert np.diff(sorted(seeds)).max() <= 2 * even


def test_a_table_bracket_is_halved_only_where_the_loss_moves_beyond_the_rows_uncertainty():
    boot = Bootstrap(1, N_BOOT)
    base = a0([2.6, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5], noise=0.01)
    # exact points at grid indices 0 and 10 (10 grid steps apart) bracket depths 2..5 in mean loops;
    # both are below A0's loss, so loops to match is the first point (no bracket to halve there)
    done = {0: None, 10: None}
    assert _refine(curve("A1", [6.0, 1.5], [2.4, 2.4], noise=0.01), done, base, 7, boot) == set()
    steep = curve("A1", [6.0, 1.5], [2.35, 2.45], noise=0.01)
    assert _refine(steep, done, base, 7, boot) == {5}
    near = {4: None, 4 + TABLE_STEPS: None}  # close enough on the grid whatever the loss does
    assert _refine(steep, near, base, 7, boot) == set()


def test_loops_to_match_and_its_ci_ends_are_bracketed_by_grid_neighbours():
    boot = Bootstrap(1, N_BOOT)
    base = a0([2.6, 2.55, 2.5], noise=0.002)
    # the curve crosses A0's loss at r_bar = 3 between its points at 2 and 4 mean loops (grid 2 and 8)
    a1 = curve("A1", [1.0, 2.0, 4.0, 8.0], [2.7, 2.6, 2.4, 2.4], noise=0.002)
    assert _refine(a1, {0: None, 2: None, 8: None, 12: None}, base, 3, boot) == {5}
    assert _refine(a1, {3: None, 4: None, 5: None, 12: None}, base, 3, boot) == set()
