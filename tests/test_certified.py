"""The certified exit (after arXiv 2608.18222): its bound, its two faces, real decoding, the measured
Lipschitz bound of the readout and the violation count (recur_core/analysis/certify.py)."""
import math

import numpy as np
import pytest
import torch

from recur_core.analysis.certify import readout_lipschitz, violations
from recur_core.analysis.trace import trace
from recur_core.decoding.decode import generate
from recur_core.decoding.serve import Request, serve
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits import catalogue
from recur_core.exits.policies import CertifiedExit, remaining_motion
from recur_core.exits.signals import LoopSignals
from recur_core.exits.trace_type import Trace

SEED, CAP = 3, 6


@pytest.mark.parametrize("kind", [np.asarray, torch.tensor])
def test_remaining_motion_is_the_geometric_tail(kind):
    step = kind(np.array([1.0, 0.0, 2.0, 1e-3, 1.0], np.float32))
    prev = kind(np.array([2.0, 5.0, 1.0, 0.0, 1.0], np.float32))
    tail = np.asarray(remaining_motion(step, prev), dtype=np.float64)
    # rho 0.5: 1 * 0.5 / 0.5 = 1; a fixed point: 0; growing, from rest, or rho 1: inf
    assert tail.tolist() == [1.0, 0.0, math.inf, math.inf, math.inf]


def hand_trace(step, probs) -> Trace:
    step, probs = np.asarray(step, np.float32), np.asarray(probs, np.float32)
    N, T, L = step.shape
    zeros = np.zeros((N, T, L), np.float32)
    return Trace(ids=np.zeros((N, T), np.int64), targets=np.zeros((N, T), np.int64), kl_prev=zeros, state_change=zeros,
                 ce=zeros, entropy=zeros, argmax=np.zeros((N, T, L), np.int64), top1_prob=probs[..., 0],
                 topk_ids=np.zeros((N, T, L, 2), np.int64), topk_probs=probs, max_loops=L, seed=0,
                 checkpoint_id="hand", state_step=step)


def test_both_faces_agree():
    rng = np.random.default_rng(0)
    step = rng.uniform(0, 1, size=(2, 7, 6)).astype(np.float32)
    p1 = rng.uniform(0.3, 0.9, size=(2, 7, 6)).astype(np.float32)
    probs = np.stack([p1, (1 - p1) * rng.uniform(0.1, 1, size=p1.shape).astype(np.float32)], axis=-1)
    tr = hand_trace(step, probs)
    margin = np.log(probs[..., 0]) - np.log(probs[..., 1])
    depths = set()
    for lipschitz in (0.05, 0.5, 5.0):
        policy, depth = CertifiedExit(lipschitz, r_max=6).private(), np.full((2, 7), -1)
        for loop in range(1, 7):
            signals = LoopSignals(state=torch.zeros(2, 7, 3), state_change=torch.zeros(2, 7),
                                  state_step=torch.from_numpy(step[..., loop - 1]),
                                  margin=torch.from_numpy(margin[..., loop - 1]))
            depth = np.where((depth < 0) & policy.halt(loop, signals).numpy(), loop, depth)
        np.testing.assert_array_equal(depth, CertifiedExit(lipschitz, r_max=6).exit_depth(tr))
        depths |= set(depth.ravel().tolist())
    assert len(depths) > 2


def test_it_needs_a_threshold_and_the_margin():
    with pytest.raises(ValueError, match="no default threshold: give L"):
        catalogue.make("Certified")
    policy = catalogue.make("certified", 2.0, r_max=4)
    policy.halt(1, LoopSignals(state=torch.zeros(1, 2, 3), state_change=torch.zeros(1, 2), state_step=torch.ones(1, 2)))
    with pytest.raises(ValueError, match="margin"):
        policy.halt(2, LoopSignals(state=torch.zeros(1, 2, 3), state_change=torch.zeros(1, 2),
                                   state_step=torch.ones(1, 2)))


def test_readout_lipschitz_is_the_largest_secant(ckpt):
    windows = ckpt.windows("probe")[:2]
    lip = readout_lipschitz(ckpt, windows, CAP, SEED)
    assert 0 < lip["p99"] <= lip["lipschitz"] and lip["n_pairs"] > 0 and lip["loops"] == CAP
    model = ckpt.model  # loop 1's secants, by hand
    with torch.inference_mode():
        inputs = torch.as_tensor(windows)[:, :-1]
        e = model.prelude(inputs)
        s0 = model.start_state(model.seeded_state(range(2), SEED, inputs.shape[1]), e)
        s1 = model.core_step(s0, e)
        z0, z1 = (model.coda(s).float() @ model.head_weight.float().T for s in (s0, s1))
        ratio = (z1 - z0).abs().amax(-1) / (s1.float() - s0.float()).norm(dim=-1)
    assert float(ratio.max()) <= lip["lipschitz"] * (1 + 1e-6)


def test_real_decoding_generate_pool_and_lockstep_agree(ckpt):
    windows = ckpt.windows("eval")[:3]
    lip = readout_lipschitz(ckpt, ckpt.windows("probe")[:2], CAP, SEED)["lipschitz"]
    tr = trace(ckpt, windows, CAP, seed=SEED, cache=False)
    # a bound scaled to where this tiny model's exits are mixed (the certified L itself may halt nothing)
    scale = next(s for s in (1.0, 0.1, 0.01, 1e-3, 1e-4) if len(np.unique(CertifiedExit(lip * s, r_max=CAP).exit_depth(tr))) > 1)
    policy = CertifiedExit(lip * scale, r_max=CAP)
    tf = teacher_forced(ckpt, windows, policy.private(), "recompute", seed=SEED, max_loops=CAP, batch_size=3)
    alone = teacher_forced(ckpt, windows[:1], policy.private(), "recompute", seed=SEED, max_loops=CAP)
    assert torch.equal(tf.exit_loop[:1], alone.exit_loop)
    reqs = [Request(windows[i, :6].tolist(), 4, policy, kv_rule="recompute", seed=i, greedy=True) for i in range(3)]
    for req, done in zip(reqs, serve(ckpt, reqs, 2, max_loops=CAP), strict=True):
        gen = generate(ckpt, req.prompt, 4, policy, kv_rule="recompute", seed=req.seed, greedy=True, max_loops=CAP)
        assert done.error is None and done.ids == gen.ids and done.exit_loops == gen.exit_loops


def test_violations_in_real_decoding_are_zero_where_the_assumptions_hold(ckpt):
    windows = ckpt.windows("eval")[:2]
    lip = readout_lipschitz(ckpt, ckpt.windows("probe")[:2], CAP, SEED)["lipschitz"]
    for scale in (1.0, 1e-3):  # the measured bound, and one 1000 times too small (it certifies more, wrongly)
        counts = violations(ckpt, windows, lip * scale, CAP, 3 * CAP, range(1, 8), SEED)
        assert counts["tokens"] == 2 * 7 and counts["certified"] <= counts["tokens"]
        assert counts["assumptions_held"] <= min(counts["tail_held"], counts["lipschitz_held"])
        assert counts["violations_where_held"] == 0


def test_lm_eval_model_args_name_it(ckpt):
    pytest.importorskip("lm_eval")
    from recur_eval.model import make_policy
    policy = make_policy(ckpt, "certified", "12.5", max_loops=5)
    assert isinstance(policy, CertifiedExit) and policy.lipschitz == 12.5 and policy.r_max == 5


def test_the_stated_l_is_the_measured_one_rounded_up_on_the_probe_windows_or_the_text(ckpt, monkeypatch):
    from recur_core import CheckpointError
    from recur_core.analysis.certify import LIPSCHITZ_WINDOWS, measured_lipschitz
    lip = measured_lipschitz(ckpt, 6, seed=0)
    raw = readout_lipschitz(ckpt, ckpt.windows("probe")[:LIPSCHITZ_WINDOWS], 6, 0)["lipschitz"]
    assert lip["measured"] == raw and lip["measured_on"] == "probe windows"
    assert raw <= lip["lipschitz"] <= raw * (1 + 1e-2) and float(f"{lip['lipschitz']:.3g}") == lip["lipschitz"]
    text = ckpt.windows("eval")[0, :-1].numpy()

    def no_windows(kind):  # a folder that ships none (Huginn, Ouro)
        raise CheckpointError("ships no windows")
    monkeypatch.setattr(ckpt, "windows", no_windows)
    with pytest.raises(CheckpointError, match="give the text"):
        measured_lipschitz(ckpt, 6)
    assert measured_lipschitz(ckpt, 6, text=text)["measured_on"] == "the text"


def test_ground_truth_runs_the_certified_exit_at_its_measured_l_alone():
    from recur_core.analysis.ground_truth import operating_point_families
    plain = operating_point_families(8, None, (1e-3,), (0.5,))
    with_l = operating_point_families(8, None, (1e-3,), (0.5,), lipschitz=12.5)
    assert "Certified" not in plain and list(with_l) == [*plain, "Certified"]
    [certified] = with_l["Certified"]
    assert isinstance(certified, CertifiedExit) and certified.lipschitz == 12.5 and certified.r_max == 8
