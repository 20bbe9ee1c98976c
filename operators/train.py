"""The train node: RL updates of the policy (FSDP2), publishing version v+1."""

from __future__ import annotations

from typing import ClassVar

from flowrl.operator import POLICY, TRAJECTORIES, GraphFacts, Operator, Resources
from flowrl_operators.config import TrainConfig


class Train(Operator):
    """Updates the policy with an RL loss (FSDP2); publishes policy version v+1."""

    kind = "train"
    Config = TrainConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"policy": POLICY}
    resources = Resources(cpus=0.5)

    @classmethod
    def check_graph(cls, config: TrainConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        loss = config.loss
        off_policy = facts.async_upstream or facts.partial_rollout_upstream
        corrected = loss.decoupled or loss.correction is not None or loss.kind == "sft"
        if off_policy and not corrected and not config.allow_uncorrected_off_policy:
            why = "an async edge" if facts.async_upstream else "partial rollout"
            return [(("loss",), f"{why} feeds this node stale data but the loss corrects nothing; set "
                     "loss.decoupled: true or loss.correction: {kind: tis}, or opt out with "
                     "allow_uncorrected_off_policy: true")]
        return []
