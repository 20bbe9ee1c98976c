"""A stage under Ray: the actor that hosts it, and the coordinator proxy it calls.

Policy records travel by reference. A train stage's policy (the new weights, the whole model) is
put into the Ray object store by the train actor, and only the `ObjectRef` is handed to
`coord.complete`; the coordinator keeps that ref in the policy channel, and the proxy of the sync
stage that takes it resolves it before the operator sees it. So the weights never enter the
coordinator actor's memory, and they are copied once into the object store (on the train actor's
node) instead of being pickled into the coordinator and out again. The object is owned by the
train actor and lives while the coordinator or the sync stage holds the ref; a checkpoint never
stores one (snapshot.py keeps policy records without their values). Ranks > 0 of a train group
hand back no policy at all: the coordinator only ever uses rank 0's (batches.py).
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
            outputs = {port: await _by_reference(value, replica) if port in self._policy_ports else value
                       for port, value in outputs.items()}
        return await self._handle.complete.remote(node, replica, work_id, outputs, *args, **kwargs)

    async def take(self, node: str, replica: int) -> Any:
        work = await self._handle.take.remote(node, replica)
        if work is not None and work.kind == "policy" and isinstance(work.value, ray.ObjectRef):
            work.value = await work.value  # the whole version, from the object store
        return work


async def _by_reference(value: Any, replica: int) -> Any:
    if value is None or replica > 0:  # rank > 0: the coordinator keeps rank 0's policy only
        return None
    # ray.put copies (and pickles) the whole model: off the stage's event loop.
    return await asyncio.to_thread(lambda: ray.put(on_host(value)))


def on_host(value: Any) -> Any:
    """`value` with its CUDA tensors copied to host memory (lists, tuples and dicts rebuilt; all
    else as is): a GPU trainer's policy must unpickle in a sync actor that sees no GPU.
    Not exercised on a GPU by this project's tests."""
    if getattr(value, "is_cuda", False):
        return value.cpu()
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [on_host(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


class StageActor:
    def __init__(self, plan: bytes, node: str, replica: int, coord: Any, run_dir: str | None, origin: float) -> None:
        # The plan travels as msgspec JSON: small arguments are inlined in the actor's creation
        # task, so a restart never depends on an object-store copy.
        decoded = msgspec.json.decode(plan, type=Plan)
        self.stage = Stage(decoded, node, replica, RemoteCoordinator(coord, decoded, node), run_dir, origin, "ray")

    async def start(self, checkpoint: str | None, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Set up the stage; returns where it runs (pid, Ray node id and address)."""
        os.environ.update(env or {})
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
        await self.stage.close()
