"""The Ground truth page in a real browser (see tests/test_browser.py for the setup): the two charts
draw, the strip's tooltip on a `?` token carries its answer's hop count, and the button adds a new
program. Saves ground_truth.png (the README's image: RECUR_SCREENSHOTS=docs/screenshots
RECUR_BROWSER_HOPS_CHECKPOINT=checkpoints/hops pytest tests/test_browser_ground_truth.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_browser import ROOT, RUN_TIMEOUT_MS, browser, chromium_path, free_port, shots, snap, wait_idle  # noqa: F401
from tiny import make_tiny_hops_checkpoint


@pytest.fixture(scope="module")
def hops_server(tmp_path_factory):
    chromium_path()
    ckpt = os.environ.get("RECUR_BROWSER_HOPS_CHECKPOINT")
    ckpt = Path(ckpt).resolve() if ckpt else make_tiny_hops_checkpoint(tmp_path_factory.mktemp("hops_browser"), 30)
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit_hops") / "server.log"
    env = dict(os.environ, RECUR_CHECKPOINT=str(ckpt), RECUR_CHECKPOINTS="",
               RECUR_SHIPPED=str(tmp_path_factory.mktemp("no_shipped")),
               RECUR_CACHE_DIR=os.environ.get("RECUR_CACHE_DIR") or str(tmp_path_factory.mktemp("cache")))
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
           "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{base}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not start:\n{log.read_text()}")
            time.sleep(0.25)  # polling interval of the health check, not a wait for the app
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_ground_truth_page_in_chromium(hops_server, browser, shots):
    page = browser.new_page(viewport={"width": 1440, "height": 2200})
    page.goto(hops_server + "/ground_truth")
    page.wait_for_selector("h1:has-text('Ground truth')", timeout=RUN_TIMEOUT_MS)
    page.wait_for_selector("[data-testid='token-strip']", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    assert page.evaluate("""() => Array.from(document.querySelectorAll('.js-plotly-plot'))
        .some(d => (d.data || []).some(t => t.type === 'box'))""")
    titles = [t for t in page.locator("[data-testid='token-strip'] [data-testid='token']").evaluate_all(
        "els => els.map(e => e.getAttribute('title'))")]
    assert any("predicts an answer" in t and "hops deep" in t for t in titles)
    before = page.locator("[data-testid='token-strip']").get_attribute("data-ids")
    snap(page, shots / "ground_truth.png")
    page.get_by_role("button", name="New random program").click()
    page.wait_for_selector(f"[data-testid='token-strip']:not([data-ids='{before}'])", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    assert not page.locator("[data-testid='stException']").count()
    page.close()
