"""The installed package (pyproject.toml): its console scripts run, its entry points resolve, its
package data is there. They need `pip install -e .` (make install does it); in CI (CI set) they must
run, elsewhere they skip when the package is not installed."""
import importlib.metadata as md
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"recur-app": "recur-app", "recur-analyze": "python -m recur_core.analyze",
           "recur-train": "python -m training.run", "recur-lm-eval": "lm-eval"}


def installed() -> md.Distribution:
    try:
        return md.distribution("recur")
    except md.PackageNotFoundError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the package is not installed here: pip install -e '.[dev]'")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_help(script):
    installed()
    exe = Path(sys.executable).parent / script
    assert exe.is_file(), f"{script} is not installed next to {sys.executable}"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"usage: {SCRIPTS[script]}" in out.stdout


def test_entry_points_resolve_to_functions():
    dist = installed()
    scripts = {ep.name: ep for ep in dist.entry_points if ep.group == "console_scripts"}
    assert set(scripts) == set(SCRIPTS)
    for ep in scripts.values():
        assert callable(ep.load())


def test_one_source_of_dependencies():
    """pyproject.toml is the only list; its torch range admits the pinned CPU build (2.13.0)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch == ["torch>=2.5,<3"]
    extras = project["optional-dependencies"]
    assert {"app", "train", "eval", "dev"} <= set(extras)
    assert any(d.startswith("lm-eval") for d in extras["eval"])
    assert "recur[app,train,eval]" in extras["dev"]


def test_requirements_txt_delegates_to_pyproject():
    """requirements.txt (the design card's `pip install -r requirements.txt`) names no version of its
    own: the Makefile's torch pin, which pyproject's range admits, then the package with an extra
    pyproject declares."""
    from packaging.requirements import Requirement

    lines = [ln.split("#")[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    assert len(lines) == 2 and lines[1].startswith("-e .["), lines
    pin = Requirement(lines[0])
    make_pins = [Requirement(w) for w in (ROOT / "Makefile").read_text().split() if w.startswith("torch==")]
    assert pin.name == "torch" and [str(r) for r in make_pins] == [str(pin)]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_range = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    assert torch_range.specifier.contains(next(iter(pin.specifier)).version)
    extras = lines[1].removeprefix("-e .[").removesuffix("]").split(",")
    assert set(extras) <= set(project["optional-dependencies"]) and "dev" in extras


def test_lm_eval_entry_point_names_the_registered_model():
    """The `lm_eval.models` entry point (lm-eval's plugin discovery after 0.4.13) loads the class that
    registers itself as the same name, which recur-lm-eval uses today."""
    dist = installed()
    models = {ep.name: ep for ep in dist.entry_points if ep.group == "lm_eval.models"}
    assert set(models) == {"recur"}
    cls = models["recur"].load()
    from lm_eval.api.registry import get_model

    assert get_model("recur") is cls


def test_package_data_is_declared_for_the_shipped_files():
    """Every non-Python file the packages read at run time matches a package-data pattern (setuptools
    globs them from the package folder)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, patterns in data.items():
        folder = ROOT / package
        shipped = {p for p in folder.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
        declared = {p for pat in patterns for p in folder.glob(pat)}
        assert shipped and shipped == declared, (package, sorted(map(str, shipped ^ declared)))
