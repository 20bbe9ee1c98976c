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
from flowrl.operator import DataFacts, Operator
from flowrl.spec import refs
from flowrl.spec.errors import Diagnostic
from flowrl.spec.load import Locator


def check_references(spec: Any, configs: dict[str, msgspec.Struct], ops: dict[str, type[Operator]], loc: Locator,
                     problems: list[Diagnostic]) -> None:
    """Every `module:attr`, model folder and data source the spec names, and what each operator's
    use of the data would meet (`Operator.check_data`)."""
    found = refs.problems(spec.model, ("model",))
    model = None if found else msgspec.to_builtins(spec.model)  # a source may ask for its tokenizer
    found += refs.problems(spec.run, ("run",))  # run.trackers: registered and installed
    for name, config in configs.items():
        found += refs.problems(config, ("nodes", name))
    if not any(path[:2] == ("data", "source") for path, _ in found):
        prompted = any(getattr(config, "workflow", None) == "single_turn" for config in configs.values())
        data = msgspec.to_builtins(spec.data)
        built, data_found = source.check(data, spec.run.seed, model, prompted)
        found += data_found
        facts = DataFacts(data=data, seed=spec.run.seed, model=model, source=built)
        for name, op in ops.items():
            for path, message in held(op, "check_data", configs[name], facts) if name in configs else []:
                path = ("nodes", name, *path) if path == ("op",) else path  # the contract's breach: at the node
                if (path, message) not in found:  # two generate nodes check the same eval once
                    found.append((path, message))
    problems.extend(loc.diagnostic(path, message) for path, message in found)


def check_stop_when(spec: Any, configs: dict[str, msgspec.Struct], ops: dict[str, type[Operator]], loc: Locator,
                    problems: list[Diagnostic]) -> None:
    """`run.stop_when: {train.<key>: ...}`: a key no train node reports would never stop the run.
    Checked against what the train nodes declare (`Operator.reported_metrics`); a node that declares
    nothing (a plugin's) may report anything, and then nothing is checked."""
    wanted = [name for name in spec.run.stop_when if name.startswith("train.")]
    trains = [name for name, op in ops.items() if op.kind == "train" and name in configs]
    if not wanted or not trains:
        return
    known: set[str] = set()
    for name in trains:
        try:
            declared = ops[name].reported_metrics(configs[name])
        except Exception:  # noqa: BLE001 - a plugin's declaration that fails declares nothing
            return
        if declared is None:
            return
        known |= set(declared)
    for name in wanted:
        if name.removeprefix("train.") not in known:
            listed = ", ".join(f"train.{k}" for k in sorted(known))
            problems.append(loc.diagnostic(("run", "stop_when", name), f"{name} is not a metric "
                                           f"{'the train nodes report' if len(trains) > 1 else 'the train node reports'}"
                                           f", so the run would never stop on it; known: {listed}", at_key=True))


def check_metric_roles(configs: dict[str, msgspec.Struct], ops: dict[str, type[Operator]], loc: Locator,
                       problems: list[Diagnostic]) -> None:
    """A train node's health roles (`Operator.metric_roles`) name metrics it reports, where it declares
    those (`reported_metrics`): a role naming another would never be judged, silently."""
    for name, op in ops.items():
        if op.kind != "train" or name not in configs:
            continue
        try:
            roles, reported = op.metric_roles(configs[name]), op.reported_metrics(configs[name])
        except Exception:  # noqa: BLE001 - a declaration that fails is reported by the compiler's own check
            continue
        if roles is None or reported is None:
            continue
        for role, metric in roles.names().items():
            if metric not in reported:
                problems.append(loc.diagnostic(("nodes", name, "op"), f"{who(op)}: its metric_roles() names "
                                               f"'{metric}' as {role}, which is not among its reported_metrics()"))


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


def held(op: type[Operator], method: str, config: msgspec.Struct, facts: Any) -> list[tuple[tuple, str]]:
    """The operator's `check_graph` or `check_data`, its result held to the contract: a list of
    (key path, message); a breach or a failure is reported at the node's `op` key, naming whose."""
    try:
        found = getattr(op, method)(config, facts)
    except Exception as e:  # noqa: BLE001 - a plugin's own check failing is its author's to fix: say whose
        return [(("op",), f"{who(op)}: its {method} failed: {type(e).__name__}: {e}")]
    good = isinstance(found, list | tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], tuple) and isinstance(p[1], str) for p in found)
    if not good:
        return [(("op",), f"{who(op)}: its {method} returned {short(found)}; it must return a list of "
                 "(key path tuple, message) pairs, e.g. [(('lr',), 'too high')]")]
    return list(found)


def who(op: type[Operator]) -> str:
    return f"operator {op.__module__}:{op.__qualname__}"


def short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
