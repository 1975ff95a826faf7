"""Bootstrap confidence intervals over windows: the one place uncertainty is computed.

Windows are the resampling unit (tokens within a window are correlated). A bootstrap replicate is a
multinomial count vector over windows (how often each window was drawn), so any statistic written
as a function of per-window weights, e.g. a token-weighted mean sum_w c_w num_w / sum_w c_w den_w,
is evaluated for all replicates at once with one matrix product (`ratio`); derived statistics
(interpolations, differences) are computed per replicate and summarised with `summarise`. Replicates share their counts
across statistics computed from the same `Bootstrap`, which makes differences between two policies
paired. Intervals are percentile intervals (95% by default); everything is seeded.
"""
from __future__ import annotations

from dataclasses import dataclass
import warnings

import numpy as np

N_BOOT = 1000
LEVEL = 0.95


@dataclass
class Estimate:
    """A point estimate with its bootstrap interval (floats, or arrays of one shape)."""

    value: float | np.ndarray
    ci_low: float | np.ndarray
    ci_high: float | np.ndarray

    def to_dict(self) -> dict:
        return {"value": _plain(self.value), "ci_low": _plain(self.ci_low), "ci_high": _plain(self.ci_high)}


def _plain(x):
    return x.tolist() if isinstance(x, np.ndarray) else float(x)


class Bootstrap:
    """Seeded resampling of n_windows windows; `weights` is (1 + n_boot, n_windows): row 0 is the
    data itself (all ones), rows 1.. are the replicates' draw counts."""

    def __init__(self, n_windows: int, n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL):
        if n_windows < 1:
            raise ValueError("the bootstrap needs at least one window")
        rng = np.random.default_rng(seed)
        counts = rng.multinomial(n_windows, np.full(n_windows, 1.0 / n_windows), size=n_boot)
        self.weights = np.vstack([np.ones((1, n_windows)), counts]).astype(np.float64)
        self.n_windows, self.level = n_windows, level

    def summarise(self, values: np.ndarray) -> Estimate:
        """Estimate from precomputed (1 + n_boot, ...) values (row 0 = the data)."""
        alpha = (1 - self.level) / 2
        with warnings.catch_warnings():  # all-NaN replicates (e.g. a level never reached) give NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            low, high = np.nanquantile(values[1:], [alpha, 1 - alpha], axis=0)
        return Estimate(_scalar(values[0]), _scalar(low), _scalar(high))

    def ratio(self, numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
        """(R, ...) replicate values of sum_w num_w / sum_w den_w; numerator and denominator are
        per-window sums of the same shape (n_windows, ...)."""
        num = np.tensordot(self.weights, numerator, axes=(1, 0))
        den = np.tensordot(self.weights, denominator, axes=(1, 0))
        with np.errstate(invalid="ignore", divide="ignore"):
            return num / den

    def mean(self, per_window: np.ndarray) -> Estimate:
        """Mean over windows of a per-window value (n_windows, ...)."""
        per_window = np.asarray(per_window, dtype=np.float64)
        return self.summarise(self.ratio(per_window, np.ones_like(per_window)))


def _scalar(x):
    x = np.asarray(x, dtype=np.float64)
    return float(x) if x.ndim == 0 else x
