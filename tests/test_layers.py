"""The library's layers, read from the code: flowrl/ (the engine) names no operator, has no torch.

Walks every module's AST, function-level imports included (module-level checks miss those), so a
lazy `from flowrl_operators... import` inside a function fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
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


def reached(path: Path) -> list[tuple[int, str]]:
    """`imports`, plus each name a `from X import name` takes as the module `X.name`: `from safetensors
    import torch` loads safetensors.torch, and torch with it."""
    out = imports(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return sorted(set(out))


def engine_imports(prefix: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in sorted((ROOT / "flowrl").rglob("*.py"))
            for line, module in reached(path) if module == prefix or module.startswith(prefix + ".")]


# safetensors.torch imports torch as it loads: a tensor file read through it is torch in the engine.
@pytest.mark.parametrize("library", ["flowrl_operators", "torch", "safetensors.torch"])
def test_the_engine_imports_neither_the_operator_library_nor_torch(library):
    assert engine_imports(library) == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from flowrl_operators.models import x\n    import torch.nn\n")
    assert imports(module) == [(2, "flowrl_operators.models"), (3, "torch.nn")]


def test_a_planted_safetensors_torch_import_in_the_engine_is_found(tmp_path, monkeypatch):
    """Each way of spelling it: the module itself, a name from it, and the module as a name of its package."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "flowrl").mkdir()
    (tmp_path / "flowrl/a.py").write_text("import safetensors.torch\n")
    (tmp_path / "flowrl/b.py").write_text("def f():\n    from safetensors.torch import load_file\n")
    (tmp_path / "flowrl/c.py").write_text("from safetensors import torch as st\n")
    (tmp_path / "flowrl/d.py").write_text("from safetensors import safe_open\nfrom safetensors.numpy import load\n")
    assert engine_imports("safetensors.torch") == [
        "flowrl/a.py:1 imports safetensors.torch", "flowrl/b.py:2 imports safetensors.torch",
        "flowrl/b.py:2 imports safetensors.torch.load_file", "flowrl/c.py:1 imports safetensors.torch"]


def test_every_builtin_task_and_model_is_registered():
    """Built-ins reach flowrl through entry points only (pyproject.toml): the lists must agree."""
    from flowrl import plugins
    from flowrl.data import models
    from flowrl_operators.models import builtin_names
    from flowrl_operators.tasks import TASKS

    assert models.builtin_names() == sorted(builtin_names())
    assert plugins.load("flowrl.tasks") == TASKS
    assert str(models.folder("builtin:tiny-qwen2")).endswith("tiny-qwen2")


OPERATORS = ROOT / "operators"


def _imports(path: Path, package: str, root: Path) -> list[str]:
    """The modules of `package` (its source in `root`) that `path` imports, at any depth
    (function-level imports included: a lazy import is still a dependency), `if TYPE_CHECKING:` blocks
    left out (annotations only), each as the module itself where an imported name is one
    (`from flowrl.runtime import run` is flowrl.runtime.run)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(block)}
    ours = lambda module: module == package or module.startswith(package + ".")  # noqa: E731
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and ours(node.module):
            for alias in node.names:
                sub = root.joinpath(*node.module.split(".")[1:], alias.name)
                found.append(f"{node.module}.{alias.name}" if sub.with_suffix(".py").is_file() or sub.is_dir()
                             else node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if ours(a.name)]
    return found


def import_graph(package: str, root: Path, unit) -> nx.DiGraph:
    """`package`'s modules (source in `root`) as `unit`s, an edge where one imports another."""
    import networkx as nx

    graph = nx.DiGraph()
    for path in root.rglob("*.py"):
        source = unit(".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"))
        for target in map(unit, _imports(path, package, root)):
            if target != source:
                graph.add_edge(source, target)
    return graph


def operator_graph(unit) -> nx.DiGraph:
    return import_graph("flowrl_operators", OPERATORS, unit)


def _package(module: str) -> str:
    """A top-level module or package of the operator library: the unit of its layers."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("unit", [_package, lambda m: m], ids=["packages", "modules"])
def test_the_operator_library_has_no_import_cycle(unit):
    assert sorted(map(sorted, nx.simple_cycles(operator_graph(unit)))) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.OPERATORS", tmp_path)
    (tmp_path / "a.py").write_text("def f():\n    from flowrl_operators.b import x\n")
    (tmp_path / "b.py").write_text("from flowrl_operators.a import f\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flowrl_operators.a import f\n")
    assert list(nx.simple_cycles(operator_graph(_package))) in (
        [["flowrl_operators.a", "flowrl_operators.b"]], [["flowrl_operators.b", "flowrl_operators.a"]])


ENGINE = ROOT / "flowrl"


def _subpackage(module: str) -> str:
    """A subpackage of flowrl (spec, graph, runtime, records, plan, data, trackers, report) or a
    top-level module (operator, health, cli, ...): the unit of the engine's layers."""
    return ".".join(module.split(".")[:2])


def _room(module: str) -> str:
    """Inside the runtime, its rooms (durability, executors) and each of its other modules; elsewhere
    `_subpackage`."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["flowrl", "runtime"] else _subpackage(module)


def engine_graph(unit) -> nx.DiGraph:
    return import_graph("flowrl", ENGINE, unit)


@pytest.mark.parametrize("unit", [_subpackage, _room], ids=["subpackages", "runtime-rooms"])
def test_the_engine_has_no_import_cycle_between_its_rooms(unit):
    """spec never imports runtime, records never imports runtime, the executors never import run.py,
    ... : each room can be read knowing only the rooms below it."""
    assert sorted(map(sorted, nx.simple_cycles(engine_graph(unit)))) == []


def test_the_engine_cycle_check_finds_a_planted_cycle(tmp_path, monkeypatch):
    """A function-level import closes a cycle too; one under TYPE_CHECKING does not."""
    monkeypatch.setattr(f"{__name__}.ENGINE", tmp_path / "flowrl")
    for room in ("spec", "runtime", "runtime/executors", "records"):
        (tmp_path / "flowrl" / room).mkdir(parents=True)
    (tmp_path / "flowrl/spec/schema.py").write_text("def f():\n    from flowrl.runtime.targets import x\n")
    (tmp_path / "flowrl/runtime/targets.py").write_text("from flowrl.spec import schema\n")
    (tmp_path / "flowrl/runtime/run.py").write_text("from flowrl.runtime.executors import ray_executor\n")
    (tmp_path / "flowrl/runtime/executors/ray_executor.py").write_text("from flowrl.runtime.run import StageFailed\n")
    (tmp_path / "flowrl/records/rundir.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flowrl.runtime.run import x\n")
    (tmp_path / "flowrl/runtime/observe.py").write_text("from flowrl.records import rundir\n")
    assert sorted(map(sorted, nx.simple_cycles(engine_graph(_subpackage)))) == [["flowrl.runtime", "flowrl.spec"]]
    assert sorted(map(sorted, nx.simple_cycles(engine_graph(_room)))) == [
        ["flowrl.runtime.executors", "flowrl.runtime.run"], ["flowrl.runtime.targets", "flowrl.spec"]]
