"""The coordinator's checkpoint state: taken while the run goes on, restored before it resumes.

`take(coord)` copies the state without touching the live run: work a stage holds counts as handed
back (a sample in flight is re-issued on resume; records being processed wait in their channel
again), exactly as if that stage had died at this instant. Policy and weights records are not
kept: their values may be references that die with the run (Ray objects, a broadcast group), and
they can be large. Instead, `restore` has every train node publish its restored policy again
(a `publish` work item, see Stage._train_loop) and keeps each generate node from issuing anything
until its engine has loaded that version: an engine is rebuilt from `model.path` (version 0), so
without it a resumed run would generate with the initial weights under a later version's label.

This module is the coordinator's own code, kept apart for size, not a role: it reads and sets the
coordinator's fields and its roles' state, so it takes the `Coordinator` itself, not the roles'
`CoordinatorView` (role.py).
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

from flowrl.runtime.channel import Record, Work

if TYPE_CHECKING:  # the coordinator imports this module
    from flowrl.runtime.coordinator import Coordinator

# Fields of the coordinator a checkpoint keeps as they are. The roles keep their own through one
# state()/restore() pair each, with the same keys both ways: generate nodes (samples.py: cursor,
# lost, quota, reissue) and train nodes (batches.py: arrived, lost_before).
PLAIN = ("versions", "ended", "counters", "resumes")


def outstanding(coord: Coordinator) -> tuple[dict[str, list[Record]], dict[str, list[Work]]]:
    """What is left anywhere, as if every stage died now: records per channel (those held by work
    or a train node's buffer first, in the order they were taken) and samples per generate node
    to be handed out again (those to re-issue, then those in flight). Copies; the run goes on."""
    channels = {label: list(c.records.values()) for label, c in coord.channels.items()}
    samples = {node: list(works) for node, works in coord.samples.reissue.items()}
    for node, held in coord.held.items():
        for _, work in held.values():
            if work.kind == "sample":
                samples[node].append(work)
            for label, records in work.records.items():
                channels[label] = list(records) + channels[label]
    for label, records in coord.batches.waiting().items():
        channels[label] = records + channels[label]
    return channels, samples


def take(coord: Coordinator) -> bytes:
    """The coordinator's state now, with held work counted as handed back (the live run goes on).
    Everything is pickled before this returns, so the live objects are never shared."""
    policy = _policy_edges(coord)
    channels, samples = outstanding(coord)
    state = {field: getattr(coord, field) for field in PLAIN}
    state["channels"] = {label: ([r for r in records] if label not in policy else
                                 [Record(r.id, r.step, r.version, None) for r in records],
                                 coord.channels[label].ended) for label, records in channels.items()}
    state.update(coord.samples.state(samples))
    state.update(coord.batches.state())
    state["observe"] = coord.observe.state()
    state["untrained"] = coord.untrained.state()
    return pickle.dumps(state)


def restore(coord: Coordinator, blob: bytes) -> None:
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
    # Every train node publishes its restored policy; engines load it before issuing anything.
    coord.samples.restore(state)
    coord.batches.restore(state, coord.resumes)
    coord.observe.restore(state["observe"])
    coord.untrained.restore(state.get("untrained", {}))
    coord.ledger.write("resume", "", "", min(coord.versions.values(), default=0), coord.clock)


def _policy_edges(coord: Coordinator) -> set[str]:
    """Data edges out of train nodes: they carry policy records."""
    return {e.label for t in coord.trains for e in coord.outs[t] if e.kind == "data"}
