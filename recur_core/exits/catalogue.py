"""The exit-policy catalogue: every policy family once, under one name.

An entry (`Family`) holds what every caller needs to know about a family besides its rule (which is
its class in policies.py): the knob and what it means, the default threshold, the analysis sweep and
the decoding benches' calibration grid, what it needs beyond the core state (the readout, a probe, a
learned gate), where it is shown, and its display name and colour. The report's keys, the app, the
CLI, lm-eval's model_args, the benchmarks and the cards all name families by `Family.name` and build
policies with `make` / `sweep`.

Adding a policy: its class in policies.py, one entry in FAMILIES, its tests.

Names: the entry's `name` is report.json's key (A2: one key per probe label kind, "A2_<kind>").
`family` also takes a name in any case and the older spellings in `aliases` (lm-eval's model_args
before the catalogue, saved calibrations, the app's earlier labels).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..settings import SETTINGS
from .policies import (
    Accel,
    ArgmaxStable,
    CertifiedExit,
    ConvergenceExit,
    CosineExit,
    EntropyDiff,
    GateExit,
    LatentDiff,
    LinearRouter,
    Policy,
    ReverseKLExit,
    Uniform,
)

# Where a family is shown (Family.places)
CURVES = "curves"  # the allocation curves of report.json and the Depth / loss page
GROUND_TRUTH = "ground_truth"  # operating points against known hop depths
COMPARE = "compare"  # the Compare page's criteria beside A0 / A1 / A2
GENERATE = "generate"  # the Generate page's policies

# Huginn's KL / entropy / cosine thresholds: every half decade from 1e-7 to 10, with 0 and inf (a
# coarser grid than A1's: these are comparisons, and the entropy rule runs outside the shared lanes)
HUGINN_GRID = (0.0, *(10.0 ** (k / 2) for k in range(-14, 3)), math.inf)


@dataclass(frozen=True)
class Family:
    """One policy family. Thresholds are numbers in [low, high] (NaN refused); `integer` ones are counts."""

    name: str
    cls: type[Policy]
    knob: str  # the threshold's symbol
    rule: str  # the rule in words with its knob (the app's control label)
    display: str  # the name people read (charts, tables)
    colour: str  # its colour in every chart (no two families share one)
    default: float | None  # the threshold when none is given; None: the caller must give it (A0's depth)
    sweep: tuple[float, ...] | None = ()  # the analysis' thresholds; None: every depth 1..cap (A0)
    calibration: tuple[float, ...] = ()  # coarse, descending: the decoding benches calibrate on it
    places: frozenset[str] = frozenset()
    needs_probe: bool = False  # A2: a trained router probe
    needs_gate: bool = False  # a model with a learned exit gate: (gate_lambda, trained steps)
    integer: bool = False
    low: float = 0.0
    high: float = math.inf
    sweep_below_cap: bool = False  # a threshold >= the cap never holds before it (argmax's run length)
    aliases: tuple[str, ...] = ()
    variants: dict[str, tuple[str, str]] = field(default_factory=dict)  # A2: label kind -> (display, colour)

    @property
    def needs_readout(self) -> bool:
        """The coda and head run at every loop (the rule reads p_i)."""
        return self.cls.needs_readout

    def check(self, threshold) -> float:
        """The threshold as a number, or a ValueError naming the family's range."""
        try:
            value = float(threshold)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: the threshold {self.knob} must be a number, got {threshold!r}") from None
        if not self.low <= value <= self.high or (self.integer and value != int(value)):
            kind = "a whole number" if self.integer else "a number"
            raise ValueError(f"{self.name}: the threshold {self.knob} must be {kind} in [{self.low:g}, {self.high:g}], "
                             f"got {threshold!r}")
        return int(value) if self.integer else value


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("A0", Uniform, "r", "r: loops for every token", "A0 uniform depth", "#4c78a8", None, sweep=None,
           places=frozenset({CURVES, GENERATE}), integer=True, low=1, aliases=("uniform",)),
    Family("A1", ConvergenceExit, "ε", "ε: halt once KL(p_i ‖ p_{i−1}) < ε [nats]", "A1 convergence exit (KL < ε)",
           "#f58518", SETTINGS.default_eps, SETTINGS.eps_grid,
           calibration=(1.0, 0.3, 0.1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 1e-6),
           places=frozenset({CURVES, GROUND_TRUTH, GENERATE})),
    Family("latent", LatentDiff, "δ", "δ: halt once ‖s_i − s_{i−1}‖ / ‖s_i‖ < δ", "latent rule (Huginn)", "#8c564b",
           0.03, (0.0, 1e-3, 3e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, math.inf),
           calibration=(1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 5e-3, 2e-3, 1e-3, 1e-4),
           places=frozenset({CURVES, GROUND_TRUTH, COMPARE, GENERATE}), aliases=("latent-diff",)),
    Family("A2", LinearRouter, "τ", "τ: halt once the predicted chance of change < τ", "A2 router", "#54a24b", 0.5,
           SETTINGS.tau_grid, calibration=(0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 3e-3, 1e-3),
           places=frozenset({CURVES, GROUND_TRUTH}), needs_probe=True,
           variants={"argmax": ("A2 router (argmax labels)", "#54a24b"), "kl": ("A2 router (KL labels)", "#b279a2"),
                     "argmax_any": ("A2 router (argmax, any later loop)", "#72b7b2"),
                     "kl_any": ("A2 router (KL, any later loop)", "#e45756")}),
    Family("huginn_kl", ReverseKLExit, "ε", "ε: halt once KL(p_{i−1} ‖ p_i) < ε [nats] (reverse of A1's)",
           "KL, Huginn's direction", "#ff9da6", 1e-3, HUGINN_GRID, places=frozenset({GROUND_TRUTH, COMPARE}),
           aliases=("reverse_kl", "KL, Huginn's direction")),
    Family("huginn_entropy", EntropyDiff, "δ", "δ: halt once |H(p_i) − H(p_{i−1})| < δ [nats]",
           "entropy difference (Huginn)", "#bab0ac", 1e-3, HUGINN_GRID, places=frozenset({GROUND_TRUTH, COMPARE}),
           aliases=("entropy", "entropy-diff")),
    Family("huginn_cosine", CosineExit, "δ", "δ: halt once 1 − cos(s_i, s_{i−1}) < δ", "cosine change (Huginn)",
           "#eeca3b", 1e-3, HUGINN_GRID, places=frozenset({GROUND_TRUTH, COMPARE}), aliases=("cosine",)),
    Family("huginn_argmax", ArgmaxStable, "n", "n: halt once the argmax is unchanged for n loops",
           "argmax stability (Huginn)", "#17becf", 5, (1, 2, 3, 4, 5, 6, 8, 10, 12, 16),
           places=frozenset({GROUND_TRUTH, COMPARE}), integer=True, low=1, sweep_below_cap=True,
           aliases=("argmax", "argmax-stability")),
    Family("Accel", Accel, "τ", "τ: halt once |δ_i − δ_{i−1}| < τ, δ_i = ‖s_i − s_{i−1}‖ (the state's step size)",
           "Accel (second-order step size)", "#393b79", 1e-2, (0.0, *(10.0 ** k for k in range(-5, 3)), math.inf),
           calibration=(30.0, 10.0, 3.0, 1.0, 0.3, 0.1, 0.03, 0.01, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5),
           places=frozenset({CURVES, GROUND_TRUTH, COMPARE, GENERATE}), aliases=("second_order",)),
    Family("Certified", CertifiedExit, "L", "L: halt once 2 L · δ_i ρ/(1 − ρ) < the top-1 − top-2 logit margin "
           "(ρ = δ_i / δ_{i−1}; L the readout's measured Lipschitz bound)", "Certified exit (sufficient condition)",
           "#637939", None, (0.0, *(10.0 ** (k / 2) for k in range(-4, 9)), math.inf),
           places=frozenset({CURVES, COMPARE}), aliases=("certified",)),
    Family("Gate", GateExit, "q", "q: halt at the first loop whose exit CDF ≥ q (Ouro's Q-exit)",
           "Learned exit gate (Ouro's Q-exit, CDF ≥ q)", "#9d755d", 0.5, SETTINGS.q_grid,
           places=frozenset({CURVES}), needs_gate=True, high=1.0),
)}
_LOOKUP = {alias.lower(): f for f in FAMILIES.values() for alias in (f.name, *f.aliases)}


def family(name: str) -> Family:
    """The family a name denotes: its name in any case, an alias, or an A2 report key "A2_<kind>"."""
    key = str(name).lower()
    stem, _, variant = key.partition("_")
    found = _LOOKUP.get(key)
    if found is None and stem in _LOOKUP and variant in _LOOKUP[stem].variants:
        found = _LOOKUP[stem]
    if found is None:
        raise ValueError(f"unknown exit policy {name!r}: expected one of {', '.join(FAMILIES)}")
    return found


def shown_in(place: str) -> list[Family]:
    """The families shown in `place` (CURVES, GROUND_TRUTH, COMPARE, GENERATE), in catalogue order."""
    return [f for f in FAMILIES.values() if place in f.places]


def display(key: str) -> str:
    """A report key's name for people (an A2 key names its probe labels)."""
    return _variant(key)[0]


def colour(key: str) -> str:
    """A report key's colour in every chart."""
    return _variant(key)[1]


def _variant(key: str) -> tuple[str, str]:
    fam = family(key)
    kind = str(key).lower().partition("_")[2]
    return fam.variants.get(kind, (fam.display, fam.colour))


def make(name: str, threshold=None, *, r_max: int | None = None, min_loops: int | None = None, probe=None,
         gate=None) -> Policy:
    """The policy of family `name` at `threshold` (None: the family's default), capped at r_max.
    min_loops: the first loop the rule is consulted at (None: the class's own). probe: A2's router
    probe; gate: (gate_lambda, trained steps) of a model with a learned exit gate, whose trained steps
    also cap it. A0 runs exactly `threshold` loops (r_max and min_loops do not apply)."""
    fam = family(name)
    if threshold is None and fam.default is None:
        raise ValueError(f"{fam.name} has no default threshold: give {fam.knob}")
    value = fam.check(fam.default if threshold is None else threshold)
    if fam.cls is Uniform:
        return Uniform(value)
    options = {"r_max": r_max} if min_loops is None else {"r_max": r_max, "min_loops": min_loops}
    if fam.needs_probe:
        if probe is None:
            raise ValueError(f"{fam.name} needs a trained router probe")
        return fam.cls(probe, value, **options)
    if fam.needs_gate:
        if gate is None:
            raise ValueError(f"{fam.name} needs a model with a learned exit gate (an Ouro checkpoint has one)")
        gate_lambda, steps = gate
        return fam.cls(value, gate_lambda, **{**options, "r_max": steps if r_max is None else min(steps, r_max)})
    return fam.cls(value, **options)


def sweep(name: str, r_max: int, grid=None, *, min_loops: int | None = None, probe=None, gate=None) -> list[Policy]:
    """The family's policies over `grid` (None: its sweep; A0: every depth 1..r_max), capped at r_max."""
    fam = family(name)
    if fam.sweep is None:
        return [make(fam.name, r) for r in range(1, r_max + 1)]
    grid = fam.sweep if grid is None else grid
    if fam.sweep_below_cap:
        grid = [t for t in grid if t < r_max]
    return [make(fam.name, t, r_max=r_max, min_loops=min_loops, probe=probe, gate=gate) for t in grid]


def sweeps(place: str, r_max: int, *, grids: dict | None = None, probes: dict | None = None, gate=None,
           min_loops: dict | None = None) -> dict[str, list[Policy]]:
    """The sweep of every family shown in `place`, by report key: grids / min_loops override a
    family's by name; A2 gets one key per probe label kind of `probes` ({kind: probe}), and a family
    that needs a probe or a gate is left out without one."""
    grids, min_loops, out = grids or {}, min_loops or {}, {}
    for fam in shown_in(place):
        options = {"min_loops": min_loops.get(fam.name), "gate": gate}
        if fam.needs_probe:
            for kind, probe in (probes or {}).items():
                out[f"{fam.name}_{kind}"] = sweep(fam.name, r_max, grids.get(fam.name), probe=probe, **options)
        elif gate is not None or not fam.needs_gate:
            out[fam.name] = sweep(fam.name, r_max, grids.get(fam.name), **options)
    return out
