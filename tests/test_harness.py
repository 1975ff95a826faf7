import math

import numpy as np
import pytest
import torch

from recur_core.analysis import fast_vs_exact
from recur_core.harness import run_exact
from recur_core.policies import ConvergenceExit, LatentDiff, Policy, Uniform
from recur_core.stats import Bootstrap
from recur_core.trace import trace

R_MAX = 5


@pytest.fixture(scope="module")
def windows(ckpt):
    return ckpt.windows("eval")[:4]


@pytest.fixture(scope="module")
def tr(ckpt, windows):
    return trace(ckpt, windows, R_MAX, seed=2, cache=False)


def test_eps_zero_equals_uniform_r_max(ckpt, windows, tr):
    result = run_exact(ckpt, windows, ConvergenceExit(0.0, r_max=R_MAX), R_MAX, seed=2)
    assert (result.exit_depth == R_MAX).all() and not result.converged.any()
    np.testing.assert_allclose(result.ce, tr.ce[..., R_MAX - 1], rtol=1e-5, atol=1e-6)


def test_eps_inf_equals_one_loop(ckpt, windows, tr):
    result = run_exact(ckpt, windows, ConvergenceExit(math.inf), R_MAX, seed=2)
    assert (result.exit_depth == 1).all() and result.converged.all()
    np.testing.assert_allclose(result.ce, tr.ce[..., 0], rtol=1e-5, atol=1e-6)


def test_uniform_and_latent_diff_extremes(ckpt, windows, tr):
    np.testing.assert_allclose(run_exact(ckpt, windows, Uniform(3), R_MAX, seed=2).ce, tr.ce[..., 2],
                               rtol=1e-5, atol=1e-6)
    huge = run_exact(ckpt, windows, LatentDiff(1e9), R_MAX, seed=2)
    np.testing.assert_allclose(huge.ce, tr.ce[..., 0], rtol=1e-5, atol=1e-6)


class FreezeFirstTokenAtLoop1(Policy):
    """Hand-made: position 0 halts after loop 1, every other token runs to the cap."""

    threshold_name = "min_loops"

    def _rule_online(self, loop, signals):
        halt = torch.zeros(signals.shape, dtype=torch.bool)
        halt[:, 0] = loop == 1
        return halt


def test_frozen_tokens_stay_in_the_context(ckpt, windows, tr):
    result = run_exact(ckpt, windows, FreezeFirstTokenAtLoop1(), R_MAX, seed=2)
    assert (result.exit_depth[:, 0] == 1).all() and (result.exit_depth[:, 1:] == R_MAX).all()
    # causal: position 0 sees only itself, so it scores exactly as after one loop
    np.testing.assert_allclose(result.ce[:, 0], tr.ce[:, 0, 0], rtol=1e-5, atol=1e-6)
    # later tokens attended to the frozen state, not the updated one: their outputs differ from uniform
    assert not np.allclose(result.ce[:, 1:], tr.ce[:, 1:, R_MAX - 1], rtol=0, atol=1e-7)


def test_fast_vs_exact_rows(ckpt, windows, tr):
    rows = fast_vs_exact(ckpt, windows, tr, [Uniform(2), ConvergenceExit(1e-3, r_max=R_MAX)], Bootstrap(4, 50))
    assert rows[0]["gap_loss"]["value"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["gap_mean_loops"]["value"] == 0.0
    for row in rows:
        assert set(row) >= {"policy", "threshold", "fast", "exact", "gap_loss", "gap_mean_loops"}
        assert row["fast"]["loss"]["ci_low"] <= row["fast"]["loss"]["ci_high"]
