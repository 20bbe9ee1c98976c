"""What the coordinator asks of the role that owns a kind of node.

The coordinator dispatches by node kind once, in one table (`Coordinator.roles`): generate nodes
to `Samples` (samples.py), train nodes to `Batches` (batches.py), sync nodes to `Policies` and
every other kind to `Joins` (joins.py). A role keeps the state of its nodes and calls back into
the coordinator (`coord`) for what every node shares: channels, the clock, the ledger, held work.
"""

from __future__ import annotations

from typing import Any

from flowrl.runtime.channel import Record, Work


class Role:
    shared = False  # True: a node's replicas share their work (the ranks of a train group)

    def __init__(self, coord: Any) -> None:
        self.coord = coord

    def attach(self, node: str, replica: int, version: int) -> None:
        """A replica (re)started with weights of `version`, or died (-1) and its work went back."""

    def take(self, node: str, replica: int) -> Work | None:
        """The next work for a replica, or None (the coordinator then waits for a change)."""
        raise NotImplementedError

    def gather(self, node: str, replica: int, outputs: dict[str, Any],
               metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """A replica's results; None while others of its group still work on the same unit."""
        return outputs, metrics

    def completed(self, node: str, work: Work, version: int | None, metrics: dict[str, Any]) -> tuple[int, str]:
        """A unit of work is done: (the version and the id its output records carry)."""
        raise NotImplementedError

    def withheld(self, node: str, work: Work) -> bool:
        """An output port returned None: True if that is a lost sample (counted), False if the
        None goes on as a record."""
        return False

    def advance(self, node: str) -> None:
        """End every step the node has finished."""

    def hand_back(self, node: str, work: Work) -> None:
        """Held work whose replica died (or that a checkpoint counts as handed back)."""
        for label, records in work.records.items():
            for record in reversed(records):
                self.coord.channels[label].put(record, front=True)

    def released(self, node: str) -> None:
        """After the work of a replica was handed back."""

    def waiting(self) -> dict[str, list[Record]]:
        """Records taken from a channel that no work holds yet (edge label -> records)."""
        return {}
