"""The generate node: runs a workflow per sample on an inference engine."""

from __future__ import annotations

from typing import ClassVar

from flowrl.operator import PROMPTS, TRAJECTORIES, WEIGHTS, Operator, Resources
from flowrl_operators.config import GenerateConfig


class Generate(Operator):
    """Runs a workflow per sample on an inference engine; emits trajectory groups."""

    kind = "generate"
    Config = GenerateConfig
    inputs: ClassVar = {"prompts": PROMPTS, "weights": WEIGHTS}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.5)
