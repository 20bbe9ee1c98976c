"""The changes `flowrl plan RUN_DIR key=value ...` simulates, applied to a copy of the run's plan.

    data.batch_size=N                    groups per train step
    run.steps=N                          steps to simulate (default: the run's)
    nodes.NODE.resources.replicas=N      replicas of a generate or reward/transform node
    nodes.NODE.group_size=N              trajectories per group of a generate node
    nodes.NODE.partial_rollout=BOOL      weight updates without draining (a generate node)
    nodes.NODE.engine.max_batch=N        the engine's slots (rows decoded together)
    max_staleness=N                      the train node's input edge: 0 sync, N > 0 async with N
    scale=F                              the model's FLOPs and bytes times F (engine, train, sync)

Anything else is refused with the key and the list above: plan does not guess what it cannot model.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import yaml

from flowrl.graph.facts import derive
from flowrl.graph.plan import Plan
from flowrl.spec.errors import UserError

KEYS = ("data.batch_size", "run.steps", "nodes.NODE.resources.replicas", "nodes.NODE.group_size",
        "nodes.NODE.partial_rollout", "nodes.NODE.engine.max_batch", "max_staleness", "scale")


@dataclass
class Scenario:
    plan: Plan
    scale: float = 1.0
    changes: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        return int(self.plan.run.get("steps", 10))


def apply(plan: Plan, overrides: list[str], steps: int) -> Scenario:
    """The scenario of `overrides` on `plan` (simulating `steps` unless run.steps is given)."""
    copy = msgspec.json.decode(msgspec.json.encode(plan), type=Plan)
    copy.run = {**copy.run, "steps": steps}
    scenario = Scenario(copy, 1.0, tuple(overrides))
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise UserError(f"override {item!r}: expected key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        _set(scenario, key, value, item)
    copy.facts = derive(copy.nodes, copy.edges, copy.order)
    return scenario


def _set(scenario: Scenario, key: str, value: object, item: str) -> None:
    plan, parts = scenario.plan, key.split(".")
    if key == "scale":
        scenario.scale = _number(value, item, float, 1e-6)
    elif key == "data.batch_size":
        plan.data = {**plan.data, "batch_size": _number(value, item, int, 1)}
    elif key == "run.steps":
        plan.run = {**plan.run, "steps": _number(value, item, int, 4)}  # WARMUP steps and two to measure
    elif key == "max_staleness":
        _staleness(plan, _number(value, item, int, 0))
    elif len(parts) >= 3 and parts[0] == "nodes":
        _node(plan, parts[1], ".".join(parts[2:]), value, item)
    else:
        raise UserError(f"override {item!r}: plan cannot simulate '{key}'; it simulates {', '.join(KEYS)}")


def _node(plan: Plan, name: str, rest: str, value: object, item: str) -> None:
    node = plan.nodes.get(name)
    if node is None:
        raise UserError(f"override {item!r}: no node '{name}' (nodes: {', '.join(plan.nodes)})")
    generate_only = {"group_size", "partial_rollout", "engine.max_batch"}
    if rest in generate_only and node.kind != "generate":
        raise UserError(f"override {item!r}: '{rest}' is a key of generate nodes; '{name}' is a {node.kind} node")
    if rest == "resources.replicas":
        if node.kind in ("train", "sync"):
            raise UserError(f"override {item!r}: plan simulates replicas of generate and reward/transform nodes; "
                            f"'{name}' is a {node.kind} node")
        node.resources = msgspec.structs.replace(node.resources, replicas=_number(value, item, int, 1))
    elif rest == "group_size":
        node.config = {**node.config, "group_size": _number(value, item, int, 1)}
    elif rest == "partial_rollout":
        if not isinstance(value, bool):
            raise UserError(f"override {item!r}: expected true or false")
        node.config = {**node.config, "partial_rollout": value}
    elif rest == "engine.max_batch":
        engine = node.config.get("engine")
        engine = dict(engine) if isinstance(engine, dict) else {"kind": engine or "embedded"}
        node.config = {**node.config, "engine": {**engine, "max_batch": _number(value, item, int, 1)}}
    else:
        raise UserError(f"override {item!r}: plan cannot simulate 'nodes.{name}.{rest}'; it simulates "
                        f"{', '.join(KEYS)}")


def _staleness(plan: Plan, limit: int) -> None:
    """The train node's data input edge: sync at 0, else async with this max_staleness."""
    trains = [n for n, f in plan.facts.nodes.items() if f.input is not None]
    for i, edge in enumerate(plan.edges):
        if edge.kind == "data" and edge.dst in trains:
            mode = "async" if limit > 0 else "sync"
            plan.edges[i] = msgspec.structs.replace(edge, mode=mode, max_staleness=limit)


def _number(value: object, item: str, kind: type, least: float) -> int | float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or value == int(value))
    if not ok or value < least:
        raise UserError(f"override {item!r}: expected {'an integer' if kind is int else 'a number'} >= {least:g}")
    return kind(value)
