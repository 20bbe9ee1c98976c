"""Records, channels and work items: the plain data the coordinator moves between stages.

A `Record` is the envelope the runtime puts around an operator's value (a `Group`, a policy
record, a weights record): its id, the data step it belongs to and the oldest policy version
that produced it. Operators never see envelopes, only values.

A `Channel` is one edge's queue. It is pure bookkeeping with no locking or waiting (the
coordinator does that), so it pickles into a checkpoint as-is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.graph.plan import EdgePlan


@dataclass
class Record:
    id: str  # "<step>:<index>" for data derived from sample <index> of <step>; "v<n>" for policy/weights
    step: int
    version: int  # oldest policy version that produced it (staleness is measured from it)
    value: Any


@dataclass
class Work:
    """One unit handed to a stage: a sample, a joined record, a train batch, a policy or weights."""

    id: str
    kind: str  # sample | record | batch | policy | weights
    step: int
    version: int  # for a sample: the version the stage had when it was admitted
    value: Any  # sample dict | {port: value} | list[{port: value}] | policy / weights value
    records: dict[str, list[Record]] = field(default_factory=dict)  # edge label -> records taken
    at: int = 0  # the consumer's version when it took the records (staleness is judged against it)
    lags: list[int] = field(default_factory=list)  # train batches: consumer version - record version


class Channel:
    """The queue of one edge.

    `limit` is the staleness limit applied when a consumer takes a record: a record whose version
    is below `consumer_version - limit` is stale. It is the sum of `max_staleness` over the async
    edges on the longest path from a generate stage through this edge (a sync edge adds 0; for a
    single async edge it is that edge's `max_staleness`). None means no check (sync edges).
    """

    def __init__(self, edge: EdgePlan, limit: int | None) -> None:
        self.edge = edge
        self.limit = limit
        self.records: dict[str, Record] = {}  # insertion (arrival) order
        self.ended: set[int] = set()  # steps the producer has finished on this edge
        self.per_step: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.records)

    @property
    def full(self) -> bool:
        # Sync edges are bounded by admission control instead: a sync consumer needs the whole
        # step present, so blocking its producer on capacity could deadlock.
        return self.edge.mode == "async" and len(self.records) >= self.edge.capacity

    def put(self, record: Record, front: bool = False) -> None:
        if record.id in self.records:
            raise RuntimeError(f"record {record.id} is already in channel {self.edge.label}")
        if front:
            self.records = {record.id: record, **self.records}
        else:
            self.records[record.id] = record
        self.per_step[record.step] = self.per_step.get(record.step, 0) + 1

    def pop(self, record_id: str) -> Record:
        record = self.records.pop(record_id)
        self.per_step[record.step] -= 1
        if not self.per_step[record.step]:
            del self.per_step[record.step]
        return record

    def has_step(self, step: int) -> bool:
        return step in self.per_step

    def of_step(self, step: int) -> list[Record]:
        return sorted((r for r in self.records.values() if r.step == step), key=lambda r: _order(r.id))

    def stale(self, record: Record, consumer_version: int) -> bool:
        return self.limit is not None and record.version < consumer_version - self.limit


def _order(record_id: str) -> tuple:
    """Sort key so that "2:10" follows "2:9"."""
    return tuple(int(p) if p.isdigit() else p for p in record_id.replace("v", "").split(":"))
