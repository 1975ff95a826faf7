"""The Streamlit app under streamlit.testing.v1.AppTest: every page on the tiny checkpoint.

The app is pointed at the session's `tiny_ckpt` through $RECUR_CHECKPOINT, with its trace cache in a
temporary folder. Token strips are checked against the engine (recur_core's trace + A1 policy)
computed here independently; Plotly figures through their JSON specs.
"""
from __future__ import annotations

import base64
import html
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

TIMEOUT = 300  # seconds per script run: first runs trace and train the A2 probes (CPU shared with training)
PAGES = ("exits", "compare", "curve", "convergence", "classes", "elasticity", "overthinking", "training")


@pytest.fixture(scope="module")
def app_env(tiny_ckpt, tmp_path_factory):
    """Environment of the app: the tiny checkpoint as default, a private cache, bad folders listed."""
    bad_root = tmp_path_factory.mktemp("bad_ckpts")
    (bad_root / "corrupt").mkdir()
    (bad_root / "corrupt" / "meta.json").write_text("{ not json")
    (bad_root / "corrupt" / "model.safetensors").write_bytes(b"\x80garbage")
    truncated = bad_root / "truncated"
    truncated.mkdir()
    for name in ("meta.json", "config.json", "tokenizer.json"):
        (truncated / name).write_bytes((Path(tiny_ckpt) / name).read_bytes())
    (truncated / "model.safetensors").write_bytes((Path(tiny_ckpt) / "model.safetensors").read_bytes()[:200])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECUR_CHECKPOINT", str(tiny_ckpt))
        mp.setenv("RECUR_CHECKPOINTS", os.pathsep.join([str(bad_root), str(bad_root / "missing")]))
        mp.setenv("RECUR_CACHE_DIR", str(tmp_path_factory.mktemp("trace_cache")))
        mp.setenv("RECUR_SHIPPED", str(tmp_path_factory.mktemp("no_shipped_checkpoints")))  # hermetic
        yield {"ckpt": Path(tiny_ckpt).resolve(), "corrupt": (bad_root / "corrupt").resolve(),
               "truncated": truncated.resolve(), "missing": (bad_root / "missing").resolve()}


def new_app() -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def settle(at: AppTest) -> AppTest:
    """Rerun until no background job (ui/jobs.py) is left: the page then shows its full results."""
    from ui import jobs
    while True:
        assert not at.exception, [e.message for e in at.exception]
        if not any(job.running for job in list(jobs._JOBS.values())):
            return at
        assert jobs.wait_all(TIMEOUT)
        at.run()


def goto(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return settle(at)


def submit_text(at: AppTest, text: str) -> AppTest:
    at.text_area[0].input(text)
    at.form_submit_button[0].click().run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def strips(at: AppTest) -> list[list[dict]]:
    """Every token strip on the page: a list of {pos, depth, converged} per token."""
    out = []
    for el in at.html:
        body = el.proto.body
        if 'data-testid="token-strip"' not in body:
            continue
        spans = re.findall(r'<span data-testid="token" data-pos="(\d+)" data-depth="(\d+)" data-converged="(\w+)"', body)
        out.append([{"pos": int(p), "depth": int(d), "converged": c == "true"} for p, d, c in spans])
    return out


def tooltips(at: AppTest) -> list[str]:
    """The native tooltips (title attributes) of the page's first token strip, unescaped."""
    body = next(el.proto.body for el in at.html if 'data-testid="token-strip"' in el.proto.body)
    return [html.unescape(t) for t in re.findall(r'title="([^"]*)"', body)]


def figures(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def figure_with(at: AppTest, trace_type: str) -> dict:
    return next(f for f in figures(at) if any(t.get("type") == trace_type for t in f["data"]))


def eps_slider(at: AppTest):
    """The page's ε slider (each page has its own widget; the value is shared through session state)."""
    return next(s for s in at.select_slider if s.key.startswith("eps_slider_"))


def engine_depths(ckpt_dir: Path, text: str, eps: float, exact: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A1 exit depths of a text (and whether A1's rule, not r_max, stopped each token) computed directly
    with recur_core, as the app should show them: exact, generate's own exits for the text as a prompt
    decoded token by token ("recompute", the seed the app uses); fast, read off the uniform trace."""
    from recur_core import load_checkpoint
    from recur_core.analysis.trace import trace
    from recur_core.exits.policies import ConvergenceExit
    from recur_core.tasks import task_of

    ckpt = load_checkpoint(ckpt_dir)
    ids = list(task_of(ckpt.meta).read(ckpt.tokenizer(), text).ids[:ckpt.config.max_seq_len])
    r_max = int(ckpt.meta["recipe"]["r_max"])
    policy = ConvergenceExit(eps, r_max=r_max)
    if exact:
        depth = generated_exits(ckpt, ids, policy)
        return depth, depth < r_max
    ex = policy.exits(trace(ckpt, np.array(ids), max(32, r_max), 0, topk=5, cache=False))
    return ex.depth[0], ex.converged[0]


def generated_exits(ckpt, ids: list[int], policy) -> np.ndarray:
    """Each token's exit loop when `generate` decodes the text as a prompt, token by token."""
    from recur_core.decoding.decode import generate
    gen = generate(ckpt, ids, 1, policy, kv_rule="recompute", greedy=True, seed=0,
                   max_loops=max(32, ckpt.recipe.r_max), prefill_chunk=1)
    return np.array(gen.prompt_exit_loops)


TEXT = "Lily saw 3 cats.\n\"Look!\" said Tom."


# -- page 1: token exit depths ------------------------------------------------------------------------------
def test_exit_strip_matches_engine_and_slider_changes_it(app_env):
    at = submit_text(new_app(), TEXT)
    [strip] = strips(at)
    depth, converged = engine_depths(app_env["ckpt"], TEXT, 1e-3)
    assert len(strip) == len(depth)  # one element per token
    assert [t["depth"] for t in strip] == depth.tolist()
    assert [t["converged"] for t in strip] == converged.tolist()

    eps_slider(at).set_value(0.0).run()  # eps = 1: most tokens stop at loop 1
    [strip_loose] = strips(at)
    loose, _ = engine_depths(app_env["ckpt"], TEXT, 1.0)
    assert [t["depth"] for t in strip_loose] == loose.tolist()
    assert sum(loose) < sum(depth)


def test_strip_coloured_by_the_loops_that_produced_each_token(app_env):
    """"produced": token t shows the exit of position t - 1 (which predicted it), the first token none;
    the choice is kept on the Ground truth page's strip too."""
    at = submit_text(new_app(), TEXT)
    [reading] = strips(at)
    at.segmented_control(key="exits_colour_by").set_value("produced").run()
    [produced] = strips(at)
    assert [t["depth"] for t in produced[1:]] == [t["depth"] for t in reading[:-1]]
    assert [t["converged"] for t in produced[1:]] == [t["converged"] for t in reading[:-1]]
    tips = tooltips(at)
    assert "no position before it" in tips[0] and all("produced at #" in t for t in tips[1:])
    assert 'background:#eeeeee' in next(el.proto.body for el in at.html if 'data-testid="token-strip"' in el.proto.body)
    assert at.session_state["kept:colour_by"] == "produced"
    at.segmented_control(key="exits_colour_by").set_value("reading").run()


def test_exit_page_exact_by_default_and_fast_on_request(app_env):
    """Exact (real decoding) is the default: the A1 loss is decoding's, and the tooltips carry no KL at
    exit (decoding keeps no per-loop signals). Fast reads exits, loss and KL off the uniform trace."""
    from recur_core import load_checkpoint
    from recur_core.analysis.curves import fast_sums
    from recur_core.analysis.exact import ExactPath
    from recur_core.analysis.trace import trace
    from recur_core.exits.policies import ConvergenceExit, Uniform

    ckpt = load_checkpoint(app_env["ckpt"])
    ids, r_max = ckpt.tokenizer().encode(TEXT).ids, ckpt.recipe.r_max
    a1, loops = ConvergenceExit(1e-3, r_max=r_max), max(32, r_max)
    loss = lambda at: next(m.value for m in at.metric if m.label == "Loss (A1)")  # noqa: E731
    kl_lines = lambda at: sum("KL(p_i ‖ p_i−1) at exit" in t for t in tooltips(at))  # noqa: E731
    at = submit_text(new_app(), TEXT)
    assert at.segmented_control(key="text_path_exits").value == "exact"
    decoded = ExactPath(ckpt, ids).decoded_text(a1, loops, 0)
    assert loss(at) == f"{decoded.loss:.3f} nats" and kl_lines(at) == 0
    # the saving is against the smallest uniform depth whose loss on the text reaches A1's
    tr = trace(ckpt, np.array(ids), loops, 0, topk=5, cache=False)
    best = next(r for r in range(1, r_max + 1) if fast_sums(tr, Uniform(r)).mean_loss <= decoded.loss + 1e-4)
    saving = next(m for m in at.metric if m.label.startswith("Loops vs"))
    assert saving.label == f"Loops vs best uniform r = {best}"
    change = decoded.mean_loops / best - 1
    if f"{abs(change):.0%}" == "0%":
        assert saving.value == "as many"
    elif change < 0:
        assert saving.value == f"{-change:.0%} fewer"
    else:  # a loss never reads as a saving
        assert saving.value == f"{change:.0%} more" and "not** a saving" in at.warning[0].value
    at.segmented_control(key="text_path_exits").set_value("fast").run()
    fast, converged = engine_depths(app_env["ckpt"], TEXT, 1e-3, exact=False)
    [strip] = strips(at)
    assert [t["depth"] for t in strip] == fast.tolist() and [t["converged"] for t in strip] == converged.tolist()
    assert loss(at) == f"{fast_sums(tr, a1).mean_loss:.3f} nats" and kl_lines(at) == len(ids)
    goto(at, "compare")  # one choice for both pasted-text pages
    assert at.segmented_control(key="text_path_compare").value == "fast"


def test_exact_decoding_that_takes_long_runs_in_the_background_behind_the_fast_path(app_env):
    """A decoding longer than compute.DECODE_WAIT_S (held here behind the decoding lock) leaves the
    page on the fast path, said in words and in the strip's title, with the decoding's progress; once
    it ends the page shows real decoding's exits."""
    from ui import compute, jobs
    text = "Tom had a red kite. He ran."
    fast, _ = engine_depths(app_env["ckpt"], text, 1e-3, exact=False)
    exact, _ = engine_depths(app_env["ckpt"], text, 1e-3)
    settle(new_app())  # the default text decoded first: below, only this text's decoding waits
    with compute._DECODING:  # another decoding holds the CPU: this one waits its turn
        at = submit_text(new_app(), text)
        [strip] = strips(at)
        assert [t["depth"] for t in strip] == fast.tolist()
        assert any("Exact decoding" in c.value and "fast path" in c.value for c in at.caption)
        assert "fast path (exact decoding running)" in next(el.proto.body for el in at.html
                                                            if 'data-testid="token-strip"' in el.proto.body)
        [job] = [j for j in jobs._JOBS.values() if j.key[0] == "decoded_text" and j.running]
        assert job.stage.startswith("Waiting") and job.total == len(strip)
    settle(at)
    assert job.done == job.total == len(strip) and not job.error
    [strip] = strips(at)
    assert [t["depth"] for t in strip] == exact.tolist()
    assert not any("Exact decoding" in c.value for c in at.caption)


def test_a_finished_decoding_is_shown_when_the_disk_cache_has_moved(app_env, tmp_path, monkeypatch):
    """The decoding job holds its result: a page whose cache directory changed since (another test
    module, a cleared or unwritable cache) shows it instead of rerunning forever on a cache miss."""
    text = "Ann had two hats. She gave one away."
    exact, _ = engine_depths(app_env["ckpt"], text, 1e-3)
    settle(submit_text(new_app(), text))
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path / "moved_cache"))
    at = AppTest.from_file("../app.py", default_timeout=60)
    at.run()
    submit_text(at, text)
    [strip] = strips(at)
    assert [t["depth"] for t in strip] == exact.tolist()
    assert not any("Exact decoding" in c.value for c in at.caption)


def test_strip_coloured_by_regime_and_the_drill_in_shows_the_state(app_env):
    """Issue 48: "its regime" colours each token by recur_core's regime of its uniform run; the drill-in
    states the token's regime and contraction rate and draws its state norm per loop."""
    from recur_core import load_checkpoint
    from recur_core.analysis.dynamics import REGIMES, contraction_rate, token_regimes
    from recur_core.analysis.trace import trace
    ckpt = load_checkpoint(app_env["ckpt"])
    tr = trace(ckpt, np.array(ckpt.tokenizer().encode(TEXT).ids), max(32, ckpt.recipe.r_max), 0, topk=5, cache=False)
    at = submit_text(new_app(), TEXT)
    at.segmented_control(key="exits_colour_by").set_value("regime").run()
    body = next(el.proto.body for el in at.html if 'data-testid="token-strip"' in el.proto.body)
    assert re.findall(r'data-regime="(\w+)"', body) == [REGIMES[c] for c in token_regimes(tr)[0]]
    assert any('data-testid="regime-legend"' in el.proto.body for el in at.html)
    assert all("regime: " in t for t in tooltips(at))
    pos = next(s for s in at.selectbox if s.label == "Token").value
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Regime"] == REGIMES[token_regimes(tr)[0, pos]].capitalize()
    assert float(metrics["Contraction rate ρ"]) == pytest.approx(contraction_rate(tr.state_step[0, pos]), rel=1e-2)
    state = next(f for f in figures(at) if "its state per loop" in f["layout"]["title"]["text"])
    assert plotly_values(state["data"][0]["y"]) == pytest.approx(tr.state_norm[0, pos].tolist(), rel=1e-5)
    at.segmented_control(key="exits_colour_by").set_value("reading").run()


def test_exit_page_heatmap_curves_and_metrics(app_env):
    at = submit_text(new_app(), TEXT)
    heat = figure_with(at, "heatmap")
    assert "KL" in heat["data"][0]["colorbar"]["title"]["text"]
    assert heat["layout"]["yaxis"]["title"]["text"] == "loop i"
    names = [t.get("name", "") for t in heat["data"]]
    assert any(n.startswith("exit loop") for n in names)  # each token's exit loop marked
    curves = next(f for f in figures(at) if f["layout"].get("yaxis", {}).get("type") == "log")
    assert "KL" in curves["layout"]["yaxis"]["title"]["text"]
    labels = [m.label for m in at.metric]
    assert "Mean loops (A1)" in labels and any(lab.startswith("Loops vs") and "uniform" in lab for lab in labels)
    assert len(at.dataframe) >= 1  # logit lens
    picker = next(s for s in at.selectbox if s.label == "Token")
    picker.set_value(2).run()
    assert not at.exception
    assert "#2" in next(f for f in figures(at) if "Token #" in f["layout"]["title"]["text"])["layout"]["title"]["text"]


def test_empty_text_shows_a_hint(app_env):
    at = submit_text(new_app(), "   ")
    assert any("empty" in i.value for i in at.info)
    assert not strips(at) and not at.error


def test_long_text_is_truncated_with_a_notice(app_env):
    at = submit_text(new_app(), "Tom saw a big red ball. " * 20)
    assert any("truncated" in w.value for w in at.warning)
    [strip] = strips(at)
    assert len(strip) == 32  # the tiny model's context


# -- page 2: depth / loss curve ------------------------------------------------------------------------------
def curve_figure(at: AppTest) -> dict:
    return next(f for f in figures(at) if f["layout"]["xaxis"]["title"]["text"] == "mean loops per token")


def highlighted(fig: dict) -> tuple[float, float]:
    point = next(t for t in fig["data"] if t.get("name", "").startswith("current"))
    return point["x"][0], point["y"][0]


def test_curve_page_policies_and_slider(app_env):
    at = goto(new_app(), "curve")
    at.segmented_control(key="curve_view").set_value("absolute").run()
    fig = curve_figure(at)
    names = {t["name"] for t in fig["data"] if t.get("mode") == "lines+markers"}
    assert names == {"A0 uniform depth", "A1 convergence exit (KL < ε)", "A2 router (argmax labels)",
                     "A2 router (KL labels)", "A2 router (argmax, any later loop)",
                     "A2 router (KL, any later loop)", "latent rule (Huginn)",
                     "Accel (second-order step size)", "Certified exit (sufficient condition)"}  # one curve per policy
    assert fig["layout"]["yaxis"]["title"]["text"] == "loss [nats/token]"
    assert any(t.get("fill") == "toself" for t in fig["data"])  # bootstrap bands
    before = highlighted(fig)
    eps_slider(at).set_value(-1.0).run()
    after = highlighted(curve_figure(at))
    assert after != before
    a1 = next(t for t in curve_figure(at)["data"] if t.get("name", "").startswith("A1 convergence"))
    assert any(math.isclose(after[0], x) and math.isclose(after[1], y) for x, y in zip(a1["x"], a1["y"], strict=True))
    assert len(at.dataframe) >= 1  # matched-depth table
    assert any(b.label == "⬇ CSV" for b in at.download_button)
    at.toggle(key="bands").set_value(False).run()
    assert not any(t.get("fill") == "toself" for t in curve_figure(at)["data"])
    # the headline's baseline is the best uniform depth, as on Token exit depths (issue 49, item 5)
    loops = next(m for m in at.metric if m.label == "Mean loops (A1)")
    assert "best uniform r =" in loops.proto.delta or "below every uniform" in loops.proto.delta
    assert "r̄" not in loops.proto.delta and "r̄" in loops.help
    match = next(m for m in at.metric if m.label.startswith("A1 loops to match"))
    assert "r̄" not in match.proto.delta and "best uniform depth" in match.help


def test_curve_page_defaults_to_paired_differences_from_a0(app_env):
    at = goto(new_app(), "curve")
    assert at.segmented_control(key="curve_view").value == "diff"
    fig = curve_figure(at)
    assert "A0" in fig["layout"]["yaxis"]["title"]["text"]
    curves = {t["name"]: t for t in fig["data"] if t.get("mode") == "lines+markers"}
    assert "A0 uniform depth" not in curves and "A1 convergence exit (KL < ε)" in curves  # A0 is the zero line
    at.segmented_control(key="curve_view").set_value("absolute").run()
    absolute = {t["name"]: t for t in curve_figure(at)["data"] if t.get("mode") == "lines+markers"}
    a0 = absolute["A0 uniform depth"]
    x0, y0 = plotly_values(a0["x"]), plotly_values(a0["y"])
    a1 = absolute["A1 convergence exit (KL < ε)"]
    diff = curves["A1 convergence exit (KL < ε)"]
    for x, y, d in zip(plotly_values(a1["x"]), plotly_values(a1["y"]), plotly_values(diff["y"]), strict=True):
        if x0[0] <= x <= x0[-1]:  # each point minus A0 interpolated at the same mean loops
            assert d == pytest.approx(y - np.interp(x, x0, y0), abs=1e-9)


def test_curve_slider_only_looks_the_sweep_up(app_env, monkeypatch):
    from recur_core.analysis import allocation as alloc
    calls = []
    real = alloc.allocation
    monkeypatch.setattr(alloc, "allocation", lambda *a, **k: calls.append(1) or real(*a, **k))
    at = goto(new_app(), "curve")
    swept = len(calls)  # 0 when an earlier test already filled the cache, else 1
    assert swept <= 1
    for value in (-5.0, -2.0, 0.5):
        eps_slider(at).set_value(value).run()
        assert not at.exception
    assert len(calls) == swept


def test_eps_is_shared_between_pages(app_env):
    at = goto(new_app(), "curve")
    eps_slider(at).set_value(-5.0).run()
    goto(at, "exits")
    assert eps_slider(at).value == -5.0
    assert all('data-policy="A1 ε=1.0e-05"' in h.proto.body for h in at.html if "token-strip" in h.proto.body)


def test_curve_page_exact_mode_on_eval_windows(app_env):
    at = goto(new_app(), "curve")
    at.segmented_control(key="eval_mode").set_value("exact").run()
    at.select_slider(key="exact_windows").set_value(4).run()
    settle(at)  # the exact sweep runs in the background; the page reruns with it
    fig = curve_figure(at)
    assert "4 window(s), exact" in fig["layout"]["title"]["text"]
    # A0 is the zero line; A1, four A2 routers, the latent rule, Accel and the certified exit (issue 48)
    assert len({t["name"] for t in fig["data"] if t.get("mode") == "lines+markers"}) == 8
    assert len(at.dataframe) >= 2  # matched depth (exact) + fast - exact per policy


def test_curve_page_exact_mode_on_pasted_text(app_env):
    at = submit_text(new_app(), TEXT)
    goto(at, "curve")
    at.segmented_control(key="source").set_value("text").run()
    at.segmented_control(key="eval_mode").set_value("exact").run()
    at.segmented_control(key="curve_view").set_value("absolute").run()
    settle(at)
    fig = curve_figure(at)
    assert {"A0 uniform depth", "A1 convergence exit (KL < ε)"} <= {t["name"] for t in fig["data"]}
    assert "exact" in fig["layout"]["title"]["text"]
    assert len(at.dataframe) >= 1  # fast vs exact table


# -- page 3: compare policies ------------------------------------------------------------------------------
def test_compare_page_three_strips(app_env):
    from recur_core import load_checkpoint
    from recur_core.analysis.trace import trace
    from recur_core.exits.policies import ArgmaxStable
    at = submit_text(new_app(), TEXT)
    goto(at, "compare")
    at.slider(key="cmp_r").set_value(2).run()
    at.selectbox(key="cmp_huginn").set_value("argmax-stability").run()
    a0, a1, a2, huginn = strips(at)
    depth, _ = engine_depths(app_env["ckpt"], TEXT, 1e-3)
    assert len(a0) == len(a1) == len(a2) == len(huginn) == len(depth)
    assert {t["depth"] for t in a0} == {2}
    assert [t["depth"] for t in a1] == depth.tolist()
    ckpt = load_checkpoint(app_env["ckpt"])
    r_max = int(ckpt.meta["recipe"]["r_max"])
    ids = ckpt.tokenizer().encode(TEXT).ids
    assert [t["depth"] for t in huginn] == generated_exits(ckpt, ids, ArgmaxStable(5, r_max=r_max)).tolist()
    at.segmented_control(key="text_path_compare").set_value("fast").run()
    tr = trace(ckpt, np.array(ids), max(32, r_max), 0, topk=5, cache=False)
    assert [t["depth"] for t in strips(at)[3]] == ArgmaxStable(5, r_max=r_max).exit_depth(tr)[0].tolist()
    assert len(at.metric) == 8  # mean loops and loss per policy, Huginn's criterion included


def test_compare_page_accel_and_the_certified_exit_beside_a1(app_env):
    """Accel and the certified exit (issue 48) are criteria on Compare: their strips are real decoding's
    exits; the certified exit's knob opens on the checkpoint's measured L (stated in its help)."""
    from recur_core import load_checkpoint
    from recur_core.analysis.certify import measured_lipschitz
    from recur_core.exits.policies import Accel, CertifiedExit
    ckpt = load_checkpoint(app_env["ckpt"])
    r_max, ids = ckpt.recipe.r_max, ckpt.tokenizer().encode(TEXT).ids
    at = goto(submit_text(new_app(), TEXT), "compare")
    at.selectbox(key="cmp_huginn").set_value("Accel").run()
    assert [t["depth"] for t in strips(at)[3]] == generated_exits(ckpt, ids, Accel(1e-2, r_max=r_max)).tolist()
    at.selectbox(key="cmp_huginn").set_value("Certified").run()
    lip = measured_lipschitz(ckpt, max(32, r_max), 0)
    knob = at.number_input(key="cmp_huginn_Certified")
    assert knob.value == pytest.approx(lip["lipschitz"]) and "probe windows" in knob.help
    certified = generated_exits(ckpt, ids, CertifiedExit(lip["lipschitz"], r_max=r_max))
    assert [t["depth"] for t in strips(at)[3]] == certified.tolist()
    knob.set_value(0.0).run()  # L = 0: halt wherever the steps shrink (a looser rule)
    loose = [t["depth"] for t in strips(at)[3]]
    assert loose == generated_exits(ckpt, ids, CertifiedExit(0.0, r_max=r_max)).tolist()
    assert sum(loose) <= sum(certified)


# -- pages 4 - 7 -------------------------------------------------------------------------------------------
def test_convergence_page(app_env):
    at = goto(new_app(), "convergence")
    figs = figures(at)
    assert len(figs) == 5  # KL, state change, moving, exit depths, and the hidden-state norm (issue 48)
    log_axes = [f for f in figs if f["layout"]["yaxis"].get("type") == "log"]
    assert any("KL" in f["layout"]["yaxis"]["title"]["text"] for f in log_axes)
    assert any(m.label == "Median convergence loop" for m in at.metric)
    norm = next(f for f in figs if f["layout"]["yaxis"]["title"]["text"] == "‖s_i‖")
    assert len(norm["data"][-1]["y"]) >= 32 and min(norm["data"][-1]["y"]) > 0  # one mean per loop
    shares = [float(m.value.rstrip("%")) for m in at.metric if m.label in ("Settling", "Marginal", "Drifting")]
    assert len(shares) == 3 and sum(shares) == pytest.approx(100, abs=0.2)


def test_overthinking_on_the_eval_set_starts_when_asked_and_matches_recur_core(app_env):
    """Issue 48: the sweep past r_max on the eval windows is a background job started by a button; its
    loss per loop is recur_core's (analyze --overthinking's figures)."""
    from recur_core import load_checkpoint
    from recur_core.analysis.dynamics import overthinking, overthinking_loops
    from recur_core.analysis.stats import Bootstrap
    from recur_core.analysis.trace import trace
    from ui.handle import Handle
    at = goto(new_app(), "overthinking")
    assert at.button(key="ot_start") and Handle.open(str(app_env["ckpt"]), "cpu").overthinking_job(None) is None
    at.button(key="ot_start").click().run()
    settle(at)
    ckpt = load_checkpoint(app_env["ckpt"])
    loops = overthinking_loops(ckpt.recipe.r_max)
    tr = trace(ckpt, ckpt.windows("eval")[:128], loops, 0, cache=False)
    ov = overthinking(tr, Bootstrap(tr.n_windows, 1000, 0), ckpt.recipe.r_max)
    assert not at.error, [e.value for e in at.error]
    fig = next(f for f in figures(at) if "past r_max" in f["layout"]["title"]["text"])
    line = fig["data"][1]
    assert plotly_values(line["x"]) == list(range(1, loops + 1))
    assert plotly_values(line["y"]) == pytest.approx(ov["loss"], rel=1e-5)
    assert {m.label: m.value for m in at.metric}["Best depth"] == f"{ov['best_loop']} loops"


def test_overthinking_on_the_pasted_text_shows_each_tokens_answer_flips(app_env):
    from recur_core import load_checkpoint
    from recur_core.analysis.dynamics import answer_flips, overthinking_loops
    from recur_core.analysis.trace import trace
    ckpt = load_checkpoint(app_env["ckpt"])
    ids = ckpt.tokenizer().encode(TEXT).ids
    at = goto(submit_text(new_app(), TEXT), "overthinking")
    at.segmented_control(key="source").set_value("text").run()
    settle(at)
    flips, last = answer_flips(trace(ckpt, np.array(ids), overthinking_loops(ckpt.recipe.r_max), 0, cache=False))
    table = at.dataframe[0].value
    assert table["answer flips"].tolist() == flips[0].tolist() and table["last flip at loop"].tolist() == last[0].tolist()
    at.segmented_control(key="source").set_value("eval").run()


def test_an_overthinking_sweep_past_the_memory_available_is_refused_naming_the_limit(app_env, monkeypatch):
    from ui import jobs
    monkeypatch.setenv("RECUR_MEMORY_LIMIT", "100000")  # 100 kB
    before = dict(jobs._JOBS)
    at = goto(new_app(), "overthinking")
    assert "refused" in at.error[0].value and "RECUR_MEMORY_LIMIT" in at.error[0].value
    assert not any(b.key == "ot_start" for b in at.button) and dict(jobs._JOBS) == before  # before any work


def test_classes_page(app_env):
    at = goto(new_app(), "classes")
    bars = figure_with(at, "bar")
    assert bars["layout"]["yaxis"]["title"]["text"] == "mean exit depth [loops]"
    assert "error_y" in bars["data"][0]
    assert len(at.dataframe) >= 2  # class summary + the tokens of a class


def test_elasticity_page(app_env):
    at = goto(new_app(), "elasticity")
    fig = figures(at)[0]
    curve = next(t for t in fig["data"] if t.get("mode") == "lines+markers")
    assert list(curve["x"]) == list(range(1, 33))  # loss at 1..32 loops
    assert any("r̄" in str(t.get("text", "")) for t in fig["data"])  # r_bar marked


def plotly_values(v) -> list:
    """A trace's values from the figure JSON (plotly writes numeric arrays as base64 "bdata")."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v)


def test_training_page(app_env):
    at = goto(new_app(), "training")
    titles = [f["layout"]["title"]["text"] for f in figures(at)]
    assert "Training loss" in titles and "Eval loss by depth over training" in titles
    assert any(m.label == "Steps" for m in at.metric)
    # the tiny run evals 8 windows at steps 20, 40, 60, then all 128 at step 60: only the periodic
    # ones are drawn as curves, the final one is stated beside them
    evals = next(f for f in figures(at) if f["layout"]["title"]["text"] == "Eval loss by depth over training")
    assert all(len(plotly_values(trace["x"])) == 3 for trace in evals["data"])
    assert any("Final eval on all 128 saved windows (step 60)" in c.value for c in at.caption)
    # the recipe with its sampler mean, and how best/ was chosen (disjoint from the analysed windows)
    assert any("sampler mean 'r_bar'" in c.value and "disjoint" in c.value for c in at.caption)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs(app_env, page):
    at = goto(new_app(), page)
    assert at.title and not at.error


# -- edges ---------------------------------------------------------------------------------------------
def test_bad_checkpoints_show_messages_and_the_app_keeps_working(app_env):
    at = new_app()
    options = at.selectbox(key="checkpoint_path").options
    assert len(options) == 4  # tiny + corrupt + truncated + missing (shipped ones are hidden in tests)
    assert sum(o.startswith("⚠") for o in options) == 2  # the truncated one has a readable meta.json
    for bad, words in (("corrupt", "unreadable"), ("truncated", "safetensors"), ("missing", "no such folder")):
        at.selectbox(key="checkpoint_path").set_value(str(app_env[bad])).run()
        assert not at.exception, [e.message for e in at.exception]
        assert any(words in e.value for e in at.error), (bad, [e.value for e in at.error])
    at.selectbox(key="checkpoint_path").set_value(str(app_env["ckpt"])).run()
    assert not at.error and strips(at)


def test_typed_checkpoint_path(app_env):
    """A typed folder that cannot be used is refused with its reason; the selection, the picker and
    the settings stay as they were. A usable one is added and selected."""
    at = submit_text(new_app(), "Mia had 2 cats.")
    eps_slider(at).set_value(-2.0).run()
    before = at.session_state["checkpoint_path"]
    at.text_input(key="typed_path_input").input(str(app_env["missing"]) + "-typed").run()
    assert any("no such folder" in e.value for e in at.error)
    assert at.session_state["checkpoint_path"] == before
    assert not any("missing-typed" in o for o in at.selectbox(key="checkpoint_path").options)
    assert eps_slider(at).value == -2.0 and at.text_area[0].value == "Mia had 2 cats."
    assert [t["depth"] for t in strips(at)[0]] == engine_depths(app_env["ckpt"], "Mia had 2 cats.", 1e-2)[0].tolist()
    at.text_input(key="typed_path_input").input(str(app_env["ckpt"])).run()
    assert not at.error and at.session_state["checkpoint_path"] == str(app_env["ckpt"])


def test_two_sessions_with_decodings_in_flight_get_their_own_results(app_env):
    """Two sessions submit different texts while neither's exact decoding has run (held behind the
    decoding lock, so both wait in the background at once); each then shows its own text's exits.
    Their script runs take turns: AppTest swaps a process-wide Runtime on every run, so two AppTests
    cannot run in threads at once. Two live tabs on one server: test_browser.py::test_two_tabs_at_once."""
    from ui import compute, jobs
    texts = ["Tom had 3 red balls.", "Mia found a cake with Ben."]
    sessions = [settle(new_app()) for _ in texts]  # the default text decoded first
    with compute._DECODING:
        for at, text in zip(sessions, texts, strict=True):
            submit_text(at, text)
        waiting = [j for j in jobs._JOBS.values() if j.key[0] == "decoded_text" and j.running]
        assert len(waiting) == 2
    for at, text in zip(sessions, texts, strict=True):
        settle(at)
        assert [t["depth"] for t in strips(at)[0]] == engine_depths(app_env["ckpt"], text, 1e-3)[0].tolist()


def test_elasticity_page_compares_checkpoints_by_paired_difference(app_env, tmp_path, monkeypatch):
    import shutil
    copy = tmp_path / "ckpts" / "tiny_copy"
    shutil.copytree(app_env["ckpt"], copy)
    monkeypatch.setenv("RECUR_CHECKPOINTS", str(tmp_path / "ckpts"))
    at = goto(new_app(), "elasticity")
    assert len(at.multiselect(key="elastic_ckpts").value) == 2
    assert at.segmented_control(key="elastic_view").value == "diff"
    fig = figures(at)[0]
    assert "Difference from" in fig["layout"]["title"]["text"]
    [curve] = [t for t in fig["data"] if t.get("mode") == "lines+markers"]
    # the same weights on the same windows: the paired difference is exactly 0 at every depth
    assert plotly_values(curve["y"]) == [0.0] * 32
    at.segmented_control(key="elastic_view").set_value("absolute").run()
    assert "Elasticity" in figures(at)[0]["layout"]["title"]["text"]


def test_elasticity_offers_only_checkpoints_scored_on_the_same_windows(app_env, tmp_path, monkeypatch):
    """"The same task" is the same eval windows and tokenizer, not a data-source string: a copy whose
    windows differ (its meta.json unchanged) is offered only on request, and then with a warning
    (issue 49, item 3)."""
    import shutil

    from safetensors.numpy import load_file, save_file
    copy = tmp_path / "ckpts" / "tiny_other_windows"
    shutil.copytree(app_env["ckpt"], copy)
    windows = load_file(copy / "eval_windows.safetensors")
    save_file({k: np.roll(v, 1, axis=0) for k, v in windows.items()}, copy / "eval_windows.safetensors")
    monkeypatch.setenv("RECUR_CHECKPOINTS", str(tmp_path / "ckpts"))
    at = goto(new_app(), "elasticity")
    assert len(at.multiselect(key="elastic_ckpts").options) == 1  # the same meta.json, other windows
    assert not at.warning
    at.toggle(key="elastic_other_tasks").set_value(True).run()
    picker = at.multiselect(key="elastic_ckpts")
    assert len(picker.options) == 2
    picker.set_value([str(app_env["ckpt"]), str(copy.resolve())]).run()
    settle(at)
    assert any("different eval windows" in w.value for w in at.warning)


def test_text_and_settings_survive_a_page_round_trip(app_env):
    at = submit_text(new_app(), "Ben found 2 cakes.")
    eps_slider(at).set_value(-2.0).run()
    goto(at, "compare")
    at.slider(key="cmp_r").set_value(2).run()
    assert at.text_area[0].value == "Ben found 2 cakes." and eps_slider(at).value == -2.0
    goto(at, "exits")
    assert at.text_area[0].value == "Ben found 2 cakes." and eps_slider(at).value == -2.0
    assert [t["depth"] for t in strips(at)[0]] == engine_depths(app_env["ckpt"], "Ben found 2 cakes.", 1e-2)[0].tolist()
    goto(at, "compare")
    assert at.slider(key="cmp_r").value == 2


def test_metric_deltas_point_the_way_of_the_change_and_colour_its_meaning():
    from ui.views import delta
    slower = delta(-0.24, ".0%", "faster than uniform", "slower than uniform", "higher", "as fast")
    assert slower == {"delta": "24% slower than uniform", "delta_arrow": "down", "delta_color": "inverse"}  # red
    more_loops = delta(3.36, ".2f", "more loops", "fewer loops", "lower", "as many loops")
    assert more_loops == {"delta": "3.36 more loops", "delta_arrow": "down", "delta_color": "inverse"}
    fewer_loops = delta(-0.45, ".2f", "more loops", "fewer loops", "lower", "as many loops")
    assert fewer_loops == {"delta": "0.45 fewer loops", "delta_arrow": "up", "delta_color": "normal"}  # green
    assert delta(0.00004, ".3f", "worse", "better", "lower", "as good") == \
        {"delta": "as good", "delta_arrow": "off", "delta_color": "off"}


def test_saving_vs_uniform_never_reads_a_loss_as_a_win():
    """Issue 39: 3.58 mean loops against a best uniform depth of 2 is a cost, said in words; issue 49:
    short values (a metric cuts long ones off), r̄'s comparison beside it, and a policy below every
    uniform depth's loss says so instead of "—"."""
    from ui.views import saving_vs_uniform
    cost = saving_vs_uniform(3.58, 2, 8, 4)
    assert cost.label == "Loops vs best uniform r = 2" and cost.value == "79% more"
    assert "not** a saving" in cost.warning and "3.58" in cost.warning and "2 loops" in cost.warning
    assert cost.vs_r_bar["delta"] == "10% fewer loops than r̄ = 4"
    win = saving_vs_uniform(3.0, 4, 8, 8)
    assert win.label == "Loops vs best uniform r = 4" and win.value == "25% fewer" and win.warning is None
    assert win.vs_r_bar["delta"] == "62% fewer loops than r̄ = 8"
    assert saving_vs_uniform(4.001, 4, 8, 4).value == "as many"
    assert saving_vs_uniform(2.0, None, 8, 4).value == "beats all r ≤ 8"
    assert all(len(s.value) <= 16 for s in (cost, win))


def test_tables_never_show_the_word_none():
    """st.dataframe prints missing values as "None"; the app's tables show "n/a" (issue 49, item 6)."""
    import pandas as pd

    from ui.download import readable
    shown = readable(pd.DataFrame({"x best uniform": [1.5, None], "labels": ["kl", None], "n": [3, 4]}))
    assert shown["x best uniform"].tolist() == ["1.5", "n/a"] and shown["labels"].tolist() == ["kl", "n/a"]
    assert shown["n"].tolist() == [3, 4]  # complete columns stay numbers


def test_small_probabilities_do_not_round_to_zero():
    """A hops program's near-uniform predictions (≈ 0.002 over 3,352 tokens) read as such (issue 49)."""
    from ui.views import probability
    assert probability(0.00232) == "0.232%" and probability(0.953) == "95.3%" and probability(1.0) == "100%"


def test_the_last_token_neither_sets_the_colour_scale_nor_opens_the_drill_in():
    """The last token has no next token to score: its depth (8 here) is left out of the scale and of
    the drill-in's default pick (issue 49, item 6)."""
    import pandas as pd

    from ui.handle import Handle
    from ui.views import deepest_token, strip_scale
    table = pd.DataFrame({"position": range(4), "exit_depth": [2, 3, 4, 8], "converged": [True] * 4})
    model = Handle("p", "id", "cpu", {}, None, 8, 3, 32, 64, 1, 10)
    assert (strip_scale(model, table).lo, strip_scale(model, table).hi) == (2, 4)
    assert deepest_token(table) == 2


def test_strip_colours_span_the_depths_present():
    """Exits at 3, 4 and 5 of r_max 16 get three clearly different colours, and the legend says the
    scale spans 3–5 and marks r_max."""
    from ui.strip import DepthScale, legend_html
    scale = DepthScale.of([3, 4, 5, 4], 16)
    colors = [scale.color(d) for d in (3, 4, 5)]
    rgb = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in colors]
    assert min(sum(abs(a - b) for a, b in zip(x, y, strict=True)) for x, y in ((rgb[0], rgb[1]), (rgb[1], rgb[2]))) > 120
    legend = legend_html(scale)
    assert 'data-lo="3"' in legend and 'data-hi="5"' in legend and "r_max = 16" in legend and "3–5" in legend


def test_generate_says_why_fewer_loops_need_not_be_faster(tiny_ckpt):
    """A1's per-loop readouts (its KL check) cost time the loop count does not show: the page says so
    beside its tokens/s (issue 49, item 6)."""
    at = AppTest.from_file("../pages/generate.py", default_timeout=TIMEOUT)
    at.session_state["checkpoint_path"] = str(tiny_ckpt)
    at.run()
    at.text_area[0].input("Lily saw a")
    next(s for s in at.slider if s.label == "New tokens").set_value(4)
    at.button[0].click().run()
    assert not at.exception
    note = next(c.value for c in at.caption if c.value.startswith("Why fewer loops"))
    assert re.search(r"\(\d+ coda \+ LM head passes, against \d+ for uniform depth", note)


def test_a_word_problem_checkpoint_reads_a_prompt_and_a_pasted_problem_as_trained(monkeypatch):
    """The default specimen was trained on problems after EOS and a space: the generate page's prompt and
    the pasted text are read so (a bare "Ben" is another token than the story's later " Ben")."""
    from tokenizers import Tokenizer
    ckpt = Path(__file__).parents[1] / "checkpoints" / "specimen"
    monkeypatch.setenv("RECUR_CHECKPOINT", str(ckpt))  # the app starts on it (other tests set the tiny one)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    problem = "Ben zoo. Amy Ben. Amy?"
    trained = [tok.token_to_id("<|endoftext|>"), *tok.encode(" " + problem).ids]
    at = AppTest.from_file("../pages/generate.py", default_timeout=TIMEOUT)
    at.session_state["checkpoint_path"] = str(ckpt)
    at.run()
    at.text_area[0].input(problem)
    next(s for s in at.slider if s.label == "New tokens").set_value(2)
    at.button[0].click().run()
    assert not at.exception
    assert any(md.value == f"**Prompt** ({len(trained)} tokens):" for md in at.markdown)
    at = AppTest.from_file("../app.py", default_timeout=TIMEOUT)
    at.session_state["checkpoint_path"] = str(ckpt)
    at.run()
    submit_text(at, problem)
    [strip] = strips(at)
    assert len(strip) == len(trained)


def test_a_leaner_policy_with_a_lower_loss_is_named_for_comment():
    """Compare names a policy that spends fewer loops than A0 and still has a lower loss, so the page
    can explain it (issue 49: A2 at 1.12 loops below A0 at 8); nothing else is named."""
    from types import SimpleNamespace as Out

    from ui.views import leaner_and_better
    outcomes = [Out(mean_loops=8.0, loss=2.0), Out(mean_loops=3.0, loss=2.1), Out(mean_loops=1.12, loss=1.9),
                Out(mean_loops=9.0, loss=1.5)]
    assert leaner_and_better(["A0 r=8", "A1", "A2", "deep"], outcomes) == ["A2"]
