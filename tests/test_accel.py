"""Accel, the second-order step-size exit (arXiv 2509.23314): |δ_i − δ_{i−1}| < τ, δ_i = ‖s_i − s_{i−1}‖.
Its two faces, its exact result against token-by-token decoding, the pool and lm-eval's model_args."""
import numpy as np
import pytest
import torch

from recur_core.analysis.harness import run_exact
from recur_core.analysis.trace import trace
from recur_core.decoding.decode import generate
from recur_core.decoding.serve import Request, serve
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits import catalogue
from recur_core.exits.policies import Accel
from recur_core.exits.signals import LoopSignals
from recur_core.exits.trace_type import Trace

SEED, CAP = 3, 6


def step_trace(step) -> Trace:
    """A hand-made trace whose only meaningful field is state_step (N, T, L)."""
    step = np.asarray(step, dtype=np.float32)
    N, T, L = step.shape
    zeros = np.zeros((N, T, L), dtype=np.float32)
    return Trace(ids=np.zeros((N, T), np.int64), targets=np.zeros((N, T), np.int64), kl_prev=zeros,
                 state_change=zeros, ce=zeros, entropy=zeros, argmax=np.zeros((N, T, L), np.int64), top1_prob=zeros,
                 topk_ids=np.zeros((N, T, L, 0), np.int64), topk_probs=np.zeros((N, T, L, 0), np.float32),
                 max_loops=L, seed=0, checkpoint_id="hand", state_step=step)


STEPS = [[[5.0, 5.05, 3.0, 2.0, 2.0],   # |Δδ| 0.05 at loop 2
          [5.0, 3.0, 1.0, 0.5, 0.45],   # |Δδ| 2, 2, 0.5, 0.05: loop 5
          [5.0, 4.0, 3.0, 2.0, 1.0]]]   # |Δδ| 1 at every loop: never below 0.1


def test_fast_face_on_a_hand_made_trace():
    exits = Accel(0.1).exits(step_trace(STEPS))
    assert exits.depth.tolist() == [[2, 5, 5]] and exits.converged.tolist() == [[True, True, False]]
    assert Accel(np.inf).exit_depth(step_trace(STEPS)).tolist() == [[2, 2, 2]]  # never at loop 1
    assert Accel(0.0).exit_depth(step_trace(STEPS)).tolist() == [[5, 5, 5]]


def test_online_face_agrees_with_the_fast_face():
    rng = np.random.default_rng(0)
    step = rng.uniform(0, 2, size=(2, 7, 6)).astype(np.float32)
    for tau in (0.05, 0.3, 1.0):
        policy, exit_depth = Accel(tau, r_max=6).private(), np.full((2, 7), -1)
        for loop in range(1, 7):
            signals = LoopSignals(state=torch.zeros(2, 7, 3), state_change=torch.zeros(2, 7),
                                  state_step=torch.from_numpy(step[..., loop - 1]))
            halt = policy.halt(loop, signals).numpy()
            exit_depth = np.where((exit_depth < 0) & halt, loop, exit_depth)
        np.testing.assert_array_equal(exit_depth, Accel(tau, r_max=6).exit_depth(step_trace(step)))


def test_the_online_face_needs_the_step_size():
    with pytest.raises(ValueError, match="state_step"):
        Accel(0.1).halt(1, LoopSignals(state=torch.zeros(1, 2, 3), state_change=torch.zeros(1, 2)))


def test_the_trace_records_the_step_size_and_the_norm(ckpt):
    windows = ckpt.windows("eval")[:2]
    tr = trace(ckpt, windows, CAP, seed=SEED, cache=False)
    assert tr.state_step.shape == tr.state_norm.shape == tr.state_change.shape
    assert (tr.state_norm > 0).all() and (tr.state_step >= 0).all()
    np.testing.assert_allclose(tr.state_change, tr.state_step / tr.state_norm, rtol=1e-5)
    frame = tr.to_frame()
    assert {"state_step", "state_norm"} <= set(frame.columns)


def mixed_tau(ckpt, windows) -> float:
    """A threshold at which the tiny model's Accel exits are mixed: the median |Δδ| at loop 3."""
    tr = trace(ckpt, windows, CAP, seed=SEED, cache=False)
    return float(np.median(np.abs(np.diff(tr.state_step, axis=-1))[..., 1]))


def test_exact_result_equals_token_by_token_decoding(ckpt):
    """The harness's exits and outputs are what teacher-forced decoding under "recompute" gets."""
    windows = ckpt.windows("eval")[:3]
    policy = catalogue.make("Accel", mixed_tau(ckpt, windows), r_max=CAP)
    exact = run_exact(ckpt, windows, policy, CAP, seed=SEED)
    assert len(np.unique(exact.exit_depth)) > 1  # the exits are mixed
    for mode in ("decode", "prefill"):
        tf = teacher_forced(ckpt, windows, policy.private(), "recompute", seed=SEED, max_loops=CAP, mode=mode)
        np.testing.assert_array_equal(tf.exit_loop.numpy(), exact.exit_depth)
        np.testing.assert_array_equal(tf.argmax.numpy(), exact.argmax)
        np.testing.assert_allclose(tf.ce.numpy(), exact.ce, atol=1e-4, rtol=0)


def test_the_pool_decodes_each_sequence_as_generate_alone(ckpt):
    windows = ckpt.windows("eval")
    policy = Accel(mixed_tau(ckpt, windows[:3]), r_max=CAP)
    reqs = [Request(windows[i, :5 + 2 * i].tolist(), 6, policy, kv_rule=rule, seed=i, greedy=True)
            for i, rule in enumerate(("latest", "recompute", "latest"))]
    pooled = serve(ckpt, reqs, 2, max_loops=CAP)
    loops = set()
    for req, done in zip(reqs, pooled, strict=True):
        alone = generate(ckpt, req.prompt, 6, policy, kv_rule=req.kv_rule, seed=req.seed, greedy=True, max_loops=CAP)
        assert done.error is None and done.ids == alone.ids and done.exit_loops == alone.exit_loops
        loops |= set(alone.exit_loops)
    assert len(loops) > 1


def test_lm_eval_model_args_name_it(ckpt):
    pytest.importorskip("lm_eval")
    from recur_eval.model import make_policy
    policy = make_policy(ckpt, "accel", "0.02", max_loops=5)
    assert isinstance(policy, Accel) and policy.tau == 0.02 and policy.r_max == 5
    with pytest.raises(ValueError, match=r"\[0, inf\]"):
        make_policy(ckpt, "accel", -1)
