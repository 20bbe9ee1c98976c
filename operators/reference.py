"""The reference node: log-probabilities of the frozen initial policy."""

from __future__ import annotations

from typing import ClassVar

from flowrl.operator import TRAJECTORIES, Operator, Resources
from flowrl_operators.config import ReferenceConfig


class Reference(Operator):
    """Adds log-probabilities of the frozen initial policy (for a KL term)."""

    kind = "reference"
    Config = ReferenceConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.25)
