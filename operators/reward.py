"""The reward node: scores trajectories with user functions, isolating failures."""

from __future__ import annotations

from typing import ClassVar

from flowrl.operator import TRAJECTORIES, Operator, Resources
from flowrl_operators.config import RewardConfig


class Reward(Operator):
    """Scores trajectories with a user function; failures are isolated and counted."""

    kind = "reward"
    Config = RewardConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.25)
