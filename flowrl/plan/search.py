"""`flowrl plan RUN_DIR --search`: engine replicas 1..N x max_staleness 0..S under a device budget,
best first by predicted samples per second."""

from __future__ import annotations

from typing import Any

from flowrl.graph.plan import Plan
from flowrl.plan.changes import apply
from flowrl.plan.fit import Costs


def budget_kind(plan: Plan) -> str:
    """What the budget counts: GPUs where a node asks for them, else CPUs."""
    return "gpus" if any(n.resources.gpus for n in plan.nodes.values()) else "cpus"


def spend(plan: Plan, kind: str) -> float:
    return sum(getattr(n.resources, kind) * n.resources.replicas for n in plan.nodes.values())


def search(plan: Plan, costs: Costs, overrides: list[str], steps: int, cores: float, budget: float | None,
           max_replicas: int = 4, max_staleness: int = 4) -> dict[str, Any]:
    """Every configuration of the space that fits the budget, predicted, best first."""
    from flowrl.plan import predict

    kind = budget_kind(plan)
    budget = budget if budget is not None else float(plan.cluster.get(kind) or 0) or None
    gens = [n for n, p in plan.nodes.items() if p.kind == "generate"]
    found = []
    for replicas in range(1, max_replicas + 1):
        for staleness in range(max_staleness + 1):
            changes = [*overrides, *(f"nodes.{g}.resources.replicas={replicas}" for g in gens),
                       f"max_staleness={staleness}"]
            scenario = apply(plan, changes, steps)
            used = spend(scenario.plan, kind)
            if budget is not None and used > budget + 1e-9:
                continue
            figures = predict(scenario, costs, cores)
            found.append({"replicas": replicas, "max_staleness": staleness, kind: round(used, 3),
                          "changes": changes, **figures})
    found.sort(key=lambda r: -r["samples_per_s"])
    return {"budget": {kind: budget}, "space": {"replicas": [1, max_replicas], "max_staleness": [0, max_staleness]},
            "configurations": found}
