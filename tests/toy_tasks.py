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
