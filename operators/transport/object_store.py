"""Ray object store transport: each bucket is one object holding its tensors as numpy byte arrays.

Ray stores numpy arrays out of band, so `ray.put` copies each tensor once into shared memory and
`ray.get` in another process on the node maps it without copying (a torch tensor would be pickled
and copied both ways: about 0.4 s per 100 MB, measured on this project's 2-core CPU machine). Dtypes numpy lacks (bfloat16) travel as
raw bytes and are viewed back with torch. The record holds the object refs, so the objects live as
long as some record does; their owner is the sending process (the train actor, for a version a Ray
train stage put and the sync stage forwarded), which must outlive the transfer (if it dies, `ray.get`
raises and the engine keeps its old weights).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from flowrl_operators.transport.base import (
    Bucket,
    Snapshot,
    Stream,
    TensorMeta,
    TransferError,
    as_bytes,
    from_bytes,
)
from flowrl_operators.transport.registry import Transport


@dataclass(frozen=True)
class StoredSnapshot:
    """A Snapshot in the Ray object store, put there by the process that made it: what a train node
    publishes under Ray (operators/train.py), so the runtime carries only this small value and the
    weights never pass through the coordinator. Each bucket is one object in this transport's layout
    (a list of flat uint8 arrays; `metas` rebuild the tensors). The sync node hands the refs on as an
    `ObjectStoreRecord` with no second copy, or `load`s the tensors for another transport."""

    buckets: list[tuple[Any, list[TensorMeta]]]  # (ray.ObjectRef of a list of uint8 arrays, metas)
    nbytes: int

    @classmethod
    def put(cls, buckets: Iterable[Bucket]) -> StoredSnapshot:
        """Put each bucket into the object store (blocking: one copy of the bytes, none before it)."""
        import ray

        if not ray.is_initialized():
            raise TransferError("the object_store transport needs Ray: call ray.init() first, or choose "
                                "transport: inprocess")
        stored, nbytes = [], 0
        for bucket in buckets:
            metas = [TensorMeta.of(name, t) for name, t in bucket]
            arrays = [as_bytes(t.cpu()).numpy() for _, t in bucket]  # a host tensor's own memory, no copy
            nbytes += sum(a.nbytes for a in arrays)
            stored.append((ray.put(arrays), metas))
        return cls(stored, nbytes)

    def record(self, version: int) -> ObjectStoreRecord:
        """The weights record of these objects as they are: nothing is copied or put again."""
        return ObjectStoreRecord(version, self.buckets, self.nbytes)

    def load(self) -> Snapshot:
        """The tensors back (blocking); on the node that put them they map the objects, read-only."""
        import ray

        arrays = ray.get([ref for ref, _ in self.buckets], timeout=600)
        return Snapshot([_tensors(a, metas) for a, (_, metas) in zip(arrays, self.buckets, strict=True)])


@dataclass(frozen=True)
class ObjectStoreRecord:
    version: int
    buckets: list[tuple[Any, list[TensorMeta]]]  # as StoredSnapshot.buckets
    nbytes: int
    transport: str = "object_store"


class ObjectStoreSender:
    transport = "object_store"

    def send(self, buckets: Iterable[Bucket], version: int) -> ObjectStoreRecord:
        return StoredSnapshot.put(buckets).record(version)

    def wait(self, timeout: float | None = None) -> None:
        del timeout

    def close(self) -> None:
        pass


def _tensors(arrays: list[Any], metas: list[TensorMeta]) -> Bucket:
    """One bucket's tensors as views of its arrays (mapped read-only shared memory: readers only read)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(m.name, from_bytes(torch.from_numpy(a), m)) for m, a in zip(metas, arrays, strict=True)]


class ObjectStoreStream(Stream):
    transport = "object_store"
    FETCH_AHEAD = 4  # buckets fetched at once: from another node, pulls overlap each other and the engine's copy

    def __init__(self, record: ObjectStoreRecord) -> None:
        super().__init__()
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(self.FETCH_AHEAD, len(record.buckets))))
        self._pending = {self._pool.submit(_fetch, ref): (ref, metas) for ref, metas in record.buckets}

    def _next(self) -> Bucket | None:
        if not self._pending:
            return None
        # The first bucket to have arrived, not the next in order: the engine copies the small ones
        # while a large one (an embedding) is still being pulled from another node.
        fetch = next(iter(wait(self._pending, return_when=FIRST_COMPLETED).done))
        ref, metas = self._pending.pop(fetch)  # the engine copies it; the mapping is let go after
        try:
            arrays = fetch.result()
        except Exception as exc:  # owner died, object lost, timeout: the version cannot be completed
            raise TransferError(f"weights bucket {ref} could not be read from the object store: {exc}") from exc
        return _tensors(arrays, metas)  # the engine copies them

    def _finish(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _fetch(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=600)


TRANSPORT = Transport("object_store", ObjectStoreRecord, lambda config: ObjectStoreSender(),
                      lambda record, replica: ObjectStoreStream(record))
