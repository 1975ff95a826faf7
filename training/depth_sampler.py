"""The randomized-depth sampler: how many loops r the whole optimizer step runs.

Huginn's recipe, which the paper follows:
    rate ~ LogNormal(mu = ln(m) - sigma^2 / 2, sigma)      so that E[rate] = m
    r    = min(Poisson(rate) + 1, r_max)

Choice where the brief is silent: Huginn passes the nominal mean itself as m, which makes the
realised mean r_bar + 1. We pass m = r_bar - 1, so that the realised mean of r (before the cap)
is exactly r_bar, the "mean recursion" of the paper's configuration table.
"""
from __future__ import annotations

import math

import torch

SAMPLER_SEED_OFFSET = 7_919  # keeps the sampler stream apart from the other per-step seeds


def sample_depth(step: int, r_bar: float, r_max: int, sigma: float = 0.5, seed: int = 0) -> int:
    """Loops for optimizer step `step`. Seeded by (seed, step): every rank draws the same r."""
    if r_bar < 1 or r_max < 1:
        raise ValueError(f"need r_bar >= 1 and r_max >= 1, got {r_bar}, {r_max}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + SAMPLER_SEED_OFFSET + step)
    m = max(r_bar - 1.0, 1e-6)
    mu = math.log(m) - sigma ** 2 / 2
    rate = torch.empty(1, dtype=torch.float64).log_normal_(mu, sigma, generator=g)
    r = int(torch.poisson(rate, generator=g).item()) + 1
    return min(r, r_max)


def loops_with_grad(r: int, k: int) -> int:
    """Truncated backprop through depth: only the last k of r loops get gradients."""
    return min(r, k)
