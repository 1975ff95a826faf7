"""The randomized-depth sampler: how many loops r the whole optimizer step runs.

Huginn's recipe, which the paper follows:
    rate ~ LogNormal(mu = ln(m) - sigma^2 / 2, sigma)      so that E[rate] = m
    r    = min(Poisson(rate) + 1, r_max)

The mean m is a recorded recipe field, `sampler_mean` (a deviation from the paper, docs/DEVIATIONS.md):
  "r_bar"   m = r_bar - 1, so that E[r] (before the cap) is exactly r_bar, the "mean recursion"
            of the paper's configuration table (ours; every shipped checkpoint used it);
  "huginn"  m = r_bar, as Huginn's code passes the nominal mean itself: E[r] = r_bar + 1.
At r_bar 4 "r_bar" draws r = 1 about 10% of the steps, "huginn" about 6%.

Per-token depth (recipe depth_mode "per_token", ours, issue 27): the step still draws r as above, and
then each token draws its own depth: r itself, or with probability `token_share` a depth uniform on
1..r. A token past its depth is frozen as the exact harness freezes a halted token
(LoopedLM.forward's token_loops), so the model cannot count on any other token being deep. The
step's cost stays that of r loops, and E[depth] = r (1 - share) + share (r + 1) / 2.
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


TOKEN_SEED_OFFSET = 104_729  # the per-token depth stream, apart from the step's r and the state noise


def sample_token_depths(step: int, r: int, shape: tuple[int, int], token_share: float, seed: int = 0,
                        rank: int = 0) -> torch.Tensor:
    """Per-token loops (B, T) int64 for step `step` whose drawn depth is r: each token keeps r, or with
    probability token_share draws uniformly from 1..r. Seeded by (seed, step, rank): a rank's batch
    rows get their own depths, and a resumed run draws the same ones."""
    if not 0.0 <= token_share <= 1.0:
        raise ValueError(f"token_share must be within [0, 1], got {token_share}")
    g = torch.Generator().manual_seed(seed_for(seed, TOKEN_SEED_OFFSET + step) * 64 + rank)
    shallow = torch.rand(shape, generator=g) < token_share
    uniform = torch.randint(1, r + 1, shape, generator=g)
    return torch.where(shallow, uniform, torch.full(shape, r))
