"""No module reaches into another's private names: `from m import _x`, `import flowrl._m`, or `m._x`
on a module of this project bound by an import. A name one module needs of another is that module's
interface, and public (flowrl/, operators/, tools/; tests may look inside). A third-party library's
private module (ray._private, for a switch Ray offers nowhere else) is that call's own risk, not
an interface of this project, and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("flowrl", "flowrl_operators")  # operators/ is installed as flowrl_operators


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def ours(node: ast.ImportFrom) -> bool:
    """An import from this project: relative, or of a PROJECT package."""
    return node.level > 0 or (node.module or "").split(".")[0] in PROJECT


def _modules_bound(tree: ast.AST) -> dict[str, str]:
    """Local name -> the project module an `import` binds to it (`import flowrl.report as r`,
    `from flowrl import report`)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT:
            for alias in node.names:
                bound.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
    return bound


def violations(path: Path) -> list[str]:
    """`file:line: what` for each reach into another module's private names in the file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            module = "." * node.level + (node.module or "")
            found += [(node.lineno, f"imports {a.name} from {module}") for a in node.names if private(a.name)]
            if ours(node) and any(private(part) for part in (node.module or "").split(".")):
                found.append((node.lineno, f"imports from the private module {module}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"imports the private module {a.name}") for a in node.names
                      if a.name.split(".")[0] in PROJECT and any(private(part) for part in a.name.split("."))]
    modules = _modules_bound(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            found.append((node.lineno, f"uses {node.value.id}.{node.attr} of {modules[node.value.id]}"))
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {what}"
            for line, what in sorted(set(found))]


def test_no_module_uses_another_modules_private_names() -> None:
    files = sorted(p for folder in ("flowrl", "operators", "tools") for p in (ROOT / folder).rglob("*.py"))
    assert len(files) > 100
    assert [v for p in files for v in violations(p)] == []


@pytest.mark.parametrize(("source", "words"), [
    ("from flowrl.report import _union\n", "imports _union from flowrl.report"),
    ("def f():\n    from .records import _rows\n", "imports _rows from .records"),
    ("import flowrl.report as report\nreport._union([])\n", "uses report._union of flowrl.report"),
    ("from flowrl import report\nx = report._fmt\n", "uses report._fmt of flowrl.report"),
    ("import flowrl._hidden\n", "imports the private module flowrl._hidden"),
    ("from flowrl._hidden import x\n", "imports from the private module flowrl._hidden"),
])
def test_a_planted_reach_is_found(tmp_path: Path, source: str, words: str) -> None:
    module = tmp_path / "m.py"
    module.write_text(source)
    assert [v.split(": ", 1)[1] for v in violations(module)] == [words]


def test_own_privates_and_dunders_are_fine(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from __future__ import annotations\nimport os\n_x = 1\n\n\nclass A:\n    def _f(self):\n"
                      "        return self._y, _x, os.__name__, os._exit\n"
                      "from ray._private import ray_constants\n")
    assert violations(module) == []
