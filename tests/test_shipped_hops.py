"""The shipped multi-hop checkpoint (checkpoints/hops): complete, id matches meta.json, and its
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
from training.hops_card import goals

PATH = Path(__file__).resolve().parents[1] / "checkpoints" / "hops"


@pytest.fixture(scope="module")
def shipped():
    ckpt = load_checkpoint(PATH)
    card = json.loads((PATH / "card.json").read_text())
    return ckpt, card


def test_complete_small_and_id_matches_meta(shipped):
    ckpt, _ = shipped
    assert all((PATH / f).is_file() for f in (*SHIPPED_FILES, GROUND_TRUTH, "README.md", "card.json"))
    assert ckpt.checkpoint_id == ckpt.meta["checkpoint_id"]
    assert sum(f.stat().st_size for f in PATH.iterdir()) <= 10 * 2 ** 20
    hops, _ = load_ground_truth(PATH)
    assert hops.shape == tuple(ckpt.windows("eval").shape) == (128, ckpt.config.max_seq_len + 1)


def test_card_accuracies_are_remeasured(shipped):
    """Answer accuracy per hop count at 1 loop and at r_bar on all 128 held-out programs."""
    ckpt, card = shipped
    gt = card["ground_truth"]
    r_bar = gt["r_bar"]
    hops, _ = load_ground_truth(PATH)
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
    _, card = shipped
    readme = (PATH / "README.md").read_text()
    for (goal, measured, met), stated in zip(goals(card["ground_truth"]), card["goals"], strict=True):
        assert stated["met"] == met and stated["goal"] == goal
        assert f"| {goal} | {measured} | {'yes' if met else '**no**'} |" in readme
