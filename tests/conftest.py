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


@pytest.fixture(scope="session")
def hops_ckpt(tmp_path_factory) -> Path:
    """A tiny checkpoint trained for seconds on multi-hop programs, with ground truth (shared by the
    whole test session; do not modify)."""
    from tiny import make_tiny_hops_checkpoint
    return make_tiny_hops_checkpoint(tmp_path_factory.mktemp("tiny_hops"), steps=30)


@pytest.fixture(scope="session")
def hops_app_cache(tmp_path_factory) -> Path:
    """The trace cache ($RECUR_CACHE_DIR) of the app's Ground truth tests on hops_ckpt: the first
    to open the page computes the exact section in the background, the next reads it from disk."""
    return tmp_path_factory.mktemp("hops_app_cache")
