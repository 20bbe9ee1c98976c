"""The weight-transport registry: entry points of the group `flowrl.transports`.

A transport is one `Transport` value: its name (what `sync: {transport: NAME}` says), the type of
the weights record its sending end produces, and two factories, the sending end from the sync
node's config and the receiving end for one of its records. The built-ins (`inprocess`,
`object_store`, `broadcast`) register through the same group as a plugin would (pyproject.toml),
so a new transport is one module and one entry point:

    [project.entry-points."flowrl.transports"]
    shm = "my_pkg.shm:TRANSPORT"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flowrl import plugins
from flowrl_operators.transport.base import Stream, TransferError, WeightSender

GROUP = "flowrl.transports"


@dataclass(frozen=True)
class Transport:
    name: str
    record: type  # what `sender(config).send(...)` returns; small and picklable
    sender: Callable[[Any], WeightSender]  # the sync node's config (SyncConfig) -> the sending end
    stream: Callable[[Any, int], Stream]  # (record, the engine's index among receivers) -> receiving end


def _check(name: str, target: str, value: Any) -> None:
    if not isinstance(value, Transport) or value.name != name:
        raise TransferError(f"entry point {name} = {target} is not a Transport named {name!r}")


def transports() -> dict[str, Transport]:
    return plugins.load(GROUP, _check)


def names() -> list[str]:
    return sorted(transports())


def get(name: str) -> Transport:
    found = transports().get(name)
    if found is None:
        raise TransferError(plugins.missing("weight transport", name, GROUP, names()))
    return found


def of_record(record: Any) -> Transport | None:
    """The transport whose sending end made `record`, or None if it is no weights record."""
    return next((t for t in transports().values() if isinstance(record, t.record)), None)
