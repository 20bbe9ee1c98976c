"""The changes `flowrl plan RUN_DIR key=value ...` simulates, applied to a copy of the run's plan.

    data.batch_size=N                    groups per train step
    run.steps=N                          steps to simulate (default: the run's)
    nodes.NODE.resources.replicas=N      replicas of a generate or reward/transform node
    nodes.NODE.group_size=N              trajectories per group of a generate node
    nodes.NODE.slots=N                   rows a generate node's engine decodes together
    nodes.NODE.partial_rollout=BOOL      weight updates without draining (a generate node)
    nodes.NODE.concurrency=N             calls in flight per replica of a generate or reward/transform node
    nodes.NODE.KEY=VALUE                 a key (path) of the node's config that changes the cost shape
                                         its operator declares, e.g. engine.max_batch, engine.threads
                                         (a plugin's own too)
    max_staleness=N                      the train node's input edge: 0 sync, N > 0 async with N
    on_stale=drop|keep                   the train node's input edge: a sample staler than N dropped or kept
    scale=F                              the model's FLOPs and bytes times F (engine, train, sync)

The node fields are those of the cost shape (flowrl.operator.CostShape) plan simulates, set on the
shape the node's operator declares (flowrl/plan/shapes.py); a config key counts through that
declaration only. Anything else is refused with the key and the list above: plan does not guess
what it cannot model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import yaml

from flowrl.graph.facts import derive
from flowrl.graph.plan import NodePlan, Plan
from flowrl.operator import CostShape
from flowrl.plan.shapes import declared, shapes
from flowrl.spec.errors import UserError

KEYS = ("data.batch_size", "run.steps", "nodes.NODE.resources.replicas", "nodes.NODE.group_size",
        "nodes.NODE.slots", "nodes.NODE.partial_rollout", "nodes.NODE.concurrency", "nodes.NODE.KEY (a config key "
        "that changes the node's declared cost shape)", "max_staleness", "on_stale", "scale")
GENERATE_FIELDS = ("group_size", "slots", "partial_rollout")  # cost-shape fields of generate nodes only


@dataclass
class Scenario:
    plan: Plan
    scale: float = 1.0
    changes: tuple[str, ...] = ()
    # Each node's cost shape: declared by its operator (shapes.py), with the overrides' fields set.
    shapes: dict[str, CostShape] = field(default_factory=dict)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> shape fields set by overrides

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
    scenario.shapes = {name: msgspec.structs.replace(shape, **scenario.fields.get(name, {}))
                       for name, shape in shapes(copy).items()}
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
    elif key == "on_stale":
        if value not in ("drop", "keep"):
            raise UserError(f"override {item!r}: expected drop or keep")
        _train_edge(plan, on_stale=value)
    elif len(parts) >= 3 and parts[0] == "nodes":
        _node(scenario, parts[1], ".".join(parts[2:]), value, item)
    else:
        raise UserError(f"override {item!r}: plan cannot simulate '{key}'; it simulates {', '.join(KEYS)}")


def _node(scenario: Scenario, name: str, rest: str, value: object, item: str) -> None:
    plan = scenario.plan
    node = plan.nodes.get(name)
    if node is None:
        raise UserError(f"override {item!r}: no node '{name}' (nodes: {', '.join(plan.nodes)})")
    if rest in GENERATE_FIELDS and node.kind != "generate":
        raise UserError(f"override {item!r}: '{rest}' is a key of generate nodes; '{name}' is a {node.kind} node")
    if rest in ("resources.replicas", "concurrency") and node.kind in ("train", "sync"):
        raise UserError(f"override {item!r}: plan simulates {rest.split('.')[-1]} of generate and "
                        f"reward/transform nodes; '{name}' is a {node.kind} node")
    if rest == "resources.replicas":
        node.resources = msgspec.structs.replace(node.resources, replicas=_number(value, item, int, 1))
    elif rest == "partial_rollout":
        if not isinstance(value, bool):
            raise UserError(f"override {item!r}: expected true or false")
        scenario.fields.setdefault(name, {})[rest] = value
    elif rest in ("group_size", "slots", "concurrency"):
        scenario.fields.setdefault(name, {})[rest] = _number(value, item, int, 1)
    else:
        node.config = _config_key(node, rest, value, item)


def _config_key(node: NodePlan, rest: str, value: object, item: str) -> dict[str, Any]:
    """The node's config with the key path `rest` set to `value`, where that changes the cost shape
    its operator declares; anything else is refused (plan would simulate the run unchanged)."""
    refused = f"override {item!r}: plan cannot simulate 'nodes.{node.name}.{rest}'"
    config = msgspec.json.decode(msgspec.json.encode(node.config))
    target, parts = config, rest.split(".")
    for i, part in enumerate(parts[:-1]):
        if target.get(part) is None:
            target[part] = {}
        target = target[part]
        if not isinstance(target, dict):
            raise UserError(f"{refused}: nodes.{node.name}.{'.'.join(parts[:i + 1])} is {target!r}, not a "
                            f"mapping; it simulates {', '.join(KEYS)}")
    target[parts[-1]] = value
    if config == node.config:
        return config  # the value the run had: nothing to simulate differently
    try:
        before, after = declared(node), declared(msgspec.structs.replace(node, config=config))
    except ValueError as e:
        raise UserError(f"{refused}: the node's config refuses it ({e}); it simulates {', '.join(KEYS)}") from None
    if before == after:
        raise UserError(f"{refused}: it changes nothing in the cost shape its operator declares; it simulates "
                        f"{', '.join(KEYS)}")
    return config


def _staleness(plan: Plan, limit: int) -> None:
    """The train node's data input edge: sync at 0, else async with this max_staleness."""
    _train_edge(plan, mode="async" if limit > 0 else "sync", max_staleness=limit)


def _train_edge(plan: Plan, **fields: Any) -> None:
    """Set `fields` on the train node's data input edges (the runtime's coordinator applies them)."""
    trains = plan.facts.trains
    for i, edge in enumerate(plan.edges):
        if edge.kind == "data" and edge.dst in trains:
            plan.edges[i] = msgspec.structs.replace(edge, **fields)


def _number(value: object, item: str, kind: type, least: float) -> int | float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or value == int(value))
    if not ok or value < least:
        raise UserError(f"override {item!r}: expected {'an integer' if kind is int else 'a number'} >= {least:g}")
    return kind(value)
