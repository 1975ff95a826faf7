"""Small data trains (issue 25): text too short for the usual 0.5% validation hold-out gets an
enlarged, hash-ordered hold-out and fewer validation windows, down to a minimum; below it, a refusal
that says how much text is needed."""
import json

import pytest
import torch
from tiny import TINY_SETTINGS, synthetic_stories

from recur_core import load_checkpoint
from recur_core.model.checkpoint import read_safetensors
from recur_core.report.export import validation_sentence
from recur_core.tasks import EOS
from training.data import (
    MAX_HOLDOUT_SHARE,
    USUAL_HOLDOUT_BELOW,
    DataError,
    DataSpec,
    enlarged_holdout_below,
    holdout_rank,
    is_heldout,
)
from training.presets import PRESETS
from training.trainer import MIN_EVAL_WINDOWS, MIN_SELECT_WINDOWS, Trainer, split_validation

SMALL = {**TINY_SETTINGS, "seq_len": "64"}  # the tiny model on windows of a kill-and-resume test's size


def write_text(path, n_docs: int, seed: int = 3):
    """n_docs synthetic stories (about 250 bytes each) as one .txt file, ended by EOS lines."""
    path.write_text(f"\n{EOS}\n".join(synthetic_stories(n_docs, seed=seed)) + "\n")
    return path


def small_trainer(tmp_path, n_docs: int, steps: int = 6, **kwargs) -> Trainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = write_text(tmp_path / "small.txt", n_docs)
    cfg = PRESETS["demo"].with_overrides(SMALL)
    cfg = cfg.with_overrides({"max_tokens": str(steps * cfg.batch_size * cfg.seq_len)})
    return Trainer("demo", cfg, SMALL, DataSpec(str(text)), tmp_path / "run", progress=False, **kwargs)


# -- the hold-out --------------------------------------------------------------------------
def test_default_holdout_is_the_usual_sha1_per_mille():
    """The rank order keeps the usual hold-out bit for bit: shipped runs' windows depend on it."""
    import hashlib
    docs = [f"doc {i}: " + "word " * (i % 13) for i in range(20_000)]
    usual = [int.from_bytes(hashlib.sha1(d.encode()).digest()[:4], "little") % 1000 < 5 for d in docs]
    assert [is_heldout(d) for d in docs] == usual
    assert [holdout_rank(d) < USUAL_HOLDOUT_BELOW for d in docs] == usual


def test_enlarged_holdout_extends_the_usual_one_in_rank_order():
    usual = [(USUAL_HOLDOUT_BELOW - 10, 5)]
    others = [(USUAL_HOLDOUT_BELOW + 100 * i, 10) for i in range(100)]  # 1,005 tokens in all
    ranked = usual + others[::-1]  # the input's order does not matter
    below = enlarged_holdout_below(ranked, need_tokens=40)
    assert below == others[3][0] + 1  # 5 + 4 x 10 tokens >= 40: whole documents, the lowest ranks
    held = [rank for rank, _ in ranked if rank < below]
    assert sorted(held) == [usual[0][0]] + [r for r, _ in others[:4]]


def test_enlarged_holdout_takes_at_most_its_share_of_the_text():
    ranked = [(USUAL_HOLDOUT_BELOW + i, 10) for i in range(100)]  # 1,000 tokens
    below = enlarged_holdout_below(ranked, need_tokens=10_000)
    assert sum(n for rank, n in ranked if rank < below) == MAX_HOLDOUT_SHARE * 1000


def test_enlarged_holdout_never_drops_the_usual_one():
    ranked = [(0, 500), (1, 500), (USUAL_HOLDOUT_BELOW, 10)]  # the usual hold-out alone is over budget
    assert enlarged_holdout_below(ranked, need_tokens=100) == USUAL_HOLDOUT_BELOW


def test_train_and_validation_documents_split_at_the_limit(tmp_path):
    docs = synthetic_stories(300, seed=4)
    text = write_text(tmp_path / "t.txt", 300, seed=4)
    below = sorted(holdout_rank(d) for d in docs)[29] + 1  # the 30 first in rank order
    spec = DataSpec(str(text), holdout_below=below)
    train, val = list(spec.train_docs()), list(spec.val_docs())
    assert len(set(val)) == 30 and not set(train) & set(val) and sorted(train + val) == sorted(docs)
    assert set(DataSpec(str(text)).val_docs()) <= set(val)


def test_windows_split_down_to_the_minimum():
    assert split_validation(160, 32) == (128, 32)
    assert split_validation(136, 8) == (128, 8)
    assert split_validation(82, 32) == (66, 16)  # the selection keeps its usual fifth
    assert split_validation(MIN_EVAL_WINDOWS + MIN_SELECT_WINDOWS, 32) == (MIN_EVAL_WINDOWS, MIN_SELECT_WINDOWS)
    assert split_validation(MIN_EVAL_WINDOWS + MIN_SELECT_WINDOWS - 1, 32) is None
    assert split_validation(MIN_EVAL_WINDOWS + 2, 2) == (MIN_EVAL_WINDOWS, 2)  # fewer wanted: fewer needed


# -- end to end ----------------------------------------------------------------------------
def test_200_kb_of_text_trains_on_an_enlarged_holdout(tmp_path, capsys):
    """About 200 KB, no validation source, windows of 64 tokens: the run holds out more documents,
    trains, says so in one line, records it in meta.json and states it on the card; no held-out
    document is in the training windows."""
    trainer = small_trainer(tmp_path, n_docs=800)
    trainer.train()
    meta = load_checkpoint(tmp_path / "run" / "latest").meta
    v = meta["validation"]
    assert v["enlarged"] and v["shrunk"] and v["hold_out_rank_below"] > USUAL_HOLDOUT_BELOW
    assert v["documents_total"] == 800 and 0 < v["documents_held_out"] <= 0.15 * 800
    assert MIN_EVAL_WINDOWS <= v["eval_windows"] < 128 and MIN_SELECT_WINDOWS <= v["selection_windows"] < 8
    saved = read_safetensors(tmp_path / "run" / "latest" / "eval_windows.safetensors")["ids"]
    assert saved.shape == (v["eval_windows"], 65)
    assert meta["best_selected_on"].startswith(f"{v['selection_windows']} validation windows after the "
                                               f"{v['eval_windows']} saved")
    lines = [line for line in capsys.readouterr().err.splitlines() if "hold-out" in line]
    assert lines == [f"demo: the usual 0.5% validation hold-out is too small for this text, so "
                     f"{v['documents_held_out']} of its 800 documents (first in hash order) are held out of "
                     f"training; validation: {v['eval_windows']} eval + {v['selection_windows']} selection "
                     "windows instead of the usual 128 + 8"]
    assert f"held {v['documents_held_out']} of its 800 documents" in validation_sentence(meta)

    held = [d for d in synthetic_stories(800, seed=3) if is_heldout(d, v["hold_out_rank_below"])]
    tok = trainer.tokenizer
    train_text = tok.decode(trainer.train_windows.windows.flatten().tolist())
    eval_text = tok.decode(saved.flatten().tolist())
    assert len(held) == v["documents_held_out"] and not any(d in train_text for d in held)
    assert sum(d in eval_text for d in held) >= 2
    assert json.loads((tmp_path / "run" / "best" / "meta.json").read_text())["validation"] == v


def test_resumed_run_keeps_the_recorded_holdout(tmp_path):
    """A run stopped and resumed equals one run straight through: --resume reads the enlarged
    hold-out from meta.json (with the saved tokenizer) instead of choosing it again."""
    small_trainer(tmp_path / "a", n_docs=800).train()
    small_trainer(tmp_path / "b", n_docs=800, stop_at_step=3).train()
    small_trainer(tmp_path / "b", n_docs=800, resume=True).train()
    for name in ("model.safetensors", "eval_windows.safetensors", "probe_windows.safetensors"):
        a = read_safetensors(tmp_path / "a" / "run" / "latest" / name)
        b = read_safetensors(tmp_path / "b" / "run" / "latest" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_too_little_text_is_refused_saying_how_much_is_needed(tmp_path):
    trainer = small_trainer(tmp_path, n_docs=40)  # about 10 KB: a tenth holds under 12 windows
    with pytest.raises(DataError) as err:
        trainer.setup()
    message = str(err.value)
    assert message.startswith("the validation data holds ")
    assert "the trainer needs at least 12 (8 saved eval windows plus 4 disjoint ones to choose best/ on; " \
           "usually 128 + 8), that is 780 tokens of validation text. It holds out at most 10% of the " \
           "training text for them, so give at least about " in message
    assert "KB of text (this is 10 KB)" in message and "\n" not in message


def test_card_sentence_only_for_a_short_validation():
    v = {"enlarged": False, "shrunk": True, "eval_windows": 20, "selection_windows": 5,
         "wanted_eval_windows": 128, "wanted_selection_windows": 32}
    assert validation_sentence({"validation": v}) == (" The validation text was short: it gave 20 saved eval "
                                                      "windows and 5 selection windows instead of the usual 128 + 32.")
    assert validation_sentence({"validation": {**v, "shrunk": False}}) == ""
    assert validation_sentence({}) == ""  # checkpoints from before the record


def test_an_empty_text_is_refused_as_empty(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    cfg = PRESETS["demo"].with_overrides(SMALL)
    trainer = Trainer("demo", cfg, SMALL, DataSpec(str(tmp_path / "empty.txt")), tmp_path / "run", progress=False)
    with pytest.raises(DataError, match="the training text is empty"):
        trainer.setup()
    assert not (tmp_path / "run" / "latest").exists()
