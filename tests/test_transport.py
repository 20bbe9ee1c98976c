"""Weight transports in one process: byte-exact round trips, the sync node into the real embedded
engine, and atomicity when a transfer fails half-way (cross-process cases: test_transport_ray.py)."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from flowrl.operator import OperatorContext
from flowrl_operators.config import SyncConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_hf_model
from flowrl_operators.sync import Sync
from flowrl_operators.transport import (
    BroadcastRecord,
    BroadcastSender,
    InProcessSender,
    TransferError,
    apply,
    open_stream,
    rebucket,
    weight_buckets,
)

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"
BUCKET_MB = 0.25  # about nine buckets for the 2 MB tiny model
LOCAL = [  # (transport, layout) pairs that run inside one process
    ("inprocess", "flat"), ("broadcast", "flat"), ("broadcast", "per_tensor"),
]


def policy(seed: int) -> torch.nn.Module:
    """The tiny model with every weight moved by a seeded random step: a 'trained' policy."""
    model = load_hf_model(MODEL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def engine_weights(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.named_parameters()}


def assert_bitwise(engine: EmbeddedEngine, expected: dict[str, torch.Tensor]) -> None:
    live = dict(engine.named_parameters())
    assert set(live) <= set(expected), set(live) - set(expected)
    for name, tensor in live.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def config(transport: str, layout: str = "flat", **extra) -> SyncConfig:
    return SyncConfig(transport=transport, bucket_mb=BUCKET_MB, layout=layout, timeout_s=60.0, **extra)


def with_bad_bucket(model: torch.nn.Module, at: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's buckets with one wrong-shaped tensor in bucket `at`: the engine rejects it half-way."""
    buckets = list(rebucket(model.state_dict().items(), int(BUCKET_MB * 2**20)))
    name, tensor = buckets[at][0]
    buckets[at][0] = (name, tensor[:-1])
    return buckets


async def greedy_version(engine: EmbeddedEngine) -> list[int]:
    result = await engine.generate(GenerateRequest(
        request_id="probe", input_ids=[5, 6, 7], sampling=SamplingParams(temperature=0.0, max_new_tokens=3)))
    return result.versions


def test_mixed_dtypes_round_trip_byte_exact():
    """Every local transport hands back the same bytes, dtypes and shapes, 0-dim and strided included."""
    gen = torch.Generator().manual_seed(0)
    source = [
        ("a.bf16", torch.randn(7, 3, generator=gen).to(torch.bfloat16)),
        ("b.fp16", torch.randn(5, generator=gen).to(torch.float16)),
        ("c.int64", torch.arange(11)),
        ("d.scalar", torch.tensor(3.5)),
        ("e.strided", torch.randn(4, 6, generator=gen).t()),
        ("f.fp32", torch.randn(33, 17, generator=gen)),
    ]
    buckets = [source[:2], source[2:5], source[5:]]

    async def receive(record) -> list[tuple[str, torch.Tensor]]:
        stream = open_stream(record)
        got = [(name, t.clone()) async for bucket in stream for name, t in bucket]
        await stream.close()
        return got

    for transport, layout in LOCAL:
        sender = InProcessSender() if transport == "inprocess" else BroadcastSender(layout=layout, timeout_s=60)
        got = asyncio.run(receive(sender.send(buckets, version=4)))
        sender.wait()
        assert [n for n, _ in got] == [n for n, _ in source]
        for (_, want), (_, have) in zip(source, got, strict=True):
            assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), transport


@pytest.mark.parametrize(("transport", "layout"), LOCAL)
def test_sync_node_into_embedded_engine_bit_for_bit(transport, layout):
    trained = policy(seed=1)
    expected = dict(trained.state_dict())

    async def run():
        node = Sync(config(transport, layout), OperatorContext(node="publish"))
        await node.setup()
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            assert await greedy_version(engine) == [0, 0, 0]
            record = await node.sync(trained, version=1)
            if transport != "inprocess":
                record = pickle.loads(pickle.dumps(record))  # what Ray does on the weights edge
            metrics = await apply(engine, record, 1)
            node.sender.wait()
            assert engine.version == 1
            assert_bitwise(engine, expected)
            assert await greedy_version(engine) == [1, 1, 1]
            return metrics
        finally:
            await engine.close()
            await node.close()

    metrics = asyncio.run(run())
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert metrics.transport == transport and metrics.version == 1
    assert metrics.bytes == total and metrics.buckets >= 5
    assert metrics.seconds > 0 and metrics.gb_per_s == pytest.approx(total / metrics.seconds / 1e9)
    assert 0 <= metrics.paused_s <= metrics.seconds


@pytest.mark.parametrize(("transport", "layout"), LOCAL)
def test_engine_rejecting_a_bucket_half_way_keeps_the_old_version(transport, layout):
    """The receiving side raises in the middle; the old weights stay and the next version still lands."""
    first, second = policy(seed=2), policy(seed=3)

    async def run():
        node = Sync(config(transport, layout), OperatorContext(node="publish"))
        await node.setup()
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            old = engine_weights(engine)
            record = await node.sync(with_bad_bucket(first), version=1)
            with pytest.raises(TransferError, match="shape"):
                await apply(engine, record, 1)
            assert engine.version == 0
            assert_bitwise(engine, old)
            assert await greedy_version(engine) == [0, 0, 0]
            # The transport is still usable (a broadcast group drained the rest and stayed in step).
            await apply(engine, await node.sync(second, version=2), 2)
            assert engine.version == 2
            assert_bitwise(engine, dict(second.state_dict()))
        finally:
            await engine.close()
            await node.close()

    asyncio.run(run())


def test_broadcast_source_failing_half_way_is_dropped_by_the_engines():
    """The sender's bucket source raises after two buckets: the engines are told, keep version 0, and
    the next version arrives over the same group."""
    trained = policy(seed=4)
    buckets = list(weight_buckets(trained, int(BUCKET_MB * 2**20)))

    def failing():
        yield from buckets[:2]
        raise RuntimeError("gather failed on rank 0")

    async def run():
        sender = BroadcastSender(receivers=2, timeout_s=60)
        engines = [EmbeddedEngine(MODEL, max_slots=2) for _ in range(2)]
        try:
            old = engine_weights(engines[0])
            record = sender.send(failing(), version=1)
            outcomes = await asyncio.gather(*(apply(e, record, 1, replica=i) for i, e in enumerate(engines)),
                                            return_exceptions=True)
            assert all(isinstance(o, TransferError) and "mid-way" in str(o) for o in outcomes), outcomes
            with pytest.raises(TransferError, match="gather failed"):
                sender.wait()
            for engine in engines:
                assert engine.version == 0
                assert_bitwise(engine, old)
            record = sender.send(buckets, version=2)
            await asyncio.gather(*(apply(e, record, 2, replica=i) for i, e in enumerate(engines)))
            sender.wait()
            for engine in engines:
                assert engine.version == 2
                assert_bitwise(engine, dict(trained.state_dict()))
        finally:
            for engine in engines:
                await engine.close()
            sender.close()

    asyncio.run(run())


def test_bad_records_and_configs_say_what_to_change():
    with pytest.raises(TransferError, match="not a weights record"):
        open_stream({"version": 1})
    sender = BroadcastSender(receivers=1, timeout_s=5)
    record = BroadcastRecord(1, sender.group, "flat")
    with pytest.raises(TransferError, match="receivers"):
        open_stream(record, replica=1)  # a second engine, but the group has room for one
    with pytest.raises(ValueError, match="at least one"):
        BroadcastSender(receivers=0)
    with pytest.raises(TypeError, match="named_weights"):
        list(weight_buckets(42, 1024))


def test_broadcast_group_meets_torch_rendezvous_as_sglang_builds_it():
    """A receiver built the way SGLang's `init_weights_update_group` builds its group (tcp://
    rendezvous, a "<group_name>" store prefix, torch's own group construction) joins our sender's
    group as rank 1 and receives its broadcast."""
    import threading
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from flowrl_operators.transport.broadcast import broadcast, connect

    sender = BroadcastSender(receivers=1, timeout_s=30)
    g = sender.group
    received = {}

    def sglang_side() -> None:
        timeout = timedelta(seconds=30)
        store, rank, world = next(c10d.rendezvous(f"tcp://{g.address}:{g.port}", 1, g.world_size, timeout=timeout))
        group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend("gloo"),
                                                  c10d.PrefixStore(g.group_name, store),
                                                  group_name=g.group_name, timeout=timeout)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
        tensor = torch.zeros(6)
        torch.distributed.broadcast(tensor, src=0, group=group)
        received["tensor"] = tensor

    thread = threading.Thread(target=sglang_side)
    thread.start()
    pg = connect(g, 0, sender.store)
    broadcast(pg, torch.arange(6.0))
    thread.join(30)
    assert torch.equal(received["tensor"], torch.arange(6.0))


@pytest.mark.parametrize(("transport", "layout"), LOCAL)
def test_a_step_without_data_advances_the_version_only(transport, layout):
    async def run():
        node = Sync(config(transport, layout), OperatorContext(node="publish"))
        await node.setup()
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            old = engine_weights(engine)
            metrics = await apply(engine, await node.sync(None, version=3), 3)
            assert engine.version == 3 and metrics.bytes == 0
            assert_bitwise(engine, old)
        finally:
            await engine.close()
            await node.close()

    asyncio.run(run())


@pytest.mark.parametrize("snapshot", [False, True])
def test_inprocess_record_aliases_the_sender_unless_snapshot(snapshot):
    """Documented trade-off: references are free but follow later changes; a snapshot does not."""
    trained = policy(seed=7)
    sent = {k: v.clone() for k, v in trained.state_dict().items()}

    async def run():
        node = Sync(config("inprocess", snapshot=snapshot), OperatorContext(node="publish"))
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            record = await node.sync(trained, version=1)
            with torch.no_grad():
                for p in trained.parameters():
                    p.add_(1.0)  # the trainer steps before the engine applied version 1
            await apply(engine, record, 1)
            assert_bitwise(engine, sent if snapshot else dict(trained.state_dict()))
        finally:
            await engine.close()

    asyncio.run(run())
