"""Dynamic sampling (DAPO) between reward and train: groups whose rewards are all equal carry no
group-relative signal, so they are dropped, and the generate side over-samples to keep the train
batch full.

How the batch stays full (flowrl/runtime/quota.py): the operator declares, through
`oversampling(config)`, (oversample, max_oversample) as multiples of `data.batch_size`. Each step
starts with ceil(oversample x batch_size) samples; over a sync edge to the train node every dropped
group is replaced by a new sample of the same step until the step has `batch_size` groups that
differ or has issued floor(max_oversample x batch_size) samples (the cap, replacements included:
DAPO's max_num_gen_batches with a generation batch of batch_size); over async edges each dropped
group credits admission one more sample, at most the cap's worth a step. The train node takes the
first `batch_size` groups; a step that would get none waits for more, past the cap. The counts are in
`metrics()` (`dynamic_sampling/dropped`, `keep_rate`) and in each metrics row (`filtered`,
`oversampled`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

from msgspec import Meta

from flowrl.data.trajectory import Group
from flowrl.operator import TRAJECTORIES, Knobs, Operator, Resources
from flowrl_operators.config import PositiveInt, Strict


class DynamicSamplingConfig(Strict):
    # A group is kept when the spread (max - min) of its rewards exceeds this.
    min_spread: Annotated[float, Meta(ge=0)] = 0.0
    oversample: Annotated[float, Meta(ge=1)] = 1.0  # samples a step starts with / batch_size
    max_oversample: Annotated[float, Meta(ge=1)] = 4.0  # samples a step may issue / batch_size, replacements included
    concurrency: PositiveInt = 16


def informative(group: Group, min_spread: float = 0.0) -> bool:
    """Whether the group's rewards differ (by more than `min_spread`); missing rewards count as 0."""
    rewards = [t.reward if t.reward is not None else sum(t.turn_rewards or []) for t in group.trajectories]
    if len(rewards) < 2 or not all(math.isfinite(r) for r in rewards):
        return False
    return max(rewards) - min(rewards) > min_spread


class DynamicSampling(Operator):
    """Drops groups whose rewards are all equal and asks generate to over-sample (DAPO)."""

    kind = "transform"
    Config = DynamicSamplingConfig

    @classmethod
    def knobs(cls, config: DynamicSamplingConfig) -> Knobs:
        return Knobs(concurrency=config.concurrency)
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.05)

    config: DynamicSamplingConfig

    @classmethod
    def oversampling(cls, config: DynamicSamplingConfig) -> tuple[float, float]:
        """(initial, maximum) samples issued per step, as multiples of data.batch_size."""
        return config.oversample, max(config.oversample, config.max_oversample)

    async def setup(self) -> None:
        self.counts = {"groups": 0, "kept": 0, "dropped": 0}

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        group: Group = inputs["trajectories"]
        self.counts["groups"] += 1
        if not informative(group, self.config.min_spread):
            self.counts["dropped"] += 1
            return {}
        self.counts["kept"] += 1
        return {"trajectories": group}

    def metrics(self) -> dict[str, float]:
        out = {f"dynamic_sampling/{k}": float(v) for k, v in self.counts.items()}
        if self.counts["groups"]:
            out["dynamic_sampling/keep_rate"] = self.counts["kept"] / self.counts["groups"]
        return out
