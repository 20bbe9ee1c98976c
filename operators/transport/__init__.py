"""Weight transports: deliver a policy version from the trainer to the generate engines in buckets.

Sending end (train rank 0 or the sync node)::

    sender = make_sender(sync_config)    # inprocess | object_store | broadcast | a plugin (registry.py)
    record = sender.send(trainer.named_weights(bucket_bytes), version)   # small and picklable

Receiving end (the generate node), one call::

    metrics = await apply(engine, record, version, replica=i)   # -> SyncMetrics

`apply` gives the engine the whole version or nothing: if the transfer fails half-way, the engine
keeps serving its previous version with its previous weights, and `apply` raises TransferError.
"""

from __future__ import annotations

import time
from typing import Any

from flowrl_operators.transport import registry
from flowrl_operators.transport.base import (
    Bucket,
    Snapshot,
    Stream,
    SyncMetrics,
    TensorMeta,
    TransferError,
    WeightSender,
    rebucket,
    weight_buckets,
)
from flowrl_operators.transport.broadcast import BroadcastGroup, BroadcastRecord, BroadcastSender
from flowrl_operators.transport.inprocess import InProcessRecord, InProcessSender
from flowrl_operators.transport.object_store import ObjectStoreRecord, ObjectStoreSender, StoredSnapshot

__all__ = [
    "Bucket", "BroadcastGroup", "BroadcastRecord", "BroadcastSender", "InProcessRecord", "InProcessSender",
    "ObjectStoreRecord", "ObjectStoreSender", "Policy", "Snapshot", "StoredSnapshot", "Stream", "SyncMetrics", "TensorMeta", "TransferError",
    "WeightSender", "WeightsRecord", "apply", "make_sender", "open_stream", "rebucket", "weight_buckets",
]

WeightsRecord = InProcessRecord | ObjectStoreRecord | BroadcastRecord  # the built-ins' records
# What a train node publishes and a sync node takes: its copy of the weights, in one process or
# (under Ray) put in the object store by the train actor; a record it sent itself; None, no change.
Policy = Snapshot | StoredSnapshot | WeightsRecord | None


def make_sender(config: Any) -> WeightSender:
    """The sending end a sync node's config (`SyncConfig`) asks for (`transport`, see registry.py)."""
    name = config.transport
    if name == "auto":
        import ray

        name = "object_store" if ray.is_initialized() else "inprocess"
    return registry.get(name).sender(config)


def open_stream(record: Any, replica: int = 0) -> Stream:
    """The receiving end for `record`; `replica` is the engine's index among the receivers."""
    transport = registry.of_record(record)
    if transport is None:
        raise TransferError(f"not a weights record: {type(record).__name__}; a sync node makes them")
    return transport.stream(record, replica)


async def apply(engine: Any, record: Any, version: int, *, replica: int = 0) -> SyncMetrics:
    """Receive `record` into `engine` as policy `version` (atomically) and measure it.

    `paused_s` is how long generation stood still for this sync: all of it if the engine was already
    paused (partial rollout pauses around the update), otherwise the time from the last bucket
    received to the engine serving the new version (it swaps weights between two decode steps; an
    upper bound, as it includes waiting for the step in progress).
    """
    start = time.perf_counter()
    paused_before = bool(getattr(engine, "paused", False))
    stream = open_stream(record, replica)
    try:
        await engine.update_weights(stream, version)
    except TransferError:
        raise
    except Exception as exc:
        raise TransferError(f"engine kept version {engine.version}: applying version {version} failed: "
                            f"{exc!r}") from exc
    finally:
        await stream.close()
    end = time.perf_counter()
    seconds = end - start
    paused = seconds if paused_before else end - (stream.done_at or end)
    return SyncMetrics(transport=stream.transport, version=version, bytes=stream.bytes, seconds=seconds,
                       gb_per_s=stream.bytes / seconds / 1e9 if seconds > 0 else 0.0, paused_s=paused,
                       buckets=stream.buckets)
