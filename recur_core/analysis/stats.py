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

import warnings
from dataclasses import dataclass

import numpy as np

from ..settings import SETTINGS


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

    def __init__(self, n_windows: int, n_boot: int = SETTINGS.n_boot, seed: int = 0, level: float = SETTINGS.ci_level):
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

    def summarise_reach(self, values: np.ndarray) -> tuple[Estimate, int]:
        """Estimate of a level-crossing statistic (e.g. loops to reach a loss) from (1 + n_boot,)
        values with NaN where a replicate never reaches the level. Such replicates are not dropped
        (that would bias the interval low exactly where the level is barely reached): they count as
        +inf, "not reached", so an interval end or the value itself can be inf ("> the cap").
        Returns the estimate and how many of the n_boot replicates never reached the level."""
        values = np.where(np.isnan(values), np.inf, np.asarray(values, dtype=np.float64))
        alpha = (1 - self.level) / 2
        low, high = (_quantile_with_inf(values[1:], q) for q in (alpha, 1 - alpha))
        return Estimate(_scalar(values[0]), _scalar(low), _scalar(high)), int(np.isinf(values[1:]).sum())

    @property
    def n_boot(self) -> int:
        return self.weights.shape[0] - 1

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


def _quantile_with_inf(x: np.ndarray, q: float) -> np.ndarray:
    """np.quantile's default (linear) rule along axis 0 where +inf is a value: a quantile that falls
    on or interpolates towards an inf is inf."""
    x = np.sort(x, axis=0)
    h = (len(x) - 1) * q
    lo = int(np.floor(h))
    hi, g = min(lo + 1, len(x) - 1), h - lo
    a, b = x[lo], x[hi]
    with np.errstate(invalid="ignore"):
        mixed = a + g * (b - a)
    return np.where(np.isinf(a) | (np.isinf(b) & (g > 0)), np.inf, np.where(g > 0, mixed, a))


def _scalar(x):
    x = np.asarray(x, dtype=np.float64)
    return float(x) if x.ndim == 0 else x
