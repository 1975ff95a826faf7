"""The shipped demo checkpoints: complete, id matches meta.json, and the elasticity claims of their
READMEs hold when re-measured on a few eval windows with the product's own code."""
import json
from pathlib import Path

import pytest

from recur_core import load_checkpoint
from recur_core.analysis.curves import convergence, elasticity
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.model.checkpoint import SHIPPED_FILES

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
N_WINDOWS = 12


@pytest.fixture(scope="module", params=["demo", "demo-r8"])
def shipped(request):
    path = CHECKPOINTS / request.param
    ckpt = load_checkpoint(path)
    tr = trace(ckpt, ckpt.windows("eval")[:N_WINDOWS].numpy(), 32, seed=0, cache=False)
    boot = Bootstrap(tr.n_windows, n_boot=50)
    return request.param, path, ckpt, elasticity(tr, boot)["loss"], convergence(tr, boot)["mean_kl_prev"]


def test_complete_and_id_matches_meta(shipped):
    name, path, ckpt, _, _ = shipped
    assert all((path / f).is_file() for f in (*SHIPPED_FILES, "README.md"))
    assert ckpt.checkpoint_id == ckpt.meta["checkpoint_id"]
    assert ckpt.windows("eval").shape[0] == 128 and ckpt.windows("probe").shape[0] == 128
    assert "CDLA-Sharing-1.0" in (path / "README.md").read_text()


def test_elasticity_and_convergence(shipped):
    name, path, ckpt, loss, kl = shipped
    r_bar = round(ckpt.meta["recipe"]["r_bar"])
    assert all(loss[i + 1] <= loss[i] + 0.005 for i in range(r_bar - 1)), loss[:r_bar]
    assert abs(loss[31] - loss[r_bar - 1]) <= 0.03
    assert kl[15] * 100 <= kl[1]
    card = json.loads((path / "card.json").read_text())["checks"]
    # the README's 1 -> r_bar drop, re-measured on a subset, within sampling noise of the card
    assert loss[0] - loss[r_bar - 1] == pytest.approx(card["drop_1_to_r_bar"], abs=0.03)
    assert loss[0] - loss[r_bar - 1] > 0.02


def test_saturation_verdict_of_the_readme_matches_the_numbers():
    """demo-r8's README says whether the pair agrees with saturation at the training mean (flat from
    4 to 8 loops at r̄ 4, still falling at r̄ 8), and that verdict follows from the measured cards."""
    loss = {name: json.loads((CHECKPOINTS / name / "card.json").read_text())["measured"]["loss"]
            for name in ("demo", "demo-r8")}
    agrees = abs(loss["demo"][7] - loss["demo"][3]) <= 0.01 and loss["demo-r8"][7] < loss["demo-r8"][3]
    readme = (CHECKPOINTS / "demo-r8" / "README.md").read_text()
    assert ("**agrees**" if agrees else "**disagrees**") in readme
    assert ("**disagrees**" if agrees else "**agrees**") not in readme
