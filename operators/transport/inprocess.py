"""In-process transport: trainer and engine share a process, so the record holds the tensors.

Nothing is copied on the way; the engine's `update_weights` copies each tensor once into its own
storage. The record therefore aliases the sender's tensors (with one train rank, the live
parameters): the sender must not change them until every engine has applied the record. In flowrl's
in-process executor with sync edges that holds by construction (the trainer waits for data made by
the new version); with async edges pass `snapshot=True`, which copies every tensor at send time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flowrl_operators.transport.base import Bucket, Stream, bucket_nbytes
from flowrl_operators.transport.registry import Transport


@dataclass(frozen=True)
class InProcessRecord:
    version: int
    buckets: list[Bucket]
    nbytes: int
    transport: str = "inprocess"


class InProcessSender:
    transport = "inprocess"

    def __init__(self, snapshot: bool = False) -> None:
        self.snapshot = snapshot

    def send(self, buckets: Iterable[Bucket], version: int) -> InProcessRecord:
        held = []
        for bucket in buckets:
            if self.snapshot:
                bucket = [(name, t.detach().clone()) for name, t in bucket]
            held.append([(name, t.detach()) for name, t in bucket])
        return InProcessRecord(version, held, sum(bucket_nbytes(b) for b in held))

    def wait(self, timeout: float | None = None) -> None:
        del timeout

    def close(self) -> None:
        pass


class InProcessStream(Stream):
    transport = "inprocess"

    def __init__(self, record: InProcessRecord) -> None:
        super().__init__()
        self._buckets = iter(record.buckets)

    def _next(self) -> Bucket | None:
        return next(self._buckets, None)


TRANSPORT = Transport("inprocess", InProcessRecord, lambda config: InProcessSender(snapshot=config.snapshot),
                      lambda record, replica: InProcessStream(record))
