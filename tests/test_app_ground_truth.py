"""The Ground truth page under AppTest, on a tiny model trained for seconds on multi-hop programs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_app import settle, tooltips

from recur_core.tasks.hops import hop_counts

TIMEOUT = 300


@pytest.fixture(scope="module")
def hops_env(tiny_ckpt, hops_ckpt, hops_app_cache, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECUR_CHECKPOINT", str(hops_ckpt))
        mp.setenv("RECUR_CHECKPOINTS", str(tiny_ckpt))
        mp.setenv("RECUR_CACHE_DIR", str(hops_app_cache))
        mp.setenv("RECUR_SHIPPED", str(tmp_path_factory.mktemp("no_shipped_checkpoints")))
        yield {"hops": Path(hops_ckpt).resolve(), "tiny": Path(tiny_ckpt).resolve()}


def open_page() -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=TIMEOUT)
    at.run()
    at.switch_page("pages/ground_truth.py").run()
    settle(at)  # the eval trace runs in the background
    if "gt_start_exact" in button_keys(at):
        at.button(key="gt_start_exact").click().run()  # the exact figures start when asked
    return settle(at)


def button_keys(at: AppTest) -> set[str]:
    return {b.key for b in at.button}


def programs(at: AppTest, env) -> list[str]:
    return [ex.text for ex in at.session_state[f"gt_programs@{env['hops']}"]]


def test_ground_truth_page_plots_and_tooltips(hops_env):
    at = open_page()
    assert not at.error
    figs = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
    boxes = next(f for f in figs if any(t.get("type") == "box" for t in f["data"]))
    # A1, latent, A2 per trained label kind (a kind whose labels are one class is refused), Huginn's
    # four other criteria, Accel and the certified exit at the checkpoint's measured L (issue 48)
    assert 8 <= len(boxes["data"]) <= 12
    from recur_core.exits import catalogue
    shown = {t["name"].split(" · ")[0] for t in boxes["data"]}
    assert {catalogue.display("Accel"), catalogue.display("Certified")} <= shown, shown
    lines = next(f for f in figs if f["layout"]["title"]["text"].startswith("Answer accuracy against loops"))
    assert len(lines["data"]) == 4  # hop counts 1..3 trained, 4 unseen
    assert any(m.label.startswith("Spearman") for m in at.metric)
    # exact by default, the gap to the fast path in words; people's names and one colour per policy
    assert at.segmented_control(key="gt_path").value == "exact"
    assert any("Under real halting" in md.value and "full depth" in md.value for md in at.markdown)
    names = [t["name"] for t in boxes["data"]]
    assert not any("_" in n.split(" · ")[0] for n in names), names
    colors = [t["marker"]["color"] for t in boxes["data"]]
    assert len(set(colors)) == len(colors)
    # the picked program's `?` tokens say their answer's hop count, as the parser computes it
    program = at.selectbox(key="gt_pick").value
    text = programs(at, hops_env)[program]
    expected = [h for h in hop_counts(text) if h]
    notes = [int(m) for t in tooltips(at) for m in re.findall(r"predicts an answer (\d+) hops? deep", t)]
    assert notes == expected and notes
    assert not any("1 hops" in t for t in tooltips(at))
    answers = at.dataframe[-1].value
    assert list(answers["right"].str[2:].unique()) != [] and set(answers["right"].str[2:]) <= {"right", "wrong"}
    assert (answers["right"].str.endswith("right") == (answers["prediction"].str.strip()
                                                          == answers["answer"].str.strip())).all()
    # the program's strip follows the page's path: real decoding keeps no KL at exit, the trace does
    kl_lines = lambda: sum("at exit" in t and "KL" in t for t in tooltips(at))  # noqa: E731
    assert kl_lines() == 0
    at.segmented_control(key="gt_path").set_value("fast").run()
    assert any("fast path" in c.value for c in at.caption)
    assert kl_lines() == len(tooltips(at))


def test_new_random_program_has_the_chosen_max_hop_count(hops_env):
    at = open_page()
    n = len(programs(at, hops_env))
    at.number_input(key="gt_max_hops").set_value(3).run()
    at.button(key="gt_new").click().run()
    assert not at.exception
    assert len(programs(at, hops_env)) == n + 1 and at.selectbox(key="gt_pick").value == n
    assert max(hop_counts(programs(at, hops_env)[n])) == 3
    notes = [int(m) for t in tooltips(at) for m in re.findall(r"predicts an answer (\d+) hops? deep", t)]
    assert max(notes) == 3


def test_checkpoint_without_ground_truth_says_so(hops_env):
    at = AppTest.from_file("../app.py", default_timeout=TIMEOUT)
    at.run()
    at.selectbox(key="checkpoint_path").set_value(str(hops_env["tiny"])).run()
    at.switch_page("pages/ground_truth.py").run()
    assert not at.exception
    assert any("no ground truth" in i.value for i in at.info)


def test_the_exact_figures_start_only_when_asked(hops_env, tmp_path, monkeypatch):
    """With nothing computed, the page shows the fast path, says the exact figures take long and
    starts nothing until its button is pressed (issue 49, item 2)."""
    from ui import ground_truth, jobs
    from ui.handle import Handle
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path))  # nothing computed yet
    monkeypatch.setattr(jobs, "_JOBS", {})
    monkeypatch.setattr(ground_truth, "_EXACT_READY", set())
    at = AppTest.from_file("../app.py", default_timeout=TIMEOUT)
    at.run()
    at.switch_page("pages/ground_truth.py").run()
    settle(at)
    key = ground_truth.exact_key(Handle.open(str(hops_env["hops"]), "cpu"))
    assert jobs.get(key) is None
    assert any("take long" in w.value and "rules from its fast operating point" in w.value for w in at.warning)
    assert not any("Under real halting" in md.value for md in at.markdown)  # the fast path meanwhile
    at.button(key="gt_start_exact").click().run()
    assert jobs.get(key) is not None
    settle(at)
    assert any("Under real halting" in md.value for md in at.markdown)
