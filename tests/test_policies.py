import math

import numpy as np
import pytest
import torch

from recur_core.exits.policies import (
    ArgmaxStable,
    ConvergenceExit,
    CosineExit,
    EntropyDiff,
    LatentDiff,
    LinearRouter,
    Uniform,
)
from recur_core.exits.signals import LoopSignals
from recur_core.exits.trace_type import Trace


def make_trace(kl_prev, state_change=None, router_chance=None) -> Trace:
    """A hand-made trace (N, T, L) with only the fields the policies read filled in meaningfully."""
    kl_prev = np.asarray(kl_prev, dtype=np.float32)
    N, T, L = kl_prev.shape
    zeros = np.zeros((N, T, L), dtype=np.float32)
    return Trace(ids=np.zeros((N, T), np.int64), targets=np.zeros((N, T), np.int64), kl_prev=kl_prev,
                 state_change=zeros if state_change is None else np.asarray(state_change, np.float32),
                 ce=np.arange(1, L + 1, dtype=np.float32) * np.ones((N, T, 1), np.float32), entropy=zeros,
                 argmax=np.zeros((N, T, L), np.int64), top1_prob=zeros,
                 topk_ids=np.zeros((N, T, L, 0), np.int64), topk_probs=np.zeros((N, T, L, 0), np.float32),
                 max_loops=L, seed=0, checkpoint_id="hand", router_chance=router_chance or {})


KL = [[[0.5, 0.2, 0.05, 0.01, 0.2],     # first below 0.1 at loop 3
       [0.5, 0.5, 0.5, 0.5, 0.5],       # never below 0.1
       [0.01, 0.5, 0.5, 0.5, 0.5]]]     # below 0.1 at loop 1


def test_convergence_exit_on_hand_made_trace():
    tr = make_trace(KL)
    exits = ConvergenceExit(0.1, min_loops=1).exits(tr)
    assert exits.depth.tolist() == [[3, 5, 1]]
    assert exits.converged.tolist() == [[True, False, True]]


def test_a1_first_check_is_loop_2_by_default():
    """The paper's convention: loop 1's KL is against the noise readout, so A1 first checks at loop 2."""
    tr = make_trace(KL)
    assert ConvergenceExit.FIRST_CHECK == 2
    assert ConvergenceExit(0.1).exit_depth(tr).tolist() == [[3, 5, 5]]  # token 3's loop-1 KL is ignored
    assert (ConvergenceExit(math.inf).exit_depth(tr) == 2).all()
    assert (ConvergenceExit(math.inf, min_loops=1).exit_depth(tr) == 1).all()
    signals = LoopSignals(state=torch.zeros(1, 1, 3), state_change=torch.zeros(1, 1), kl_prev=torch.zeros(1, 1))
    assert not ConvergenceExit(0.1).halt(1, signals).any() and ConvergenceExit(0.1).halt(2, signals).all()


def test_min_loops_and_r_max():
    tr = make_trace(KL)
    assert ConvergenceExit(0.1, min_loops=2).exit_depth(tr).tolist() == [[3, 5, 5]]
    assert ConvergenceExit(0.1, min_loops=4).exit_depth(tr).tolist() == [[4, 5, 5]]
    capped = ConvergenceExit(0.1, min_loops=1, r_max=2).exits(tr)
    assert capped.depth.tolist() == [[2, 2, 1]]
    assert capped.converged.tolist() == [[False, False, True]]


def test_extreme_eps():
    tr = make_trace(KL)
    assert (ConvergenceExit(math.inf, min_loops=1).exit_depth(tr) == 1).all()
    assert (ConvergenceExit(0.0).exit_depth(tr) == 5).all()
    assert not ConvergenceExit(0.0).exits(tr).converged.any()


def test_uniform_and_budget():
    tr = make_trace(KL)
    assert (Uniform(4).exit_depth(tr) == 4).all()
    with pytest.raises(ValueError):
        Uniform(6).exits(tr)


def test_latent_diff_reads_state_change():
    change = [[[0.9, 0.02, 0.01, 0.01, 0.01], [0.9, 0.5, 0.2, 0.04, 0.01], [0.9, 0.9, 0.9, 0.9, 0.9]]]
    tr = make_trace(KL, state_change=change)
    assert LatentDiff(0.03).exit_depth(tr).tolist() == [[2, 5, 5]]
    assert LatentDiff(0.05).exit_depth(tr).tolist() == [[2, 4, 5]]


class ConstantProbe:
    probe_id = "const"

    def chance(self, state, loop):
        return state[..., 0]


def test_linear_router_fast_path_needs_recorded_chances():
    chance = np.array([[[0.9, 0.6, 0.3, 0.1, 0.0]]], np.float32)
    tr = make_trace(np.ones((1, 1, 5)), router_chance={"const": chance})
    assert LinearRouter(ConstantProbe(), 0.5).exit_depth(tr).tolist() == [[3]]
    assert LinearRouter(ConstantProbe(), 0.05).exit_depth(tr).tolist() == [[5]]
    with pytest.raises(KeyError):
        LinearRouter(ConstantProbe(), 0.5).exits(make_trace(np.ones((1, 1, 5))))


@pytest.mark.parametrize("policy", [ConvergenceExit(0.1), ConvergenceExit(0.1, min_loops=2, r_max=4),
                                    LatentDiff(0.3), Uniform(2), LinearRouter(ConstantProbe(), 0.4, r_max=4)])
def test_online_halt_agrees_with_fast_path(policy):
    """Feeding the trace's signals loop by loop to halt() gives the fast path's exit depths."""
    rng = np.random.default_rng(0)
    kl = rng.exponential(0.2, size=(2, 7, 6)).astype(np.float32)
    change = rng.uniform(0, 1, size=(2, 7, 6)).astype(np.float32)
    chance = rng.uniform(0, 1, size=(2, 7, 6)).astype(np.float32)
    tr = make_trace(kl, state_change=change, router_chance={"const": chance})
    exit_depth = np.full((2, 7), -1)
    for loop in range(1, 7):
        state = torch.from_numpy(chance[..., loop - 1])[..., None].expand(2, 7, 3)
        signals = LoopSignals(state=state, state_change=torch.from_numpy(change[..., loop - 1]),
                              kl_prev=torch.from_numpy(kl[..., loop - 1]))
        halt = policy.halt(loop, signals).numpy() | (loop == 6)
        exit_depth = np.where((exit_depth < 0) & halt, loop, exit_depth)
    np.testing.assert_array_equal(exit_depth, policy.exit_depth(tr))


def test_needs_readout():
    assert ConvergenceExit(0.1).needs_readout
    assert not Uniform(3).needs_readout
    assert not LatentDiff(0.03).needs_readout
    assert not LinearRouter(ConstantProbe(), 0.5).needs_readout


def test_nan_kl_never_halts_and_missing_kl_is_an_error():
    signals = LoopSignals(state=torch.zeros(1, 2, 3), state_change=torch.zeros(1, 2),
                          kl_prev=torch.tensor([[math.nan, 0.0]]))
    assert ConvergenceExit(0.1, min_loops=1).halt(1, signals).tolist() == [[False, True]]
    with pytest.raises(ValueError):
        ConvergenceExit(0.1).halt(2, LoopSignals(state=torch.zeros(1, 2, 3), state_change=torch.zeros(1, 2)))


def test_private_gives_a_remembering_rule_its_own_empty_memory():
    stateless = ConvergenceExit(1e-3)
    assert stateless.private() is stateless
    for policy in (EntropyDiff(1e-2), ArgmaxStable(2)):
        policy._last_loop, policy._prev = 3, torch.zeros(1, 4)
        twin = policy.private()
        assert twin is not policy and repr(twin) == repr(policy)
        assert twin._last_loop == 0 and twin._prev is None and policy._last_loop == 3


class LoopProbe:
    """A probe whose chance falls with the loop index: 0.9, 0.7, 0.5, ... (state ignored)."""

    probe_id = "loop"

    def chance(self, state, loop):
        return (1.1 - 0.2 * torch.as_tensor(loop, dtype=torch.float32)).expand(state.shape[:-1])


@pytest.mark.parametrize("policy", [LinearRouter(LoopProbe(), 0.6, min_loops=2, r_max=5), LatentDiff(0.3, min_loops=2),
                                    Uniform(3), CosineExit(0.2, r_max=4)])
def test_halt_with_a_loop_per_token_equals_halt_at_each_loop(policy):
    g = torch.Generator().manual_seed(0)
    loops = torch.tensor([[1, 2, 3, 4, 5, 6, 3]])
    signals = LoopSignals(state=torch.randn(1, 7, 4, generator=g), state_change=torch.rand(1, 7, generator=g),
                          cosine_change=torch.rand(1, 7, generator=g))
    at_once = policy.halt(loops, signals)
    one_by_one = [bool(policy.halt(int(loop), signals)[0, n]) for n, loop in enumerate(loops[0])]
    assert at_once[0].tolist() == one_by_one
    assert len(set(one_by_one)) == 2  # both outcomes occur


def test_a_rule_that_remembers_loops_refuses_a_loop_per_token():
    signals = LoopSignals(state=torch.zeros(1, 2, 3), state_change=torch.zeros(1, 2), entropy=torch.zeros(1, 2))
    with pytest.raises(TypeError, match="remembers earlier loops"):
        EntropyDiff().halt(torch.tensor([[1, 2]]), signals)


def _readout_policies():
    from recur_core.analysis.certify import _PastTheExit
    from recur_core.exits.policies import ArgmaxStable, CertifiedExit, ConvergenceExit, EntropyDiff, ReverseKLExit
    return [ConvergenceExit(0.05), ReverseKLExit(0.05), EntropyDiff(0.05), ArgmaxStable(1), CertifiedExit(1.0),
            _PastTheExit(CertifiedExit(1.0), last=0)]


@pytest.mark.parametrize("policy", _readout_policies(), ids=lambda p: type(p).__name__)
def test_a_readout_policy_decides_the_same_on_its_declared_fields_alone(policy):
    """A decoder computes only a policy's `readout_fields`: with those alone (the others None) the
    halt decisions over several loops equal those with every readout field."""
    from recur_core.exits.signals import READOUT_FIELDS, readout_signals, state_signals
    assert policy.needs_readout and policy.readout_fields <= READOUT_FIELDS
    g = torch.Generator().manual_seed(3)
    states = [torch.randn(2, 5, 8, generator=g) * 0.5 ** i for i in range(4)]
    logps = [torch.log_softmax(torch.randn(2, 5, 11, generator=g) * 0.6 ** i, -1) for i in range(4)]
    full, alone = policy.private(), policy.private()
    for loop in range(1, 4):
        states_ = state_signals(states[loop], states[loop - 1])
        every = readout_signals(logps[loop], logps[loop - 1])
        mine = readout_signals(logps[loop], logps[loop - 1], policy.readout_fields)
        assert set(mine) == set(policy.readout_fields)
        for name, value in mine.items():
            torch.testing.assert_close(value, every[name], rtol=0, atol=0)
        a = full.halt(loop, LoopSignals(state=states[loop], **states_, **every))
        b = alone.halt(loop, LoopSignals(state=states[loop], **states_, **mine))
        assert torch.equal(a, b)


def test_readout_fields_name_known_signals_and_set_needs_readout():
    from recur_core.exits.policies import Policy
    with pytest.raises(TypeError, match="no readout signal"):
        type("Bad", (Policy,), {"readout_fields": frozenset({"kl_next"})})
    margin_reader = type("MarginReader", (Policy,), {"readout_fields": frozenset({"margin"})})
    assert margin_reader.needs_readout and margin_reader.needs_margin
    assert not Policy.needs_readout
