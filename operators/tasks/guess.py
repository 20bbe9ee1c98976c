"""Guess the number: a multi-turn task. The environment holds a secret number per episode and
answers each guess with `higher`, `lower` or `correct`.

Turn rewards: a correct guess on turn t earns `1 - 0.1 (t - 1)` (at least 0.5), a reply that is not
a number in range costs 0.1, any other guess earns 0. The episode reward is their sum.
"""

from __future__ import annotations

import random
import re
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import Split, TaskSource, draw
from flowrl_operators.workflows.environment import EnvironmentWorkflow, StepResult

_NUMBER = re.compile(r"-?\d+")


class GuessNumberEnv:
    """One episode's state: the secret and the turn count."""

    def __init__(self) -> None:
        self.secret: int | None = None
        self.turn = 0

    def reset(self, sample: dict[str, Any]) -> str:
        self.secret, self.low, self.high = sample["secret"], sample["low"], sample["high"]
        self.turn = 0
        return sample["prompt"]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        match = _NUMBER.search(action)
        guess = int(match.group()) if match else None
        if guess is None or not self.low <= guess <= self.high:
            return StepResult(f"say a number from {self.low} to {self.high}", -0.1, False, {"solved": False})
        if guess == self.secret:
            return StepResult("correct", max(0.5, 1.0 - 0.1 * (self.turn - 1)), True,
                              {"solved": True, "turns_to_solve": self.turn})
        return StepResult("higher" if self.secret > guess else "lower", 0.0, False, {"solved": False})


class guess_number(TaskSource):  # noqa: N801 - the name users write: builtin:guess_number
    """Guess a secret integer in [low, high]; the environment says higher or lower."""

    name = "guess_number"

    def __init__(self, seed: int = 0, split: Split = "train", low: int = 1, high: int = 16) -> None:
        super().__init__(seed, split)
        if low >= high:
            raise ValueError(f"guess_number needs low < high, got {low}, {high}")
        self.low, self.high = low, high

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        # Secrets are few, so the held-out key includes a per-draw nonce: eval episodes are new
        # draws, not unseen secrets.
        secret, nonce = draw(lambda r: (r.randint(self.low, self.high), r.getrandbits(32)), rng, split,
                             lambda p: f"{p[0]}/{p[1]}")
        return {"secret": secret, "low": self.low, "high": self.high,
                "prompt": f"Guess my number, {self.low} to {self.high}."}

    @staticmethod
    def workflow(max_turns: int = 5, **args: Any) -> EnvironmentWorkflow:
        return EnvironmentWorkflow(GuessNumberEnv, max_turns=max_turns, **args)

    @staticmethod
    def reference(sample: dict[str, Any]) -> str:
        """The right first guess (`flowrl validate --probe`, flowrl_operators/probe.py)."""
        return str(sample["secret"])

    @staticmethod
    def reward(trajectory: Trajectory) -> float:
        """The environment already scored the episode; this reads it back (sum of turn rewards)."""
        return float(sum(trajectory.turn_rewards or [])) if trajectory.turn_rewards else (trajectory.reward or 0.0)
