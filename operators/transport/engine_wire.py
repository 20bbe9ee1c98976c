"""How weights travel to an engine server: tensor buckets in HTTP bodies, and a broadcast group.

HTTP (`/update_weights_from_tensor`): SGLang sends CUDA-IPC handles there, which only work between
processes on one GPU. flowrl's server instead takes each entry of `serialized_named_tensors` as
base64 of a safetensors file holding one bucket (`load_format: "flowrl_safetensors"`): portable,
dtype-exact (bf16 included), and readable without pickle.

Broadcast (`/init_weights_update_group` + `/update_weights_from_distributed`): the trainer is rank 0
of a separate process group and the engines join at `rank_offset`. The group is built the way
SGLang builds it (a TCP rendezvous at master_address:master_port, its keys under `group_name`), so
one trainer-side `weight_update_group(...)` call works against SGLang and against flowrl's server.
"""

from __future__ import annotations

import base64
from datetime import timedelta

import torch

LOAD_FORMAT = "flowrl_safetensors"


def encode_bucket(named_tensors) -> str:
    """(name, tensor) pairs -> base64 safetensors text. Tensors that share storage are copied."""
    from safetensors.torch import save

    seen: set[int] = set()
    tensors = {}
    for name, tensor in named_tensors:
        tensor = torch.as_tensor(tensor).detach().cpu().contiguous()
        if tensor.data_ptr() in seen:  # safetensors refuses aliases (e.g. a tied lm_head)
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    return base64.b64encode(save(tensors)).decode("ascii")


def decode_bucket(text: str | bytes) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(base64.b64decode(text)).items())


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang sends either spelling)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return dtype


# How long joining a weight update group may wait for the rendezvous address to answer. A connection
# takes seconds; the group's own timeout (a broadcast of a large model's weights) is far longer, and
# an address where nothing answers must not wait that long.
CONNECT_TIMEOUT_S = 30.0


def weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                        group_name: str, backend: str = "gloo", timeout_s: float = 600.0,
                        connect_timeout_s: float = CONNECT_TIMEOUT_S):
    """Join (rank 0: create) a process group for weight broadcasts, beside any default group.

    Uses torch's own rendezvous and group construction, as SGLang does, so both sides agree on the
    store keys. Blocks until all `world_size` ranks have joined; a rank other than 0 whose
    rendezvous address does not answer within `connect_timeout_s` gets a ConnectionError.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    connect = timeout if rank == 0 else timedelta(seconds=min(connect_timeout_s, timeout_s))
    store, rank, world_size = unreachable_as_error(
        lambda: next(c10d.rendezvous(url, rank, world_size, timeout=connect)), master_address, master_port, connect)
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )
    # Register the rank map so torch.distributed collectives accept `group=`.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def unreachable_as_error(join, address: str, port: int, timeout: timedelta):
    """`join()` (a store connecting to address:port); torch's timeout there as a ConnectionError naming it."""
    try:
        return join()
    except (RuntimeError, TimeoutError, OSError) as e:  # torch's DistStoreError / DistNetworkError
        raise ConnectionError(f"the weight update rendezvous at {address}:{port} did not answer within "
                              f"{timeout.total_seconds():g} s ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              "is the trainer running, and is that address reachable from here?") from None
