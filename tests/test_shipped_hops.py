"""The shipped multi-hop checkpoints (checkpoints/hops, hops-per-token, hops10-per-token): complete, id matches meta.json, and its
card's answer accuracies per hop count re-measured with the product's own code; the goal verdicts
of the README follow from the card's numbers."""
import json
from pathlib import Path

import numpy as np
import pytest

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import GROUND_TRUTH, answer_hops, correct_at, load_ground_truth
from recur_core.analysis.trace import trace
from recur_core.model.checkpoint import SHIPPED_FILES
from recur_core.report.hops_card import goals

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@pytest.fixture(scope="module", params=["hops", "hops-per-token", "hops10-per-token"])
def shipped(request):
    path = CHECKPOINTS / request.param
    return path, load_checkpoint(path), json.loads((path / "card.json").read_text())


def test_complete_small_and_id_matches_meta(shipped):
    path, ckpt, _ = shipped
    assert all((path / f).is_file() for f in (*SHIPPED_FILES, GROUND_TRUTH, "README.md", "card.json"))
    assert ckpt.checkpoint_id == ckpt.meta["checkpoint_id"]
    assert sum(f.stat().st_size for f in path.iterdir()) <= 10 * 2 ** 20
    hops, _ = load_ground_truth(path)
    assert hops.shape == tuple(ckpt.windows("eval").shape) == (128, ckpt.config.max_seq_len + 1)


def test_card_accuracies_are_remeasured(shipped):
    """Answer accuracy per hop count at 1 loop and at r_bar on all 128 held-out programs."""
    path, ckpt, card = shipped
    gt = card["ground_truth"]
    r_bar = gt["r_bar"]
    hops, _ = load_ground_truth(path)
    tr = trace(ckpt, ckpt.windows("eval").numpy(), r_bar, seed=0, cache=False)
    ah = answer_hops(tr, hops)
    for loops in (1, r_bar):
        ok = correct_at(tr, np.full(ah.shape, loops))
        for h in gt["hop_counts"]:
            n = int((ah == h).sum())
            assert n == gt["n_answers_by_hops"][str(h)]
            assert ok[ah == h].mean() == pytest.approx(gt["uniform"]["accuracy_by_hops"][str(h)][loops - 1],
                                                       abs=1.01 / n)  # at most one answer flips


def test_readme_goal_verdicts_follow_from_the_card(shipped):
    path, _, card = shipped
    readme = (path / "README.md").read_text()
    for (goal, measured, met), stated in zip(goals(card["ground_truth"]), card["goals"], strict=True):
        assert stated["met"] == met and stated["goal"] == goal
        assert f"| {goal} | {measured} | {'yes' if met else '**no**'} |" in readme


def test_per_token_checkpoint_records_its_recipe_and_sits_beside_hops():
    path = CHECKPOINTS / "hops-per-token"
    ckpt = load_checkpoint(path)
    assert ckpt.recipe.depth_mode == "per_token" and ckpt.recipe.token_share == 0.5
    assert ckpt.meta["init_from"]["checkpoint_id"] == load_checkpoint(CHECKPOINTS / "hops").checkpoint_id
    readme = (path / "README.md").read_text()
    assert "per-token depth (50% of tokens" in readme and "## Beside `hops`" in readme
    assert "**Started from** `checkpoints/hops`" in readme
    assert "the same 128 eval programs" in readme  # the same generator and seed: comparable row by row


def test_deeper_per_token_checkpoint_trains_ten_hops_at_r_bar_12():
    """The deeper task issue 27 asked for: hop counts to 10, r̄ >= 10, best uniform depth >= 8."""
    path = CHECKPOINTS / "hops10-per-token"
    ckpt = load_checkpoint(path)
    assert ckpt.recipe.depth_mode == "per_token" and ckpt.recipe.token_share == 1.0 and ckpt.recipe.r_bar == 12
    assert ckpt.meta["init_from"]["checkpoint_id"] == load_checkpoint(CHECKPOINTS / "hops-per-token").checkpoint_id
    gt = json.loads((path / "card.json").read_text())["ground_truth"]
    assert gt["max_train_hops"] == 10 and gt["best_uniform_depth"] >= 8
    assert "on **different** eval programs" in (path / "README.md").read_text()  # another task's generator
