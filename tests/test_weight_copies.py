"""Weight copies per version are bounded: the train node copies a step's weights once (a Snapshot),
the in-process transport and the embedded engine keep those tensors (the engine's weights become
them), and exactness holds: the engine serves one whole version while the trainer moves on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import torch

from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import OperatorContext
from flowrl_operators.config import SyncConfig, TrainConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.sync import Sync
from flowrl_operators.train import Train
from flowrl_operators.transport import Snapshot, apply

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"


def groups(step: int) -> list[Group]:
    g = torch.Generator().manual_seed(step)
    out = []
    for k in range(2):
        prompt = torch.randint(5, 60, (4,), generator=g).tolist()
        trajs = [Trajectory(id=f"{step}:{k}:{i}", group_id=f"{step}:{k}", sample_id=f"{step}:{k}", step=step,
                            prompt_ids=prompt, response_ids=torch.randint(5, 60, (5,), generator=g).tolist(),
                            loss_mask=[1] * 5, behaviour_logprobs=[-4.0] * 5, versions=[step] * 5,
                            reward=float(i % 2)) for i in range(4)]
        out.append(Group(id=f"{step}:{k}", step=step, trajectories=trajs))
    return out


def test_a_version_is_copied_once_and_the_engine_adopts_it(tmp_path: Path):
    async def run():
        learner = Train(msgspec.convert({"optim": {"lr": 1e-2}}, TrainConfig),
                        OperatorContext(node="learner", run_dir=tmp_path, seed=1, model={"path": MODEL}))
        publish = Sync(SyncConfig(transport="inprocess", bucket_mb=0.25), OperatorContext(node="publish"))
        engine = EmbeddedEngine(MODEL, max_slots=2)
        await learner.setup()
        try:
            policy = (await learner.train(groups(0), step=0)).policy
            assert isinstance(policy, Snapshot)
            trainer = dict(learner.learner.trainer.model.named_parameters())
            sent = {n: t for b in policy for n, t in b}
            # The one copy: the snapshot shares no storage with the trainer.
            assert all(sent[n].data_ptr() != trainer[n].data_ptr() for n in sent)
            record = await publish.sync(policy, version=1)
            assert record.owned and record.buckets[0][0][1].data_ptr() == sent[record.buckets[0][0][0]].data_ptr()
            await apply(engine, record, 1)
            live = dict(engine.named_parameters())
            # No second copy: the engine's weights are the snapshot's tensors.
            assert all(live[n].data_ptr() == sent[n].data_ptr() for n in live)
            version_1 = {n: t.clone() for n, t in live.items()}
            await learner.train(groups(1), step=1)  # the trainer moves on; the engine keeps version 1
            assert all(torch.equal(live[n], version_1[n]) for n in live)
            assert any(not torch.equal(trainer[n], version_1[n]) for n in live)
        finally:
            await engine.close()
            await learner.close()

    asyncio.run(run())


def test_buckets_that_are_not_a_snapshot_are_copied():
    """A trainer's live tensors (views) sent as they are: the engine copies them, so a later change
    of the sender's tensors never reaches the engine's weights."""
    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            mine = [[(n, p.detach().clone() + 0.5) for n, p in engine.named_parameters()]]
            await engine.update_weights(mine, 1)
            live = dict(engine.named_parameters())
            assert all(live[n].data_ptr() != t.data_ptr() for n, t in mine[0])
            expected = {n: t.clone() for n, t in mine[0]}
            for _, t in mine[0]:
                t.add_(1.0)
            assert all(torch.equal(live[n], expected[n]) for n in live)
        finally:
            await engine.close()

    asyncio.run(run())


def test_frozen_weights_are_shared_by_trainer_and_engine(tmp_path: Path):
    """LoRA: the first version hands the base over as it is, the engine adopts it, and trainer and
    engine hold one copy of the base weights between them; later versions carry only adapters."""
    async def run():
        config = {"optim": {"lr": 1e-2}, "lora": {"r": 2, "target_modules": ["q_proj", "up_proj"]}}
        learner = Train(msgspec.convert(config, TrainConfig),
                        OperatorContext(node="learner", run_dir=tmp_path, seed=1, model={"path": MODEL}))
        publish = Sync(SyncConfig(transport="inprocess"), OperatorContext(node="publish"))
        engine = EmbeddedEngine(MODEL, max_slots=2)
        await learner.setup()
        try:
            for step in range(2):
                policy = (await learner.train(groups(step), step=step)).policy
                await apply(engine, await publish.sync(policy, version=step + 1), step + 1)
                if step == 0:
                    first = {n for b in policy for n, _ in b}
            base = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
                    for n, p in learner.learner.trainer.model.named_parameters() if ".lora_" not in n}
            live = dict(engine.named_parameters())
            assert set(live) <= set(base) and first >= set(live)
            assert {n for b in policy for n, _ in b} == {n for n in first if ".lora_" in n}
            assert all(live[n].data_ptr() == base[n].data_ptr() for n in live)
        finally:
            await engine.close()
            await learner.close()

    asyncio.run(run())
