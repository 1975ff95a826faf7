"""Padding (zero loss weight in training) is left out of every statistic, fast and exact.

A hops checkpoint's eval windows are programs padded with EOS; padding-predicting-padding had zero
weight in training (training/hops.py), so a loss over it measures nothing the model learned.
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny import make_tiny_hops_checkpoint

from recur_core import load_checkpoint
from recur_core.analysis import allocation as alloc
from recur_core.analysis.curves import convergence, elasticity, fast_sums, token_classes
from recur_core.analysis.exact import ExactPath
from recur_core.analysis.harness import run_exact
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import padding_token, trace, weighted_positions
from recur_core.exits.policies import ConvergenceExit, Uniform


@pytest.fixture(scope="module")
def hops(tmp_path_factory):
    ckpt = load_checkpoint(make_tiny_hops_checkpoint(tmp_path_factory.mktemp("hops_pad"), steps=20))
    windows = ckpt.windows("eval")[:6]
    return ckpt, windows, trace(ckpt, windows, 4, 0, topk=0, cache=False)


def test_padding_is_marked_on_hops_and_nowhere_else(hops, ckpt):
    hckpt, hwin, tr = hops
    pad = hckpt.tokenizer().token_to_id("<|endoftext|>")
    inputs, targets = hwin[:, :-1].numpy(), hwin[:, 1:].numpy()
    assert padding_token(hckpt) == pad
    np.testing.assert_array_equal(tr.zero_weight, (inputs == pad) & (targets == pad))
    assert tr.zero_weight.any() and not tr.zero_weight.all()  # the tiny programs leave padding behind them
    np.testing.assert_array_equal(tr.scored, ~tr.zero_weight)
    np.testing.assert_array_equal(weighted_positions(hckpt, hwin), ~tr.zero_weight)
    other = trace(ckpt, ckpt.windows("eval")[:2], 3, 0, topk=0, cache=False)  # a prose checkpoint: every position counts
    assert padding_token(ckpt) is None and other.zero_weight is None and other.scored.all()


def test_fast_statistics_skip_padding(hops):
    _, _, tr = hops
    keep = tr.scored
    boot = Bootstrap(tr.n_windows, 10, 0)
    for r in (1, 4):
        sums = fast_sums(tr, Uniform(r))
        assert sums.n_scored == keep.sum()
        assert sums.mean_loss == pytest.approx(tr.ce[..., r - 1][keep].mean())
    assert elasticity(tr, boot)["loss"][1] == pytest.approx(tr.ce[..., 1][keep].mean())
    conv = convergence(tr, boot)
    assert conv["mean_kl_prev"][2] == pytest.approx(tr.kl_prev[..., 2][tr.weighted].mean())
    classes = token_classes(tr, np.zeros(int(tr.ids.max()) + 1, dtype=int), ConvergenceExit(1e-3, r_max=4), boot)
    assert classes["whitespace"]["n_tokens"] == keep.sum()


def test_exact_curves_skip_padding(hops):
    ckpt, windows, tr = hops
    boot = Bootstrap(tr.n_windows, 10, 0)
    families = {name: f for name, f in alloc.allocation_families(4, eps_grid=(1e-2,)).items() if name in ("A0", "A1")}
    res = alloc.allocation(tr, boot, 2, families, ExactPath(ckpt, windows))
    a1 = res["curves"]["A1"]
    naive = run_exact(ckpt, windows, ConvergenceExit(1e-2, r_max=4), 4, 0)
    keep = tr.scored
    assert a1.loss[0, 0] == pytest.approx(naive.ce[keep].mean())
    assert a1.mean_loops[0, 0] == pytest.approx(naive.exit_depth[keep].mean())
