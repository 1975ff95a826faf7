"""The runtime's layers import only downward: `recur_core/model` and `recur_core/exits` never import
the layers above them (analysis, decoding, the app, training, lm-eval), not even for type checking."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABOVE = ("recur_core.analysis", "recur_core.decoding", "recur_core.analyze", "ui", "pages", "training",
         "recur_eval", "bench")


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


def upward(path: Path, root: Path = ROOT) -> list[str]:
    return sorted(m for m in imported_modules(path, root) if any(m == a or m.startswith(a + ".") for a in ABOVE))


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
