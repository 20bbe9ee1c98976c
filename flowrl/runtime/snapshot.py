"""The coordinator's checkpoint state: taken while the run goes on, restored before it resumes.

`take(coord)` copies the state without touching the live run: work a stage holds counts as handed
back (a sample in flight is re-issued on resume; records being processed wait in their channel
again), exactly as if that stage had died at this instant. Policy and weights records are not
kept: their values may be references that die with the run (Ray objects, a broadcast group), and
they can be large. Instead, `restore` has every train node publish its restored policy again
(a `publish` work item, see Stage._train_loop) and keeps each generate node from issuing anything
until its engine has loaded that version: an engine is rebuilt from `model.path` (version 0), so
without it a resumed run would generate with the initial weights under a later version's label.
"""

from __future__ import annotations

import pickle
from typing import Any

from flowrl.runtime.channel import Record

# Fields of the coordinator a checkpoint keeps as they are.
PLAIN = ("versions", "cursor", "ended", "counters", "lost", "lost_before", "arrived", "resumes")


def take(coord: Any) -> bytes:
    """The coordinator's state now, with held work counted as handed back (the live run goes on)."""
    policy = _policy_edges(coord)
    channels = {label: list(c.records.values()) for label, c in coord.channels.items()}
    reissue = {node: list(works) for node, works in coord.reissue.items()}
    for node, held in coord.held.items():
        for _, work in held.values():
            if work.kind == "sample":
                reissue[node].append(work)
            for label, records in work.records.items():
                channels[label] = list(records) + channels[label]
    for t in coord.trains:
        label = coord.ins[t][0].label
        channels[label] = list(coord.buffers[t]) + channels[label]
    state = {field: getattr(coord, field) for field in PLAIN}
    state["channels"] = {label: ([r for r in records] if label not in policy else
                                 [Record(r.id, r.step, r.version, None) for r in records],
                                 coord.channels[label].ended) for label, records in channels.items()}
    state["reissue"] = reissue
    state["quota"] = {g: (q.fate, q.bonus) for g, q in coord.quota.items()}
    state["observe"] = coord.observe.state()
    return pickle.dumps(state)


def restore(coord: Any, blob: bytes) -> None:
    state = pickle.loads(blob)
    for field in PLAIN:
        if field in state:
            setattr(coord, field, state[field])
    coord.resumes += 1
    policy = _policy_edges(coord)
    for label, (records, ended) in state["channels"].items():
        ch = coord.channels[label]
        ch.ended = ended
        for r in records:
            if label in policy:  # superseded by the publish below
                coord.ledger.write("drop", label, r.id, r.step, r.version, reason="superseded")
            else:
                ch.put(r)
    coord.reissue = state["reissue"]
    for g, (fate, bonus) in state["quota"].items():
        coord.quota[g].fate, coord.quota[g].bonus = fate, bonus
    coord.observe.restore(state["observe"])
    coord.ledger.write("resume", "", "", min(coord.versions.values(), default=0), coord.clock)
    # Every train node publishes its restored policy; engines load it before issuing anything.
    coord.republish = {t for t in coord.trains if coord.versions[t] > 0}
    for g, edge in coord.weights_in.items():
        if edge is not None and coord.plan.nodes[g].kind == "generate":
            coord.required[g] = coord.clock


def _policy_edges(coord: Any) -> set[str]:
    """Data edges out of train nodes: they carry policy records."""
    return {e.label for t in coord.trains for e in coord.outs[t] if e.kind == "data"}
