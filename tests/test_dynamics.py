"""How a token's state moves: hidden-state norms per loop and per-token regimes (recur_core/analysis/dynamics.py)."""
import numpy as np
import pytest

from recur_core.analysis.dynamics import MARGINAL, REGIMES, contraction_rate, dynamics, regime, token_regimes
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.exits.trace_type import Trace


def test_contraction_rate_is_the_geometric_mean_of_the_last_step_ratios():
    steps = np.array([[8.0, 4.0, 2.0, 1.0, 0.5, 0.25],    # halves every loop: rho 0.5
                      [3.0, 1.0, 1.0, 1.0, 1.0, 1.0],     # constant at the end: rho 1
                      [1.0, 1.0, 1.0, 2.0, 4.0, 8.0],     # (8 / 1) ** (1 / 4) = 1.68
                      [5.0, 1.0, 0.0, 0.0, 0.0, 0.0],     # a fixed point reached exactly: 0
                      [1.0, 0.0, 0.0, 0.0, 0.0, 1e-3]])   # moving again from rest: inf
    rate = contraction_rate(steps)
    np.testing.assert_allclose(rate[:3], [0.5, 1.0, 8 ** 0.25])
    assert rate[3] == 0 and rate[4] == np.inf
    assert [REGIMES[i] for i in regime(rate)] == ["settling", "marginal", "drifting", "settling", "drifting"]
    assert [REGIMES[i] for i in regime(np.array([MARGINAL[0] - 1e-9, MARGINAL[0], MARGINAL[1], MARGINAL[1] + 1e-9]))] \
        == ["settling", "marginal", "marginal", "drifting"]
    np.testing.assert_allclose(contraction_rate(steps[:, -2:]), [0.5, 1.0, 2.0, 0.0, np.inf])  # 2 loops: one ratio
    with pytest.raises(ValueError, match="at least 2 loops"):
        contraction_rate(steps[:, :1])


def test_dynamics_on_a_real_trace(ckpt):
    windows = ckpt.windows("eval")[:4]
    tr = trace(ckpt, windows, 6, seed=1, cache=False)
    boot = Bootstrap(tr.n_windows, 50, 0)
    dy = dynamics(tr, boot)
    np.testing.assert_allclose(dy["mean_state_norm"], tr.state_norm.reshape(-1, 6).mean(0), rtol=1e-6)
    assert all(lo <= v <= hi for v, lo, hi in zip(dy["mean_state_norm"], dy["mean_state_norm_ci_low"],
                                                  dy["mean_state_norm_ci_high"], strict=True))
    assert all(a <= b for a, b in zip(dy["state_norm_p10"], dy["state_norm_p90"], strict=True))
    shares = [dy[f"share_{name}"]["value"] for name in REGIMES]
    assert sum(shares) == pytest.approx(1.0)
    codes = token_regimes(tr)
    assert shares == pytest.approx([(codes == i).mean() for i in range(3)])


def test_a_token_converged_to_float32_resolution_is_settling_whatever_its_rate():
    step = np.array([[[1.0, 1e-6, 1e-6, 1e-6, 1e-6, 1e-6]], [[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]], np.float32)  # rate 1
    zeros = np.zeros(step.shape, np.float32)
    change = np.where(step < 1e-3, 1e-7, 0.1).astype(np.float32)  # relative steps: rounding noise, and moving
    tr = Trace(ids=np.zeros((2, 1), np.int64), targets=np.zeros((2, 1), np.int64), kl_prev=zeros, state_change=change,
               ce=zeros, entropy=zeros, argmax=np.zeros(step.shape, np.int64), top1_prob=zeros,
               topk_ids=np.zeros((2, 1, 6, 0), np.int64), topk_probs=np.zeros((2, 1, 6, 0), np.float32),
               max_loops=6, seed=0, checkpoint_id="hand", state_step=step, state_norm=np.ones_like(step))
    assert [REGIMES[i] for i in token_regimes(tr).ravel()] == ["settling", "marginal"]


def test_a_trace_without_step_sizes_is_refused():
    zeros = np.zeros((1, 2, 3), np.float32)
    tr = Trace(ids=np.zeros((1, 2), np.int64), targets=np.zeros((1, 2), np.int64), kl_prev=zeros, state_change=zeros,
               ce=zeros, entropy=zeros, argmax=np.zeros((1, 2, 3), np.int64), top1_prob=zeros,
               topk_ids=np.zeros((1, 2, 3, 0), np.int64), topk_probs=np.zeros((1, 2, 3, 0), np.float32),
               max_loops=3, seed=0, checkpoint_id="hand")
    with pytest.raises(ValueError, match="trace it again"):
        token_regimes(tr)


def test_answer_flips_count_changes_and_the_last_one():
    from recur_core.analysis.dynamics import answer_flips
    argmax = np.array([[[5, 5, 5, 5], [1, 2, 2, 3], [7, 8, 7, 7]]])
    zeros = np.zeros(argmax.shape, np.float32)
    tr = Trace(ids=np.zeros((1, 3), np.int64), targets=np.zeros((1, 3), np.int64), kl_prev=zeros, state_change=zeros,
               ce=zeros, entropy=zeros, argmax=argmax, top1_prob=zeros, topk_ids=np.zeros((1, 3, 4, 0), np.int64),
               topk_probs=np.zeros((1, 3, 4, 0), np.float32), max_loops=4, seed=0, checkpoint_id="hand")
    n, last = answer_flips(tr)
    assert n.tolist() == [[0, 2, 2]] and last.tolist() == [[0, 4, 3]]


def test_overthinking_past_r_max(ckpt):
    from recur_core.analysis.dynamics import answer_flips, overthinking, overthinking_loops
    assert overthinking_loops(4) == 32 and overthinking_loops(16) == 64 and overthinking_loops(48) == 128
    assert overthinking_loops(200) == 200  # never below the trained depth
    windows = ckpt.windows("eval")[:3]
    tr = trace(ckpt, windows, 12, seed=1, cache=False)
    boot = Bootstrap(tr.n_windows, 50, 0)
    hops = np.zeros(tr.ids.shape, np.int64)
    hops[:, ::4], hops[:, 1::4] = 1, 2  # stand-in answer tokens of two "hop counts"
    ov = overthinking(tr, boot, 3, hops)
    loss = np.asarray(ov["loss"])
    assert len(loss) == 12 and ov["best_loop"] == int(np.argmin(loss)) + 1 and ov["loss_at_r_max"] == loss[2]
    n, last = answer_flips(tr)
    assert ov["mean_flips"]["value"] == pytest.approx(n[tr.scored].mean())
    assert ov["share_flipping_past_r_max"]["value"] == pytest.approx((last[tr.scored] > 3).mean())
    right = tr.argmax == tr.targets[..., None]
    np.testing.assert_allclose(ov["answer_accuracy"], right[hops > 0].mean(0))
    np.testing.assert_allclose(ov["answer_accuracy_by_hops"]["2"], right[hops == 2].mean(0))


def test_a_trace_past_the_memory_available_is_refused_before_any_work(ckpt, monkeypatch):
    monkeypatch.setenv("RECUR_MEMORY_LIMIT", "1000000")  # 1 MB
    with pytest.raises(ValueError, match=r"needs .* GiB, more than the 0.00 GiB available .*RECUR_MEMORY_LIMIT"):
        trace(ckpt, ckpt.windows("eval")[:64], 128, seed=0, cache=False, progress=lambda *a: pytest.fail("worked"))


def test_analyze_reports_overthinking_when_asked(tiny_ckpt, tmp_path):
    from recur_core.analyze import main
    report = main([str(tiny_ckpt), "--windows", "3", "--max-loops", "6", "--n-boot", "20", "--probe-windows", "3",
                   "--probe-tokens", "8", "--fast-only", "--overthinking", "--cache-dir", str(tmp_path / "cache"),
                   "--out", str(tmp_path / "out")])
    from recur_core import load_checkpoint
    from recur_core.analysis.dynamics import overthinking_loops
    ov, r_max = report["overthinking"], report["settings"]["r_max"]
    depth = overthinking_loops(load_checkpoint(tiny_ckpt).recipe.r_max)
    assert ov["r_max"] == r_max and len(ov["loss"]) == len(ov["loops"]) == depth >= 32
    assert {"best_loop", "loss_at_r_max", "loss_at_last", "mean_flips", "share_flipping_past_r_max"} <= set(ov)
    assert "answer_accuracy" not in ov  # no ground truth on this checkpoint
    assert {"mean_state_norm", "share_settling", "share_marginal", "share_drifting"} <= set(report["dynamics"])
