"""The randomized-depth sampler: how many loops r the whole optimizer step runs.

Huginn's recipe, which the paper follows:
    rate ~ LogNormal(mu = ln(m) - sigma^2 / 2, sigma)      so that E[rate] = m
    r    = min(Poisson(rate) + 1, r_max)

The mean m is a recorded recipe field, `sampler_mean` (a deviation from the paper, README.md):
  "r_bar"   m = r_bar - 1, so that E[r] (before the cap) is exactly r_bar, the "mean recursion"
            of the paper's configuration table (ours; every shipped checkpoint used it);
  "huginn"  m = r_bar, as Huginn's code passes the nominal mean itself: E[r] = r_bar + 1.
At r_bar 4 "r_bar" draws r = 1 about 10% of the steps, "huginn" about 6%.
"""
from __future__ import annotations

import math

import torch

from recur_core.model.recipe import SAMPLER_MEANS
from recur_core.settings import seed_for

SAMPLER_SEED_OFFSET = 7_919  # keeps the sampler stream apart from the other per-step seeds


def rate_mean(r_bar: float, sampler_mean: str = "r_bar") -> float:
    """m, the mean of the log-normal rate, for the recorded sampler_mean."""
    if sampler_mean not in SAMPLER_MEANS:
        raise ValueError(f"sampler_mean must be one of {SAMPLER_MEANS}, got {sampler_mean!r}")
    return max(r_bar - 1.0, 1e-6) if sampler_mean == "r_bar" else float(r_bar)


def sample_depth(step: int, r_bar: float, r_max: int, sigma: float = 0.5, seed: int = 0,
                 sampler_mean: str = "r_bar") -> int:
    """Loops for optimizer step `step`. Seeded by (seed, step): every rank draws the same r."""
    if r_bar < 1 or r_max < 1:
        raise ValueError(f"need r_bar >= 1 and r_max >= 1, got {r_bar}, {r_max}")
    g = torch.Generator().manual_seed(seed_for(seed, SAMPLER_SEED_OFFSET + step))
    mu = math.log(rate_mean(r_bar, sampler_mean)) - sigma ** 2 / 2
    rate = torch.empty(1, dtype=torch.float64).log_normal_(mu, sigma, generator=g)
    r = int(torch.poisson(rate, generator=g).item()) + 1
    return min(r, r_max)
