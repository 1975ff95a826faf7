"""The exit-policy catalogue: one entry per family, one `make`, one sweep (recur_core/exits/catalogue.py)."""
import math

import numpy as np
import pytest
import torch

from recur_core.analysis.allocation import allocation_families
from recur_core.analysis.ground_truth import operating_point_families
from recur_core.exits import catalogue
from recur_core.exits.policies import (
    ArgmaxStable,
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
from recur_core.settings import SETTINGS


class FixedProbe:
    probe_id = rule_id = "fixed"

    def chance(self, state, loop):
        return torch.zeros(state.shape[:-1])


def gate_lambda(state):
    return torch.full(state.shape[:-1], 0.3)


def extras(fam) -> dict:
    return {"probe": FixedProbe() if fam.needs_probe else None, "gate": (gate_lambda, 6) if fam.needs_gate else None}


@pytest.mark.parametrize("fam", list(catalogue.FAMILIES.values()), ids=list(catalogue.FAMILIES))
def test_every_entry_makes_its_class_at_its_default_and_over_its_sweep(fam):
    threshold = 3 if fam.default is None else fam.default
    policy = catalogue.make(fam.name, threshold, r_max=8, **extras(fam))
    assert type(policy) is fam.cls and policy.threshold == threshold
    assert fam.needs_readout == type(policy).needs_readout
    swept = catalogue.sweep(fam.name, 8, **extras(fam))
    assert swept and all(type(p) is fam.cls for p in swept)
    if fam.calibration:  # descending, inside the family's range
        assert list(fam.calibration) == sorted(fam.calibration, reverse=True)
        assert all(fam.check(t) == t for t in fam.calibration)


def test_names_aliases_and_report_keys_resolve_to_one_family():
    assert catalogue.family("a1") is catalogue.family("A1") is catalogue.FAMILIES["A1"]
    for alias, name in [("uniform", "A0"), ("reverse_kl", "huginn_kl"), ("entropy", "huginn_entropy"),
                        ("argmax", "huginn_argmax"), ("cosine", "huginn_cosine"), ("argmax-stability", "huginn_argmax"),
                        ("A2_kl_any", "A2"), ("gate", "Gate")]:
        assert catalogue.family(alias).name == name
    with pytest.raises(ValueError, match="unknown exit policy 'kl'.*A0, A1"):
        catalogue.family("kl")


def test_display_names_and_colours_are_one_per_report_key():
    keys = [k for f in catalogue.FAMILIES.values() for k in ([f"A2_{v}" for v in f.variants] or [f.name])]
    assert len({catalogue.display(k) for k in keys}) == len(keys)
    assert len({catalogue.colour(k) for k in keys}) == len(keys)  # no two curves share a colour
    assert catalogue.display("A2_kl") == "A2 router (KL labels)" and catalogue.display("A1").startswith("A1 ")


@pytest.mark.parametrize("name,bad,limit", [("A1", -1e-3, r"\[0, inf\]"), ("Gate", 1.5, r"\[0, 1\]"),
                                            ("huginn_argmax", 0, r"whole number in \[1, inf\]"),
                                            ("huginn_argmax", 2.5, "whole number"), ("latent", math.nan, "latent"),
                                            ("A0", "deep", "must be a number"),
                                            ("Accel", -0.1, r"Accel: the threshold τ must be a number in \[0, inf\]"),
                                            ("Certified", -3.0, r"Certified: the threshold L must be a number in \[0, inf\]"),
                                            ("Certified", math.nan, "Certified")])
def test_a_threshold_outside_its_range_is_refused_naming_the_limit(name, bad, limit):
    with pytest.raises(ValueError, match=limit):
        catalogue.make(name, bad, r_max=8, gate=(gate_lambda, 6))


def test_what_a_family_needs_is_asked_for():
    with pytest.raises(ValueError, match="router probe"):
        catalogue.make("A2", 0.5, r_max=4)
    with pytest.raises(ValueError, match="learned exit gate"):
        catalogue.make("Gate", 0.5, r_max=4)
    with pytest.raises(ValueError, match="give r"):
        catalogue.make("A0")
    assert catalogue.make("Gate", 0.5, r_max=10, gate=(gate_lambda, 6)).r_max == 6  # capped at the trained steps
    assert catalogue.make("Gate", 0.5, r_max=4, gate=(gate_lambda, 6)).r_max == 4


def test_sweeps_are_the_families_the_analysis_ran_before_the_catalogue():
    """The allocation curves and the ground-truth operating points keep their policies, key order included."""
    r_max, probe = 8, FixedProbe()
    huginn = (0.0, *(10.0 ** (k / 2) for k in range(-14, 3)), math.inf)
    before_gt = {"A1": [ConvergenceExit(e, r_max=r_max) for e in SETTINGS.eps_grid],
                 "latent": [LatentDiff(d, r_max=r_max) for d in (0.0, 1e-3, 3e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5,
                                                                 math.inf)],
                 "A2_kl": [LinearRouter(probe, t, r_max=r_max) for t in SETTINGS.tau_grid],
                 "huginn_kl": [ReverseKLExit(e, r_max=r_max) for e in huginn],
                 "huginn_entropy": [EntropyDiff(e, r_max=r_max) for e in huginn],
                 "huginn_cosine": [CosineExit(e, r_max=r_max) for e in huginn],
                 "huginn_argmax": [ArgmaxStable(n, r_max=r_max) for n in (1, 2, 3, 4, 5, 6)]}
    gt = operating_point_families(r_max, {"kl": probe}, SETTINGS.eps_grid, SETTINGS.tau_grid)
    assert list(gt) == [*before_gt, "Accel"]  # Accel: issue 48 (a state rule: harness passes only)
    assert {k: [repr(p) for p in gt[k]] for k in before_gt} == {k: [repr(p) for p in v] for k, v in before_gt.items()}
    before_curves = {"A0": [Uniform(r) for r in range(1, r_max + 1)],
                     "A1": [ConvergenceExit(e, 2, r_max) for e in SETTINGS.eps_grid],
                     "A2_kl": [LinearRouter(probe, t, 1, r_max) for t in SETTINGS.tau_grid],
                     "Gate": [GateExit(q, gate_lambda, 1, 6) for q in SETTINGS.q_grid]}
    curves = allocation_families(r_max, probes={"kl": probe}, gate=(gate_lambda, 6))
    assert list(curves) == ["A0", "A1", "latent", "A2_kl", "Accel", "Certified", "Gate"]  # latent on: issue 48
    assert {k: [repr(p) for p in curves[k]] for k in before_curves} == {k: [repr(p) for p in v]
                                                                          for k, v in before_curves.items()}
    assert list(allocation_families(r_max)) == ["A0", "A1", "latent", "Accel", "Certified"]  # no probe, no gate


def test_a_family_with_variants_names_each_and_refuses_an_unknown_one():
    assert catalogue.display("A2") == "A2 router" and catalogue.colour("A2_argmax") != catalogue.colour("A2_kl")
    with pytest.raises(ValueError, match="unknown exit policy 'A2_nope'"):
        catalogue.family("A2_nope")


class StepExit(Policy):
    """A rule no module of the project knows: halt once the state's step ||s_i - s_{i-1}|| < delta
    (absolute, where the latent rule divides by ||s_i||)."""

    per_token_loops = True
    threshold_name = "delta"

    def __init__(self, delta: float, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.delta = delta

    def _rule_online(self, loop, signals):
        return signals.state_step < self.delta

    def _rule_trace(self, trace):
        return trace.state_step < self.delta


def test_a_new_family_is_one_entry_beside_its_class(ckpt, monkeypatch):
    """Issue 47's promise: a new policy is its class plus one catalogue entry. Registered here alone,
    it reaches the allocation curves, the ground truth's operating points, the Compare and Generate
    pages' lists, lm-eval's model_args, the exact harness and real decoding (which agree on it)."""
    from recur_core.analysis.harness import run_exact
    from recur_core.analysis.trace import trace
    from recur_core.decoding.teacher_forced import teacher_forced
    from recur_eval.model import make_policy

    windows = ckpt.windows("eval")[:3, :17]
    steps = trace(ckpt, windows, 8, seed=2, cache=False).state_step[..., 1:]
    v = np.sort(np.asarray(steps).ravel())  # a threshold in the widest gap of the middle half: some tokens
    lo, hi = len(v) // 4, 3 * len(v) // 4  # halt early, some later, and no order of float arithmetic moves one
    i = lo + int(np.argmax(v[lo + 1:hi + 1] - v[lo:hi]))
    middle = float((v[i] + v[i + 1]) / 2)
    entry = catalogue.Family("Step", StepExit, "δ", "δ: halt once ‖s_i − s_{i−1}‖ < δ", "absolute step",
                             "#010203", middle, (0.0, middle, math.inf),
                             places=frozenset({catalogue.CURVES, catalogue.GROUND_TRUTH, catalogue.COMPARE,
                                               catalogue.GENERATE}))
    monkeypatch.setitem(catalogue.FAMILIES, "Step", entry)
    monkeypatch.setitem(catalogue._LOOKUP, "step", entry)

    assert [p.delta for p in allocation_families(8)["Step"]] == [0.0, middle, math.inf]
    assert len(operating_point_families(8)["Step"]) == 3
    for place in (catalogue.COMPARE, catalogue.GENERATE):
        assert entry in catalogue.shown_in(place)
    assert catalogue.display("Step") == "absolute step" and catalogue.colour("Step") == "#010203"
    policy = make_policy(ckpt, "step", middle, max_loops=8)  # lm-eval: model_args policy=step,threshold=...
    assert isinstance(policy, StepExit) and policy.delta == middle and policy.r_max == 8

    exact = run_exact(ckpt, windows, policy, 8, seed=2)
    decoded = teacher_forced(ckpt, windows, policy, "recompute", seed=2, max_loops=8)
    np.testing.assert_array_equal(decoded.exit_loop.numpy(), exact.exit_depth)
    assert 1 < len(np.unique(exact.exit_depth))  # the rule really decides: the exits differ by token
