import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny checkpoint trained for a few steps (shared by the whole test session; do not modify)."""
    from tiny import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def ckpt(tiny_ckpt):
    """The tiny checkpoint, loaded once (a shared model: do not modify it)."""
    from recur_core import load_checkpoint
    return load_checkpoint(tiny_ckpt)
