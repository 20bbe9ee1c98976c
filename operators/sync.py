"""The sync node: delivers new policy versions to the generate engines in buckets."""

from __future__ import annotations

from typing import ClassVar

from flowrl.operator import POLICY, WEIGHTS, Operator, Resources
from flowrl_operators.config import SyncConfig


class Sync(Operator):
    """Delivers a new policy version to the generate engines in weight buckets."""

    kind = "sync"
    Config = SyncConfig
    inputs: ClassVar = {"policy": POLICY}
    outputs: ClassVar = {"weights": WEIGHTS}
    resources = Resources(cpus=0.1)
