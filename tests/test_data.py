"""Local data pipeline: .txt / .jsonl / .parquet, globs and folders, packing, hold-out, shuffling."""
import json

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer

from training.data import (
    DataError,
    DataSpec,
    ShuffledWindows,
    is_heldout,
    local_files,
    pack_windows,
    split_txt,
    take_windows,
)
from training.tokenizer import eos_id, load_tokenizer

DOCS = [f"Story {i}: the cat sat on mat {i}." for i in range(40)]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("\n<|endoftext|>\n".join(DOCS[:10]) + "\n<|endoftext|>\n")
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in DOCS[10:25]) + "\n")
    pd.DataFrame({"text": DOCS[25:], "other": range(15)}).to_parquet(d / "c.parquet")
    (d / "ignored.csv").write_text("x\n")
    return d


def test_each_format_yields_its_documents(corpus):
    for name, expected in [("a.txt", DOCS[:10]), ("b.jsonl", DOCS[10:25]), ("c.parquet", DOCS[25:])]:
        spec = DataSpec(str(corpus / name), val=str(corpus / name))
        assert list(spec.train_docs()) == expected


def test_folder_and_glob_expand_to_supported_files(corpus):
    assert [p.name for p in local_files(str(corpus))] == ["a.txt", "b.jsonl", "c.parquet"]
    assert [p.name for p in local_files(str(corpus / "*.txt"))] == ["a.txt"]
    assert local_files(str(corpus / "none-*.txt")) is None
    with pytest.raises(DataError, match="no .txt"):
        local_files(str(corpus / "ignored.csv"))


def test_txt_without_markers_splits_at_blank_lines():
    assert split_txt("one para.\n\nsecond\nline\n\n\nthird") == ["one para.", "second\nline", "third"]


def test_hashed_holdout_is_deterministic_and_disjoint(corpus):
    spec = DataSpec(str(corpus))
    many = [f"doc number {i}" for i in range(4000)]
    held = [d for d in many if is_heldout(d)]
    assert 5 < len(held) < 60  # about 0.5%
    train, val = set(spec.train_docs()), set(spec.val_docs())
    assert not train & val and train | val == set(DOCS)


def test_packing_joins_documents_with_eos(corpus):
    tok = load_tokenizer("bpe:300", DOCS)
    eos = eos_id(tok)
    windows = list(pack_windows(iter(DOCS), tok, 17, eos))
    flat = [t for w in windows for t in w]
    expected = []
    for d in DOCS:
        expected += tok.encode(d, add_special_tokens=False).ids + [eos]
    assert all(len(w) == 17 for w in windows)
    assert flat == expected[: len(flat)] and len(expected) - len(flat) < 17
    assert isinstance(Tokenizer.from_str(tok.to_str()), Tokenizer)


def test_shuffled_windows_visit_each_window_once_per_epoch_and_resume_exactly():
    windows = torch.arange(10).unsqueeze(1)
    src = ShuffledWindows(windows, seed=0)
    epoch = torch.cat([src.next_batch(3), src.next_batch(3), src.next_batch(4)]).flatten()
    assert sorted(epoch.tolist()) == list(range(10))
    nxt = src.next_batch(5)
    resumed = ShuffledWindows(windows, seed=0)
    resumed.load_state({"position": 10})
    assert torch.equal(resumed.next_batch(5), nxt)


def test_too_little_data_is_a_clear_error():
    with pytest.raises(DataError, match="shorter than one window"):
        take_windows(iter([]), 4)
