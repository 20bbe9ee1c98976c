"""A stage under Ray: the actor that hosts it, and the coordinator proxy it calls.

Policy records travel by reference. What a train stage publishes (opaque here: the built-in train
node's is a small `StoredSnapshot` whose weights it put into the object store itself) is put into
the Ray object store by the train actor, and only the `ObjectRef` is handed to `coord.complete`;
the coordinator keeps that ref in the policy channel, and the proxy of the sync stage that takes it
resolves it before the operator sees it. So no policy value enters the coordinator actor's memory,
whatever a plugin's train node publishes. The objects are owned by the train actor and live while
the coordinator, the sync stage or a weights record holds a ref; a checkpoint never stores one
(snapshot.py keeps policy records without their values). Ranks > 0 of a train group hand back no
policy at all: the coordinator only ever uses rank 0's (batches.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
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
            outputs = {port: await by_reference(value, replica) if port in self._policy_ports else value
                       for port, value in outputs.items()}
        return await self._handle.complete.remote(node, replica, work_id, outputs, *args, **kwargs)

    async def take(self, node: str, replica: int) -> Any:
        work = await self._handle.take.remote(node, replica)
        if work is not None and work.kind == "policy" and isinstance(work.value, ray.ObjectRef):
            work.value = await work.value  # the policy record the train stage put
        return work


async def by_reference(value: Any, replica: int) -> Any:
    """A policy output as an object ref the stage put itself (None from ranks > 0), so the
    coordinator passes a reference, never the weights."""
    if value is None or replica > 0:  # rank > 0: the coordinator keeps rank 0's policy only
        return None
    # A plugin's policy may be a whole model, pickled by ray.put: off the stage's event loop.
    return await asyncio.to_thread(ray.put, value)


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
