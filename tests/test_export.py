"""Shipping a checkpoint: the copy, the measured card, and the saturation verdict."""
import json

import pytest

from recur_core import load_checkpoint
from training.export import SHIPPED_FILES, export, saturation_section


def flat_after(depth: int, start: float = 3.0, fall: float = 0.05) -> list[float]:
    """A loss curve over 32 loops that falls by `fall` per loop until `depth`, then stays flat."""
    return [start - fall * (min(i, depth) - 1) for i in range(1, 33)]


def test_saturation_agrees_when_each_model_flattens_at_its_own_mean():
    text = saturation_section("a", flat_after(4), 4, "b", flat_after(8), 8)
    assert "**agrees**" in text and "from\n4 to 8 loops" in text
    assert "+0.0000 nats at r̄ 4" in text and "-0.2000 nats at r̄ 8" in text


def test_saturation_disagrees_when_both_flatten_at_the_same_depth():
    assert "**disagrees**" in saturation_section("b", flat_after(4), 8, "a", flat_after(4), 4)
    assert "**disagrees**" in saturation_section("a", flat_after(8), 4, "b", flat_after(8), 8)


def test_saturation_needs_two_training_means():
    with pytest.raises(ValueError, match="two training means"):
        saturation_section("a", flat_after(4), 4, "b", flat_after(4), 4)


def test_export_copies_the_checkpoint_and_measures_its_card(tiny_ckpt, tmp_path):
    dst = tmp_path / "shipped"
    checks = export(tiny_ckpt, dst, command="python -m training.run demo ...", machine="a test machine")
    assert sorted(p.name for p in dst.iterdir()) == sorted({*SHIPPED_FILES, "README.md", "card.json"})
    assert load_checkpoint(dst).checkpoint_id == load_checkpoint(tiny_ckpt).checkpoint_id
    card = json.loads((dst / "card.json").read_text())
    loss = card["measured"]["loss"]
    assert len(loss) == 32 and card["checks"] == pytest.approx(checks)
    assert checks["drop_1_to_r_bar"] == pytest.approx(loss[0] - loss[2])  # tiny r̄ is 3
    readme = (dst / "README.md").read_text()
    assert f"| 1 | {loss[0]:.4f} [" in readme and "a test machine" in readme
    assert "CDLA-Sharing-1.0" in readme and "saturation" not in readme
