"""The sync node: delivers new policy versions to the generate engines in buckets."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from flowrl.operator import POLICY, WEIGHTS, GraphFacts, Operator, OperatorContext, Resources
from flowrl_operators.config import SyncConfig


class Sync(Operator):
    """Delivers a new policy version to the generate engines in weight buckets.

    `sync(policy, version=)` accepts what a train node publishes: a trainer (anything with
    `named_weights(bucket_bytes)`), a torch module, a state dict, an iterable of buckets, None (the
    step changed nothing: the version advances with no bytes), or a weights
    record the trainer already sent itself (passed through; that is how a broadcast leaves a Ray train
    actor's rank 0 without the weights travelling through this node). A policy a Ray train stage put
    in the object store (`object_refs`) goes on by reference with the object store transport. It
    returns the weights record
    that the generate node hands to `flowrl_operators.transport.apply`.
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
        from flowrl_operators.transport import Snapshot, rebucket, registry, weight_buckets

        if registry.of_record(policy) is not None:
            return policy
        if self.sender is None:
            await self.setup()
        # None: the train step changed nothing (no data); the version still advances, with no bytes.
        stored = getattr(policy, "object_refs", None)
        if stored is not None and hasattr(self.sender, "forward"):
            # Under Ray the train stage put the version in buckets already: pass its refs on (the
            # trainer's bucket size, not `bucket_mb`), no second copy into the object store.
            return self.sender.forward(stored, version)
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
