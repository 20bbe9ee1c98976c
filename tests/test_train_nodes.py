"""The train, reference and critic nodes, called the way the runtime calls them (Operator contract):
setup(), then train(groups, step=) / process({port: group}), then save/load and close()."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import msgspec
import torch

from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import OperatorContext
from flowrl_operators.config import CriticConfig, ReferenceConfig, TrainConfig
from flowrl_operators.critic import Critic
from flowrl_operators.reference import Reference
from flowrl_operators.train import Train

MODEL = {"path": "builtin:tiny-qwen2"}


def groups(step: int, count: int = 2, size: int = 4) -> list[Group]:
    g = torch.Generator().manual_seed(step)
    out = []
    for k in range(count):
        prompt = torch.randint(5, 60, (5,), generator=g).tolist()
        trajs = []
        for i in range(size):
            n = int(torch.randint(3, 8, (1,), generator=g))
            trajs.append(Trajectory(
                id=f"{step}:{k}:{i}", group_id=f"{step}:{k}", sample_id=f"{step}:{k}", prompt_ids=prompt,
                response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=[1] * n,
                behaviour_logprobs=(-4 + torch.rand(n, generator=g)).tolist(), versions=[step] * n,
                reward=float(i % 2), step=step))
        out.append(Group(id=f"{step}:{k}", step=step, trajectories=trajs))
    return out


def context(tmp_path: Path, node: str, batch_size: int = 2) -> OperatorContext:
    return OperatorContext(node=node, run_dir=tmp_path, seed=1, model=MODEL, data={"batch_size": batch_size})


def test_train_node_updates_publishes_checkpoints_and_exports(tmp_path: Path) -> None:
    async def main() -> None:
        config = msgspec.convert({"optim": {"lr": 1e-2}, "loss": {"kind": "ppo_clip", "decoupled": True,
                                                                  "correction": {"kind": "tis"}}}, TrainConfig)
        op = Train(config, context(tmp_path, "learner"))
        await op.setup()
        before = {n: t.clone() for b in op.learner.trainer.named_weights() for n, t in b}
        result = await op.train(groups(0), step=0)
        assert result.metrics["trajectories"] == 8 and result.metrics["reward_mean"] == 0.5
        assert result.metrics["skipped"] == 0.0
        published = {n: t for bucket in result.policy for n, t in bucket}
        assert published.keys() == before.keys()
        assert any(not torch.equal(published[n], before[n]) for n in before), "the step changed nothing"
        live = {n: t for b in op.learner.trainer.named_weights() for n, t in b}
        assert all(torch.equal(published[n], live[n]) for n in live)
        # The published record is a copy: the next step leaves it untouched.
        snapshot = {n: t.clone() for n, t in published.items()}
        (tmp_path / "ckpt").mkdir()
        op.save(tmp_path / "ckpt")
        await op.train(groups(1), step=1)
        assert all(torch.equal(published[n], snapshot[n]) for n in snapshot)
        # Loading the checkpoint restores the weights after step 0.
        op.load(tmp_path / "ckpt")
        restored = {n: t for b in op.learner.trainer.named_weights() for n, t in b}
        assert all(torch.equal(restored[n], snapshot[n]) for n in snapshot)
        assert (await op.train([], step=2)).policy is None  # nothing arrived: no update
        await op.close()

    asyncio.run(main())
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "learner", local_files_only=True)
    assert sum(p.numel() for p in exported.parameters()) > 0


def test_train_node_exports_every_n_steps(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    async def main() -> None:
        config = msgspec.convert({"optim": {"lr": 1e-2}, "export_every": 2}, TrainConfig)
        op = Train(config, context(tmp_path, "learner"))
        await op.setup()
        for step in range(3):
            await op.train(groups(step), step=step)
        await op.close()

    asyncio.run(main())
    folders = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert folders == ["learner", "learner-step-2"]  # versions 1 and 3 are not multiples of 2
    at_2, final = (AutoModelForCausalLM.from_pretrained(tmp_path / "export" / f, local_files_only=True)
                   for f in ("learner-step-2", "learner"))
    assert any(not torch.equal(a, b) for a, b in zip(at_2.parameters(), final.parameters(), strict=True))


def test_reference_node_adds_initial_policy_logprobs(tmp_path: Path) -> None:
    async def main() -> None:
        op = Reference(ReferenceConfig(), context(tmp_path, "ref"))
        await op.setup()
        group = groups(0, count=1)[0]
        out = (await op.process({"trajectories": group}))["trajectories"]
        for traj in out.trajectories:
            assert traj.reference_logprobs is not None and len(traj.reference_logprobs) == len(traj.response_ids)
            assert all(lp <= 0 and math.isfinite(lp) for lp in traj.reference_logprobs)
        # The same numbers a trainer with the initial weights computes.
        from flowrl_operators.training.batch import pack, response_values
        from flowrl_operators.training.trainer import Trainer

        trainer = Trainer(MODEL["path"])
        batch = pack(out.trajectories, require_reward=False)
        batch.reference_logprobs = trainer.compute_logprobs(batch)
        expected = response_values(batch, "reference_logprobs", out.trajectories)
        for traj, lps in zip(out.trajectories, expected, strict=True):
            assert max(abs(a - b) for a, b in zip(traj.reference_logprobs, lps, strict=True)) < 1e-5

    asyncio.run(main())


def test_critic_node_values_then_one_update_per_step(tmp_path: Path) -> None:
    async def main() -> None:
        op = Critic(msgspec.convert({"optim": {"lr": 1e-2}}, CriticConfig), context(tmp_path, "value", batch_size=2))
        await op.setup()
        first, second = groups(0)
        out = (await op.process({"trajectories": first}))["trajectories"]
        assert all(t.values is not None and len(t.values) == len(t.response_ids) for t in out.trajectories)
        assert op.metrics()["critic_updates"] == 0  # half a step so far
        values_before = list(second.trajectories[0].values or [])
        assert values_before == []
        await op.process({"trajectories": second})
        assert op.metrics()["critic_updates"] == 1  # the step's two groups trained the value model
        again = groups(0)[0]
        await op.process({"trajectories": again})
        assert again.trajectories[0].values != first.trajectories[0].values  # the update moved the values

    asyncio.run(main())


def test_the_context_sets_the_steps_torch_threads_in_the_thread_each_runs_in(tmp_path: Path) -> None:
    """`OperatorContext.threads` (what `flowrl replay` gives, the recorded run's count) reaches the
    step's own thread; without it a step keeps the count its thread has. No environment variable."""
    async def step_threads(threads: int | None) -> float:
        ctx = msgspec.structs.replace(context(tmp_path / str(threads), "learner"), threads=threads)
        op = Train(msgspec.convert({"policy_kl_every": 0}, TrainConfig), ctx)
        await op.setup()
        try:
            return (await op.train(groups(0), step=0)).metrics["torch_threads"]
        finally:
            await op.close()

    own = asyncio.run(step_threads(None))
    wanted = int(own) + 1  # a count the step's thread would not have of itself
    assert asyncio.run(step_threads(wanted)) == float(wanted)
