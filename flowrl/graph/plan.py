"""The execution plan: what the compiler hands the runtime.

Plain data only. Operator classes are named by their registry name (or `module:attr`) and
resolved again inside each stage's process, so a plan crosses process boundaries as-is.
`Plan.facts` holds what the runtime needs to know about the graph (admission budgets, staleness
limits, which generate nodes feed which train nodes: flowrl/graph/facts.py), derived from the
nodes and edges when the plan is built; a plan.json written without them gets them on load.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from flowrl.graph.facts import Facts, derive
from flowrl.operator import MetricRoles, Resources


class NodePlan(msgspec.Struct, kw_only=True):
    name: str
    kind: str  # generate | reward | reference | train | sync | transform
    op: str  # registry name or module:attr
    config: dict[str, Any]  # validated against the operator's Config; rebuilt with msgspec.convert
    resources: Resources
    inputs: dict[str, str]  # port name -> port type
    outputs: dict[str, str]
    # (initial, maximum) samples per step / batch_size that this filter asks of generate (Operator.oversampling).
    oversampling: tuple[float, float] | None = None


class EdgePlan(msgspec.Struct, kw_only=True):
    src: str
    src_port: str
    dst: str
    dst_port: str
    port_type: str
    kind: Literal["data", "weights"] = "data"
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 0  # only meaningful for async data edges
    capacity: int = 64  # records (groups) the channel may hold
    on_stale: Literal["drop", "keep"] = "drop"

    @property
    def label(self) -> str:
        return f"{self.src}.{self.src_port} -> {self.dst}.{self.dst_port}"


class Plan(msgspec.Struct, kw_only=True):
    name: str
    nodes: dict[str, NodePlan]
    edges: list[EdgePlan]
    order: list[str]  # topological order over data edges
    # Pipeline-level sections, validated by the spec schema, as plain dicts.
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    run: dict[str, Any] = {}
    cluster: dict[str, Any] = {}
    phases: list[dict[str, Any]] = []
    seed: int = 0
    # Environment variables the spec reads (`${oc.env:NAME}`): their values, often secrets, are
    # shown as the interpolation in what is written to disk (`record`).
    environment: list[str] = []
    facts: Facts | None = None  # derived in __post_init__ unless given
    # What each train node's operator declares its metrics mean (`Operator.metric_roles`; a node that
    # declares none is absent), for flowrl/health.py. None: a plan built without the compiler, or
    # recorded before operators declared them; health then reads the built-in train operator's names.
    metric_roles: dict[str, MetricRoles] | None = None

    def __post_init__(self) -> None:
        if self.facts is None:
            self.facts = derive(self.nodes, self.edges, self.order)

    def record(self) -> bytes:
        """The plan as JSON for run files and `inspect`, environment values redacted."""
        values = {os.environ[n]: f"${{oc.env:{n}}}" for n in self.environment if os.environ.get(n)}
        return msgspec.json.encode(_redact(msgspec.to_builtins(self), values))

    def inputs_of(self, node: str) -> list[EdgePlan]:
        return [e for e in self.edges if e.dst == node]

    def outputs_of(self, node: str) -> list[EdgePlan]:
        return [e for e in self.edges if e.src == node]


def _redact(data: Any, values: dict[str, str]) -> Any:
    """`data` with each string equal to a value replaced by its placeholder; values of 8 characters
    or more also where they appear inside a longer string (a header, a URL)."""
    if isinstance(data, dict):
        return {k: _redact(v, values) for k, v in data.items()}
    if isinstance(data, list):
        return [_redact(v, values) for v in data]
    if isinstance(data, str) and values:
        if data in values:
            return values[data]
        for value, placeholder in values.items():
            if len(value) >= 8:
                data = data.replace(value, placeholder)
    return data
