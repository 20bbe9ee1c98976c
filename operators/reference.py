"""The reference node: log-probabilities of the frozen initial policy."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from flowrl.data.trajectory import Group
from flowrl.operator import TRAJECTORIES, GraphFacts, Operator, Resources
from flowrl_operators.config import ReferenceConfig


class Reference(Operator):
    """Adds log-probabilities of the frozen initial policy (for a KL term)."""

    kind = "reference"
    Config = ReferenceConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    provides: ClassVar = frozenset({"reference_logprobs"})
    resources = Resources(cpus=0.25)

    @classmethod
    def check_graph(cls, config: ReferenceConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        from flowrl_operators.training.engine import check_name

        return [(("engine",), problem)] if (problem := check_name(config.engine)) else []

    def model_path(self) -> str:
        """The frozen model's checkpoint: the node's `model`, else the pipeline's."""
        return self.config.model or self.context.model["path"]

    async def setup(self) -> None:
        from flowrl_operators.tokenizer import import_transformers
        from flowrl_operators.training.engine import build
        from flowrl_operators.training.trainer import TrainerConfig

        config = TrainerConfig(micro_batch_tokens=self.config.micro_batch_tokens, seed=self.context.seed)
        import_transformers()  # here, not in two threads at once
        self.model = await asyncio.to_thread(build, self.config.engine, self.model_path(), config, "reference")
        # One forward at a time: records arrive concurrently, the model is shared.
        self.lock = asyncio.Lock()

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        group: Group = inputs["trajectories"]
        async with self.lock:
            await asyncio.to_thread(self._score, group)
        return {"trajectories": group}

    def _score(self, group: Group) -> None:
        trajectories = [t for t in group.trajectories if t.response_ids]
        for traj, logprobs in zip(trajectories, self.logprobs(trajectories), strict=True):
            traj.reference_logprobs = logprobs

    def logprobs(self, trajectories: list) -> list[list[float]]:
        """The frozen model's logprob of each response token, under the token's sampling distribution."""
        from flowrl_operators.training.batch import pack, response_values

        if not trajectories:
            return []
        batch = pack(trajectories, require_reward=False)
        batch.reference_logprobs = self.model.compute_logprobs(batch)
        return response_values(batch, "reference_logprobs", trajectories)
