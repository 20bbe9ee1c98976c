"""The critic node: value estimates for GAE, and the value model's own training."""

from __future__ import annotations

from typing import ClassVar

from flowrl.operator import TRAJECTORIES, Operator, Resources
from flowrl_operators.config import CriticConfig


class Critic(Operator):
    """Adds value estimates, then trains the value model on the batch's returns."""

    kind = "transform"
    Config = CriticConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.25)
