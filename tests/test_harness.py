import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recur_core.analysis.allocation import allocation, allocation_families, exact_plan
from recur_core.analysis.curves import fast_curve, fast_minus_exact
from recur_core.analysis.exact import ExactPath
from recur_core.analysis.harness import run_exact, uniform_run_result
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.exits.policies import ConvergenceExit, LatentDiff, Policy, Uniform

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
    result = run_exact(ckpt, windows, ConvergenceExit(math.inf, min_loops=1), R_MAX, seed=2)
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


@pytest.mark.parametrize("policy", [Uniform(2), Uniform(R_MAX), ConvergenceExit(0.0, r_max=R_MAX)],
                         ids=["A0@2", "A0@r_max", "A1@eps0"])
def test_a_policy_that_halts_nothing_early_is_read_off_the_trace(ckpt, windows, tr, policy):
    got, want = uniform_run_result(tr, policy), run_exact(ckpt, windows, policy, R_MAX, seed=2)
    np.testing.assert_allclose(got.ce, want.ce, rtol=1e-5, atol=1e-6)
    for field in ("exit_depth", "converged", "targets", "argmax"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


def test_a_policy_that_halts_early_needs_the_harness(tr):
    assert uniform_run_result(tr, ConvergenceExit(math.inf, r_max=R_MAX)) is None


def test_exact_results_are_cached_per_policy_and_a_never_early_policy_is_read_off_the_trace(
        ckpt, windows, tr, tmp_path, monkeypatch):
    """A policy two plans share (the allocation's and the ground truth's) runs in the harness once, and
    one that halts nothing before its cap not at all: only the others reach run_exact_sweep."""
    import recur_core.analysis.exact as exact_module
    from recur_core.analysis.cache import TraceCache
    swept = []
    real = exact_module.run_exact_sweep
    monkeypatch.setattr(exact_module, "run_exact_sweep",
                        lambda m, ids, policies, *a, **k: swept.append([repr(p) for p in policies]) or real(
                            m, ids, policies, *a, **k))
    shared, first, second = (ConvergenceExit(eps, r_max=R_MAX) for eps in (1e-2, 1e-1, 1.0))
    path = ExactPath(ckpt, windows, cache=TraceCache(tmp_path))
    path.results([first, shared], R_MAX, 2)
    got = path.results([Uniform(R_MAX), shared, second], R_MAX, 2, uniform=tr)
    assert swept == [[repr(first), repr(shared)], [repr(second)]]
    want = run_exact(ckpt, windows, shared, R_MAX, seed=2)
    np.testing.assert_allclose(got[1].ce, want.ce, rtol=1e-5, atol=1e-6)
    for field in ("exit_depth", "converged", "targets", "argmax"):
        np.testing.assert_array_equal(getattr(got[1], field), getattr(want, field))
    np.testing.assert_array_equal(got[0].exit_depth, np.full(want.exit_depth.shape, R_MAX))
    cached = ExactPath(ckpt, windows, cache=TraceCache(tmp_path), cache_only=True)
    assert cached.results([shared, second], R_MAX, 2) is not None and len(swept) == 2
    assert cached.results([shared, ConvergenceExit(3e-2, r_max=R_MAX)], R_MAX, 2) is None


def test_the_exact_plan_refuses_a_trace_of_other_windows(ckpt, windows, tr):
    boot = Bootstrap(4, 20)
    families = {"A0": [Uniform(2)], "A1": [ConvergenceExit(1e-3, r_max=R_MAX)]}
    fast = {name: fast_curve(tr, name, policies, boot) for name, policies in families.items()}
    with pytest.raises(ValueError, match="trace's windows"):
        exact_plan(ExactPath(ckpt, windows[:2]), families, fast, 2, tr, boot)


def test_frozen_tokens_stay_in_the_context(ckpt, windows, tr):
    result = run_exact(ckpt, windows, FreezeFirstTokenAtLoop1(), R_MAX, seed=2)
    assert (result.exit_depth[:, 0] == 1).all() and (result.exit_depth[:, 1:] == R_MAX).all()
    # causal: position 0 sees only itself, so it scores exactly as after one loop
    np.testing.assert_allclose(result.ce[:, 0], tr.ce[:, 0, 0], rtol=1e-5, atol=1e-6)
    # later tokens attended to the frozen state, not the updated one: their outputs differ from uniform
    assert not np.allclose(result.ce[:, 1:], tr.ce[:, 1:, R_MAX - 1], rtol=0, atol=1e-7)


def test_fast_minus_exact_per_policy(ckpt, windows, tr):
    boot = Bootstrap(4, 50)
    families = {"A0": [Uniform(2), Uniform(R_MAX)], "A1": [ConvergenceExit(1e-3, r_max=R_MAX), ConvergenceExit(0.0, r_max=R_MAX)]}
    fast = {name: fast_curve(tr, name, policies, boot) for name, policies in families.items()}
    exact = exact_plan(ExactPath(ckpt, windows), families, fast, 2, tr, boot)
    assert exact["A1"].thresholds == [1e-3, 0.0]  # two-point grids: every point is in the plan
    gap = fast_minus_exact(fast, exact, boot)
    for row in gap["A0"] + gap["A1"][1:]:  # uniform depth (and eps 0 = r_max): both paths agree
        assert row["gap_loss"]["value"] == pytest.approx(0.0, abs=1e-5)
        assert row["gap_mean_loops"]["value"] == 0.0
    row = gap["A1"][0]
    assert row["gap_loss"]["value"] == pytest.approx(row["fast_loss"]["value"] - row["exact_loss"]["value"])
    assert set(row) >= {"threshold", "fast_mean_loops", "exact_mean_loops", "gap_mean_loops"}


# -- the batched sweep ---------------------------------------------------------------------------
class RandomProbe:
    """A fixed random linear probe (stands in for a trained A2 router)."""

    probe_id = "random-test-probe"

    def __init__(self, d: int):
        self.weight = torch.randn(d, generator=torch.Generator().manual_seed(5))

    def chance(self, state, loop):
        return torch.sigmoid(state.float() @ self.weight / 4 + 0.3 * (2 - loop))


@torch.inference_mode()
def naive_exact(model, windows, policy, max_loops, seed):
    """Test oracle: one full-width masking-harness run of one policy (no lanes, no cut-off)."""
    from recur_core.analysis.trace import split_inputs
    from recur_core.exits.readout import readout_stats
    from recur_core.exits.signals import LoopSignals, cosine_change, relative_change
    inputs, targets = split_inputs(windows)
    e, state = model.prelude(inputs), model.seeded_state(range(len(inputs)), seed, inputs.shape[1])
    h_prev = model.coda(state)
    cap = policy.cap(max_loops)
    frozen = torch.zeros(inputs.shape, dtype=torch.bool)
    depth, conv = torch.full(inputs.shape, cap), torch.zeros_like(frozen)
    for loop in range(1, cap + 1):
        new = model.core_step(state, e, freeze=frozen)
        h = model.coda(new)
        stats = readout_stats(h, model.head_weight, None, h_prev, topk=2)  # full width, every token read out
        h_prev = h
        signals = LoopSignals(new, relative_change(new, state), stats.kl_prev.clamp_min(0),
                              stats.kl_prev_reverse.clamp_min(0), stats.entropy,
                              stats.argmax, cosine_change(new, state), state_step=(new.float() - state.float()).norm(dim=-1),
                              state_norm=new.float().norm(dim=-1),
                              margin=stats.topk_probs[..., 0].log() - stats.topk_probs[..., 1].log())
        met = policy.rule_met(loop, signals) & ~frozen
        halt = met | ~frozen if loop == cap else met
        depth[halt], conv, frozen, state = loop, conv | met, frozen | halt, new
    final = readout_stats(model.coda(state), model.head_weight, targets)
    return final.ce.numpy(), depth.numpy(), conv.numpy(), final.argmax.numpy()


def test_sweep_equals_one_run_per_policy(ckpt, windows, tr):
    from recur_core.analysis.harness import SweepWork, run_exact_sweep
    from recur_core.exits.policies import (
        Accel,
        ArgmaxStable,
        CertifiedExit,
        CosineExit,
        EntropyDiff,
        GateExit,
        LinearRouter,
        ReverseKLExit,
    )
    probe = RandomProbe(ckpt.config.d_model)
    taus = np.quantile(np.abs(np.diff(tr.state_step, axis=-1)), [0.4, 0.6, 0.8])  # Accel halting some tokens
    gate = lambda state: torch.sigmoid(state.float() @ probe.weight / 4 - 1)  # noqa: E731 (a stand-in exit gate)
    policies = ([Uniform(r) for r in (1, 3, R_MAX)]
                + [ConvergenceExit(eps, r_max=R_MAX) for eps in (0.0, 1e-4, 1e-2, 0.1, math.inf)]
                + [ConvergenceExit(1e-2, min_loops=1, r_max=R_MAX), LatentDiff(0.05, r_max=4)]
                + [LinearRouter(probe, tau, r_max=R_MAX) for tau in (0.0, 0.3, 0.6, 1.0)]
                + [ReverseKLExit(1e-2, r_max=R_MAX), CosineExit(1e-3, r_max=R_MAX)]  # Huginn's criteria
                # these remember loops: each lane keeps their memory, so thresholds share lanes with the rest
                + [ArgmaxStable(n, r_max=R_MAX) for n in (1, 2)] + [EntropyDiff(1e-2, r_max=R_MAX)]
                + [Accel(tau, r_max=R_MAX) for tau in taus] + [Accel(taus[1], min_loops=3, r_max=R_MAX)]
                + [CertifiedExit(lip, r_max=R_MAX) for lip in (0.1, 3.0)] + [GateExit(q, gate, r_max=R_MAX) for q in (0.5, 0.9)])
    work = SweepWork()
    results = run_exact_sweep(ckpt, windows, policies, R_MAX, seed=2, batch_size=3, window_group=3, work=work)
    for policy, got in zip(policies, results, strict=True):
        if policy.remembers_loops:  # each halts some tokens early and not all at one loop: lanes split on them
            assert len(np.unique(got.exit_depth)) > 1 and (got.exit_depth < R_MAX).any(), repr(policy)
        ce, depth, conv, argmax = naive_exact(ckpt.model, windows, policy, R_MAX, seed=2)
        np.testing.assert_array_equal(got.exit_depth, depth, err_msg=repr(policy))
        np.testing.assert_array_equal(got.converged, conv, err_msg=repr(policy))
        np.testing.assert_allclose(got.ce, ce, rtol=1e-4, atol=1e-5, err_msg=repr(policy))
        np.testing.assert_array_equal(got.argmax, argmax, err_msg=repr(policy))
    # the thresholds shared lanes: far less work than one run per policy
    assert 0 < work.lane_loops < work.naive_window_loops / 2
    assert work.token_loops <= work.lane_loops * windows.shape[1] - 1
    # the positions counted: unfrozen ones among those run, A1's readout lanes among all lanes
    assert 0 < work.readout_live_token_loops <= work.readout_token_loops < work.token_loops
    assert 0 < work.live_token_loops < work.token_loops
    assert work.token_loops <= work.attention_pairs <= work.token_loops * windows.shape[1]


def test_policies_that_halt_alike_run_once(ckpt, windows):
    """Two routers whose probes differ only in name (label kinds that fit equal weights) share one run:
    the same work as one of them, and the same results."""
    from recur_core.analysis.harness import SweepWork, run_exact_sweep
    from recur_core.exits.policies import LinearRouter
    named = [RandomProbe(ckpt.config.d_model), RandomProbe(ckpt.config.d_model)]
    named[1].probe_id = "random-test-probe-other-kind"
    for probe in named:
        probe.rule_id = "same-weights"
    pair = [LinearRouter(named[0], 0.3, r_max=R_MAX), LinearRouter(named[1], 0.3, r_max=R_MAX)]
    assert repr(pair[0]) != repr(pair[1]) and pair[0].rule_key == pair[1].rule_key
    one_work, two_work = SweepWork(), SweepWork()
    one = run_exact_sweep(ckpt, windows, pair[:1], R_MAX, seed=2, work=one_work)
    two = run_exact_sweep(ckpt, windows, pair, R_MAX, seed=2, work=two_work)
    assert one_work.as_dict() == two_work.as_dict()
    for got in two:
        np.testing.assert_array_equal(got.exit_depth, one[0].exit_depth)
        np.testing.assert_array_equal(got.ce, one[0].ce)
    other = RandomProbe(ckpt.config.d_model)  # without rule_id: told apart by name
    assert LinearRouter(other, 0.3).rule_key != pair[0].rule_key


def test_bench_exact_prints_the_floor(tiny_ckpt, tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RECUR_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "bench.bench_exact", "--checkpoint", str(tiny_ckpt),
                          "--windows", "1", "--threads", "1", "--sweep-only"],
                         capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["floor_tflop_full"] == pytest.approx(result["floor_tflop"] * 128)
    assert result["matmul_peak_gflops"] > 0 and result["achieved_gflops"] > 0
    assert "floor:" in out.stdout and "speedup_vs_per_policy" not in result


def test_exact_plan_points_equal_run_exact(ckpt, windows, tr):
    """The exact allocation's points are harness runs at their thresholds, at least 8 per family, and
    loops to match A0 at r_bar is decided between exact points that are grid neighbours."""
    from recur_core.analysis.curves import EPS_GRID
    boot = Bootstrap(4, 40)
    res = allocation(tr, boot, 3, allocation_families(R_MAX), ExactPath(ckpt, windows))
    assert res["path"] == "exact"
    a1 = {p.threshold: p for p in allocation_families(R_MAX)["A1"]}
    points = res["report"]["A1"]
    assert len(points) >= 8 and res["report"]["exact_points"]["A1"] == [p["threshold"] for p in points]
    for point in points:
        got = run_exact(ckpt, windows, a1[point["threshold"]], R_MAX, seed=2)
        scored = got.has_target & ~np.isnan(got.ce)
        assert point["loss"] == pytest.approx(float(got.ce[scored].mean()), rel=1e-5)
        assert point["mean_loops"] == pytest.approx(float(got.exit_depth[scored].mean()))
    assert res["report"]["A0"][2]["loss"] == pytest.approx(float(np.nanmean(tr.ce[..., 2])), rel=1e-5)
    curve, target = res["curves"]["A1"], res["curves"]["A0"].loss[0, 2]
    order = np.argsort(curve.mean_loops[0], kind="stable")
    reached = np.flatnonzero(curve.loss[0][order] <= target)
    if len(reached) and reached[0] > 0:  # the bracket of the match is two grid neighbours
        pair = [EPS_GRID.index(curve.thresholds[order[reached[0] - k]]) for k in (0, 1)]
        assert abs(pair[0] - pair[1]) == 1


def test_a_remembering_rule_past_min_loops_halts_as_in_decoding(ckpt):
    """Accel (it compares each loop's step with the previous one) first consulted at loop 3: its
    memory starts at loop 1 in the harness and in token-by-token decoding alike, so a token may halt
    at loop 3 itself, and the exits are those of real decoding ("recompute")."""
    from recur_core.decoding.teacher_forced import teacher_forced
    from recur_core.exits.policies import Accel
    windows = ckpt.windows("eval")[:2, :16]
    steps = trace(ckpt, windows, 8, seed=5, cache=False).state_step
    policy = Accel(float(np.median(np.abs(steps[..., 2] - steps[..., 1]))), min_loops=3)
    exact = run_exact(ckpt, windows, policy, 8, seed=5)
    decoded = teacher_forced(ckpt, windows, policy, "recompute", seed=5, max_loops=8, mode="decode")
    np.testing.assert_array_equal(decoded.exit_loop.numpy(), exact.exit_depth)
    assert (exact.exit_depth == 3).any() and (exact.exit_depth > 3).any()
