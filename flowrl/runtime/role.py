"""What the coordinator asks of the role that owns a kind of node, and what a role may ask back.

The coordinator dispatches by node kind once, in one table (`Coordinator.roles`): generate nodes
to `Samples` (samples.py), train nodes to `Batches` (batches.py), sync nodes to `Policies` and
every other kind to `Joins` (joins.py). A role keeps the state of its nodes and calls back into
the coordinator for what every node shares: channels, the clock, the ledger, held work. It sees
the coordinator only as a `CoordinatorView`: the typed list below of what it may read and call
(tests/test_role_view.py fails on a role that uses anything else). A role that needs another role
is handed it at construction (Batches gets Samples), not reached through the coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from flowrl.graph.plan import EdgePlan, Plan
from flowrl.runtime.channel import Channel, Record, Work
from flowrl.runtime.durability.ledger import Ledger


@runtime_checkable
class CoordinatorView(Protocol):
    """The coordinator as the roles see it (coordinator.py implements it). Read-only members are
    properties: a role changes shared state only through the methods."""

    # ---- the run's configuration -------------------------------------------------------------
    @property
    def plan(self) -> Plan: ...  # the compiled graph, with its facts (flowrl/graph/facts.py)
    @property
    def batch_size(self) -> int: ...  # samples per step (data.batch_size)
    @property
    def steps(self) -> int: ...  # the train steps the run makes in all
    @property
    def run_dir(self) -> Path | None: ...  # where the run writes its files; None: nowhere

    # ---- shared state, read ------------------------------------------------------------------
    @property
    def clock(self) -> int: ...  # the lowest version of all train nodes (0 without any)
    @property
    def versions(self) -> Mapping[str, int]: ...  # train node -> the version it has published
    @property
    def ended(self) -> Mapping[str, set[int]]: ...  # node -> the steps it has finished (`end`)
    @property
    def held(self) -> Mapping[str, Mapping[str, tuple[int, Work]]]: ...  # node -> work id -> (replica, work)
    @property
    def channels(self) -> Mapping[str, Channel]: ...  # data edge label -> its channel
    @property
    def ins(self) -> Mapping[str, list[EdgePlan]]: ...  # node -> its data input edges
    @property
    def checkpoint_due(self) -> bool: ...  # a periodic checkpoint waits: hand out no batch

    # ---- shared state, changed ---------------------------------------------------------------
    @property
    def ledger(self) -> Ledger: ...  # where a role writes its records' events (ledger.py)
    def hold(self, node: str, replica: int, work: Work) -> Work:
        """Count `work` as held by `replica` until it completes or is handed back; returns it."""
    def deliver(self, ch: Channel, record: Record, version: int) -> bool:
        """Whether a record taken at `version` may be delivered (False: dropped as stale)."""
    def drop(self, ch: Channel, record: Record, reason: str, **extra: Any) -> None:
        """Drop a record taken from `ch` (counted, ledger `drop`, its sample lost)."""
    def lose(self, node: str, sample_id: str, arrived: bool = False) -> None:
        """A sample will not reach the train nodes after `node`: tell the roles that count it."""
    def count(self, counter: str) -> None:
        """Add one to a run counter (rejected, filtered, oversampled, ...)."""
    def end(self, node: str, step: int) -> None:
        """`node` has finished `step` (and so have its data output edges)."""
    def trained(self, node: str, work: Work, metrics: dict[str, Any]) -> None:
        """A train node finished step `work.step`: its version moves on."""
    def notify(self) -> None:
        """The state changed: every waiting stage re-checks its condition."""


class Role:
    shared = False  # True: a node's replicas share their work (the ranks of a train group)

    def __init__(self, coord: CoordinatorView) -> None:
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
