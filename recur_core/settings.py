"""The analysis settings, in one place: `python -m recur_core.analyze`, the app (ui/compute.py),
`python -m recur_core.report.export`, decoding and the benches all read SETTINGS, so a figure in the app, in
report.json and in a checkpoint's card comes from the same seed, windows, loops and grids.

`seed_for` is the one rule that derives a seed for item `index` (a window, a step, a program) from a
run's seed, so that every seeded stream is independent of how items are batched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .model.recipe import Recipe


@dataclass(frozen=True)
class Settings:
    seed: int = 0  # recurrent-state noise of every trace, and the bootstrap's resampling
    n_boot: int = 1000  # bootstrap replicates over windows
    ci_level: float = 0.95  # bootstrap percentile intervals
    windows: int = 128  # the canonical eval set: a checkpoint's first 128 validation windows
    min_trace_loops: int = 32  # every trace runs to max(32, r_max) loops: elasticity needs 1..32
    topk: int = 5  # predictions kept per token and loop (the app's logit lens)
    moving_kl: float = 1e-3  # a token is "still moving" at loop i while KL(p_i || p_{i-1}) > this (the paper's)
    # A1's ε grid: 0, every quarter decade from 1e-7 to 10, and inf (the app's slider stops are its
    # finite positive values, so moving the slider only looks a point up)
    eps_log10_min: int = -7
    eps_log10_max: int = 1
    eps_per_decade: int = 4
    tau_grid: tuple[float, ...] = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
                                   0.9, 0.95, 0.99, math.inf)  # A2's router threshold τ
    # GateExit's q grid (the exit CDF a learned gate must reach; Ouro's Q-exit): 0 = loop 1, 1 = its cap
    q_grid: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)
    default_eps: float = 1e-3  # the app's A1 ε when it opens (the paper's "still moving" threshold)
    kv_rule: str = "latest"  # decoding's default KV rule (recur_core.decoding.kv.KV_RULES)
    probe_windows: int = 32  # training-side windows A2's probes are trained on
    probe_tokens: int = 64  # sampled positions per probe window

    @property
    def eps_log10(self) -> tuple[float, ...]:
        n = (self.eps_log10_max - self.eps_log10_min) * self.eps_per_decade
        return tuple(self.eps_log10_min + i / self.eps_per_decade for i in range(n + 1))

    @property
    def eps_grid(self) -> tuple[float, ...]:
        return (0.0, *(10.0 ** x for x in self.eps_log10), math.inf)

    def trace_loops(self, recipe: Recipe) -> int:
        """Depth of a checkpoint's traces: max(min_trace_loops, r_max)."""
        return max(self.min_trace_loops, recipe.r_max)

    def as_dict(self) -> dict:
        """What report.json records under "settings"."""
        return {"seed": self.seed, "n_boot": self.n_boot, "windows": self.windows,
                "min_trace_loops": self.min_trace_loops, "topk": self.topk, "moving_threshold": self.moving_kl,
                "eps_grid": list(self.eps_grid), "tau_grid": list(self.tau_grid), "q_grid": list(self.q_grid)}


SETTINGS = Settings()

SEED_STRIDE = 1_000_003  # a prime larger than any count of windows, steps or programs per seed


def seed_for(seed: int, index: int) -> int:
    """The seed of item `index` of a run seeded `seed`: distinct for every (seed, index) with
    index < SEED_STRIDE, and a valid torch / numpy / random seed (in [0, 2**63))."""
    return (seed * SEED_STRIDE + index) % (2 ** 63)
