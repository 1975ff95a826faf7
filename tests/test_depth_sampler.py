import numpy as np
import pytest

from training.depth_sampler import loops_with_grad, sample_depth


@pytest.mark.parametrize("r_bar,r_max", [(4, 16), (8, 32)])
def test_sampler_mean_near_r_bar_and_capped(r_bar, r_max):
    draws = np.array([sample_depth(step, r_bar, r_max, 0.5, seed=3) for step in range(4000)])
    assert draws.min() >= 1 and draws.max() <= r_max
    # standard error of the mean is about 0.04 (r_bar 4) / 0.07 (r_bar 8) at 4000 draws
    assert abs(draws.mean() - r_bar) < 0.25
    assert len(np.unique(draws)) > 5  # it is random, not a constant


def test_sampler_is_a_function_of_seed_and_step():
    a = [sample_depth(s, 4, 16, seed=1) for s in range(200)]
    assert a == [sample_depth(s, 4, 16, seed=1) for s in range(200)]
    assert a != [sample_depth(s, 4, 16, seed=2) for s in range(200)]


def test_tight_cap_is_respected():
    assert max(sample_depth(s, 8, 3) for s in range(300)) == 3


def test_loops_with_grad():
    assert loops_with_grad(10, 4) == 4 and loops_with_grad(2, 4) == 2
