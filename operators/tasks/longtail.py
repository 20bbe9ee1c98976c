"""A long-tail agentic task: digit reversal over many turns, with a slow tool.

A problem is a chain of `chunks` digit strings. Each turn the environment shows the next one in the
reversal prompt's format (`<1234>`); the model answers it (`4321`, then the end token); the
environment checks the answer with a tool call that takes time (an `asyncio.sleep`, as a remote
sandbox's wait), then shows the next chunk. The episode ends after the last chunk. Every turn needs
the skill the digit warm-up and GRPO teach (pipelines/quickstart.yaml), so a long problem is not a
harder one: it is a longer one, and its rollout takes longer because the task makes it so.

Each turn's context is the environment's current observation alone (an agent that keeps only the
last observation, as many agent loops truncate their history), in the reversal prompt's raw-text
format, so the quickstart's copy warm-up applies to every turn (measured: with the whole history
as context, the warm-up model answered the second chunk on with nothing or noise, eval 0.10). An
episode is one trajectory per turn, all in its sample's group: GRPO compares each turn's tokens with
those of the group's other turns and episodes.

One knob, `tail` (0 to 1), sets how heavy the tail of a rollout's time is:
- chunks per problem: `ceil(1.5 * u ** (-0.6 * tail))`, u uniform, at most `max_chunks`:
  always 2 at tail 0; at tail 1 median 3, p90 6, 3.6% of problems at 12;
- each tool call waits `latency_s * exp(0.6 * tail * z)` (z standard normal: a lognormal wait),
  plus, with probability `0.02 * tail`, a cold start of `20 * tail * latency_s` on the episode's
  first call (a sandbox that had to start).
At tail 1 the p99 of an episode's time is 5-7x its median (`rollout_seconds` below, tested: 6.8x
for the waits alone, 5.4x with 0.04 s of generation a turn; the longest of 50,000 ~10x), at tail 0.5
4-5x, at tail 0 1x: inside the tails the literature reports (p99 ~10x the median, Laminar; the
longest >20x, RollPacker). Episodes of one group share the problem and draw their own
waits. Held-out (eval) problems have the same chunk counts and no waits: the evaluation measures the
policy, not the tool.

Rewards: `fn: flowrl_operators.tasks.digits:position_rewards` credits each turn's tokens as it
credits a single reversal (every turn's trajectory holds its turn's `target`). `longtail_digits.reward`
(`builtin:longtail_digits`, the eval's score) is the episode's mean over turns of the fraction of
correct positions.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import Split, TaskSource, draw
from flowrl_operators.tasks.digits import positions_correct
from flowrl_operators.workflows.base import TrajectoryBuilder, WorkflowContext

BASE_CHUNKS = 1.5  # chunks = ceil(BASE_CHUNKS * u ** (-CHUNK_SHAPE * tail))
CHUNK_SHAPE = 0.6
WAIT_SIGMA = 0.6  # lognormal sigma of a tool wait at tail 1
COLD_START_P = 0.02  # chance of a cold start on an episode's first tool call at tail 1
COLD_START_X = 20.0  # a cold start's extra wait, in units of latency_s, at tail 1


def chunk_count(u: float, tail: float, max_chunks: int) -> int:
    """Chunks of a problem whose uniform draw is `u` (in (0, 1]) at tail setting `tail`."""
    return max(1, min(max_chunks, math.ceil(BASE_CHUNKS * u ** (-CHUNK_SHAPE * tail) - 1e-9)))


def tool_waits(rng: random.Random, calls: int, tail: float, latency_s: float) -> list[float]:
    """Seconds each of an episode's `calls` tool calls waits (module docs)."""
    waits = [latency_s * math.exp(WAIT_SIGMA * tail * rng.gauss(0.0, 1.0)) for _ in range(calls)]
    if waits and rng.random() < COLD_START_P * tail:
        waits[0] += COLD_START_X * tail * latency_s
    return waits


def rollout_seconds(rng: random.Random, tail: float, latency_s: float, turn_s: float, max_chunks: int = 12) -> float:
    """An episode's nominal time: `turn_s` of generation per turn plus its tool waits (for the tail's
    quantiles; the engine's real share depends on batching)."""
    chunks = chunk_count(1.0 - rng.random(), tail, max_chunks)
    return chunks * turn_s + sum(tool_waits(rng, chunks, tail, latency_s))


class ChainEnv:
    """One episode: the chunks to reverse, and the tool's waits."""

    def __init__(self, sample: dict[str, Any], waits: list[float]) -> None:
        self.chunks, self.waits, self.turn = sample["chunks"], waits, 0

    def reset(self) -> str:
        return f"<{self.chunks[0]}>"

    async def step(self, answer: str) -> tuple[str | None, float]:
        """Checks turn `self.turn`'s answer (after the tool's wait); returns the next observation
        (None when the chain is done) and the turn's score."""
        if self.waits[self.turn] > 0:
            await asyncio.sleep(self.waits[self.turn])
        score = positions_correct(answer, self.chunks[self.turn][::-1])
        self.turn += 1
        return (f"<{self.chunks[self.turn]}>" if self.turn < len(self.chunks) else None), score


async def chain_workflow(ctx: WorkflowContext, sample: dict[str, Any]) -> list[Trajectory]:
    """One episode of the chain (`workflow: builtin:longtail_digits`): one trajectory per turn, each
    holding its turn's sample (`prompt`, `digits`, `target`: what `digits.position_rewards` credits)
    and the episode's mean score (`episode_reward`: what `longtail_digits.reward` reads)."""
    waits = tool_waits(ctx.rng, len(sample["chunks"]), sample["tail"], sample["latency_s"])
    env = ChainEnv(sample, waits)
    observation: str | None = env.reset()
    turns, scores = [], []
    while observation is not None:
        turn = {"prompt": observation, "digits": env.chunks[env.turn], "target": env.chunks[env.turn][::-1],
                "turn": env.turn, "chunks": env.chunks}
        builder = TrajectoryBuilder(ctx.prompt_ids(turn))
        result = await ctx.generate(builder.context_ids)
        builder.add_model(result)
        turns.append((builder, turn))
        observation, score = await env.step(ctx.decode(result.output_ids))
        scores.append(score)
    mean = sum(scores) / len(scores)
    return [b.build(metadata={"sample": turn, "episode_reward": mean, "turns": len(turns),
                              "tool_seconds": round(sum(waits), 4)}) for b, turn in turns]


class longtail_digits(TaskSource):  # noqa: N801 - the name users write: builtin:longtail_digits
    """Reverse a chain of digit strings, one per turn, with a slow tool between turns (module docs)."""

    name = "longtail_digits"

    def __init__(self, seed: int = 0, split: Split = "train", tail: float = 1.0, latency_s: float = 0.05,
                 min_digits: int = 3, max_digits: int = 6, max_chunks: int = 12) -> None:
        super().__init__(seed, split)
        if not 0.0 <= tail <= 1.0:
            raise ValueError(f"tail must be in [0, 1] (0 uniform, 1 heavy), got {tail}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        if not 1 <= min_digits <= max_digits or max_chunks < 1:
            raise ValueError(f"need 1 <= min_digits <= max_digits and max_chunks >= 1, got {min_digits}, "
                             f"{max_digits}, {max_chunks}")
        self.tail, self.latency_s, self.max_chunks = tail, latency_s, max_chunks
        self.min_digits, self.max_digits = min_digits, max_digits

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        def chain(r: random.Random) -> list[str]:
            count = chunk_count(1.0 - r.random(), self.tail, self.max_chunks)
            return ["".join(r.choice("0123456789") for _ in range(r.randint(self.min_digits, self.max_digits)))
                    for _ in range(count)]

        chunks = draw(chain, rng, split, lambda c: "|".join(c))
        return {"prompt": f"<{chunks[0]}>", "chunks": chunks, "tail": self.tail,
                "latency_s": 0.0 if split == "eval" else self.latency_s}

    @staticmethod
    def workflow() -> Any:
        return chain_workflow

    @staticmethod
    def reference(sample: dict[str, Any]) -> str:
        """The first turn's right answer (`flowrl validate --probe`, flowrl_operators/probe.py)."""
        return sample["chunks"][0][::-1]

    @staticmethod
    def turn_sample(sample: dict[str, Any]) -> dict[str, Any]:
        """The first turn's sample, as `chain_workflow` hands it to the reward."""
        chunk = sample["chunks"][0]
        return {"prompt": f"<{chunk}>", "digits": chunk, "target": chunk[::-1], "turn": 0, "chunks": sample["chunks"]}

    @staticmethod
    def reward(trajectory: Trajectory) -> float:
        """The episode's mean over turns of the fraction of correct positions (the eval's score; any
        turn's trajectory holds it)."""
        return float(trajectory.metadata["episode_reward"])
