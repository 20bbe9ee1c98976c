"""Graph facts the runtime needs, derived once from a plan's nodes and data edges (`Plan.facts`).

- A generate node's `budget`: the smallest, over the data paths from it to a train node, of the
  sum of `max_staleness` of the path's async edges (sync edges add 0); None if it reaches no
  train node (it is then not limited by admission).
- `credited`: its lost samples credit its admission (flowrl/runtime/admission.py): only where
  budget > 0 and every train node it feeds has an async input (a sync input takes exactly its
  step's records, so a later step's sample cannot stand in for a lost one).
- `oversampling`: the first filter (in plan order) that asks it for more samples and reaches a
  train node (`NodePlan.oversampling`, flowrl/runtime/quota.py).
- An edge's staleness `limit`: for an async data edge, the longest sum of `max_staleness` over
  the async edges on a path from any node up to it, this edge's included; None for sync edges.
- Per node: the generate nodes upstream of it and the train nodes downstream of it (each
  includes the node itself when it is of that kind), and a train node's one data input edge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from flowrl.graph.plan import EdgePlan, NodePlan


class GenerateFacts(msgspec.Struct, kw_only=True):
    budget: int | None
    credited: bool
    feeds: list[str]  # the train nodes it reaches
    oversampling: str | None = None  # the filter node that asks it for more samples per step


class NodeFacts(msgspec.Struct, kw_only=True):
    generators: list[str]  # generate nodes with a data path to this node (itself included)
    trains: list[str]  # train nodes this node has a data path to (itself included)
    input: str | None = None  # a train node's one data input edge (its label)


class Facts(msgspec.Struct, kw_only=True):
    generate: dict[str, GenerateFacts]
    nodes: dict[str, NodeFacts]
    limits: dict[str, int | None]  # data edge label -> staleness limit

    @property
    def trains(self) -> list[str]:
        """The train nodes: those with a data input edge."""
        return [n for n, f in self.nodes.items() if f.input is not None]


def derive(nodes: dict[str, NodePlan], edges: list[EdgePlan], order: list[str]) -> Facts:
    """The facts of a graph. Raises ValueError if a train node has other than one data input
    (the compiler reports it as a located error first: flowrl/graph/rules.py)."""
    data = [e for e in edges if e.kind == "data"]
    reach = _reach(list(nodes), data)
    trains = [n for n, p in nodes.items() if p.kind == "train"]
    gens = [n for n, p in nodes.items() if p.kind == "generate"]
    inputs = {t: [e for e in data if e.dst == t] for t in trains}
    for t, ins in inputs.items():
        if len(ins) != 1:
            raise ValueError(f"train node '{t}' needs exactly one data input edge, has {len(ins)}")
    generate = {}
    for g in gens:
        budget = _budget(g, trains, data)
        feeds = [t for t in trains if t in reach[g]]
        credited = bool(budget) and all(inputs[t][0].mode == "async" for t in feeds)
        filters = [n for n in order if nodes[n].oversampling and n in reach[g]
                   and any(t in reach[n] for t in trains)]
        generate[g] = GenerateFacts(budget=budget, credited=credited, feeds=feeds,
                                    oversampling=filters[0] if filters else None)
    per_node = {n: NodeFacts(generators=[g for g in gens if n in reach[g]], trains=[t for t in trains if t in reach[n]],
                             input=inputs[n][0].label if n in inputs else None) for n in nodes}
    return Facts(generate=generate, nodes=per_node, limits=_limits(list(nodes), data))


def _reach(names: list[str], data: list[EdgePlan]) -> dict[str, set[str]]:
    """Each node -> the nodes it has a data path to, itself included."""
    after: dict[str, set[str]] = {n: set() for n in names}
    for e in data:
        after[e.src].add(e.dst)
    reach: dict[str, set[str]] = {}
    for n in names:
        seen, todo = {n}, [n]
        while todo:
            for m in after[todo.pop()] - seen:
                seen.add(m)
                todo.append(m)
        reach[n] = seen
    return reach


def _budget(g: str, trains: list[str], data: list[EdgePlan]) -> int | None:
    """Smallest staleness sum over the data paths from g to a train node (Dijkstra; weights >= 0)."""
    best = {g: 0}
    todo = [g]
    while todo:
        todo.sort(key=lambda n: best[n])
        n = todo.pop(0)
        for e in data:
            if e.src == n:
                cost = best[n] + _k(e)
                if cost < best.get(e.dst, cost + 1):
                    best[e.dst] = cost
                    todo.append(e.dst)
    reached = [best[t] for t in trains if t in best]
    return min(reached) if reached else None


def _limits(names: list[str], data: list[EdgePlan]) -> dict[str, int | None]:
    before: dict[str, list[EdgePlan]] = {n: [] for n in names}
    for e in data:
        before[e.dst].append(e)
    longest: dict[str, int] = {}

    def up_to(n: str) -> int:  # the longest staleness sum of a path ending at n (a DAG)
        if n not in longest:
            longest[n] = max((up_to(e.src) + _k(e) for e in before[n]), default=0)
        return longest[n]

    return {e.label: (up_to(e.src) + e.max_staleness if e.mode == "async" else None) for e in data}


def _k(edge: EdgePlan) -> int:
    return edge.max_staleness if edge.mode == "async" else 0
