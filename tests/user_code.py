"""User code that is wrong in the ways a run must report, not swallow (tests/test_untrained.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from flowrl.data.trajectory import Trajectory
from flowrl.operator import POLICY, TRAJECTORIES, Operator, TrainResult


async def wrong_returns(ctx: Any, sample: dict) -> Any:
    """Each sample's episodes return another wrong thing: a string, an int, None, a trajectory whose
    lengths disagree."""
    index = int(ctx.sample_id.split(":")[1]) % 4
    if index == 0:
        return "an answer"
    if index == 1:
        return 42
    if index == 2:
        return None
    return Trajectory(id="", group_id="", sample_id="", prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 1],
                      behaviour_logprobs=[0.0, 0.0, 0.0], versions=[0, 0, 0])


async def foreign_ids(ctx: Any, sample: dict) -> Any:
    """A trajectory tokenized with another vocabulary: a prompt id past the model's."""
    return Trajectory(id="", group_id="", sample_id="", prompt_ids=[1, 2, 1_000_000], response_ids=[3, 4],
                      loss_mask=[1, 1], behaviour_logprobs=[-1.0, -1.0], versions=[0, 0])


def nan_reward(trajectory: Trajectory) -> float:
    return float("nan")


def parse_answer(text: str) -> float:
    raise ValueError(f"cannot parse {text[:10]!r} as a number")


def raising_reward(trajectory: Trajectory) -> float:
    return parse_answer(trajectory.metadata["text"])


class WrongPort(Operator):
    """Passes groups on under a port it does not declare (a typo: 'trajectory')."""

    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"trajectory": inputs["trajectories"]}


class SetupRaises(WrongPort):
    """Its setup() fails on a resource it expects (a plugin's own bug, not flowrl's)."""

    async def setup(self) -> None:
        lookup({}, "tokenizer")


def lookup(table: dict, key: str) -> Any:
    return table[key]


class RaisingOp(Operator):
    """A transform whose own code raises on every group."""

    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return lookup({}, "weights")


class GarbageOut(Operator):
    """A transform whose result has the right port and the wrong type (a str, not a Group)."""

    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"trajectories": "garbage"}


class BadMetricsTrain(Operator):
    """A trainer whose metrics hold a value JSON cannot write (a set)."""

    kind = "train"
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"policy": POLICY}

    async def train(self, groups: list[Any], *, step: int) -> TrainResult:
        return TrainResult(policy={"version": step + 1}, metrics={"loss": {0.5}})
