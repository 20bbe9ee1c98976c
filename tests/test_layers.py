"""The library's layers, read from the code: flowrl/ (the engine) names no operator, has no torch.

Walks every module's AST, function-level imports included (module-level checks miss those), so a
lazy `from flowrl_operators... import` inside a function fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def engine_imports(prefix: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in sorted((ROOT / "flowrl").rglob("*.py"))
            for line, module in imports(path) if module == prefix or module.startswith(prefix + ".")]


@pytest.mark.parametrize("library", ["flowrl_operators", "torch"])
def test_the_engine_imports_neither_the_operator_library_nor_torch(library):
    assert engine_imports(library) == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from flowrl_operators.models import x\n    import torch.nn\n")
    assert imports(module) == [(2, "flowrl_operators.models"), (3, "torch.nn")]


def test_every_builtin_task_and_model_is_registered():
    """Built-ins reach flowrl through entry points only (pyproject.toml): the lists must agree."""
    from flowrl import plugins
    from flowrl.data import models
    from flowrl_operators.models import builtin_names
    from flowrl_operators.tasks import TASKS

    assert models.builtin_names() == sorted(builtin_names())
    assert plugins.load("flowrl.tasks") == TASKS
    assert str(models.folder("builtin:tiny-qwen2")).endswith("tiny-qwen2")
