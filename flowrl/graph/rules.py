"""Compiler rules beyond the graph's shape: what a run would find only once its stages start.

Keys naming code or files (`flowrl.spec.refs`), the data source built as a run builds it, and how
many inputs a train or sync node may take.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec

from flowrl.data import source
from flowrl.graph.plan import EdgePlan
from flowrl.operator import Operator
from flowrl.spec import refs
from flowrl.spec.errors import Diagnostic
from flowrl.spec.load import Locator


def check_references(spec: Any, configs: dict[str, msgspec.Struct], loc: Locator, problems: list[Diagnostic]) -> None:
    """Every `module:attr`, model folder and data source the spec names."""
    found = refs.problems(spec.model, ("model",))
    model = None if found else msgspec.to_builtins(spec.model)  # a source may ask for its tokenizer
    found += refs.problems(spec.run, ("run",))  # run.trackers: registered and installed
    for name, config in configs.items():
        found += refs.problems(config, ("nodes", name))
    if not any(path[:2] == ("data", "source") for path, _ in found):
        prompted = any(getattr(config, "workflow", None) == "single_turn" for config in configs.values())
        found += source.problems(msgspec.to_builtins(spec.data), spec.run.seed, model, prompted)
    problems.extend(loc.diagnostic(path, message) for path, message in found)


def check_fan_in(edges: list[tuple[int, EdgePlan]], ops: dict[str, type[Operator]], loc: Locator,
                 problems: list[Diagnostic]) -> None:
    """A train node learns from one stream of trajectories; a sync node publishes one trainer's policy."""
    into: dict[str, list[tuple[int, EdgePlan]]] = defaultdict(list)
    for i, edge in edges:
        if edge.kind == "data":
            into[edge.dst].append((i, edge))
    for node, feeding in into.items():
        kind = ops[node].kind
        if kind in ("train", "sync") and len(feeding) > 1:
            sources = ", ".join(f"'{e.src}'" for _, e in feeding)
            what = "trajectories from one node" if kind == "train" else "the policy of one train node"
            problems.append(loc.diagnostic(("edges", feeding[1][0]), f"{kind} node '{node}' takes {what}, but "
                                           f"{sources} feed it; merge them before it", at_key=True))
