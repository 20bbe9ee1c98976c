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

from flowrl_operators.transport.base import Bucket, Stream, TensorMeta, TransferError, as_bytes, from_bytes
from flowrl_operators.transport.registry import Transport


@dataclass(frozen=True)
class ObjectStoreRecord:
    version: int
    buckets: list[tuple[Any, list[TensorMeta]]]  # (ray.ObjectRef of a list of uint8 arrays, metas)
    nbytes: int
    transport: str = "object_store"


class ObjectStoreSender:
    transport = "object_store"

    def send(self, buckets: Iterable[Bucket], version: int) -> ObjectStoreRecord:
        import ray

        if not ray.is_initialized():
            raise TransferError("the object_store transport needs Ray: call ray.init() first, or choose "
                                "transport: inprocess")
        refs, nbytes = [], 0
        for bucket in buckets:
            metas = [TensorMeta.of(name, t) for name, t in bucket]
            arrays = [as_bytes(t.cpu()).numpy() for _, t in bucket]
            nbytes += sum(a.nbytes for a in arrays)
            refs.append((ray.put(arrays), metas))
        return ObjectStoreRecord(version, refs, nbytes)

    def forward(self, stored: list[tuple[Any, list[tuple[str, str, tuple[int, ...]]]]], version: int) -> ObjectStoreRecord:
        """The record of buckets already in the object store in this transport's layout (a list of
        uint8 arrays per object; a Ray train stage puts a policy so, `object_refs` on what the sync
        stage receives): their refs go on as they are, nothing is copied or put again. The engines
        then read the trainer's objects, which live while a record holds their refs."""
        buckets = [(ref, [TensorMeta(name, dtype, tuple(shape)) for name, dtype, shape in metas]) for ref, metas in stored]
        return ObjectStoreRecord(version, buckets, sum(m.nbytes for _, metas in buckets for m in metas))

    def wait(self, timeout: float | None = None) -> None:
        del timeout

    def close(self) -> None:
        pass


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
        with warnings.catch_warnings():
            # The arrays map read-only shared memory; the engine only reads (and copies) them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return [(m.name, from_bytes(torch.from_numpy(a), m)) for m, a in zip(metas, arrays, strict=True)]

    def _finish(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _fetch(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=600)


TRANSPORT = Transport("object_store", ObjectStoreRecord, lambda config: ObjectStoreSender(),
                      lambda record, replica: ObjectStoreStream(record))
