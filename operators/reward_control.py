"""The random-reward control arm of a reward node (`control: random`).

A learning claim needs a control: would the same run, with rewards that carry no information about
the answer, have gained as much (from a shorter reply, a format, the eval's noise)? Under `control:
random` the node still scores every trajectory with its function, keeps that score as
`metadata["true_reward"]` (and reports its mean as `reward/true_mean`), and trains on a reward drawn
at random from the scores seen so far in the run, this one's included: the task's own reward
distribution, pooled since the run (or its resume) began (for a 0/1 reward, 1 with the pooled rate's
probability; a control arm does not learn, so that stays about the base rate), independent of what
the sample says. Only sequence rewards can be drawn so: a trajectory with turn or token rewards fails
the node, naming the option. The draws are seeded by the run's seed, the node's name and how many
scores the pool held.
"""

from __future__ import annotations

import random
import zlib

from flowrl.data.trajectory import Trajectory


class ControlMisused(ValueError):
    """control: random met a reward it cannot draw (turn or token rewards)."""


class RandomReward:
    def __init__(self, seed: int, node: str) -> None:
        self.seed = seed * 1_000_003 + zlib.crc32(node.encode())
        self.seen: list[float] = []

    def apply(self, trajectories: list[Trajectory]) -> None:
        if any(t.turn_rewards is not None or t.token_rewards is not None for t in trajectories):
            raise ControlMisused("control: random draws sequence rewards; this reward function returns "
                                 "turn or token rewards: remove `control` or return one float per trajectory")
        scored = [t for t in trajectories if t.reward is not None]
        self.seen.extend(float(t.reward) for t in scored)
        rng = random.Random(self.seed * 7_919 + len(self.seen))  # a group's draws: seed and pool size
        for t in scored:
            t.metadata["true_reward"] = t.reward
            t.reward = rng.choice(self.seen)
