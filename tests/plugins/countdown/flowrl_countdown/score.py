"""A reward operator: keeps the environment's per-turn rewards and charges each turn for its length."""

from typing import Any, ClassVar

import msgspec

from flowrl.operator import TRAJECTORIES, Operator, Resources


class CountdownScoreConfig(msgspec.Struct, forbid_unknown_fields=True):
    token_cost: float = 0.02  # reward subtracted per model token of a turn
    concurrency: int = 16


class CountdownScore(Operator):
    """Turn-level rewards: the environment's reward for each turn minus a cost per token."""

    kind = "reward"
    Config = CountdownScoreConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.1)

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        group = inputs["trajectories"]
        for t in group.trajectories:
            env = t.turn_rewards or [0.0] * len(t.turns)
            t.turn_rewards = [r - self.config.token_cost * (turn.end - turn.start) for r, turn in zip(env, t.turns, strict=True)]
            t.reward = sum(t.turn_rewards)
        return {"trajectories": group}
