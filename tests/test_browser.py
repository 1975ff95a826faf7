"""The app in a real browser: `streamlit run app.py` headless, driven by Playwright in Debian's Chromium.

Paste a prompt, check the token strip (one element per token, each with a depth) and the KL heatmap,
go to the depth / loss curve, move the ε slider and check that the highlighted point moved; a
screenshot of every main page is saved on the way. Waits use Streamlit's script-state attribute
and the page's own content, never a fixed sleep.

Chromium: /usr/bin/chromium (`apt-get install chromium`; `.ci/run` installs it). Missing chromium
fails the test under CI ($CI set) and skips it elsewhere.

Settings (environment):
  RECUR_BROWSER_CHECKPOINT  checkpoint to run the app on (default: the tiny test checkpoint)
  RECUR_BROWSER_CHECKPOINTS more checkpoint folders for the app to list (e.g. checkpoints, for elasticity)
  RECUR_SCREENSHOTS         folder for the PNGs (default: the test's temporary folder). The README's
                            images: RECUR_SCREENSHOTS=docs/screenshots RECUR_BROWSER_CHECKPOINT=checkpoints/specimen \
                            RECUR_BROWSER_CHECKPOINTS=checkpoints pytest tests/test_browser.py
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_app import engine_depths

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
SLIDER = "[data-testid='stSlider'] input[type='range']"  # the ε slider's thumb (keyboard-focusable)
PROMPT = ("Once upon a time, Tom had 3 red balls. He gave 2 of them to his friend Mia.\n"
          "\"Thank you!\" said Mia, and they played in the park all day.")
RUN_TIMEOUT_MS = 900_000  # first runs trace the eval windows and train the A2 probes


def chromium_path() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: CI must install it (.ci/run: apt-get install chromium)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); the real-browser test needs it")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(ckpt: Path, tmp_path_factory, checkpoints: str = "", cache: Path | None = None):
    """`streamlit run app.py` on `ckpt`, on a free port, until the block ends; yields the base url.
    cache: its $RECUR_CACHE_DIR (default the caller's, else a fresh folder)."""
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = dict(os.environ, RECUR_CHECKPOINT=str(ckpt), RECUR_CHECKPOINTS=checkpoints,
               RECUR_SHIPPED=str(tmp_path_factory.mktemp("no_shipped_checkpoints")),
               RECUR_CACHE_DIR=str(cache or os.environ.get("RECUR_CACHE_DIR") or tmp_path_factory.mktemp("cache")))
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


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """`streamlit run app.py` on a free port; yields (base url, checkpoint folder)."""
    chromium_path()
    ckpt = Path(os.environ.get("RECUR_BROWSER_CHECKPOINT") or tiny_ckpt).resolve()
    with streamlit_server(ckpt, tmp_path_factory, os.environ.get("RECUR_BROWSER_CHECKPOINTS", "")) as base:
        yield base, ckpt


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("the playwright package is missing (it is in the dev extra: pip install -e .[dev])")
        pytest.skip("the playwright package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ["RECUR_SCREENSHOTS"]) if os.environ.get("RECUR_SCREENSHOTS") else \
        tmp_path_factory.mktemp("screenshots")
    folder = folder if folder.is_absolute() else ROOT / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- waiting on the page -------------------------------------------------------------------------------
def wait_idle(page) -> None:
    """The script run is over, no background computation is showing progress (ui/jobs.py: the page
    reruns with its full results when one ends) and every chart has drawn (no skeletons left)."""
    page.wait_for_selector(IDLE, timeout=RUN_TIMEOUT_MS)
    page.wait_for_function("""() => {
        const charts = document.querySelectorAll("[data-testid='stPlotlyChart']");
        const drawn = Array.from(charts).every(c => c.querySelector('.js-plotly-plot .main-svg'));
        return drawn && !document.querySelector("[data-testid='stSkeleton']")
            && !document.querySelector("[data-testid='stProgress']");
    }""", timeout=RUN_TIMEOUT_MS)
    page.wait_for_selector(IDLE, timeout=RUN_TIMEOUT_MS)


def open_page(page, title: str) -> None:
    """Click a page in the sidebar navigation and wait for it to finish running."""
    page.locator("[data-testid='stSidebarNavLink']", has_text=title).first.click()
    page.wait_for_selector(f"h1:has-text('{title}')", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)


def move_eps(page, key: str) -> None:
    """Press a key on the ε slider and wait until the run for the new value is over: the page's
    "ε (current point)" metric shows the slider's new value and the script is idle."""
    handle = page.locator(SLIDER).first
    old = handle.get_attribute("aria-valuetext")
    handle.focus()
    handle.press(key)
    page.wait_for_function(f"""() => {{
        const h = document.querySelector("{SLIDER}");
        const m = document.querySelector("[data-testid='stMetricValue']");
        const v = h && h.getAttribute('aria-valuetext');
        return v && v !== {old!r} && m && m.innerText.trim() === v && !!document.querySelector("{IDLE}");
    }}""", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)


CURRENT_POINT_JS = """() => {
    for (const div of document.querySelectorAll('.js-plotly-plot')) {
        for (const t of (div.data || [])) {
            if ((t.name || '').startsWith('current')) return [t.x[0], t.y[0]];
        }
    }
    return null;
}"""


def snap(page, path: Path) -> None:
    """Screenshot of the whole page: the viewport is fitted to the content's height first."""
    height = page.evaluate("""() => {
        const main = document.querySelector("[data-testid='stMainBlockContainer']") ||
                     document.querySelector("[data-testid='stMain']");
        return main ? main.scrollHeight : document.body.scrollHeight;
    }""")
    page.evaluate("() => document.activeElement && document.activeElement.blur()")  # no focus ring in the image
    page.set_viewport_size({"width": 1440, "height": max(900, min(int(height) + 40, 6000))})
    wait_idle(page)
    page.screenshot(path=str(path), full_page=True)


def expected_ids(ckpt: Path, text: str) -> list[int]:
    """The token ids the app analyses: the text as the checkpoint's task reads it, within the model's context."""
    import json

    from tokenizers import Tokenizer

    from recur_core.tasks import task_of
    max_len = json.loads((ckpt / "config.json").read_text())["max_seq_len"]
    task = task_of(json.loads((ckpt / "meta.json").read_text()))
    return list(task.read(Tokenizer.from_file(str(ckpt / "tokenizer.json")), text).ids[:max_len])


def strip_selector(ckpt: Path, text: str) -> str:
    """CSS selector of the token strip of exactly this text (a stale strip of another text won't match)."""
    from ui.strip import ids_key
    ids = expected_ids(ckpt, text)
    return f"[data-testid='token-strip'][data-n-tokens='{len(ids)}'][data-ids='{ids_key(ids)}']"


def test_app_in_chromium(server, browser, shots):
    base, ckpt = server
    page = browser.new_page(viewport={"width": 1440, "height": 2200})
    page.goto(base + "/")
    page.wait_for_selector("h1:has-text('Token exit depths')", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)

    # paste a prompt and submit the form (Ctrl+Enter); wait for its strip
    n = len(expected_ids(ckpt, PROMPT))
    box = page.locator("textarea[aria-label='Text']")
    box.fill(PROMPT)
    box.press("Control+Enter")
    page.wait_for_selector(strip_selector(ckpt, PROMPT), timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    tokens = page.locator("[data-testid='token-strip'] [data-testid='token']")
    assert tokens.count() == n
    depths = [int(tokens.nth(i).get_attribute("data-depth")) for i in range(n)]
    assert depths == engine_depths(ckpt, PROMPT, 1e-3)[0].tolist()  # the default ε is 1e-3
    assert "exit depth" in (tokens.first.get_attribute("title") or "")  # the tooltip
    assert page.evaluate("""() => Array.from(document.querySelectorAll('.js-plotly-plot'))
        .some(d => (d.data || []).some(t => t.type === 'heatmap'))""")
    snap(page, shots / "token_exit_depths.png")
    word_problem_produced(page, ckpt, shots)

    # the depth / loss curve: move the ε slider with the keyboard, the highlighted point moves
    open_page(page, "Depth / loss curve")
    before = page.evaluate(CURRENT_POINT_JS)
    assert before is not None
    snap(page, shots / "depth_loss_curve.png")
    handle = page.locator(SLIDER).first
    default = handle.get_attribute("aria-valuetext")
    after = before
    for _ in range(16):  # up to 4 decades looser, one stop (¼ decade) per key press, until the point moves
        move_eps(page, "ArrowRight")
        after = page.evaluate(CURRENT_POINT_JS)
        if after != before:
            break
    assert after != before and after[0] < before[0]  # fewer mean loops at a looser threshold
    while handle.get_attribute("aria-valuetext") != default:  # back to the default ε for the screenshots
        move_eps(page, "ArrowLeft")
    assert page.evaluate(CURRENT_POINT_JS) == before

    for title, name in (("Compare policies", "compare_policies"), ("Convergence", "convergence"),
                        ("Token classes", "token_classes"), ("Elasticity & saturation", "elasticity"),
                        ("Training run", "training_run")):
        open_page(page, title)
        assert not page.locator("[data-testid='stException']").count(), title
        snap(page, shots / f"{name}.png")
    page.close()


def word_problem_produced(page, ckpt: Path, shots: Path) -> None:
    """The checkpoint's first word-problem example (its task's: a terse mixture's own problems), each token
    coloured by the loops that produced it (the README's word-problem image): token t shows position t - 1's
    exit, the first token none."""
    import json

    from recur_core.tasks import task_of
    from ui.views import COLOUR_BY
    examples = task_of(json.loads((ckpt / "meta.json").read_text())).text_examples(None, None, 8)
    problem = next(t for name, t in examples.items() if name.startswith("Word problem"))
    box = page.locator("textarea[aria-label='Text']")
    box.fill(problem)
    box.press("Control+Enter")
    page.wait_for_selector(strip_selector(ckpt, problem), timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    page.locator("button", has_text=COLOUR_BY["produced"]).click()
    page.wait_for_function("""() => {
        const t = document.querySelector("[data-testid='token-strip'] [data-testid='token']");
        return t && (t.getAttribute('title') || '').includes('no position before it');
    }""", timeout=RUN_TIMEOUT_MS)
    wait_idle(page)
    tokens = page.locator("[data-testid='token-strip'] [data-testid='token']")
    depths = [int(tokens.nth(i).get_attribute("data-depth")) for i in range(tokens.count())]
    assert depths[1:] == engine_depths(ckpt, problem, 1e-3)[0].tolist()[:-1]
    snap(page, shots / "word_problem.png")
    page.locator("button", has_text=COLOUR_BY["reading"]).click()
    wait_idle(page)


def test_two_tabs_at_once(server, browser):
    """Two tabs submit different texts at the same moment; each gets its own, correct strip."""
    base, ckpt = server
    texts = ["Ben found 2 cakes.", "The cat sat on the mat with Mia and Sam."]
    tabs = [browser.new_page(viewport={"width": 1200, "height": 1400}) for _ in texts]
    for tab in tabs:
        tab.goto(base + "/")
        tab.wait_for_selector("h1:has-text('Token exit depths')", timeout=RUN_TIMEOUT_MS)
        wait_idle(tab)
    for tab, text in zip(tabs, texts, strict=True):
        tab.locator("textarea[aria-label='Text']").fill(text)
    for tab in tabs:  # submit both before waiting for either
        tab.locator("textarea[aria-label='Text']").press("Control+Enter")
    for tab, text in zip(tabs, texts, strict=True):
        n = len(expected_ids(ckpt, text))
        tab.wait_for_selector(strip_selector(ckpt, text), timeout=RUN_TIMEOUT_MS)
        wait_idle(tab)
        tokens = tab.locator("[data-testid='token-strip'] [data-testid='token']")
        assert [int(tokens.nth(i).get_attribute("data-depth")) for i in range(n)] == \
            engine_depths(ckpt, text, 1e-3)[0].tolist()
        tab.close()
