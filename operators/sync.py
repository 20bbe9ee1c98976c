"""The sync node: delivers new policy versions to the generate engines in buckets."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from flowrl.operator import POLICY, WEIGHTS, GraphFacts, Operator, OperatorContext, Resources
from flowrl_operators.config import SyncConfig


class Sync(Operator):
    """Delivers a new policy version to the generate engines in weight buckets.

    `sync(policy, version=)` takes a policy record as a train node publishes it (`Policy`): a
    `Snapshot` (in one process), a `StoredSnapshot` (under Ray: the train actor put it in the object
    store), a weights record the trainer already sent itself (passed through: how a broadcast leaves
    a Ray train rank 0 without the weights travelling through this node), or None (the step changed
    nothing: the version advances with no bytes). A plugin's train node may publish a weights source
    instead (a trainer, module, state dict or buckets: `weight_buckets`), streamed to the transport
    as live tensors. Returns the weights record that the generate node hands to
    `flowrl_operators.transport.apply`.
    """

    kind = "sync"
    Config = SyncConfig
    inputs: ClassVar = {"policy": POLICY}
    outputs: ClassVar = {"weights": WEIGHTS}
    resources = Resources(cpus=0.1)

    @classmethod
    def check_graph(cls, config: SyncConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        from flowrl_operators.transport import TransferError, registry

        if config.transport != "auto":
            try:
                registry.get(config.transport)
            except TransferError as e:
                return [(("transport",), str(e))]
        if config.transport == "inprocess" and facts.executor == "ray":
            # Its record holds the tensors themselves: across Ray actors it would be pickled through
            # the coordinator, a full copy per hop, where the object store moves them once.
            return [(("transport",), "transport: inprocess needs the stages in one process, but "
                     "run.executor is ray; use transport: auto (the Ray object store there) or object_store")]
        return []

    def __init__(self, config: SyncConfig, context: OperatorContext) -> None:
        super().__init__(config, context)
        self.sender: Any = None  # made by setup(), or by the first sync() of an operator used alone

    async def setup(self) -> None:
        from flowrl_operators.transport import make_sender

        self.sender = make_sender(self.config)

    async def sync(self, policy: Any, *, version: int) -> Any:
        from flowrl_operators.transport import (
            ObjectStoreSender,
            Snapshot,
            StoredSnapshot,
            rebucket,
            registry,
            weight_buckets,
        )

        if self.sender is None:
            await self.setup()
        if isinstance(policy, StoredSnapshot):
            if isinstance(self.sender, ObjectStoreSender):
                # Put by the trainer already, in its buckets (not `bucket_mb`): the refs go on, no second copy.
                return policy.record(version)
            policy = await asyncio.to_thread(policy.load)
        elif registry.of_record(policy) is not None:
            return policy
        size = int(self.config.bucket_mb * 2**20)
        if isinstance(policy, Snapshot):  # the train node's private copy: stays one, so it is not copied again
            buckets = Snapshot(rebucket((pair for bucket in policy for pair in bucket), size))
        else:
            buckets = [] if policy is None else weight_buckets(policy, size)
        # Gathering and copying block: keep the stage's event loop free.
        return await asyncio.to_thread(self.sender.send, buckets, version)

    async def close(self) -> None:
        if self.sender is not None:
            await asyncio.to_thread(self.sender.close)
