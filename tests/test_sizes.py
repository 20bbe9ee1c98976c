"""Size as a rule: every module of flowrl/ and operators/ is at most MAX_LINES lines and every function
(method, nested function) at most MAX_FUNCTION_LINES, counted from its `def` line to its last line,
docstring and comments included. A file or function past that is split along its seams (a room of
its own, a helper per responsibility), not waved through.

ALLOWED holds the few exceptions, each with the reason it stays whole; an entry that is no longer
needed fails too, so the list only shrinks. Keys are "path" for a file and "path::function" (the
function's qualified name, Class.method) for a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowrl", "operators")
MAX_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_ALLOWED = 5

ALLOWED: dict[str, str] = {
    # "path" or "path::Qualified.name": "why it stays whole (one line)",
}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def oversized(root: Path = ROOT) -> dict[str, str]:
    """Every file and function past its limit: key (as in ALLOWED) -> its size."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            lines = len(text.splitlines())
            if lines > MAX_LINES:
                found[rel] = f"{lines} lines (at most {MAX_LINES})"
            for name, size in _functions(ast.parse(text, rel)):
                if size > MAX_FUNCTION_LINES:
                    found[f"{rel}::{name}"] = f"{size} lines (at most {MAX_FUNCTION_LINES})"
    return found


def test_no_module_or_function_is_past_its_size():
    found = oversized()
    past = {k: v for k, v in found.items() if k not in ALLOWED}
    assert past == {}, "split these along their seams (or, with a reason, add them to ALLOWED):\n" + "\n".join(
        f"  {k}: {v}" for k, v in past.items())


def test_the_allow_list_is_short_reasoned_and_still_needed():
    assert len(ALLOWED) <= MAX_ALLOWED
    assert all(reason.strip() and "\n" not in reason for reason in ALLOWED.values())
    stale = sorted(set(ALLOWED) - set(oversized()))
    assert stale == [], f"no longer past the limit: remove from ALLOWED: {stale}"


def test_a_planted_oversized_file_and_function_are_found(tmp_path):
    (tmp_path / "flowrl").mkdir()
    (tmp_path / "operators/engine").mkdir(parents=True)
    (tmp_path / "flowrl/small.py").write_text("def f():\n    return 1\n")
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # with its def line: one too many
    (tmp_path / "flowrl/long_function.py").write_text(
        "class A:\n    def ok(self):\n        pass\n\n    async def step(self):\n" + body)
    (tmp_path / "operators/engine/big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "operators/engine/limit.py").write_text("x = 1\n" * MAX_LINES)
    assert oversized(tmp_path) == {
        "flowrl/long_function.py::A.step": f"{MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
        "operators/engine/big.py": f"{MAX_LINES + 1} lines (at most {MAX_LINES})",
    }
