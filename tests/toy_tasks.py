"""A toy task for graph-level learning tests: after a fixed prompt, answer with digits.

The reward is the fraction of the (at most 3) response characters that are digits: about 10% for
a randomly initialised tiny model, 1.0 once it has learned.
"""

from __future__ import annotations

from typing import Any

from flowrl.data.trajectory import Trajectory


class AnswerWithDigits:
    def __init__(self, seed: int = 0, **_: Any) -> None:
        self.seed = seed

    def sample(self, step: int, index: int) -> dict[str, Any]:
        return {"prompt": "say a number>"}


def digit_fraction(trajectory: Trajectory) -> float:
    text = trajectory.metadata["text"]
    return sum(c.isdigit() for c in text[:3]) / 3


SCORED: dict[str, list[float]] = {}  # group id -> rewards given (tests/test_dapo.py reads it back)


def first_is_digit(trajectory: Trajectory) -> float:
    """1 if the response starts with a digit, else 0: about 10% for the untrained tiny model, so most
    groups of 4 tie at 0 and some do not."""
    reward = float(trajectory.metadata["text"][:1].isdigit())
    SCORED.setdefault(trajectory.group_id, []).append(reward)
    return reward
