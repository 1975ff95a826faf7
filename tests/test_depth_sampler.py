import numpy as np
import pytest

from training.depth_sampler import sample_depth


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


@pytest.mark.parametrize("r_bar,r_max", [(4, 16), (8, 32)])
def test_huginn_sampler_mean_is_one_loop_higher(r_bar, r_max):
    """sampler_mean "huginn" passes r_bar itself as the rate's mean (Huginn's code): E[r] = r_bar + 1."""
    draws = np.array([sample_depth(step, r_bar, r_max, 0.5, seed=3, sampler_mean="huginn") for step in range(4000)])
    assert abs(draws.mean() - (r_bar + 1)) < 0.3


def test_sampler_mean_changes_how_often_one_loop_is_drawn():
    """At r_bar 4 the issue's figures: P(r = 1) about 10% with E[r] = r_bar, about 6% with Huginn's mean
    (standard error about 0.3 points at 8000 draws)."""
    ours = np.array([sample_depth(s, 4, 16, seed=5) for s in range(8000)])
    huginn = np.array([sample_depth(s, 4, 16, seed=5, sampler_mean="huginn") for s in range(8000)])
    assert (ours == 1).mean() == pytest.approx(0.102, abs=0.012)
    assert (huginn == 1).mean() == pytest.approx(0.058, abs=0.01)
    assert [sample_depth(s, 4, 16, seed=5, sampler_mean="r_bar") for s in range(100)] == ours[:100].tolist()


def test_unknown_sampler_mean_is_refused():
    with pytest.raises(ValueError, match="sampler_mean"):
        sample_depth(0, 4, 16, sampler_mean="paper")
