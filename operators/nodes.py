"""The built-in node kinds, registered under the entry-point group `flowrl.operators`.

Each class declares what the compiler needs (kind, ports, Config, default resources). The
work itself lives in the engine, training, transport and workflow modules these classes load
inside their stage.
"""

from __future__ import annotations

from typing import ClassVar

from flowrl_operators.config import (
    CriticConfig,
    GenerateConfig,
    ReferenceConfig,
    RewardConfig,
    SyncConfig,
    TrainConfig,
)

from flowrl.operator import POLICY, PROMPTS, TRAJECTORIES, WEIGHTS, GraphFacts, Operator, Resources


class Generate(Operator):
    """Runs a workflow per sample on an inference engine; emits trajectory groups."""

    kind = "generate"
    Config = GenerateConfig
    inputs: ClassVar = {"prompts": PROMPTS, "weights": WEIGHTS}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.5)


class Reward(Operator):
    """Scores trajectories with a user function; failures are isolated and counted."""

    kind = "reward"
    Config = RewardConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.25)


class Reference(Operator):
    """Adds log-probabilities of the frozen initial policy (for a KL term)."""

    kind = "reference"
    Config = ReferenceConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.25)


class Critic(Operator):
    """Adds value estimates, then trains the value model on the batch's returns."""

    kind = "transform"
    Config = CriticConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.25)


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


class Sync(Operator):
    """Delivers a new policy version to the generate engines in weight buckets."""

    kind = "sync"
    Config = SyncConfig
    inputs: ClassVar = {"policy": POLICY}
    outputs: ClassVar = {"weights": WEIGHTS}
    resources = Resources(cpus=0.1)
