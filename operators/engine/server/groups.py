"""`/init_weights_update_group` on the engine server: the body checked, the rendezvous bounded.

SGLang's body (master_address, master_port, rank_offset, world_size, group_name, backend), each field
checked before anything connects, so a wrong one is a 400 naming it. The rendezvous with rank 0 (the
trainer) is bounded: `rendezvous_timeout_s` in the body (a flowrl extension; SGLang has none), else
the server's `--rendezvous-timeout` (default RENDEZVOUS_TIMEOUT_S). An address where no rank 0
answers within that bound is the client's mistake: a 400 within the bound, not a 500 after torch's
own timeouts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from flowrl_operators.transport.engine_wire import weight_update_group

RENDEZVOUS_TIMEOUT_S = 5.0  # rank 0 is created before the servers are asked to join: seconds are plenty
MAX_RENDEZVOUS_TIMEOUT_S = 600.0
BACKENDS = ("gloo", "nccl")


class GroupError(ValueError):
    """A body or a rendezvous the client got wrong (answered 400)."""


@dataclass(frozen=True)
class GroupArgs:
    address: str
    port: int
    rank: int
    world_size: int
    name: str
    backend: str
    rendezvous_timeout_s: float


def _integer(body: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = body.get(key, default)
    if value is None:
        raise GroupError(f"init_weights_update_group needs {key}")
    if isinstance(value, str) and value.strip().isdigit():  # SGLang clients may send numbers as text
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GroupError(f"{key} must be an integer from {low} to {high}, got {value!r:.40}")
    return value


def group_args(body: dict[str, Any], default_timeout_s: float, cuda: bool) -> GroupArgs:
    """The body's fields, each checked (GroupError naming the first that is wrong)."""
    address = body.get("master_address")
    if not isinstance(address, str) or not address or len(address) > 253:
        raise GroupError(f"master_address must be a host name or IP address, got {address!r:.60}")
    port = _integer(body, "master_port", 1, 65535)
    world = _integer(body, "world_size", 2, 1 << 16)
    rank = _integer(body, "rank_offset", 1, world - 1, default=1)
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str) or not name:
        raise GroupError(f"group_name must be a non-empty string, got {name!r:.60}")
    backend = body.get("backend", "gloo")
    if backend not in BACKENDS:
        raise GroupError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r:.40}")
    if backend == "nccl" and not cuda:
        raise GroupError("backend nccl needs a GPU; this server runs on the CPU: use gloo")
    timeout = body.get("rendezvous_timeout_s", default_timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_RENDEZVOUS_TIMEOUT_S:
        raise GroupError(f"rendezvous_timeout_s must be a number of seconds in (0, {MAX_RENDEZVOUS_TIMEOUT_S:g}], "
                         f"got {timeout!r:.40}")
    return GroupArgs(address, port, rank, world, name, backend, float(timeout))


async def join(args: GroupArgs) -> Any:
    """Join the group as `args.rank`; a rank 0 that does not answer in time is a GroupError."""
    try:
        return await asyncio.to_thread(weight_update_group, args.address, args.port, args.rank, args.world_size,
                                       args.name, args.backend, connect_timeout_s=args.rendezvous_timeout_s)
    except ConnectionError as e:  # engine_wire.unreachable_as_error: the address, the port, the bound
        raise GroupError(f"{e} (rendezvous_timeout_s {args.rendezvous_timeout_s:g})") from None
