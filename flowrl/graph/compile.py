"""Compiler: checked spec -> networkx graph -> execution plan.

Every rule reports a located diagnostic; all problems of a spec are collected and reported
together. Rules: unknown op, invalid node config, malformed or dangling edges, port type
mismatch, unconnected input port, data-edge cycle (only `kind: weights` from a sync node to a
generate node may point back), isolated node, staleness and capacity limits, duplicate edges,
resources beyond the cluster, and each operator's own graph checks (`Operator.check_graph`);
then (flowrl/graph/rules.py) fan-in into train and sync nodes, and every `module:attr`, model
folder and data source the spec names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
import networkx as nx

from flowrl import registry
from flowrl.graph import rules
from flowrl.graph.plan import EdgePlan, NodePlan, Plan
from flowrl.operator import PROMPTS, WEIGHTS, CostShape, GraphFacts, Knobs, MetricRoles, Operator, Resources
from flowrl.spec.errors import Diagnostic, SpecError, did_you_mean
from flowrl.spec.load import LoadedSpec, load, validation_diagnostic
from flowrl.spec.schema import EdgeSpec

DEFAULT_CAPACITY = 64  # records an async edge holds before its producer waits
_EDGE = re.compile(r"^\s*([\w-]+)(?:\.([\w-]+))?\s*->\s*([\w-]+)(?:\.([\w-]+))?\s*$")


@dataclass
class Compiled:
    plan: Plan
    graph: nx.MultiDiGraph
    loaded: LoadedSpec


def compile_file(file: str, overrides: list[str] | None = None, probe: bool = False) -> Compiled:
    """Load, validate and compile a spec file, then check what it means (flowrl/spec/semantics.py;
    `probe`: also score a few rows with the reward). Raises SpecError with every problem found."""
    from flowrl.spec import semantics
    from flowrl.spec.phases import expand

    loaded = load(file, overrides)
    compiled = [(phase, compile_spec(phase_loaded)) for phase, phase_loaded in expand(loaded)]
    semantics.check(compiled, probe)
    return compiled[0][1]


def compile_spec(loaded: LoadedSpec) -> Compiled:
    spec, loc = loaded.spec, loaded.locator
    problems: list[Diagnostic] = []
    ops, configs, resources = _read_nodes(spec.nodes, loc, problems)

    graph = nx.MultiDiGraph()
    for name, op in ops.items():
        graph.add_node(name, kind=op.kind, op=spec.nodes[name]["op"])
    edges = _parse_edges(spec.edges, ops, spec.nodes, loc, problems)
    for i, edge in edges:
        graph.add_edge(edge.src, edge.dst, index=i, plan=edge)

    if not problems:  # connectivity is only meaningful once every node and edge could be read
        _check_connectivity(graph, ops, edges, loc, problems)
    _check_resources(spec, resources, loc, problems)
    if not problems:
        rules.check_fan_in(edges, ops, loc, problems)
        rules.check_stop_when(spec, configs, ops, loc, problems)
        rules.check_metric_roles(configs, ops, loc, problems)
        _check_operators(edges, ops, configs, resources, spec, loc, problems)
    rules.check_references(spec, configs, ops, loc, problems)  # imports the modules named, builds the data source
    if problems:
        raise SpecError(_ordered(problems))

    data_graph = nx.DiGraph([(e.src, e.dst) for _, e in edges if e.kind == "data"])
    data_graph.add_nodes_from(ops)
    plan = Plan(
        name=spec.name,
        nodes={
            name: NodePlan(
                name=name, kind=op.kind, op=spec.nodes[name]["op"],
                config=msgspec.to_builtins(configs[name]), resources=resources[name],
                inputs=dict(op.inputs), outputs=dict(op.outputs), oversampling=op.oversampling(configs[name]),
            )
            for name, op in ops.items()
        },
        edges=[e for _, e in edges],
        order=list(nx.lexicographical_topological_sort(data_graph)),
        model=msgspec.to_builtins(spec.model), data=msgspec.to_builtins(spec.data),
        run=msgspec.to_builtins(spec.run), cluster=msgspec.to_builtins(spec.cluster),
        phases=msgspec.to_builtins(spec.phases), seed=spec.run.seed, environment=loaded.environment,
        metric_roles={name: roles for name, op in ops.items()
                      if op.kind == "train" and (roles := op.metric_roles(configs[name])) is not None},
    )
    return Compiled(plan, graph, loaded)


def _read_nodes(nodes: dict[str, Any], loc, problems: list[Diagnostic]
                ) -> tuple[dict[str, type[Operator]], dict[str, msgspec.Struct], dict[str, Resources]]:
    """Each node's operator, config and resources; what cannot be read is reported in `problems`."""
    ops: dict[str, type[Operator]] = {}
    configs: dict[str, msgspec.Struct] = {}
    resources: dict[str, Resources] = {}

    if not nodes:
        problems.append(loc.diagnostic(("nodes",), "the pipeline has no nodes"))
    for name, entry in nodes.items():
        node_path = ("nodes", name)
        if not isinstance(entry, dict):
            problems.append(loc.diagnostic(node_path, "a node is a mapping with at least an 'op' key"))
            continue
        op_name = entry.get("op")
        if not isinstance(op_name, str):
            problems.append(loc.diagnostic(node_path, "missing 'op' (an operator name or module:attr path)"))
            continue
        try:
            op = registry.resolve(op_name)
        except registry.OperatorError as e:
            hint = did_you_mean(op_name, registry.names()) if ":" not in op_name else ""
            message = f"unknown operator '{op_name}'{hint}" if str(e).startswith("unknown") else str(e)
            problems.append(loc.diagnostic((*node_path, "op"), message))
            continue
        ops[name] = op
        try:
            resources[name] = msgspec.convert(entry.get("resources") or msgspec.to_builtins(op.resources), Resources)
        except msgspec.ValidationError as e:
            problems.append(validation_diagnostic(e, entry.get("resources"), (*node_path, "resources"), loc, Resources))
        body = {k: v for k, v in entry.items() if k not in ("op", "resources")}
        try:
            configs[name] = msgspec.convert(body, op.Config)
        except msgspec.ValidationError as e:
            problems.append(validation_diagnostic(e, body, node_path, loc, op.Config))
            continue
        problem = _knobs_problem(op, configs[name]) or _declaration_problem(op, configs[name], "metric_roles")
        if problem is not None:
            problems.append(loc.diagnostic((*node_path, "op"), problem))
    return ops, configs, resources


def _knobs_problem(op: type[Operator], config: msgspec.Struct) -> str | None:
    """Why the operator's `knobs(config)` is unusable (it raised, or is not a Knobs), or None."""
    try:
        knobs = op.knobs(config)
    except Exception as e:  # noqa: BLE001 - the plugin's own bug: say whose
        return f"{rules.who(op)}: its knobs() failed: {type(e).__name__}: {e}"
    if not isinstance(knobs, Knobs):
        return f"{rules.who(op)}: its knobs() returned {type(knobs).__name__}; it must return flowrl.operator.Knobs"
    if not isinstance(knobs.provides, frozenset | set):
        return f"{rules.who(op)}: its knobs().provides is {knobs.provides!r}; it must be a frozenset of field names"
    return None


# What an operator declares from its config, and the types it may return: the health detector and
# the planner read them later, far from the plugin that broke them.
DECLARED = {"metric_roles": (MetricRoles, type(None)), "cost_shape": (CostShape,)}


def _declaration_problem(op: type[Operator], config: msgspec.Struct, method: str) -> str | None:
    """Why the operator's declaration `method(config)` (one of DECLARED) is unusable, or None."""
    types = DECLARED[method]
    try:
        value = getattr(op, method)(config)
    except Exception as e:  # noqa: BLE001 - the plugin's own bug: say whose
        return f"{rules.who(op)}: its {method}() failed: {type(e).__name__}: {e}"
    if not isinstance(value, types):
        return (f"{rules.who(op)}: its {method}() returned {type(value).__name__}; it must return "
                f"{' or '.join('None' if t is type(None) else 'flowrl.operator.' + t.__name__ for t in types)}")
    return None


def _parse_edges(entries, ops, nodes, loc, problems) -> list[tuple[int, EdgePlan]]:
    out: list[tuple[int, EdgePlan]] = []
    seen: set[tuple[str, str, str, str]] = set()
    for i, entry in enumerate(entries):
        path: tuple[str | int, ...] = ("edges", i)
        options: Any = None
        if isinstance(entry, dict):
            if len(entry) != 1:
                problems.append(loc.diagnostic(path, "an edge mapping has exactly one key, 'src -> dst'"))
                continue
            text, options = next(iter(entry.items()))
            path = (*path, text)
        else:
            text = entry
        match = _EDGE.match(str(text))
        if not match:
            problems.append(loc.diagnostic(path, f"cannot read edge '{text}'; write 'src -> dst' or 'src.port -> dst.port'", at_key=True))
            continue
        src, src_port, dst, dst_port = match.groups()
        try:
            spec = msgspec.convert(options or {}, EdgeSpec)
        except msgspec.ValidationError as e:
            problems.append(validation_diagnostic(e, options, path, loc, EdgeSpec))
            continue
        unknown = [n for n in (src, dst) if n not in nodes]
        if unknown:
            for n in unknown:
                problems.append(loc.diagnostic(path, f"edge names unknown node '{n}'" + did_you_mean(n, nodes), at_key=True))
            continue
        if src not in ops or dst not in ops:
            continue  # the node itself is already reported
        before = len(problems)
        edge = _resolve_ports(src, src_port, dst, dst_port, spec, ops, path, loc, problems)
        if len(problems) > before or edge is None:
            continue
        key = (edge.src, edge.src_port, edge.dst, edge.dst_port)
        if key in seen:
            problems.append(loc.diagnostic(path, f"duplicate edge {edge.label}", at_key=True))
            continue
        seen.add(key)
        _check_edge_options(edge, spec, ops, path, loc, problems)
        out.append((i, edge))
    return out


def _resolve_ports(src, src_port, dst, dst_port, spec: EdgeSpec, ops, path, loc, problems) -> EdgePlan | None:
    outs, ins = ops[src].outputs, ops[dst].inputs
    for node, port, ports, side in ((src, src_port, outs, "output"), (dst, dst_port, ins, "input")):
        if port is not None and port not in ports:
            listed = ", ".join(ports) or "none"
            problems.append(loc.diagnostic(path, f"node '{node}' has no {side} port '{port}' ({side} ports: {listed})", at_key=True))
            return None
    wanted = WEIGHTS if spec.kind == "weights" else None
    # Without an explicit port, try the ports of the edge's kind first (weights for kind: weights).
    src_choices = [src_port] if src_port else sorted(outs, key=lambda p: (outs[p] == WEIGHTS) != (wanted == WEIGHTS))
    for sp in src_choices:
        t = outs[sp]
        dst_choices = [dst_port] if dst_port else [p for p, ti in ins.items() if ti == t]
        if len(dst_choices) == 1 and ins[dst_choices[0]] == t:
            return EdgePlan(
                src=src, src_port=sp, dst=dst, dst_port=dst_choices[0], port_type=t, kind=spec.kind,
                mode=spec.mode, max_staleness=spec.max_staleness or 0, capacity=spec.capacity or DEFAULT_CAPACITY,
                on_stale=spec.on_stale or "drop",
            )
    out_types = ", ".join(f"{p}: {t}" for p, t in outs.items()) or "none"
    in_types = ", ".join(f"{p}: {t}" for p, t in ins.items()) or "none"
    problems.append(loc.diagnostic(
        path, f"port type mismatch: '{src}' outputs ({out_types}) but '{dst}' takes ({in_types})", at_key=True))
    return None


def _check_edge_options(edge: EdgePlan, spec: EdgeSpec, ops, path, loc, problems) -> None:
    # A sync edge is bounded by its step and never stale, so these are read on async edges only.
    for key in ("max_staleness", "capacity", "on_stale"):
        if spec.mode == "sync" and getattr(spec, key) is not None:
            fix = "remove it" if spec.kind == "weights" else "set mode: async or remove it"
            problems.append(loc.diagnostic((*path, key), f"{key} applies only to async edges; {fix}"))
    if spec.max_staleness is not None and spec.max_staleness < 0:
        problems.append(loc.diagnostic((*path, "max_staleness"), "max_staleness must be >= 0"))
    if spec.mode == "async" and spec.max_staleness is None:
        edge.max_staleness = 1  # one-step-off unless said otherwise
    if spec.capacity is not None and spec.capacity < 1:
        problems.append(loc.diagnostic((*path, "capacity"), f"capacity must be >= 1, got {spec.capacity}"))
    if edge.port_type == WEIGHTS and spec.kind != "weights":
        problems.append(loc.diagnostic(path, "an edge carrying weights must be marked kind: weights", at_key=True))
    if spec.kind == "weights":
        if ops[edge.src].kind != "sync" or ops[edge.dst].kind != "generate":
            problems.append(loc.diagnostic(path, "kind: weights is only allowed from a sync node to a generate node", at_key=True))
        if spec.mode != "sync":
            problems.append(loc.diagnostic((*path, "mode"), "a weights edge has no mode; staleness is set on data edges"))


def _check_connectivity(graph: nx.MultiDiGraph, ops, edges, loc, problems) -> None:
    data = nx.DiGraph()
    for i, e in edges:
        if e.kind == "data":
            data.add_edge(e.src, e.dst, index=i)
    try:
        cycle = nx.find_cycle(data)
        u, v = cycle[-1][0], cycle[-1][1]
        names = " -> ".join([c[0] for c in cycle] + [cycle[0][0]])
        i = data.edges[u, v]["index"]
        problems.append(loc.diagnostic(("edges", i), f"cycle among data edges ({names}); only a kind: weights edge from sync to generate may point back", at_key=True))
    except nx.NetworkXNoCycle:
        pass
    for name, op in ops.items():
        if graph.degree(name) == 0:
            problems.append(loc.diagnostic(("nodes", name), f"node '{name}' is connected to nothing", at_key=True))
            continue
        fed = {d["plan"].dst_port for _, _, d in graph.in_edges(name, data=True)}
        for port, port_type in op.inputs.items():
            if port_type != PROMPTS and port not in fed:  # prompts come from the `data` section
                problems.append(loc.diagnostic(("nodes", name), f"input port '{port}' ({port_type}) of '{name}' is not connected", at_key=True))


def custom_problem(name: str, amount: float) -> str | None:
    """Why `name: amount` cannot be in `resources.custom`, Ray's custom resources (None: it can)."""
    if not name.strip():
        return "a custom resource needs a name"
    if name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:"):
        return f"'{name}' is Ray's own resource: use resources.cpus / resources.gpus, or a name of your own"
    if not amount > 0 or amount == float("inf"):
        return f"each replica needs an amount of '{name}' above 0 (fractions are fine), not {amount}"
    return None


# Ray's label syntax (Kubernetes-style): a name of at most 63 letters, digits, '-', '_', '.', starting
# and ending with a letter or digit; a key may have a DNS prefix ('example.com/gpu'); a selector value
# is `v`, `!v`, `in(v1, v2)` or `!in(v1, v2)` (Ray's label_selector documentation).
LABEL_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
LABEL_SELECTOR = re.compile(rf"!?(?:{LABEL_NAME}|in\({LABEL_NAME}(?:, ?{LABEL_NAME})*\))")


def label_key_problem(key: str) -> str | None:
    """Why `key` cannot be a key of `resources.labels`, Ray's label selector (None: it can)."""
    if not key.strip():
        return "a node label needs a name"
    prefix, _, label = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not all(re.fullmatch(LABEL_NAME, p) for p in prefix.split("."))):
        return f"label key {key!r}: its prefix must be a DNS name (e.g. example.com/{label})"
    if not re.fullmatch(LABEL_NAME, label):
        return (f"label key {key!r}: a label name is 1-63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit")
    return None


def _check_resources(spec, resources: dict[str, Resources], loc, problems) -> None:
    cluster = spec.cluster
    total_cpus = total_gpus = 0.0
    for name, r in resources.items():
        for key, amount in r.custom.items():  # Ray placement keys (flowrl/runtime/executors/ray_placement.py)
            if (problem := custom_problem(key, amount)) is not None:
                problems.append(loc.diagnostic(("nodes", name, "resources", "custom", key), problem, at_key=True))
        for key, value in r.labels.items():
            at = ("nodes", name, "resources", "labels", *((key,) if key.strip() else ()))
            if (problem := label_key_problem(key)) is not None:
                problems.append(loc.diagnostic(at, problem, at_key=bool(key.strip())))
            elif value and not LABEL_SELECTOR.fullmatch(value):
                problems.append(loc.diagnostic(at, f"{value!r} is not a Ray label selector; write a value (a1), "
                                               "its negation (!a1), in(a1, a2) or !in(a1, a2), each value 1-63 "
                                               "letters, digits, '-', '_' or '.'"))
        cpus, gpus = r.cpus * r.replicas, r.gpus * r.replicas
        total_cpus, total_gpus = total_cpus + cpus, total_gpus + gpus
        if cpus > cluster.cpus or gpus > cluster.gpus:
            problems.append(loc.diagnostic(
                ("nodes", name, "resources"),
                f"asks for {cpus:g} CPUs and {gpus:g} GPUs but the cluster section offers {cluster.cpus:g} CPUs and {cluster.gpus:g} GPUs"))
    if not problems and (total_cpus > cluster.cpus + 1e-9 or total_gpus > cluster.gpus + 1e-9):
        problems.append(loc.diagnostic(
            ("cluster",),
            f"the nodes together ask for {total_cpus:g} CPUs and {total_gpus:g} GPUs; the cluster offers {cluster.cpus:g} and {cluster.gpus:g}"))


def _check_operators(edges, ops, configs, resources, spec, loc, problems) -> None:
    data = nx.DiGraph([(e.src, e.dst, {"mode": e.mode}) for _, e in edges if e.kind == "data"])
    data.add_nodes_from(ops)
    for name, op in ops.items():
        if name not in configs:
            continue
        upstream = nx.ancestors(data, name)
        async_in = any(d["mode"] == "async" for _, v, d in data.edges(data=True) if v == name or v in upstream)
        partial = any(ops[u].knobs(configs[u]).partial_rollout for u in upstream if u in configs)
        provided = frozenset(field for u in upstream if u in configs
                             for field in ops[u].provides | ops[u].knobs(configs[u]).provides)
        facts = GraphFacts(async_upstream=async_in, partial_rollout_upstream=partial, executor=spec.run.executor,
                           upstream_provides=provided, replicas=resources[name].replicas if name in resources else 1,
                           model_path=spec.model.path)
        found = rules.held(op, "check_graph", configs[name], facts)
        for key_path, message in found:
            problems.append(loc.diagnostic(("nodes", name, *key_path), message))
        # The cost shape is read from a config the operator's own checks passed: a bad loss key is
        # reported at its own key above, not as the shape's failure.
        if not found and (problem := _declaration_problem(op, configs[name], "cost_shape")):
            problems.append(loc.diagnostic(("nodes", name, "op"), problem))


def _ordered(problems: list[Diagnostic]) -> list[Diagnostic]:
    return sorted(problems, key=lambda d: (d.line == 0, d.line, d.col))
