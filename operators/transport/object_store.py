"""Ray object store transport: each bucket is one object holding its tensors as numpy byte arrays.

Ray stores numpy arrays out of band, so `ray.put` copies each tensor once into shared memory and
`ray.get` in another process on the node maps it without copying (a torch tensor would be pickled
and copied both ways: about 0.4 s per 100 MB, measured on this project's 2-core CPU machine). Dtypes numpy lacks (bfloat16) travel as
raw bytes and are viewed back with torch. The record holds the object refs, so the objects live as
long as some record does; their owner is the sending process, which must outlive the transfer (if it
dies, `ray.get` raises and the engine keeps its old weights).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
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

    def wait(self, timeout: float | None = None) -> None:
        del timeout

    def close(self) -> None:
        pass


class ObjectStoreStream(Stream):
    transport = "object_store"
    FETCH_AHEAD = 4  # buckets fetched at once: from another node, pulls overlap each other and the engine's copy

    def __init__(self, record: ObjectStoreRecord) -> None:
        super().__init__()
        self._metas = [metas for _, metas in record.buckets]
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(self.FETCH_AHEAD, len(record.buckets))))
        self._fetches = [(ref, self._pool.submit(_fetch, ref)) for ref, _ in record.buckets]
        self._at = 0

    def _next(self) -> Bucket | None:
        if self._at == len(self._fetches):
            return None
        (ref, fetch), metas = self._fetches[self._at], self._metas[self._at]
        self._fetches[self._at] = (ref, None)  # the engine copies it; let go of the mapping after
        self._at += 1
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
