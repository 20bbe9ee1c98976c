"""LR schedules take their horizon from the run: the phase's steps (or `optim.total_steps`) times the
optimizer steps of one train step; the critic's from its own optim. The operators are called the
way the runtime calls them, with the context a Stage builds from a compiled plan."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from test_train_nodes import MODEL, groups

from flowrl.graph.compile import compile_spec
from flowrl.operator import OperatorContext
from flowrl.runtime.stage import Stage
from flowrl.spec.load import load
from flowrl.spec.phases import expand
from flowrl_operators.config import CriticConfig, TrainConfig
from flowrl_operators.critic import Critic
from flowrl_operators.train import Train

ROOT = Path(__file__).resolve().parents[1]


def test_stage_context_carries_the_phase_steps_and_executor(tmp_path: Path) -> None:
    spec = tmp_path / "p.yaml"
    spec.write_text((ROOT / "tests/specs/good/base.yaml").read_text() + (
        "phases:\n  - {name: warm, steps: 40}\n  - {name: rl, seconds: 30}\n"))
    contexts = []
    for phase, loaded in expand(load(str(spec))):
        plan = compile_spec(loaded).plan
        plan.run["phase"] = phase.name  # as flowrl.launch does for a file with phases
        contexts.append(Stage(plan, "learner", 0, None, None, 0.0, "ray").context())
    assert [(c.steps, c.phase, c.executor) for c in contexts] == [(40, "warm", "ray"), (None, "rl", "ray")]


def lr(op: Train | Critic) -> float:
    trainer = op.model if isinstance(op, Critic) else op.learner.trainer
    return trainer.optimizer.param_groups[0]["lr"]


def train_steps(optim: dict, steps: int | None, run: int, epochs: int = 1) -> list[float]:
    """The lr after each of `run` train steps of a Train node in a run of `steps` steps."""
    async def main() -> list[float]:
        config = msgspec.convert({"optim": optim, "epochs": epochs}, TrainConfig)
        op = Train(config, OperatorContext(node="learner", seed=1, model=MODEL, data={"batch_size": 1},
                                           steps=steps))
        await op.setup()
        after = []
        for step in range(run):
            metrics = (await op.train(groups(step, count=1, size=2), step=step)).metrics
            assert metrics["skipped"] == 0.0
            after.append(lr(op))
        return after

    return asyncio.run(main())


def test_linear_schedule_ends_at_the_runs_last_step() -> None:
    after = train_steps({"lr": 1e-3, "schedule": "linear"}, steps=40, run=40)
    # The 40th optimizer step is the horizon's last: the lr it leaves is the final one (0), not before.
    assert after[19] == pytest.approx(1e-3 * 20 / 40)
    assert after[38] == pytest.approx(1e-3 / 40) and after[39] == 0.0


def test_epochs_step_the_schedule_per_optimizer_step_and_total_steps_overrides() -> None:
    # 2 epochs over a 6-step run: 12 optimizer steps; after 3 train steps half of the lr is left.
    after = train_steps({"lr": 1e-3, "schedule": "linear"}, steps=6, run=6, epochs=2)
    assert after[2] == pytest.approx(0.5e-3) and after[5] == 0.0
    # optim.total_steps replaces the run's steps (in train steps): 4 x 2 optimizer steps.
    after = train_steps({"lr": 1e-3, "schedule": "linear", "total_steps": 4}, steps=100, run=4, epochs=2)
    assert after[1] == pytest.approx(0.5e-3) and after[3] == 0.0


def test_a_decaying_schedule_without_a_step_count_is_refused() -> None:
    with pytest.raises(ValueError, match="bounded only by seconds; set optim.total_steps"):
        train_steps({"schedule": "cosine"}, steps=None, run=0)
    assert train_steps({"lr": 1e-3}, steps=None, run=1) == [1e-3]  # a constant lr needs no horizon


def test_critic_lr_follows_its_own_horizon(tmp_path: Path) -> None:
    async def run(optim: dict, steps: int) -> list[float]:
        config = msgspec.convert({"optim": optim}, CriticConfig)
        op = Critic(config, OperatorContext(node="value", seed=1, model=MODEL, data={"batch_size": 1}, steps=steps))
        await op.setup()
        after = []
        for step in range(steps):
            await op.process({"trajectories": groups(step, count=1, size=2)[0]})
            after.append(lr(op))
        assert op.metrics()["critic_updates"] == steps  # one update (one optimizer step) per train step
        return after

    after = asyncio.run(run({"lr": 1e-2, "schedule": "linear"}, 4))
    assert after == pytest.approx([0.75e-2, 0.5e-2, 0.25e-2, 0.0])
    after = asyncio.run(run({"lr": 1e-2, "schedule": "linear", "total_steps": 8}, 4))
    assert after == pytest.approx([1e-2 * (8 - k) / 8 for k in range(1, 5)])
