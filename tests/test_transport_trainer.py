"""Weight sync from the real trainer after a real train step: one rank in this process (in-process
and broadcast transports), and FSDP2 over two spawned gloo ranks whose rank 0 broadcasts the
gathered buckets to the embedded engine here."""

from __future__ import annotations

import asyncio
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_training_fsdp import CONFIG, free_port, train_step
from test_transport import MODEL, assert_bitwise, greedy_version

from flowrl.operator import OperatorContext
from flowrl_operators.config import SyncConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.sync import Sync
from flowrl_operators.training.trainer import Trainer
from flowrl_operators.transport import BroadcastSender, apply

torch.set_num_threads(1)
BUCKET_BYTES = 300_000


@pytest.mark.parametrize("transport", ["inprocess", "broadcast"])
def test_one_rank_trainer_to_engine_after_a_step(transport):
    trainer = Trainer(MODEL, CONFIG)
    before = {k: v.clone() for k, v in trainer.state_dict_full().items()}  # one rank: it aliases
    train_step(trainer, 0)
    expected = trainer.state_dict_full()
    assert any(not torch.equal(before[k], expected[k]) for k in expected), "the step changed nothing"

    async def run():
        node = Sync(SyncConfig(transport=transport, bucket_mb=BUCKET_BYTES / 2**20, timeout_s=60.0),
                    OperatorContext(node="publish"))
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            record = await node.sync(trainer, version=1)  # the trainer itself: named_weights buckets
            metrics = await apply(engine, record, 1)
            assert engine.version == 1 and metrics.buckets > 1
            assert_bitwise(engine, expected)
            assert await greedy_version(engine) == [1, 1, 1]
        finally:
            await engine.close()
            await node.close()

    asyncio.run(run())


def rank_main(rank: int, port: int, results) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = Trainer(MODEL, CONFIG)
        train_step(trainer, 0)
        buckets = trainer.named_weights(BUCKET_BYTES)  # collective: both ranks gather, rank 0 yields
        if rank == 0:
            # The broadcast group is separate from the trainers' FSDP group; rank 0 hosts its store.
            sender = BroadcastSender(receivers=1, timeout_s=60.0)
            results.put(("record", sender.send(buckets, version=1)))
            sender.wait()
        else:
            assert list(buckets) == []
        full = trainer.state_dict_full()
        if rank == 0:
            results.put(("expected", {k: v.numpy().copy() for k, v in full.items()}))  # by value
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_ranks_broadcast_to_engine():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=rank_main, args=(r, port, results), daemon=True) for r in range(2)]
    for p in ranks:
        p.start()

    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            kind, record = await asyncio.to_thread(results.get, timeout=120)
            assert kind == "record"
            await apply(engine, record, 1)
            kind, expected = await asyncio.to_thread(results.get, timeout=120)
            assert kind == "expected"
            assert engine.version == 1
            assert_bitwise(engine, {k: torch.from_numpy(v) for k, v in expected.items()})
        finally:
            await engine.close()

    try:
        asyncio.run(run())
    except queue.Empty:
        pytest.fail("the train ranks sent nothing within 120 s")
    finally:
        for p in ranks:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
