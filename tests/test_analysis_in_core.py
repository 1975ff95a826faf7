"""Analysis that used to live in the app, now in recur_core / training (issue 12, item 11): the
per-token exit table, the exact sweep, the metrics.jsonl parser; and the dead code that went."""
import json

import numpy as np
import pandas as pd
import pytest

from recur_core.analysis import curves as analysis
from recur_core.analysis.trace import trace
from recur_core.exits.policies import ConvergenceExit


@pytest.fixture(scope="module")
def small_trace(ckpt):
    return trace(ckpt, ckpt.windows("eval")[:4], 6, seed=0, cache=False)


def test_token_exit_table_matches_a_groupby_over_scored_positions(ckpt, small_trace):
    tr = small_trace
    classes = analysis.vocab_classes(ckpt.tokenizer(), ckpt.config.vocab_size)
    policy = ConvergenceExit(1e-2, r_max=6)
    table = pd.DataFrame(analysis.token_exit_table(tr, classes, policy))
    ex = policy.exits(tr)
    scored = tr.has_target
    ref = (pd.DataFrame({"token_id": tr.ids[scored], "depth": ex.depth[scored], "conv": ex.converged[scored]})
           .groupby("token_id").agg(count=("depth", "size"), mean=("depth", "mean"), conv=("conv", "mean")))
    assert len(table) == len(ref) and table["count"].sum() == scored.sum()
    got = table.set_index("token_id").loc[ref.index]
    np.testing.assert_array_equal(got["count"], ref["count"])
    np.testing.assert_allclose(got["mean_exit_depth"], ref["mean"])
    np.testing.assert_allclose(got["frac_converged"], ref["conv"])
    assert (got["class"] == [analysis.TOKEN_CLASSES[c] for c in classes[ref.index]]).all()
    # ordered by class (TOKEN_CLASSES order), then by count, descending
    rank = table["class"].map(analysis.TOKEN_CLASSES.index)
    assert rank.is_monotonic_increasing
    assert all(g["count"].is_monotonic_decreasing for _, g in table.groupby("class"))


def test_smallest_uniform_depth_is_the_first_depth_at_that_loss(small_trace):
    """The best uniform depth at a loss: the smallest r whose A0 loss (each token's mean ce at loop r
    over the scored positions) is within the tolerance of it; None when no depth gets there."""
    tr = small_trace
    per_depth = [float(tr.ce[..., r - 1][tr.has_target].mean()) for r in range(1, 7)]
    for r in range(1, 7):
        expected = next(d for d in range(1, 7) if per_depth[d - 1] <= per_depth[r - 1] + 1e-4)
        assert analysis.smallest_uniform_depth(tr, per_depth[r - 1], 6) == expected <= r
    assert analysis.smallest_uniform_depth(tr, min(per_depth) - 1.0, 6) is None


def test_metrics_parser_reads_old_and_new_logs(tmp_path):
    from recur_core.model.metrics_log import append, read_metrics

    new = tmp_path / "new.jsonl"
    append(new, {"event": "start", "recipe": {"r_bar": 4, "sampler_mean": "huginn"}})
    append(new, {"event": "train", "step": 1, "loss": 3.0, "r": 2})
    append(new, {"event": "eval", "step": 1, "windows": 32, "split": "select", "loss_by_depth": {"1": 3.1, "4": 3.0}})
    append(new, {"event": "eval", "step": 1, "windows": 128, "split": "eval", "loss_by_depth": {"1": 3.2}})
    with open(new, "a") as f:
        f.write("{ not json\n\n")
    log = read_metrics(new)
    assert log.start["recipe"]["sampler_mean"] == "huginn" and log.bad_lines == 1
    assert log.train["loss"].tolist() == [3.0]
    assert log.evals[["depth", "loss", "split", "periodic"]].values.tolist() == [
        [1, 3.1, "select", True], [4, 3.0, "select", True], [1, 3.2, "eval", False]]

    old = tmp_path / "old.jsonl"  # before the split was recorded: periodic evals ran on the first 32 eval windows
    old.write_text("\n".join(json.dumps(r) for r in (
        {"event": "eval", "step": 100, "windows": 32, "loss_by_depth": {"1": 3.0}},
        {"event": "eval", "step": 200, "windows": 128, "loss_by_depth": {"1": 2.9}})) + "\n")
    log = read_metrics(old)
    assert log.start is None and log.evals["periodic"].tolist() == [True, False]
    assert log.evals["split"].tolist() == ["eval", "eval"]


def test_dead_code_is_gone():
    import training.depth_sampler
    from recur_core.decoding import decode
    from ui.handle import Handle

    assert not hasattr(analysis, "evaluate_policies")
    assert not hasattr(training.depth_sampler, "loops_with_grad")
    assert not hasattr(decode.Drift, "as_dict")
    assert not hasattr(Handle, "r_bar_exact")
