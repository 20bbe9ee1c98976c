"""Weight pushes into SGLang servers (used by `SGLangEngine.update_weights`, and by `SGLangSender` in
sender.py, the same push from the trainer's side, where the trainer's rank 0 is rank 0 of the
broadcast group).

Broadcast (SGLang's `update_weights_from_distributed`): the pusher creates a group (torch's TCP
rendezvous, gloo on CPU / NCCL on GPU) and each server joins it through `/init_weights_update_group`
at `rank_offset` (server i's tensor-parallel ranks follow server i-1's). Then per bucket one HTTP
call per server carries the names, dtypes and shapes while the tensors go by broadcast, one
broadcast per tensor in that order.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl_operators.engine.sglang.adapter import SGLangEngine

GROUP_PREFIX = "flowrl-sglang-weights"


class ServerError(RuntimeError):
    """An SGLang server answered an error (or could not be reached); the message says which and why."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sglang_ipc(bucket, tp_size: int) -> list:
    """A bucket in SGLang's own `update_weights_from_tensor` form: CUDA-IPC handles, one entry per TP
    rank. Needs sglang here and the tensors on the server's GPU (colocated trainer and engine)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        raise ServerError("weight_sync 'tensor' into a real SGLang server needs sglang installed next to the "
                          "trainer and a colocated GPU; use weight_sync 'distributed' or 'disk'") from exc
    return [MultiprocessingSerializer.serialize(list(bucket), output_str=True) for _ in range(tp_size)]


@dataclass
class WeightGroup:
    """The broadcast group into the servers: rank 0 here, then each server's TP ranks."""

    group: Any  # torch ProcessGroup
    backend: str
    name: str


async def join_servers(engine: SGLangEngine, backend: str = "auto", address: str = "127.0.0.1") -> WeightGroup:
    """Create the broadcast group: this process is rank 0, server i's TP ranks follow in order."""
    import torch

    from flowrl_operators.transport.engine_wire import weight_update_group

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    port = free_port(address)
    name = f"{GROUP_PREFIX}-{uuid.uuid4().hex[:8]}"  # unique: torch registers groups by name per process
    world = 1 + sum(s.tp_size for s in engine.servers)
    joining = asyncio.create_task(asyncio.to_thread(weight_update_group, address, port, 0, world, name,
                                                    backend))
    offset, calls = 1, []
    for server in engine.servers:
        calls.append(engine._post(server, "/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": offset, "world_size": world,
            "group_name": name, "backend": backend}))
        offset += server.tp_size
    try:
        await asyncio.gather(*calls)
    except BaseException:
        joining.cancel()
        raise
    return WeightGroup(await joining, backend, name)


async def push_distributed(engine: SGLangEngine, group: WeightGroup, bucket, version: int) -> None:
    """One bucket: names/dtypes/shapes by HTTP to every server while the tensors go by broadcast."""
    import torch
    import torch.distributed as dist

    device = "cuda" if group.backend == "nccl" else "cpu"
    body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group.name, "flush_cache": False,
            "weight_version": str(version)}
    calls = [asyncio.create_task(engine._post(s, "/update_weights_from_distributed", body)) for s in engine.servers]

    def send() -> None:
        for _, tensor in bucket:
            dist.broadcast(tensor.detach().to(device).contiguous(), src=0, group=group.group)
        if device == "cuda":
            torch.cuda.synchronize()

    await asyncio.to_thread(send)
    await asyncio.gather(*calls)


def write_checkpoint(source: Path, folder: Path, tensors: dict) -> None:
    """A loadable checkpoint: `source`'s config/tokenizer files plus `tensors` as model.safetensors."""
    from safetensors.torch import save_file

    for path in source.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy(path, folder / path.name)
    seen: set[int] = set()
    for name, tensor in tensors.items():  # safetensors refuses tensors sharing storage (tied heads)
        if tensor.data_ptr() in seen:
            tensors[name] = tensor.clone()
        seen.add(tensors[name].data_ptr())
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
