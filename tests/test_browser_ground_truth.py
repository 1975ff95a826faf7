"""The Ground truth page in a real browser (see tests/test_browser.py for the setup): the two charts
draw, the strip's tooltip on a `?` token carries its answer's hop count, and the button adds a new
program. Saves ground_truth.png (the README's and docs/CHECKPOINTS.md's image: RECUR_SCREENSHOTS=docs/screenshots
RECUR_BROWSER_HOPS_CHECKPOINT=checkpoints/hops pytest tests/test_browser_ground_truth.py)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from test_browser import RUN_TIMEOUT_MS, browser, chromium_path, shots, snap, streamlit_server, wait_idle  # noqa: F401


@pytest.fixture(scope="module")
def hops_server(tmp_path_factory, request):
    """The app on $RECUR_BROWSER_HOPS_CHECKPOINT, else on the session's tiny hops checkpoint with the
    trace cache of the in-process page test (which, run first, has computed the exact section)."""
    chromium_path()
    ckpt, cache = os.environ.get("RECUR_BROWSER_HOPS_CHECKPOINT"), None
    if ckpt is None:
        ckpt, cache = request.getfixturevalue("hops_ckpt"), request.getfixturevalue("hops_app_cache")
    with streamlit_server(Path(ckpt).resolve(), tmp_path_factory, cache=cache) as base:
        yield base


def test_ground_truth_page_in_chromium(hops_server, request):
    # the imported fixtures are looked up by name: as parameters they would shadow the imports
    chromium, screenshots = request.getfixturevalue("browser"), request.getfixturevalue("shots")
    page = chromium.new_page(viewport={"width": 1440, "height": 2200})
    page.goto(hops_server + "/ground_truth")
    page.wait_for_selector("h1:has-text('Ground truth')", timeout=RUN_TIMEOUT_MS)
    page.wait_for_selector("[data-testid='token-strip']", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    assert page.evaluate("""() => Array.from(document.querySelectorAll('.js-plotly-plot'))
        .some(d => (d.data || []).some(t => t.type === 'box'))""")
    titles = [t for t in page.locator("[data-testid='token-strip'] [data-testid='token']").evaluate_all(
        "els => els.map(e => e.getAttribute('title'))")]
    assert any(re.search(r"predicts an answer \d+ hops? deep", t) for t in titles)  # "1 hop", "2 hops"
    before = page.locator("[data-testid='token-strip']").get_attribute("data-ids")
    snap(page, screenshots / "ground_truth.png")
    page.get_by_role("button", name="New random program").click()
    page.wait_for_selector(f"[data-testid='token-strip']:not([data-ids='{before}'])", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    assert not page.locator("[data-testid='stException']").count()
    page.close()
