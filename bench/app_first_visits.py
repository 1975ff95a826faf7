"""`python -m bench.app_first_visits [--out FILE]`: the app's first visits as a newcomer meets them: `streamlit
run app.py` on its default checkpoint with an empty cache, every page visited in the navigation's order in
Chromium (1500 px wide), timing when each page shows progress, its first result and its complete state
(no progress bar, the script idle, for 4 s). Also says whether a page raised, and whether the Ground truth
page asked before its exact figures. The README's first-visit table comes from here. Needs Debian's
chromium and playwright (the dev extra). Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
# (page title in the navigation, a selector that marks its first result, how long to wait for it at most)
PAGES = [("Token exit depths", "[data-testid='token-strip']", 1800),
         ("Compare policies", "[data-testid='token-strip']", 1800),
         ("Depth / loss curve", ".js-plotly-plot .main-svg", 3600),
         ("Convergence", ".js-plotly-plot .main-svg", 1800),
         ("Token classes", ".js-plotly-plot .main-svg", 1800),
         ("Elasticity & saturation", ".js-plotly-plot .main-svg", 1800),
         ("Ground truth", ".js-plotly-plot .main-svg", 1800),
         ("Training run", ".js-plotly-plot .main-svg", 600)]
STATE_JS = """(sel) => ({
    busy: !!document.querySelector("[data-testid='stProgress'], [data-testid='stSpinner']"),
    shown: !!document.querySelector(sel),
    idle: !!document.querySelector("[data-testid='stApp'][data-test-script-state='notRunning']"),
    raised: !!document.querySelector("[data-testid='stException']"),
    text: document.body.innerText})"""
CALM_S = 4.0  # complete: the result shown, the script idle and no progress bar for this long


@contextlib.contextmanager
def app_server(cache: str):
    """`streamlit run app.py` on its default checkpoint (no RECUR_CHECKPOINT) with `cache` as its cache."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RECUR_CHECKPOINT", "RECUR_CHECKPOINTS", "RECUR_SHIPPED")}
    env["RECUR_CACHE_DIR"] = cache
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if urllib.request.urlopen(f"{base}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("streamlit did not start") from None
                time.sleep(0.5)  # the health check's polling interval
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def visit(page, selector: str, limit: float) -> dict:
    """Seconds until progress shows, the first result shows and the page is complete (None: not seen)."""
    t0 = time.monotonic()
    progress = first = calm = None
    state = {}
    while time.monotonic() - t0 < limit:
        state = page.evaluate(STATE_JS, selector)
        now = time.monotonic() - t0
        progress = now if progress is None and state["busy"] else progress
        first = now if first is None and state["shown"] else first
        if state["shown"] and state["idle"] and not state["busy"]:
            calm = now if calm is None else calm
            if now - calm >= CALM_S:
                break
        else:
            calm = None
        time.sleep(0.25)
    return {"progress_s": progress, "first_s": first, "complete_s": calm, "raised": state.get("raised", False),
            "asks_before_exact": "Compute the exact figures" in state.get("text", "")}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright
    rows = []
    with tempfile.TemporaryDirectory() as cache, app_server(cache) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 1400})
        for i, (title, selector, limit) in enumerate(PAGES):
            if i == 0:
                page.goto(base + "/")
            else:
                page.locator("[data-testid='stSidebarNavLink']", has_text=title).first.click()
            rows.append({"page": title, **visit(page, selector, limit), "load": round(os.getloadavg()[0], 1)})
            r = rows[-1]
            fmt = lambda s: "—" if s is None else f"{s:7.1f} s"  # noqa: E731
            print(f"{title:26s} progress {fmt(r['progress_s'])}  first {fmt(r['first_s'])}  "
                  f"complete {fmt(r['complete_s'])}  load {r['load']}", flush=True)
        browser.close()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(json.dumps({"first_visits": rows}))
    return rows


if __name__ == "__main__":
    main()
