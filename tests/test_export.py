"""Shipping a checkpoint: the copy, the measured card, the saturation verdict, and what the card says
about the data, the recipe, best/ and the deviations from the paper."""
import json
import re
import shutil
from pathlib import Path

import pytest

from recur_core import load_checkpoint
from recur_core.model.checkpoint import SHIPPED_FILES
from recur_core.report.export import DEVIATIONS, card, criteria_table, export, saturation_section
from recur_core.report.sources import KNOWN

ROOT = Path(__file__).resolve().parents[1]


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


def test_the_saturation_criterion_is_checked_at_the_models_own_mean():
    c = {"bits_per_byte_at_r_bar": 1.0, "monotone_to_r_bar": True, "drop_1_to_r_bar": 0.2,
         "gap_32_vs_r_bar": 0.0, "kl_ratio_2_over_16": 1e3}
    at_6 = criteria_table({**c, "loss_8_minus_loss_4": -0.1}, 6, flat_after(6))  # still falling 4 -> 6
    assert "| loss@12 within 0.01 nats of loss@6 (saturates at r̄ 6) | +0.0000 | yes |" in at_6 and "loss@4" not in at_6
    assert "| +0.0500 | **no** |" in criteria_table({**c, "loss_8_minus_loss_4": 0.0}, 6,
                                                     flat_after(6)[:11] + [flat_after(6)[5] + 0.05] * 21)
    at_4 = criteria_table({**c, "loss_8_minus_loss_4": 0.0}, 4, flat_after(4))
    assert "| loss@8 within 0.01 nats of loss@4 (saturates at r̄ 4) | +0.0000 | yes |" in at_4
    at_8 = criteria_table({**c, "loss_8_minus_loss_4": -0.2}, 8, flat_after(8))
    assert "| loss@8 < loss@4 (r̄ 8 still gains) | -0.2000 | yes |" in at_8


def test_export_copies_the_checkpoint_and_measures_its_card(tiny_ckpt, tmp_path):
    dst, src = tmp_path / "shipped", tmp_path / "step-60"  # a run's folder other than best/ and latest/
    shutil.copytree(tiny_ckpt, src)
    checks = export(src, dst, command="python -m training.run demo ...", machine="a test machine")
    assert sorted(p.name for p in dst.iterdir()) == sorted({*SHIPPED_FILES, "README.md", "card.json"})
    assert load_checkpoint(dst).checkpoint_id == load_checkpoint(tiny_ckpt).checkpoint_id
    card_data = json.loads((dst / "card.json").read_text())
    loss = card_data["measured"]["loss"]
    assert len(loss) == 32 and card_data["checks"] == pytest.approx(checks)
    assert checks["drop_1_to_r_bar"] == pytest.approx(loss[0] - loss[2])  # tiny r̄ is 3
    readme = (dst / "README.md").read_text()
    assert f"| 1 | {loss[0]:.4f} [" in readme and "a test machine" in readme and "saturation" not in readme
    # the synthetic corpus is no known source: named by file, size and hash, and said to be unrecorded
    assert "`train.txt` (" in readme and "`val.txt` (" in readme and "source not recorded" in readme
    assert f"]({DEVIATIONS})" in readme and 'sampler mean `"r_bar"` (E[r] = r̄, ours)' in readme
    assert "the run's `step-60/` checkpoint, its step" in readme and "`best/` checkpoint" not in readme
    meta = {**json.loads((tiny_ckpt / "meta.json").read_text()), "vocab_size": 0}
    as_best = card("shipped", meta, card_data["measured"], card_data["checks"], "cmd", "a test machine")
    assert "8 validation windows after the 128 saved eval windows (disjoint from them)" in as_best


def test_deviations_page_lists_each_deviation_and_the_links_resolve():
    section = (ROOT / "docs" / "DEVIATIONS.md").read_text()
    assert section.startswith("# Deviations from the paper\n")
    assert "(docs/DEVIATIONS.md)" in (ROOT / "README.md").read_text()  # the front page links it
    for words in ("RMSNorm on the prelude output", "sampler's mean", "A1's first check", "Plain normal noise",
                  "2 / 4 / 2", "57,301,632 unique"):
        assert words in section, words
    assert DEVIATIONS == "../../docs/DEVIATIONS.md"


def test_s1_unique_parameter_count_in_the_deviations_is_the_models():
    from recur_core import LoopedLM
    from training.presets import PRESETS

    n = LoopedLM(PRESETS["s1"].model_config(49_152)).num_params()
    assert f"**{n:,} unique" in (ROOT / "docs" / "DEVIATIONS.md").read_text()


def test_old_checkpoint_card_names_its_data_by_source_and_how_best_was_chosen():
    """The shipped demo's meta.json predates data_files and disjoint selection (sampler_mean was added
    to it by hand later; a meta.json without it gets the "predates" sentence)."""
    meta = {**json.loads((ROOT / "checkpoints/demo/meta.json").read_text()), "vocab_size": 2048}
    shipped = json.loads((ROOT / "checkpoints/demo/card.json").read_text())
    text = card("demo", meta, shipped["measured"], shipped["checks"], "cmd", "machine")
    names = [s.name for s in KNOWN if s.folder == "tinystories"]
    assert all(f"`{n}` (sha256" in text for n in names)
    assert "split `train`" in text and "split `validation`" in text and "../shared" not in text
    assert "CDLA-Sharing-1.0" in text and "huggingface-cli download roneneldan/TinyStories" in text
    assert "first 32 of the 128 saved eval windows" in text and "not retrained" in text
    assert 'sampler mean `"r_bar"` (E[r] = r̄, ours)' in text
    old = {**meta, "recipe": {k: v for k, v in meta["recipe"].items() if k != "sampler_mean"}}
    assert "predates the field" in card("demo", old, shipped["measured"], shipped["checks"], "cmd", "machine")


@pytest.mark.parametrize("name", ["demo", "demo-r8"])
def test_shipped_cards_link_the_deviations_and_name_no_machine_path(name):
    readme = (ROOT / "checkpoints" / name / "README.md").read_text()
    assert f"]({DEVIATIONS})" in readme and (ROOT / "checkpoints" / name / DEVIATIONS.split("#")[0]).resolve().is_file()
    data = readme.split("- **Training**:")[0]
    assert "../shared" not in data and "TinyStories-train.head.txt" in data and "roneneldan/TinyStories" in data
    assert re.search(r"sampler mean `\"r_bar\"`", readme)


def test_a_card_names_the_folder_it_was_exported_from():
    meta = {**json.loads((ROOT / "checkpoints/demo/meta.json").read_text()), "vocab_size": 2048}
    shipped = json.loads((ROOT / "checkpoints/demo/card.json").read_text())
    latest = card("demo", meta, shipped["measured"], shipped["checks"], "cmd", "machine", source="latest")
    assert f"the run's `latest/` checkpoint, its step {meta['step']}" in latest and "`best/` checkpoint" not in latest
    assert "`best/` checkpoint: " in card("demo", meta, shipped["measured"], shipped["checks"], "cmd", "machine")
