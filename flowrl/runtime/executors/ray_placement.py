"""Where the Ray executor puts each stage, and the record of where it went.

Each node gets a placement group of its own, one bundle per replica: `cpus` and `gpus` as Ray's
CPU and GPU, `custom` as Ray custom resources (what `ray start --resources '{"name": n}'` offers),
`labels` as the bundle's label selector (what `ray start --labels key=value` sets), and
`placement` as the group's strategy (pack, spread, strict_pack, strict_spread). A node without
placement keys goes wherever Ray finds room. Before anything is placed, every node's request is
checked against the Ray nodes alive now: a request no node can meet stops the run with a message
naming the node and what the cluster offers, instead of waiting forever (a cluster that adds nodes
on demand must have them up first).

`placement.json` in the run directory records whether the run attached to a running cluster
(`attached`), how many Ray nodes were alive (`ray_nodes`), and per node (`nodes`) each replica's
Ray node (id and address), its process id, and that Ray node's custom resources and labels;
`flowrl inspect RUN_DIR` prints it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.operator import Resources

STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
# Resources Ray defines itself: a node asks for them with cpus / gpus, never under `custom`.
RAY_OWN = ("CPU", "GPU", "memory", "object_store_memory")


class PlacementError(RuntimeError):
    """No Ray node can host a stage as its `resources` ask."""


def bundle(resources: Resources) -> dict[str, float]:
    if resources.cpus <= 0:
        raise PlacementError("Ray rejects a bundle of 0 CPUs: give every node resources.cpus > 0 (fractions are fine)")
    out = {"CPU": resources.cpus, **resources.custom}
    if resources.gpus:
        out["GPU"] = resources.gpus
    return out


def group(name: str, resources: Resources) -> Any:
    """The placement group of node `name`: a bundle per replica."""
    from ray.util.placement_group import placement_group

    n = resources.replicas
    selector = [dict(resources.labels) for _ in range(n)] if resources.labels else None
    return placement_group([bundle(resources) for _ in range(n)], strategy=STRATEGIES[resources.placement],
                           bundle_label_selector=selector)


def check(resources: dict[str, Resources], nodes: list[dict[str, Any]]) -> None:
    """Raise PlacementError naming the first node whose replicas no alive Ray node can host, or
    the resources all nodes together ask beyond what the alive Ray nodes have in total (a cluster
    that other jobs share may still lack room; Ray then waits)."""
    alive = [n for n in nodes if n.get("Alive")]
    for name, res in resources.items():
        fits = [n for n in alive if _fits(bundle(res), res.labels, n)]
        need = res.replicas if res.placement == "strict_spread" else 1
        if len(fits) < need:
            offers = "; ".join(f"{n['NodeManagerAddress']}: {_offer(n)}" for n in alive)
            raise PlacementError(
                f"node '{name}': no Ray node can host it: it asks {bundle(res)}"
                + (f" on a node labelled {res.labels}" if res.labels else "")
                + (f" on {need} distinct nodes (placement: strict_spread)" if need > 1 else "")
                + f"; the cluster's nodes offer {offers or 'nothing'}. Change nodes.{name}.resources, "
                "or start Ray nodes that offer it (ray start --resources / --labels)")
    demand: dict[str, float] = {}
    for res in resources.values():
        for key, amount in bundle(res).items():
            demand[key] = demand.get(key, 0.0) + amount * res.replicas
    supply = {key: sum(n.get("Resources", {}).get(key, 0.0) for n in alive) for key in demand}
    short = {key: (round(need, 6), supply[key]) for key, need in demand.items() if need > supply[key] + 1e-9}
    if short:  # Ray would wait for them forever
        raise PlacementError("the nodes together ask for more than the Ray cluster has: "
                             + ", ".join(f"{k} {need:g} of {have:g}" for k, (need, have) in short.items())
                             + ". Lower the nodes' resources (or replicas), or add Ray nodes")


def _fits(ask: dict[str, float], labels: dict[str, str], node: dict[str, Any]) -> bool:
    total = node.get("Resources", {})
    if any(total.get(k, 0.0) + 1e-9 < v for k, v in ask.items()):
        return False
    have = node.get("Labels", {})
    # Only plain values are checked here; Ray's selector operators (!v, in(...)) are left to Ray.
    return all(have.get(k) == v for k, v in labels.items() if not v.startswith("!") and "(" not in v)


def _offer(node: dict[str, Any]) -> str:
    res = {k: v for k, v in node.get("Resources", {}).items() if k not in ("memory", "object_store_memory")
           and not k.startswith("node:")}
    labels = {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}
    return json.dumps(res) + (f" labels {json.dumps(labels)}" if labels else "")


def record(where: dict[tuple[str, int], dict[str, Any]], nodes: list[dict[str, Any]]) -> dict[str, list[dict]]:
    """placement.json's content: per node, where each replica runs."""
    by_id = {n["NodeID"]: n for n in nodes}
    out: dict[str, list[dict]] = {}
    for (name, replica), at in sorted(where.items()):
        node = by_id.get(at["node_id"], {})
        custom = sorted(k for k in node.get("Resources", {}) if k not in RAY_OWN and not k.startswith("node:"))
        labels = {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}
        out.setdefault(name, []).append({"replica": replica, "ray_node": at["node_id"], "ip": at["ip"],
                                         "pid": at["pid"], "custom": custom, "labels": labels})
    return out


def write(run_dir: str | None, where: dict[tuple[str, int], dict[str, Any]], attached: bool) -> None:
    if run_dir is None:
        return
    import ray

    content = {"attached": attached, "ray_nodes": sum(1 for n in ray.nodes() if n.get("Alive")),
               "nodes": record(where, ray.nodes())}
    Path(run_dir, "placement.json").write_text(json.dumps(content, indent=1) + "\n")
