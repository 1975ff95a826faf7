"""The app's checkpoint handle and its discovery (issue 47, item 4): the picker describes a folder once
per stamp of its files, and a cold load reads meta.json once, not once per reader."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections import Counter

import pytest
from streamlit.testing.v1 import AppTest
from test_app import TIMEOUT, settle

from ui import checkpoints


@pytest.fixture
def folders(tiny_ckpt, tmp_path, monkeypatch):
    """Two copies of the tiny checkpoint that no other test has described or loaded, the first the
    default, with a private trace cache."""
    root = tmp_path / "ckpts"
    copies = [root / name for name in ("first", "second")]
    for c in copies:
        shutil.copytree(tiny_ckpt, c)
    monkeypatch.setenv("RECUR_CHECKPOINT", str(copies[0]))
    monkeypatch.setenv("RECUR_CHECKPOINTS", str(root))
    monkeypatch.setenv("RECUR_SHIPPED", str(tmp_path / "no_shipped"))
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path / "cache"))
    return [c.resolve() for c in copies]


def count_meta_reads(monkeypatch) -> Counter:
    """meta.json reads per folder: recur_core.model.checkpoint.read_meta, the one reader, reads it
    with Path.read_text."""
    reads, real = Counter(), pathlib.Path.read_text

    def counting(self, *args, **kwargs):
        if self.name == "meta.json":
            reads[self.parent.resolve()] += 1
        return real(self, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "read_text", counting)
    return reads


def run(at: AppTest) -> AppTest:
    at.run()
    return settle(at)


def test_a_cold_load_reads_meta_json_once(folders, monkeypatch):
    reads = count_meta_reads(monkeypatch)
    at = run(AppTest.from_file("../app.py", default_timeout=TIMEOUT))
    assert at.title[0].value == "Token exit depths"  # the page ran on the loaded model
    assert reads == {folders[0]: 1, folders[1]: 1}  # the picker's read; the load and the page reuse it


def test_a_rerun_describes_no_unchanged_folder(folders, monkeypatch):
    described, real = [], checkpoints.describe_folder

    def counting(path, meta=None):
        described.append(pathlib.Path(path))
        return real(path, meta=meta)
    monkeypatch.setattr(checkpoints, "describe_folder", counting)
    at = run(AppTest.from_file("../app.py", default_timeout=TIMEOUT))
    assert sorted(described) == folders
    run(at)
    assert sorted(described) == folders  # nothing changed: nothing described again

    meta_file = folders[1] / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "step": 4321}))
    os.utime(meta_file, ns=(meta_file.stat().st_atime_ns, meta_file.stat().st_mtime_ns + 10**9))
    run(at)
    assert sorted(described) == [folders[0], folders[1], folders[1]]  # the changed folder, once more
    assert checkpoints.describe(folders[1]).meta["step"] == 4321


def test_the_study_is_kept_per_checkpoint_and_cache_folder(folders, tmp_path, monkeypatch):
    """compute.study returns one Study per (checkpoint, cache folder) across reruns, so the certified
    exit's L is measured once, not on every rerun of the Ground truth page's readiness check."""
    from recur_core.analysis import study as study_module
    from ui import compute
    from ui.handle import Handle
    measured = Counter()

    def counting(ckpt, max_loops, seed):
        measured[ckpt.path] += 1
        return {"lipschitz": 1.0}
    monkeypatch.setattr(study_module, "measured_lipschitz", counting)
    key = Handle.open(str(folders[0]), "cpu").key
    first = compute.study(*key)
    assert compute.study(*key) is first
    assert first.lipschitz == compute.study(*key).lipschitz == {"lipschitz": 1.0}
    assert sum(measured.values()) == 1
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert compute.study(*key) is not first and str(compute.study(*key).cache.root) == str(tmp_path / "elsewhere")
