"""What every weight transport shares: the protocol, the metrics, and the bucket helpers.

A transport has two ends. The sending end (in the trainer's rank 0, or in the sync node) turns a
stream of buckets, each a list of (Hugging Face name, tensor), plus a policy version into a *weights
record*: a small picklable value that the runtime carries over the `kind: weights` edge. The
receiving end (in the generate node) turns the record back into buckets, which
`InferenceEngine.update_weights` applies as a whole version or not at all.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

Bucket = list[tuple[str, torch.Tensor]]
ALIGN = 64  # bytes; tensors packed into one flat buffer start at aligned offsets so views stay legal


class Snapshot(list):
    """Buckets whose tensors belong to one version alone: whoever made them (the train node's copy
    after a step, or the tensors a pipe or process boundary just rebuilt) changes them never again.
    A receiver may therefore keep such tensors as they are instead of copying them; the embedded
    engine adopts them as its weights (`Stream.owned`)."""


class TransferError(RuntimeError):
    """A version could not be delivered (the sender failed, a peer died, a record is unusable)."""


class SyncMetrics(msgspec.Struct, kw_only=True):
    """One applied weight sync, as the generate node records it in metrics.jsonl."""

    transport: str
    version: int
    bytes: int
    seconds: float  # from the start of the transfer until the engine serves the new version
    gb_per_s: float
    paused_s: float  # how long generation was stopped for this sync (see `apply`)
    buckets: int

    def as_dict(self, prefix: str = "sync/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in msgspec.structs.asdict(self).items() if k != "transport"}


@dataclass(frozen=True)
class TensorMeta:
    """How to rebuild one tensor from bytes: its name, dtype (torch name, e.g. "bfloat16") and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


@runtime_checkable
class WeightSender(Protocol):
    """The sending end. `send` may return before the bytes have moved (broadcast); `wait` blocks until
    the last version sent has been delivered (or raises why not)."""

    transport: str

    def send(self, buckets: Iterable[Bucket], version: int) -> Any: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class Stream:
    """The receiving end of one record: an async iterator of buckets for `engine.update_weights`.

    Blocking receives run in a worker thread so the engine's event loop keeps serving. `close()`
    finishes the transfer even if the consumer stopped early (a broadcast must drain what the sender
    still sends, or the group would fall out of step); it is idempotent.
    """

    transport = "none"
    # True when the buckets hold tensors nobody changes after this version (a Snapshot): the engine
    # may adopt them as its weights without copying. False (the default): it copies each tensor.
    owned = False

    def __init__(self) -> None:
        self.bytes = 0
        self.buckets = 0
        self.done_at: float | None = None  # when the last bucket was handed out

    def _next(self) -> Bucket | None:
        """The next bucket, or None at the end (blocking; runs in a worker thread)."""
        raise NotImplementedError

    def _finish(self) -> None:
        """Drain / release what is left (blocking)."""

    def __aiter__(self) -> AsyncIterator[Bucket]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Bucket]:
        while (bucket := await asyncio.to_thread(self._next)) is not None:
            self.buckets += 1
            self.bytes += bucket_nbytes(bucket)
            yield bucket
        self.done_at = time.perf_counter()

    async def close(self) -> None:
        await asyncio.to_thread(self._finish)


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view of the tensor's bytes (copies only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, as a view of the uint8 tensor `raw` (no copy)."""
    return raw.view(meta.torch_dtype).view(meta.shape)


# --- where buckets come from -----------------------------------------------------------------------


def weight_buckets(source: Any, bucket_bytes: int) -> Iterator[Bucket]:
    """Buckets of about `bucket_bytes` from what a train node publishes.

    Accepted: anything with `named_weights(bucket_bytes)` (the FSDP2 trainer: gathers one parameter
    at a time), a torch module (its parameters and persistent buffers), a mapping of name to tensor
    (a state dict), or an iterable that already yields buckets.
    """
    if hasattr(source, "named_weights"):
        yield from source.named_weights(bucket_bytes)
        return
    if isinstance(source, torch.nn.Module):
        yield from rebucket(source.state_dict().items(), bucket_bytes)
        return
    if isinstance(source, Mapping):
        yield from rebucket(source.items(), bucket_bytes)
        return
    if isinstance(source, Iterable):
        yield from source
        return
    raise TypeError(f"cannot take weights from a {type(source).__name__}: publish a trainer (named_weights), "
                    "a torch module, a state dict, or an iterable of [(name, tensor), ...] buckets")


def rebucket(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into buckets of at least `bucket_bytes` (the last may be smaller);
    `bucket_bytes <= 0` gives one tensor per bucket."""
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        bucket.append((name, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
