"""The runtime's layers import only downward: `recur_core/model` and `recur_core/exits` never import
the layers above them (analysis, decoding, the app, training, lm-eval), not even for type checking;
nothing in `recur_core` imports the packages on top of it; and nothing outside `training/` imports
`training` (issue 47; the benchmarks of training itself live in it); and few functions take more than
8 parameters (issue 47's bound)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABOVE = ("recur_core.analysis", "recur_core.decoding", "recur_core.analyze", "ui", "pages", "training",
         "recur_eval", "bench")
ON_TOP_OF_CORE = ("ui", "pages", "training", "recur_eval", "bench", "app")


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, anywhere in it (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def upward(path: Path, root: Path = ROOT, above: tuple[str, ...] = ABOVE) -> list[str]:
    return sorted(m for m in imported_modules(path, root) if any(m == a or m.startswith(a + ".") for a in above))


def project_files() -> list[Path]:
    """Every .py file of the project (not its tests, virtual environment or checkpoints)."""
    skip = {".venv", "tests", "checkpoints", ".git"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts))


@pytest.mark.parametrize("layer", ["recur_core/model", "recur_core/exits"])
def test_lower_layers_never_import_upward(layer):
    files = sorted((ROOT / layer).glob("*.py"))
    assert files
    found = {str(f.relative_to(ROOT)): upward(f) for f in files}
    assert {f: m for f, m in found.items() if m} == {}


def test_the_check_sees_a_relative_import_under_type_checking(tmp_path):
    """The scan resolves `from ..analysis.trace import Trace` inside `if TYPE_CHECKING:` (how the
    exits once reached the Trace type) to an upward import."""
    package = tmp_path / "recur_core" / "exits"
    package.mkdir(parents=True)
    module = package / "bad.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..analysis.trace import Trace\n")
    assert upward(module, tmp_path) == ["recur_core.analysis.trace", "recur_core.analysis.trace.Trace"]


def test_nothing_outside_training_imports_training():
    outside = [p for p in project_files() if p.relative_to(ROOT).parts[0] != "training"]
    assert len(outside) > 50  # the walk found the project
    assert [str(p.relative_to(ROOT)) for p in outside if upward(p, above=("training",))] == []


def test_recur_core_imports_nothing_on_top_of_it():
    core = [p for p in project_files() if p.relative_to(ROOT).parts[0] == "recur_core"]
    assert len(core) > 30
    assert {str(p.relative_to(ROOT)): upward(p, above=ON_TOP_OF_CORE) for p in core if upward(p, above=ON_TOP_OF_CORE)} == {}


def test_the_check_sees_training_imported_inside_a_function(tmp_path):
    (tmp_path / "ui").mkdir()
    module = tmp_path / "ui" / "bad.py"
    module.write_text("def f():\n    from training.hops import PAD\n    return PAD\n")
    assert upward(module, tmp_path, above=("training",)) == ["training.hops", "training.hops.PAD"]



MAX_LONG_SIGNATURES = 10  # issue 47's bound: at most this many functions take more than 8 parameters


def long_signatures(path: Path, limit: int = 8) -> list[tuple[str, int, int]]:
    """(name, line, parameters) of a file's functions taking more than `limit` parameters (self / cls
    not counted; *args and **kwargs count one each)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            n = len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)
            if n > limit:
                out.append((node.name, node.lineno, n))
    return out


def test_few_functions_take_long_parameter_lists():
    """A long parameter list is where a concept has no home yet (issue 47 gathered them into objects:
    HaltSchedule, ExactPath, Recording, the app's handle): at most MAX_LONG_SIGNATURES remain."""
    found = [f"{path.relative_to(ROOT)}:{line} {name} ({n})"
             for path in project_files() for name, line, n in long_signatures(path)]
    assert len(found) <= MAX_LONG_SIGNATURES, "\n".join(found)


def test_the_signature_count_sees_keyword_only_and_star_parameters(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class C:\n    def m(self, a, b, c, d, e, f, g, h): ...\n"
                 "def k(a, b, c, d, e, *args, g, h, **kw): ...\n")
    assert long_signatures(f) == [("k", 3, 9)]
