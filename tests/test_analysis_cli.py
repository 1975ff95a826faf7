import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recur_core.analysis.curves import (
    Curve,
    classify_text,
    interp_rows,
    json_safe,
    loops_to_reach,
    matched_depth_table,
    settle_loop,
    weighted_median_rows,
)
from recur_core.analysis.stats import Bootstrap

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = {"<class>": ["whitespace", "numeral", "punctuation", "word", "other"],
                "<curve>": ["A0", "A1", "A2_argmax", "A2_kl", "A2_argmax_any", "A2_kl_any", "latent", "Accel", "Certified"],
                "<kind>": ["argmax", "kl", "argmax_any", "kl_any"]}


@pytest.mark.parametrize("text, expected", [
    (" ", "whitespace"), ("\n\n", "whitespace"), ("42", "numeral"), (" 7", "numeral"), (".", "punctuation"),
    ("\"", "punctuation"), (" $", "punctuation"), ("!\"", "punctuation"), (" the", "word"), ("Tom", "word"),
    ("'s", "word"), ("3rd", "word"), ("", "other"), ("\ufffd", "other"), ("3.", "other")])
def test_token_classes(text, expected):
    assert classify_text(text) == expected


def test_interpolation_and_loops_to_reach():
    loops = np.array([[1.0, 2.0, 4.0], [4.0, 1.0, 2.0]])  # second row unsorted: sorted internally
    loss = np.array([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0]])
    np.testing.assert_allclose(interp_rows(3.0, loops, loss), [1.5, 1.5])
    np.testing.assert_allclose(interp_rows(1.0, loops, loss), [3.0, 3.0])
    assert np.isnan(interp_rows(5.0, loops, loss)).all()
    np.testing.assert_allclose(loops_to_reach(np.array([2.5, 1.0]), loops, loss), [1.5, 4.0])
    np.testing.assert_allclose(loops_to_reach(np.array([3.5, 3.0]), loops, loss), [1.0, 1.0])
    assert np.isnan(loops_to_reach(np.array([0.5, 0.5]), loops, loss)).all()


def test_matched_depth_table_on_known_curves():
    boot = Bootstrap(2, n_boot=10)
    a0 = Curve("A0", "r", [1, 2, 3], np.tile([3.0, 2.0, 1.8], (11, 1)), np.tile([1.0, 2.0, 3.0], (11, 1)), np.ones(3))
    a1 = Curve("A1", "eps", [0.0, 1.0], np.tile([1.8, 2.8], (11, 1)), np.tile([3.0, 1.0], (11, 1)), np.ones(2))
    rows = matched_depth_table(a0, [a1], boot)
    assert [r["depth"] for r in rows] == [1, 2, 3]
    assert rows[1]["A1"]["value"] == pytest.approx(2.3)
    assert rows[1]["A1_minus_A0"]["value"] == pytest.approx(0.3)
    assert rows[0]["A1_minus_A0"]["value"] == pytest.approx(-0.2)


def test_settle_loop_and_weighted_median():
    kl = np.array([[0.5, 1e-4, 0.5, 1e-4, 1e-5], [1e-4, 1e-4, 1e-4, 1e-4, 1e-4], [0.5, 0.5, 0.5, 0.5, 0.5]])
    assert settle_loop(kl, 1e-3).tolist() == [4, 1, 6]
    hist = np.array([[0, 3, 1, 0], [5, 0, 0, 1]], dtype=float)  # values 1..4
    assert weighted_median_rows(hist).tolist() == [2.0, 1.0]


def test_json_safe():
    out = json_safe({"a": np.float32(1.5), "b": [math.nan, math.inf, np.int64(3)], "c": np.array([1.0, -math.inf])})
    assert out == {"a": 1.5, "b": [None, "inf", 3], "c": [1.0, "-inf"]}
    json.dumps(out, allow_nan=False)


def documented_keys() -> list[str]:
    """Key paths from the first column of docs/REPORT_KEYS.md's table; ".x" items are relative to
    the previous full path (replacing as many trailing components as they have)."""
    keys = []
    for line in (ROOT / "docs" / "REPORT_KEYS.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        base = None
        for item in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if item.startswith("."):
                parts = item[1:].split(".")
                item = ".".join(base.split(".")[:-len(parts)] + parts)
            keys.append(item)
            base = item
    return keys


def listed_keys() -> list[str]:
    """Every key path docs/REPORT_KEYS.md names: its tables' first column (documented_keys) and the
    items of its lists ("- `a.b`, `.c`: meaning", the sections of keys only some reports have)."""
    keys = documented_keys()
    for line in (ROOT / "docs" / "REPORT_KEYS.md").read_text().splitlines():
        if line.startswith("- `"):
            base = None
            for item in re.findall(r"`([^`]+)`", line.split("`: ", 1)[0] + "`"):
                if item.startswith("."):
                    item = ".".join(base.split(".")[:-1] + [item[1:]])
                keys.append(item)
                base = item
    return keys


def report_paths(node, where: str = "") -> list[str]:
    """The key path of every value in a report that is not an object (list elements as "[]")."""
    if isinstance(node, list) and any(isinstance(e, dict | list) for e in node):
        return [p for element in node for p in report_paths(element, where + "[]")]
    if not isinstance(node, dict):
        return [where]
    return [p for name, child in node.items() for p in report_paths(child, f"{where}.{name}" if where else name)]


def undocumented(report: dict) -> set[str]:
    """The report's key paths that no key named in docs/REPORT_KEYS.md covers (a documented key covers
    itself and everything under it; placeholders such as <curve> stand for their values; the
    digits of a per-count key such as a hop count stand for <h>)."""
    patterns = []
    for key in listed_keys():
        parts = []
        for part in key.split("."):
            stem, brackets = part.removesuffix("[]"), "[]" if part.endswith("[]") else ""
            names = PLACEHOLDERS.get(stem, [stem]) if not stem.startswith("<") or stem in PLACEHOLDERS else None
            parts.append("(?:" + "|".join(re.escape(n) for n in names) + ")" if names else r"[^.\[]+")
            parts[-1] += r"(?:\[\])?" if brackets else ""  # a list of numbers is itself the leaf
        patterns.append(re.compile(r"\.".join(parts) + r"(?:[.\[].*)?$"))
    return {path for path in report_paths(report) if not any(p.match(path) for p in patterns)}


def check_path(node, parts: list[str], where: str) -> None:
    if not parts:
        return
    head, rest = parts[0], parts[1:]
    names = PLACEHOLDERS.get(head.removesuffix("[]"), [head.removesuffix("[]")])
    for name in names:
        assert isinstance(node, dict) and name in node, f"report lacks {where}{name}"
        child = node[name]
        if head.endswith("[]"):
            assert isinstance(child, list) and child, f"{where}{name} is not a non-empty list"
            for element in child:
                check_path(element, rest, f"{where}{name}[].")
        else:
            check_path(child, rest, f"{where}{name}.")


def test_cli_writes_a_report_with_every_documented_key(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "recur_core.analyze", str(tiny_ckpt), "--windows", "6", "--max-loops", "6",
           "--n-boot", "50", "--probe-windows", "6", "--probe-tokens", "8",
           "--cache-dir", str(tmp_path / "cache"), "--overthinking", "--out", str(out), "--export-trace"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for title in ("Table 2", "Table 3", "Table 4", "Fig. 4", "Fast (trace) vs exact", "label kinds side by side"):
        assert title in run.stdout
    text = (out / "report.json").read_text()
    report = json.loads(text)
    keys = [k for k in documented_keys() if not k.startswith("ground_truth")]  # checkpoints with ground
    assert len(keys) > 60  # truth only: tests/test_ground_truth.py checks those keys
    for key in keys:
        check_path(report, key.split("."), "")
    assert not undocumented(report)  # and every key the report holds is in docs/REPORT_KEYS.md
    assert undocumented({"elasticity": {"loss": [], "made_up": 1}}) == {"elasticity.made_up"}
    assert report["overthinking"]["loops"][-1] == max(32, 4 * report["checkpoint"]["recipe"]["r_max"])  # --overthinking

    s = report["settings"]
    assert (s["windows"], s["max_loops"], s["r_max"]) == (6, 6, 6)
    assert len(report["elasticity"]["loss"]) == 6 and len(report["allocation"]["A0"]) == 6
    for r, point in enumerate(report["allocation"]["A0"], start=1):
        assert point["mean_loops"] == r
        assert point["loss"] == pytest.approx(report["elasticity"]["loss"][r - 1])
    assert report["allocation"]["path"] == report["settings"]["path"] == "exact"
    a1 = {str(p["threshold"]): p for p in report["allocation"]["A1"]}
    assert a1["inf"]["mean_loops"] == 2.0 and a1["0.0"]["mean_loops"] == 6.0  # first check at loop 2
    assert a1["0.0"]["loss"] == pytest.approx(report["elasticity"]["loss"][5])
    for point in report["allocation"]["A1"]:
        assert point["ci_low"] <= point["ci_high"]
    assert len(pd.read_parquet(out / "trace.parquet")) == 6 * 32 * 6
    # exact and fast agree where they must (uniform depth), and the gap is fast - exact
    for row in report["fast_minus_exact"]["A0"]:
        assert row["gap_loss"]["value"] == pytest.approx(0.0, abs=1e-5)
    for row in report["fast_minus_exact"]["A1"]:
        assert row["gap_loss"]["value"] == pytest.approx(row["fast_loss"]["value"] - row["exact_loss"]["value"], abs=1e-9)
    assert report["exact_work"]["lane_loops"] < report["exact_work"]["naive_window_loops"]

    # a second run is served by the trace and probe caches and gives the same numbers
    again = subprocess.run(cmd[:-1] + ["--out", str(tmp_path / "out2")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads((tmp_path / "out2" / "report.json").read_text())
    assert second["allocation"] == report["allocation"] and second["elasticity"] == report["elasticity"]


# -- paired differences (issue 12, item 13) -------------------------------------------------------------
def _curve(name, loss, loops, thresholds, boot):
    """A Curve from per-window loss sums (n_windows, P), one token per window, through the bootstrap."""
    tokens = np.ones_like(loss)
    return Curve(name, "t", thresholds, boot.ratio(loss, tokens), boot.ratio(loops, tokens), np.ones(len(thresholds)))


def test_difference_from_a0_bands_are_paired():
    """Every window is 0.01 nats better under the policy than under A0 at the same depth, while the
    windows themselves differ by ~1 nat. A paired band (same resampled windows in both terms) is
    exactly 0.01 wide zero; an unpaired one would span about +-0.4 nats."""
    from recur_core.analysis.curves import difference_from_a0
    rng = np.random.default_rng(0)
    n, depths = 30, np.arange(1, 6, dtype=float)
    window_level = rng.normal(3.0, 1.0, size=(n, 1))
    a0_loss = window_level + 0.1 / depths  # (n, 5): A0 falls with depth
    boot = Bootstrap(n, n_boot=300, seed=1)
    a0 = _curve("A0", a0_loss, np.tile(depths, (n, 1)), list(range(1, 6)), boot)
    policy_loops = np.array([1.5, 2.5, 3.5])
    policy_loss = window_level + 0.1 / policy_loops - 0.01
    # A0 interpolates linearly between depths: compare against that line, not 0.1 / x
    lin = np.interp(policy_loops, depths, 0.1 / depths)
    policy_loss = window_level + lin - 0.01
    policy = _curve("A1", policy_loss, np.tile(policy_loops, (n, 1)), [1e-3, 1e-4, 1e-5], boot)
    d = difference_from_a0(policy, a0, boot)
    np.testing.assert_allclose(d["diff"], -0.01, atol=1e-9)
    np.testing.assert_allclose(d["ci_low"], -0.01, atol=1e-9)
    np.testing.assert_allclose(d["ci_high"], -0.01, atol=1e-9)
    assert d["mean_loops"] == [1.5, 2.5, 3.5]
    # the unpaired bands of the two curves themselves are wide and overlap
    loss_band = boot.summarise(policy.loss)
    assert (loss_band.ci_high - loss_band.ci_low > 0.3).all()
    # pairing is by replicate: shuffling the replicates of one term breaks it
    shuffled = Curve("A1", "t", policy.thresholds, policy.loss[np.r_[0, rng.permutation(np.arange(1, 301))]],
                     policy.mean_loops, policy.frac_converged)
    unpaired = difference_from_a0(shuffled, a0, boot)
    assert (np.array(unpaired["ci_high"]) - np.array(unpaired["ci_low"]) > 0.3).all()


def test_elasticity_difference_is_paired_and_needs_the_same_windows(ckpt):
    from recur_core.analysis.curves import elasticity_difference
    from recur_core.analysis.trace import trace
    windows = ckpt.windows("eval")[:6]
    tr = trace(ckpt, windows, 3, seed=0, cache=False)
    other = trace(ckpt, windows, 3, seed=7, cache=False)  # another noise draw: a stand-in for a second checkpoint
    boot = Bootstrap(6, n_boot=200, seed=0)
    d = elasticity_difference(other, tr, boot)
    per_window = np.nanmean(other.ce, axis=1) - np.nanmean(tr.ce, axis=1)  # (6, 3), same windows
    for r in range(3):
        assert d["diff"][r] == pytest.approx(np.nanmean(other.ce[..., r]) - np.nanmean(tr.ce[..., r]), abs=1e-6)
        assert d["ci_low"][r] >= per_window[:, r].min() - 1e-6 and d["ci_high"][r] <= per_window[:, r].max() + 1e-6
    self_diff = elasticity_difference(tr, tr, boot)
    assert self_diff["ci_low"] == self_diff["ci_high"] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="same windows"):
        elasticity_difference(trace(ckpt, ckpt.windows("eval")[1:7], 3, seed=0, cache=False), tr, boot)



def test_bench_analyze_times_a_cold_run_and_counts_the_exact_points(tiny_ckpt):
    from bench.bench_analyze import main
    from recur_core.settings import SETTINGS
    result = main([str(tiny_ckpt), "--windows", "4", "--max-loops", "4"])
    assert result["path"] == "exact" and result["timing"]["total_s"] > 0
    n_exact, n_grid = result["exact_points"]["A1"]
    assert 8 <= n_exact <= n_grid == len(SETTINGS.eps_grid)
    assert result["exact_points"]["A0"] == (4, 4)  # every depth
