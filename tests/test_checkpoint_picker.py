"""The app's default checkpoint: $RECUR_CHECKPOINT when set, else the shipped specimen
(ui.checkpoints.SHIPPED_DEFAULT) when usable, else the first usable folder."""
from __future__ import annotations

import shutil
from pathlib import Path

from ui import checkpoints


def _shipped(root: Path, tiny_ckpt) -> Path:
    for name in ("demo", checkpoints.SHIPPED_DEFAULT):
        shutil.copytree(tiny_ckpt, root / name)
    return root


def test_the_shipped_specimen_opens_unless_a_checkpoint_is_named(tiny_ckpt, tmp_path, monkeypatch):
    root = _shipped(tmp_path / "shipped", tiny_ckpt)
    monkeypatch.setenv("RECUR_SHIPPED", str(root))
    monkeypatch.delenv("RECUR_CHECKPOINT", raising=False)
    monkeypatch.delenv("RECUR_CHECKPOINTS", raising=False)
    entries = checkpoints.discover()
    assert [Path(e.path).name for e in entries] == ["demo", checkpoints.SHIPPED_DEFAULT]  # both selectable
    assert Path(checkpoints.default_path(entries)).name == checkpoints.SHIPPED_DEFAULT
    monkeypatch.setenv("RECUR_CHECKPOINT", str(root / "demo"))
    assert Path(checkpoints.default_path(checkpoints.discover())).name == "demo"


def test_a_broken_specimen_falls_back_to_the_first_usable(tiny_ckpt, tmp_path, monkeypatch):
    root = _shipped(tmp_path / "shipped", tiny_ckpt)
    (root / checkpoints.SHIPPED_DEFAULT / "meta.json").write_text("{ not json")
    monkeypatch.setenv("RECUR_SHIPPED", str(root))
    monkeypatch.delenv("RECUR_CHECKPOINT", raising=False)
    monkeypatch.delenv("RECUR_CHECKPOINTS", raising=False)
    entries = checkpoints.discover()
    assert not next(e for e in entries if Path(e.path).name == checkpoints.SHIPPED_DEFAULT).ok
    assert Path(checkpoints.default_path(entries)).name == "demo"
