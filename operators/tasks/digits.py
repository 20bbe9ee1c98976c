"""Digit tasks: reverse the digits (single-turn RL with a dense reward) and copy them (a supervised
warm-up whose target is known).

A prompt is raw text: a start mark, the digits, then a marker (`<1234>` reverses, `<1234=` copies);
the answer is the digits and the end-of-text token. The start mark gives the first digit a left
neighbour, so a model reading the digits backwards meets it where the answer ends; without one it
must count the digits to know when to stop, and the tiny quickstart model often did not (measured
in docs/benchmarks.md). Raw prompts keep sequences short for a CPU quickstart; set `chat: true` to wrap the
prompt in the chat template instead.
"""

from __future__ import annotations

import random
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import Split, TaskSource, draw, response_text, sample_of


def positions_correct(answer: str, target: str) -> float:
    """Fraction of target positions answered correctly; extra characters count as wrong positions."""
    answer = answer.strip()
    if not target:
        return float(answer == "")
    hits = sum(a == b for a, b in zip(answer, target, strict=False))
    return hits / max(len(target), len(answer))


class _Digits(TaskSource):
    marker = "?"

    def __init__(self, seed: int = 0, split: Split = "train", min_digits: int = 3, max_digits: int = 6,
                 chat: bool = False, marker: str | None = None, start: str = "<") -> None:
        super().__init__(seed, split)
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if marker is not None and (not marker or any(c.isdigit() for c in marker)):
            raise ValueError(f"marker must be non-empty text without digits, got {marker!r}")
        if any(c.isdigit() for c in start):
            raise ValueError(f"start must be text without digits ('' for none), got {start!r}")
        self.min_digits, self.max_digits, self.chat, self.start = min_digits, max_digits, chat, start
        self.marker = self.marker if marker is None else marker

    def answer(self, digits: str) -> str:
        raise NotImplementedError

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        def digits_of(r: random.Random) -> str:
            return "".join(r.choice("0123456789") for _ in range(r.randint(self.min_digits, self.max_digits)))

        digits = draw(digits_of, rng, split, lambda d: d)
        text = self.start + digits + self.marker
        prompt: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text}
        return {**prompt, "digits": digits, "target": self.answer(digits)}

    @staticmethod
    def reference(sample: dict[str, Any]) -> str:
        """The right answer (`flowrl validate --probe`, flowrl_operators/probe.py)."""
        return sample["target"]

    @staticmethod
    def reward(trajectory: Trajectory) -> float:
        """Dense reward: the fraction of correct positions."""
        return positions_correct(response_text(trajectory), sample_of(trajectory)["target"])


class reverse_digits(_Digits):  # noqa: N801 - the name users write: data.source builtin:reverse_digits
    """Reverse a string of digits: `<1234>` -> `4321`."""

    name = "reverse_digits"
    marker = ">"

    def answer(self, digits: str) -> str:
        return digits[::-1]


class copy_digits(_Digits):  # noqa: N801
    """Copy a string of digits: `<1234=` -> `1234`. Fresh random problems each step (a small fixed
    pool would be memorised); use with `workflow: supervised` for a warm-up phase. `marker: ">"`
    asks in the reversal prompt's format, so the warm-up teaches the answer format on the very
    prompts RL will see."""

    name = "copy_digits"
    marker = "="

    def answer(self, digits: str) -> str:
        return digits


def exact_match(trajectory: Trajectory) -> float:
    """Sequence-level reward for the digit tasks (`fn: flowrl_operators.tasks.digits:exact_match`):
    1 if the answer is the target exactly, else 0. A group's answers then often tie (all wrong, or
    all right), which is what DAPO's dynamic sampling filters (pipelines/dapo.yaml)."""
    return float(response_text(trajectory).strip() == sample_of(trajectory)["target"])


def position_rewards(trajectory: Trajectory) -> dict[str, Any]:
    """Per-token credit for the digit tasks (`fn: flowrl_operators.tasks.digits:position_rewards`):
    each character scores 1 in its place if right, 0 if wrong, -1 past the target's end; the end
    token scores 1 right after the last digit and -1 anywhere else. `reward` (reported, not credited)
    is the fraction of correct positions.

    Why: a sequence score tells a group which answer was better, not which digit; per-token rewards
    do (with `advantage: {estimator: grpo, gamma: 0}` each token is judged on its own). Why -1 for a
    misplaced end: stopping early and writing a wrong digit both scored 0, so policies settled on
    answers one or two digits short and never explored the missing positions (measured with
    builtin:tiny-qwen2). Needs a character-level tokenizer (one token per character), like the
    built-in models'; a response whose tokens and characters do not line up (a special token sampled
    inside the answer) scores -1 on every token.
    """
    text, target = response_text(trajectory), sample_of(trajectory)["target"]
    credit = token_credit(text, target, len(trajectory.response_ids), trajectory.finish_reason == "stop")
    return {"reward": positions_correct(text, target), "token_rewards": credit}


def token_credit(text: str, target: str, tokens: int, stopped: bool) -> list[float]:
    """`position_rewards`' values for a response of `tokens` tokens decoded (specials skipped) to
    `text`: one per character, then one for the end token if the response `stopped` on it (rather
    than being cut off by the length limit); -1 on every token if they do not line up."""
    ended = stopped and tokens == len(text) + 1
    if tokens != len(text) + ended:  # a special token inside the answer: no character lines up, all wrong
        return [-1.0] * tokens
    rewards = [(1.0 if char == target[i] else 0.0) if i < len(target) else -1.0 for i, char in enumerate(text)]
    if ended:
        rewards.append(1.0 if len(text) == len(target) else -1.0)
    return rewards
