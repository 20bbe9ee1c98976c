"""The roles see the coordinator only through `CoordinatorView` (role.py).

The roles' modules are read as syntax trees: every `self.coord.<name>` / `coord.<name>` must be a
member the view declares, the view declares nothing the roles do not use, and the coordinator
itself must not be handed on whole (`getattr(coord, ...)`, `helper(self.coord)`). The real
Coordinator is checked to provide every member, with the same parameters for the methods."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import runtime_ops as ops
from test_roles import now

import flowrl.runtime.batches as batches_module
import flowrl.runtime.durability.snapshot as snapshot_module
import flowrl.runtime.joins as joins_module
import flowrl.runtime.role as role_module
import flowrl.runtime.samples as samples_module
from flowrl.runtime.batches import Batches
from flowrl.runtime.coordinator import Coordinator
from flowrl.runtime.durability import snapshot
from flowrl.runtime.joins import Joins, Policies
from flowrl.runtime.role import CoordinatorView, Role
from flowrl.runtime.samples import Samples

ROLE_MODULES = [role_module, samples_module, batches_module, joins_module]


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")}


def _is_coord(node: ast.AST) -> bool:
    """`coord` (a parameter or a local alias) or `self.coord`."""
    if isinstance(node, ast.Name):
        return node.id == "coord"
    return (isinstance(node, ast.Attribute) and node.attr == "coord" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _is_alias(parent: ast.AST) -> bool:
    """`coord = self.coord` or `self.coord = coord`."""
    return isinstance(parent, ast.Assign) and all(_is_coord(t) for t in parent.targets)


def _is_super_init(parent: ast.AST) -> bool:
    """`super().__init__(coord)`."""
    return (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
            and parent.func.attr == "__init__" and isinstance(parent.func.value, ast.Call)
            and isinstance(parent.func.value.func, ast.Name) and parent.func.value.func.id == "super")


def coord_uses(source: str) -> tuple[set[str], list[str]]:
    """The coordinator members a module uses, and where it uses the coordinator otherwise (line: code)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    used, escapes = set(), []
    for node in ast.walk(tree):
        if not _is_coord(node) or not isinstance(node.ctx, ast.Load):
            continue
        parent = parents[node]
        if isinstance(parent, ast.Attribute) and parent.value is node:
            used.add(parent.attr)
        elif not (_is_alias(parent) or _is_super_init(parent)):
            escapes.append(f"{node.lineno}: {ast.unparse(parent)}")
    return used, escapes


def uses_of(module) -> tuple[set[str], list[str]]:
    return coord_uses(Path(module.__file__).read_text())


@pytest.mark.parametrize("module", ROLE_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_a_role_uses_only_what_the_view_declares(module):
    used, escapes = uses_of(module)
    assert not used - members(CoordinatorView), f"{module.__name__} uses undeclared coordinator members"
    assert not escapes, f"{module.__name__} hands the coordinator on: {escapes}"


def test_the_view_declares_nothing_the_roles_do_not_use():
    used = set().union(*(uses_of(m)[0] for m in ROLE_MODULES))
    assert used == members(CoordinatorView)


def test_the_check_catches_an_undeclared_member_and_a_coordinator_handed_on():
    source = '''
class Sneaky(Role):
    def __init__(self, coord):
        super().__init__(coord)
        self.pacing = coord.pacing
    def take(self, node, replica):
        coord = self.coord
        helper(self.coord)
        return getattr(coord, "held"), self.coord.samples.oversampled([node])
'''
    used, escapes = coord_uses(source)
    assert used == {"pacing", "samples"} and not used <= members(CoordinatorView)
    assert [e.split(":")[0] for e in escapes] == ["8", "9"]


def test_the_roles_take_the_view():
    for cls in (Role, Samples, Batches, Joins, Policies):
        assert inspect.signature(cls.__init__).parameters["coord"].annotation == "CoordinatorView", cls
    assert inspect.signature(Batches.__init__).parameters["samples"].annotation == "Samples"


def test_the_coordinator_provides_every_member_of_the_view():
    coord = Coordinator(ops.grpo("async", k=1, steps=2, batch_size=2), None, 2)
    assert isinstance(coord, CoordinatorView)  # runtime_checkable: every member is there
    for name in members(CoordinatorView):
        declared = inspect.getattr_static(CoordinatorView, name)
        if isinstance(declared, property):
            assert not callable(getattr(coord, name)), name
            continue
        wanted = list(inspect.signature(declared).parameters)[1:]  # without self
        # Ray, once it has made the Coordinator an actor class in this process, adds `_ray_trace_ctx`.
        given = [p for p in inspect.signature(getattr(coord, name)).parameters if p != "_ray_trace_ctx"]
        assert given == wanted, name
    assert coord.checkpoint_due is (coord.pacing.due is not None)
    coord.count("filtered")
    assert coord.counters["filtered"] == 1


def test_snapshot_uses_only_what_the_coordinator_has():
    """snapshot.py is the coordinator's own code and takes the Coordinator itself (its docstring)."""
    coord = Coordinator(ops.grpo("sync", steps=2, batch_size=1), None, 2)
    used, _ = uses_of(snapshot_module)
    assert used and all(hasattr(coord, name) for name in used | set(snapshot.PLAIN))




def test_a_resumed_train_node_republishes_under_the_count_of_resumes():
    coord = Coordinator(ops.grpo("sync", steps=3, batch_size=1), None, 3)
    sample = coord.roles["rollout"].take("rollout", 0)
    assert now(coord.complete("rollout", 0, sample.id, {"trajectories": "group"}, version=sample.version))
    scored = coord.roles["score"].take("score", 0)
    assert now(coord.complete("score", 0, scored.id, {"trajectories": "group"}))
    work = coord.roles["learner"].take("learner", 0)
    assert now(coord.complete("learner", 0, work.id, {"policy": {"version": 1}})) and coord.clock == 1
    once = Coordinator(coord.plan, None, 3, state=snapshot.take(coord))
    twice = Coordinator(coord.plan, None, 3, state=snapshot.take(once))
    for resumed, n in ((once, 1), (twice, 2)):
        publish = resumed.roles["learner"].take("learner", 0)
        assert (publish.kind, publish.id, resumed.resumes) == ("publish", f"v1:r{n}", n)
