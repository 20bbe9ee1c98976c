"""In-process transport: trainer and engine share a process, so the record holds the tensors.

Nothing is copied on the way; the engine's `update_weights` copies each tensor once into its own
storage. The record therefore aliases the sender's tensors (with one train rank, the live
parameters): the sender must not change them until every engine has applied the record. In flowrl's
in-process executor with sync edges that holds by construction (the trainer waits for data made by
the new version); with async edges pass `snapshot=True`, which copies every tensor at send time.
Buckets that are a `Snapshot` already (what the train node publishes: its copy of the step's
weights) are private to the version: neither is copied again, and the record says so (`owned`), so
the embedded engine adopts those tensors as its weights instead of copying them once more.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flowrl_operators.transport.base import Bucket, Snapshot, Stream, bucket_nbytes
from flowrl_operators.transport.registry import Transport


@dataclass(frozen=True)
class InProcessRecord:
    version: int
    buckets: list[Bucket]
    nbytes: int
    transport: str = "inprocess"
    owned: bool = False  # the tensors are this version's alone (see Snapshot): receivers may keep them


class InProcessSender:
    transport = "inprocess"

    def __init__(self, snapshot: bool = False) -> None:
        self.snapshot = snapshot

    def send(self, buckets: Iterable[Bucket], version: int) -> InProcessRecord:
        private = isinstance(buckets, Snapshot)
        held = []
        for bucket in buckets:
            if self.snapshot and not private:
                bucket = [(name, t.detach().clone()) for name, t in bucket]
            held.append([(name, t.detach()) for name, t in bucket])
        return InProcessRecord(version, held, sum(bucket_nbytes(b) for b in held), owned=private or self.snapshot)

    def wait(self, timeout: float | None = None) -> None:
        del timeout

    def close(self) -> None:
        pass


class InProcessStream(Stream):
    transport = "inprocess"

    def __init__(self, record: InProcessRecord) -> None:
        super().__init__()
        self._buckets = iter(record.buckets)
        self.owned = record.owned

    def _next(self) -> Bucket | None:
        return next(self._buckets, None)


TRANSPORT = Transport("inprocess", InProcessRecord, lambda config: InProcessSender(snapshot=config.snapshot),
                      lambda record, replica: InProcessStream(record))
