import numpy as np
import pytest

from recur_core.analysis.stats import Bootstrap


def test_interval_covers_a_known_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    true_mean, covered, trials = 2.0, 0, 200
    for trial in range(trials):
        per_window = rng.normal(true_mean, 1.0, size=40)
        est = Bootstrap(40, n_boot=400, seed=trial).mean(per_window)
        assert est.ci_low <= est.value <= est.ci_high
        covered += est.ci_low <= true_mean <= est.ci_high
    assert 0.88 <= covered / trials <= 0.99


def test_ratio_is_token_weighted_and_row_zero_is_the_data():
    boot = Bootstrap(3, n_boot=50, seed=0)
    loss_sum, tokens = np.array([10.0, 2.0, 6.0]), np.array([5.0, 1.0, 2.0])
    reps = boot.ratio(loss_sum, tokens)
    assert reps.shape == (51,)
    assert reps[0] == pytest.approx(18.0 / 8.0)
    assert set(np.round(reps[1:], 6)) <= {round(v, 6) for v in _all_resample_ratios(loss_sum, tokens)}


def _all_resample_ratios(num, den):
    out = []
    for a in range(3):
        for b in range(3):
            for c in range(3):
                idx = [a, b, c]
                out.append(num[idx].sum() / den[idx].sum())
    return out


def test_seeded_and_vectorised_over_columns():
    values = np.random.default_rng(0).normal(size=(30, 4))
    a, b = Bootstrap(30, 300, seed=5).mean(values), Bootstrap(30, 300, seed=5).mean(values)
    np.testing.assert_array_equal(a.ci_low, b.ci_low)
    np.testing.assert_allclose(a.value, values.mean(0))
    assert a.ci_low.shape == (4,)
    c = Bootstrap(30, 300, seed=6).mean(values)
    assert not np.array_equal(a.ci_low, c.ci_low)


def test_nan_replicates_are_ignored_and_all_nan_gives_nan():
    boot = Bootstrap(5, 100, seed=0)
    values = np.full((101, 2), np.nan)
    values[:, 1] = np.linspace(0, 1, 101)
    est = boot.summarise(values)
    assert np.isnan(est.value[0]) and np.isnan(est.ci_low[0])
    assert 0.0 < est.ci_low[1] < est.ci_high[1] < 1.0


def test_replicates_that_never_reach_the_level_count_as_not_reached():
    """Dropping NaN replicates (nanquantile) would bias the upper end low; they are +inf instead."""
    boot = Bootstrap(10, n_boot=100, seed=0)
    values = np.concatenate([[3.0], np.linspace(2.0, 4.0, 100)])
    values[1:][::4] = np.nan  # a quarter of the replicates never reach the level
    est, never = boot.summarise_reach(values)
    assert never == 25
    assert est.value == 3.0 and np.isfinite(est.ci_low)
    assert est.ci_high == np.inf  # 25% > 2.5%: the upper end is "not reached" (> the cap)
    dropped = boot.summarise(values)  # the old behaviour, for contrast
    assert np.isfinite(dropped.ci_high) and dropped.ci_high < 4.0


def test_reach_interval_is_the_ordinary_one_when_every_replicate_reaches():
    boot = Bootstrap(10, n_boot=200, seed=1)
    values = np.concatenate([[3.0], np.random.default_rng(2).normal(3.0, 0.1, 200)])
    est, never = boot.summarise_reach(values)
    ref = boot.summarise(values)
    assert never == 0 and est.ci_low == pytest.approx(ref.ci_low) and est.ci_high == pytest.approx(ref.ci_high)
    # a couple of unreached replicates (1%) move the upper end up but keep it finite
    values[1:3] = np.nan
    est2, never2 = boot.summarise_reach(values)
    assert never2 == 2 and est.ci_high < est2.ci_high < np.inf
    # the data itself never reaching the level: the value is inf, not NaN
    values[0] = np.nan
    assert boot.summarise_reach(values)[0].value == np.inf
