import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recur_core.analysis import (classify_text, interp_rows, json_safe, loops_to_reach, matched_depth_table,
                                 settle_loop, weighted_median_rows, Curve)
from recur_core.stats import Bootstrap

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = {"<class>": ["whitespace", "numeral", "punctuation", "word", "other"],
                "<curve>": ["A0", "A1", "A2_argmax", "A2_kl"], "<kind>": ["argmax", "kl"]}


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
           "--n-boot", "50", "--probe-windows", "6", "--probe-tokens", "8", "--exact", "--exact-windows", "3",
           "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--export-trace"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for title in ("Table 2", "Table 3", "Table 4", "Fig. 4", "Fast vs exact"):
        assert title in run.stdout
    text = (out / "report.json").read_text()
    report = json.loads(text)
    keys = documented_keys()
    assert len(keys) > 60
    for key in keys:
        check_path(report, key.split("."), "")

    s = report["settings"]
    assert (s["windows"], s["max_loops"], s["r_max"]) == (6, 6, 6)
    assert len(report["elasticity"]["loss"]) == 6 and len(report["allocation"]["A0"]) == 6
    for r, point in enumerate(report["allocation"]["A0"], start=1):
        assert point["mean_loops"] == r
        assert point["loss"] == pytest.approx(report["elasticity"]["loss"][r - 1])
    a1 = {str(p["threshold"]): p for p in report["allocation"]["A1"]}
    assert a1["inf"]["mean_loops"] == 1.0 and a1["0.0"]["mean_loops"] == 6.0
    assert a1["0.0"]["loss"] == pytest.approx(report["elasticity"]["loss"][5])
    for point in report["allocation"]["A1"]:
        assert point["ci_low"] <= point["ci_high"]
    assert len(pd.read_parquet(out / "trace.parquet")) == 6 * 32 * 6

    # a second run is served by the trace and probe caches and gives the same numbers
    again = subprocess.run(cmd[:-1] + ["--out", str(tmp_path / "out2")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads((tmp_path / "out2" / "report.json").read_text())
    assert second["allocation"] == report["allocation"] and second["elasticity"] == report["elasticity"]
