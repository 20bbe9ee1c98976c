"""The critic node: value estimates for GAE, and the value model's own training.

Records pass one group at a time: each gets the values of the critic as it is now (what GAE in
the train node reads). Groups are also kept per step; when a step's `data.batch_size` groups have
passed (or a later step's group arrives), the critic takes one clipped-value-loss update on them,
with GAE returns computed from those same values.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

from flowrl.data.trajectory import Group
from flowrl.operator import TRAJECTORIES, GraphFacts, Operator, Resources
from flowrl_operators.config import CriticConfig


class Critic(Operator):
    """Adds value estimates, then trains the value model on the batch's returns."""

    kind = "transform"
    Config = CriticConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    provides: ClassVar = frozenset({"values"})
    resources = Resources(cpus=0.25)

    @classmethod
    def check_graph(cls, config: CriticConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        from flowrl_operators.training.engine import check_name

        return [(("engine",), problem)] if (problem := check_name(config.engine)) else []

    async def setup(self) -> None:
        from flowrl_operators.tokenizer import import_transformers
        from flowrl_operators.train import schedule_horizon, trainer_config
        from flowrl_operators.training.engine import build
        from flowrl_operators.training.losses import ValueLossConfig, value_loss

        c: CriticConfig = self.config
        # One optimizer step per train step's batch (see _update): its own horizon, from its own optim.
        config = trainer_config(c.optim, c.micro_batch_tokens, 3, schedule_horizon(c.optim, self.context, 1),
                                self.context.seed)
        import_transformers()  # here, not in two threads at once
        self.model = await asyncio.to_thread(build, c.engine, c.model or self.context.model["path"], config, "value")
        self.loss_fn = value_loss(ValueLossConfig(value_clip=c.value_clip))
        self.batch_size = int(self.context.data.get("batch_size", 1))
        self.pending: dict[int, list[Group]] = {}
        self.lock = asyncio.Lock()
        self.updates = 0

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        group: Group = inputs["trajectories"]
        async with self.lock:
            await asyncio.to_thread(self._values, group)
            self.pending.setdefault(group.step, []).append(group)
            for step in sorted(self.pending):
                if step < group.step or len(self.pending[step]) >= self.batch_size:
                    await asyncio.to_thread(self._update, self.pending.pop(step))
        return {"trajectories": group}

    def _values(self, group: Group) -> None:
        from flowrl_operators.training.batch import pack, response_values

        trajectories = [t for t in group.trajectories if t.response_ids]
        if trajectories:
            batch = pack(trajectories, require_reward=False)
            batch.values = self.model.compute_values(batch)
            for traj, values in zip(trajectories, response_values(batch, "values", trajectories), strict=True):
                traj.values = values

    def _update(self, groups: list[Group]) -> None:
        from flowrl_operators.training.advantages import compute_advantages
        from flowrl_operators.training.batch import pack

        trajectories = [t for g in groups for t in g.trajectories if t.response_ids and t.values is not None]
        if not trajectories:
            return
        batch = pack(trajectories)
        compute_advantages(batch, {"estimator": "gae", "gamma": self.config.gamma, "lam": self.config.lam})
        self.model.forward_backward(batch, self.loss_fn)
        self.model.step()
        self.updates += 1

    def save(self, path: Path) -> None:
        self.model.save(path / "critic")

    def load(self, path: Path) -> None:
        self.model.load(path / "critic")

    def metrics(self) -> dict[str, float]:
        return {"critic_updates": float(self.updates)}
