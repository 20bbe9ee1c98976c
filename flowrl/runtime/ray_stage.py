"""A stage under Ray: the actor that hosts it, and the coordinator proxy it calls.

Policy records travel by reference. A train stage's policy (the new weights, the whole model) is
put into the Ray object store by the train actor, its tensors as numpy byte arrays (`HostBytes`),
and only the `ObjectRef` is handed to `coord.complete`; the coordinator keeps that ref in the
policy channel, and the proxy of the sync stage that takes it resolves it before the operator sees
it. So the weights never enter the coordinator actor's memory, and they are copied once into the
object store (on the train actor's node), then mapped without a copy by a sync stage on that node.
A policy in buckets (the train operator's Snapshot) goes in bucket by bucket, one object each, in
the object store transport's layout (`StoredBuckets`): a sync stage with that transport hands the
trainer's refs on to the engines instead of putting the version a second time. The objects are
owned by the train actor and live while the coordinator, the sync stage or a weights record holds
a ref; a checkpoint never stores one (snapshot.py keeps policy records without their values). Ranks > 0 of a train group
hand back no policy at all: the coordinator only ever uses rank 0's (batches.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import warnings
from typing import Any

import msgspec
import ray

from flowrl.graph.plan import Plan
from flowrl.operator import POLICY
from flowrl.runtime.stage import Stage


class RemoteCoordinator:
    """Makes `await coord.method(...)` call the coordinator actor; policy values go as object refs."""

    def __init__(self, handle: Any, plan: Plan, node: str) -> None:
        self._handle = handle
        self._policy_ports = {p for p, t in plan.nodes[node].outputs.items() if t == POLICY}

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await method.remote(*args, **kwargs)

        return call

    async def complete(self, node: str, replica: int, work_id: str, outputs: dict[str, Any],
                       *args: Any, **kwargs: Any) -> bool:
        if self._policy_ports:
            outputs = {port: await _by_reference(value, replica) if port in self._policy_ports else value
                       for port, value in outputs.items()}
        return await self._handle.complete.remote(node, replica, work_id, outputs, *args, **kwargs)

    async def take(self, node: str, replica: int) -> Any:
        work = await self._handle.take.remote(node, replica)
        if work is not None and work.kind == "policy" and isinstance(work.value, ray.ObjectRef):
            work.value = await from_store(work.value)  # the whole version, from the object store
        return work


async def _by_reference(value: Any, replica: int) -> Any:
    if value is None or replica > 0:  # rank > 0: the coordinator keeps rank 0's policy only
        return None
    # ray.put copies the whole model once: off the stage's event loop.
    return await asyncio.to_thread(lambda: ray.put(StoredBuckets.put(value) if _is_buckets(value) else to_store(value)))


async def from_store(ref: Any) -> Any:
    """The value a train stage put (`_by_reference`), with its tensors back: on the same Ray node
    they map the object store's memory, read-only, without a copy."""
    value = await ref
    if isinstance(value, StoredBuckets):
        return await value.resolve()
    return _unpack(value)


def _is_buckets(value: Any) -> bool:
    """A policy in buckets (a train node's Snapshot): a non-empty list of lists of (name, tensor)."""
    return (isinstance(value, list) and bool(value) and all(isinstance(b, list) for b in value)
            and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and _is_tensor(p[1])
                    for b in value for p in b))


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "element_size")


class StoredBuckets:
    """A policy in buckets as the train stage puts it: each bucket its own object, a list of flat
    numpy byte arrays (the object store transport's bucket layout), described by (name, dtype,
    shape) triples; this small value holds their refs. A sync stage with the object store transport
    hands these refs on to the engines as they are (`object_refs` on what `resolve` returns): the
    version is put once, by the trainer, and never copied again before an engine's node pulls it."""

    __slots__ = ("buckets", "kind")

    def __init__(self, kind: type, buckets: list[tuple[Any, list[tuple[str, str, tuple[int, ...]]]]]) -> None:
        self.kind, self.buckets = kind, buckets

    @classmethod
    def put(cls, value: list) -> StoredBuckets:
        """Put each bucket of `value` (blocking: one copy of the bytes into the object store)."""
        buckets = []
        for bucket in value:
            stored = [HostBytes(t.cpu() if t.is_cuda else t) for _, t in bucket]
            metas = [(name, str(h.dtype).removeprefix("torch."), h.shape) for (name, _), h in zip(bucket, stored, strict=True)]
            buckets.append((ray.put([h.array for h in stored]), metas))
        return cls(type(value), buckets)

    async def resolve(self) -> Any:
        """The buckets with their tensors (mapped, not copied, on the same node), as the type that was
        put, carrying the refs as `object_refs`."""
        import torch

        arrays = await asyncio.gather(*(ref for ref, _ in self.buckets))
        with warnings.catch_warnings():  # a read-only mapping: readers (sync, engines) only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out = self.kind([[(name, torch.from_numpy(a).view(getattr(torch, dtype)).reshape(shape))
                              for a, (name, dtype, shape) in zip(bucket, metas, strict=True)]
                             for bucket, (_, metas) in zip(arrays, self.buckets, strict=True)])
        if self.kind is not list:  # a plain list takes no attribute: the sync stage re-puts it
            out.object_refs = self.buckets
        return out


class HostBytes:
    """A tensor as a flat numpy byte array. Ray pickles numpy arrays out of band: `ray.put` copies
    their bytes once into the object store and a reader on the node maps them. A torch tensor is
    pickled in band instead, copied on both ends (with the sync stage's re-bucketing, a 211 MB
    policy took 1.9 s to put and 0.7 s to read back here; tools/bench_weight_sync.py --ray-path)."""

    __slots__ = ("array", "dtype", "shape")

    def __init__(self, tensor: Any) -> None:
        import torch

        self.array = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.dtype, self.shape = tensor.dtype, tuple(tensor.shape)

    def tensor(self) -> Any:
        import torch

        with warnings.catch_warnings():  # a read-only mapping: readers (sync, engines) only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self.array).view(self.dtype).reshape(self.shape)


def to_store(value: Any) -> Any:
    """`value` as it goes into the object store: each tensor a `HostBytes`, a host tensor's bytes
    not copied (a CUDA tensor is copied to host memory first: a GPU trainer's policy must unpickle
    in a sync actor that sees no GPU; not exercised on a GPU by this project's tests)."""
    if _is_tensor(value):
        return HostBytes(value.cpu() if value.is_cuda else value)
    return _rebuilt(value, to_store)


def _unpack(value: Any) -> Any:
    return value.tensor() if isinstance(value, HostBytes) else _rebuilt(value, _unpack)


def _rebuilt(value: Any, each: Any) -> Any:
    """Dicts, lists and tuples with `each` applied to their items; a list subclass (a Snapshot)
    keeps its type; anything else as is."""
    if isinstance(value, dict):
        return {k: each(v) for k, v in value.items()}
    if isinstance(value, list):
        return type(value)(each(v) for v in value)
    if isinstance(value, tuple):
        return tuple(each(v) for v in value)
    return value


class StageActor:
    """Hosts one replica of a stage. The constructor takes only plain values (the plan as msgspec
    JSON, small): Ray inlines them in the actor's creation task, which it replays on a restart. The
    coordinator's handle comes with `start` instead: an actor handle among the constructor arguments
    would be kept in the object store, where a restart could not count on it (Ray warns of exactly
    that for an actor with max_restarts > 0)."""

    def __init__(self, plan: bytes, node: str, replica: int, run_dir: str | None, origin: float) -> None:
        self.plan = msgspec.json.decode(plan, type=Plan)
        self.node, self.replica, self.run_dir, self.origin = node, replica, run_dir, origin
        self.stage: Stage | None = None

    async def start(self, coord: Any, checkpoint: str | None, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Set up the stage, calling the coordinator `coord`; returns where it runs (pid, Ray node id
        and address)."""
        os.environ.update(env or {})
        remote = RemoteCoordinator(coord, self.plan, self.node)
        self.stage = Stage(self.plan, self.node, self.replica, remote, self.run_dir, self.origin, "ray")
        await self.stage.start(checkpoint)
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address()}

    def address(self) -> tuple[str, int]:
        """This host's address and a free port: the rendezvous of a replica group."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    async def run(self) -> str | None:
        return await self.stage.run()

    def save(self, path: str) -> None:
        self.stage.save(path)

    async def close(self) -> None:
        if self.stage is not None:  # None: closed before it started (a failed start elsewhere)
            await self.stage.close()
