"""Weight transports across processes: a Ray actor publishes (object store, gloo broadcast), the
embedded engine in this process applies; and what happens when the publisher dies half-way."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
from test_transport import MODEL, assert_bitwise, engine_weights, greedy_version, policy

from flowrl.operator import OperatorContext
from flowrl_operators.config import SyncConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.transport import TransferError, apply, rebucket

torch.set_num_threads(1)
BUCKET_BYTES = 256 * 1024  # the actor's globals must come from importable modules or this file
CROSS = [("object_store", "flat"), ("broadcast", "flat"), ("broadcast", "per_tensor")]


# Module scope: a Ray session left running would serve later test files without their PYTHONPATH.
@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2)
    yield
    if started:
        ray.shutdown()


@ray.remote(num_cpus=0.25, max_restarts=0)
class Publisher:
    """A train rank 0 stand-in in its own process: the policy's weights, and sync nodes' sending ends."""

    def __init__(self, weights: dict) -> None:
        import torch

        torch.set_num_threads(1)
        self.weights = {name: torch.from_numpy(array.copy()) for name, array in weights.items()}
        self.nodes = {}

    async def publish(self, transport: str, layout: str, version: int, source: str = "good"):
        from flowrl_operators.sync import Sync

        if (transport, layout) not in self.nodes:
            config = SyncConfig(transport=transport, layout=layout, bucket_mb=BUCKET_BYTES / 2**20, timeout_s=60.0)
            self.nodes[transport, layout] = Sync(config, OperatorContext(node="publish"))
            await self.nodes[transport, layout].setup()
        buckets = list(rebucket(self.weights.items(), BUCKET_BYTES))
        if source == "bad":  # a wrong shape in the middle: the receiving engine raises half-way
            name, tensor = buckets[3][0]
            buckets[3][0] = (name, tensor[:-1])
        elif source == "dies":
            buckets = self._dies_after(buckets, 2)
        return await self.nodes[transport, layout].sync(buckets, version=version)

    async def put_policy(self) -> list:
        """The policy as a Ray train stage hands it to the coordinator: the train node puts its
        Snapshot into the object store (operators/train.py), the stage puts that record (ray_stage)."""
        from flowrl.runtime.executors.ray_stage import by_reference
        from flowrl_operators.transport import Snapshot, StoredSnapshot

        return [await by_reference(StoredSnapshot.put(Snapshot(rebucket(self.weights.items(), BUCKET_BYTES))), 0)]

    def _dies_after(self, buckets, count: int):
        yield from buckets[:count]
        os._exit(1)  # the train process dies half-way through the transfer

    def sentinel(self) -> list:
        import numpy as np

        return [ray.put(np.zeros(200_000, dtype=np.uint8))]  # in a list: the caller borrows the ref


@pytest.fixture(scope="module")
def trained() -> dict[str, torch.Tensor]:
    return dict(policy(seed=5).state_dict())


def publisher(weights: dict[str, torch.Tensor]):
    return Publisher.remote({name: t.numpy() for name, t in weights.items()})


@pytest.fixture(scope="module")
def shared_publisher(ray_session, trained):
    actor = publisher(trained)
    yield actor
    ray.kill(actor)


@pytest.mark.parametrize(("transport", "layout"), CROSS)
def test_cross_process_sync_is_bit_for_bit_and_atomic(shared_publisher, trained, transport, layout):
    actor = shared_publisher

    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            old = engine_weights(engine)
            # Half-way rejection by the receiving engine: old version and weights stay.
            record = await actor.publish.remote(transport, layout, 1, "bad")
            with pytest.raises(TransferError, match="shape"):
                await apply(engine, record, 1)
            assert engine.version == 0
            assert_bitwise(engine, old)
            # A good version, across processes, lands bit for bit.
            record = await actor.publish.remote(transport, layout, 2)
            metrics = await apply(engine, record, 2)
            assert engine.version == 2
            assert_bitwise(engine, trained)
            assert await greedy_version(engine) == [2, 2, 2]
            return metrics
        finally:
            await engine.close()

    metrics = asyncio.run(run())
    assert metrics.transport == transport
    assert metrics.bytes == sum(t.numel() * t.element_size() for t in trained.values())


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_publisher_dying_half_way_leaves_the_old_weights(ray_session, trained, transport):
    actor = publisher(trained)

    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            old = engine_weights(engine)
            if transport == "object_store":
                # The object store copy is complete once publish returns; its owner dying before the
                # engine read it is this transport's half-way failure.
                record = await actor.publish.remote(transport, "flat", 1)
                [sentinel] = await actor.sentinel.remote()
                ray.kill(actor)
                for _ in range(200):  # until Ray treats the owner's objects as lost (it notices late)
                    try:
                        await asyncio.to_thread(ray.get, sentinel, timeout=5)
                    except ray.exceptions.OwnerDiedError:
                        break
                    await asyncio.sleep(0.05)
            else:
                record = await actor.publish.remote(transport, "flat", 1, "dies")
            with pytest.raises(TransferError):
                await apply(engine, record, 1)
            assert engine.version == 0
            assert_bitwise(engine, old)
            assert await greedy_version(engine) == [0, 0, 0]
        finally:
            await engine.close()

    asyncio.run(run())


@pytest.mark.parametrize("transport", ["auto", "broadcast"])
def test_a_ray_train_stages_put_reaches_the_engine_without_a_second_put(shared_publisher, trained, transport):
    from flowrl_operators.sync import Sync
    from flowrl_operators.transport import ObjectStoreRecord, StoredSnapshot

    async def run():
        [ref] = await shared_publisher.put_policy.remote()
        policy = await ref  # as the sync stage's proxy resolves it
        assert isinstance(policy, StoredSnapshot) and len(policy.buckets) > 1
        config = SyncConfig(transport=transport, bucket_mb=BUCKET_BYTES / 2**20, timeout_s=60.0)
        node = Sync(config, OperatorContext(node="sync"))
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            record = await node.sync(policy, version=1)
            if transport == "auto":  # the object store: the trainer's objects go on as they are
                assert isinstance(record, ObjectStoreRecord)
                assert [r for r, _ in record.buckets] == [r for r, _ in policy.buckets]
            metrics = await apply(engine, record, 1)
            assert engine.version == 1
            assert_bitwise(engine, trained)
            return metrics
        finally:
            await engine.close()
            await node.close()

    metrics = asyncio.run(run())
    assert metrics.bytes == sum(t.numel() * t.element_size() for t in trained.values())


def test_a_policy_goes_to_the_object_store_as_byte_arrays_of_its_own_memory(ray_session, monkeypatch):
    """The object store layout, once (transport/object_store.py): each bucket one object, a list of
    uint8 arrays viewing the tensors' own memory (ray.put's is the one copy), mapped back on load."""
    import numpy as np

    from flowrl_operators.transport import Snapshot, StoredSnapshot

    weights, half = torch.arange(6.0).reshape(2, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    handed, real_put = [], ray.put
    monkeypatch.setattr(ray, "put", lambda value: handed.append(value) or real_put(value))  # a spy: Ray stores it
    stored = StoredSnapshot.put(Snapshot([[("w", weights), ("h", half)]]))
    [arrays] = handed
    assert all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in arrays)
    assert arrays[0].ctypes.data == weights.data_ptr()  # not copied before ray.put
    assert stored.nbytes == 6 * 4 + 2 * 2 and [m.name for m in stored.buckets[0][1]] == ["w", "h"]
    back = stored.load()
    assert isinstance(back, Snapshot)
    (name, w), (_, h) = back[0]
    assert name == "w" and torch.equal(w, weights) and h.dtype == torch.bfloat16 and torch.equal(h, half)
    assert w.data_ptr() != weights.data_ptr()  # read from the object store, not the original
