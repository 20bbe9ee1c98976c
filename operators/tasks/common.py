"""What the built-in tasks share: deterministic per-(seed, split, step, index) RNGs, held-out splits,
and reading a trajectory's text and sample."""

from __future__ import annotations

import random
from typing import Any, Literal

from flowrl.data.trajectory import Trajectory
from flowrl_operators.workflows.base import derive_seed

Split = Literal["train", "eval"]
EVAL_BUCKETS = 20  # 1 in 20 problems is held out for evaluation


def rng_for(task: str, seed: int, split: str, step: int, index: int) -> random.Random:
    return random.Random(derive_seed(task, seed, split, step, index))


def held_out(key: str) -> bool:
    """Whether a problem (by its canonical text) belongs to the eval split; a pure function of the key,
    so a problem is never in both splits whatever the seed."""
    return derive_seed("held-out", key) % EVAL_BUCKETS == 0


def draw(make: Any, rng: random.Random, split: str, key: Any) -> Any:
    """Draw problems from `make(rng)` until one lands in `split` (by `key(problem)`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    want_eval = split == "eval"
    for _ in range(10_000):
        problem = make(rng)
        if held_out(key(problem)) == want_eval:
            return problem
    raise RuntimeError("could not draw a problem for the split; widen the task's options")


def response_text(trajectory: Trajectory) -> str:
    """The decoded response the generate node stored (metadata `text`)."""
    text = trajectory.metadata.get("text")
    if text is None:
        raise KeyError("trajectory metadata has no 'text'; it is set by the generate node")
    return text


def sample_of(trajectory: Trajectory) -> dict[str, Any]:
    sample = trajectory.metadata.get("sample")
    if sample is None:
        raise KeyError("trajectory metadata has no 'sample'; it is set by the generate node")
    return sample


class TaskSource:
    """Base of the built-in tasks' data sources: `sample(step, index)` and `eval_sample(index)`."""

    name = "task"

    def __init__(self, seed: int = 0, split: Split = "train") -> None:
        self.seed = seed
        self.split = split

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        raise NotImplementedError

    def sample(self, step: int, index: int) -> dict[str, Any]:
        return self.make(rng_for(self.name, self.seed, self.split, step, index), self.split)

    def eval_sample(self, index: int) -> dict[str, Any]:
        """Held-out sample `index`: the same problems for every seed, never drawn for training."""
        return self.make(rng_for(self.name, 0, "eval", 0, index), "eval")
