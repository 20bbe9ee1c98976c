"""The machine-share model of `flowrl plan`: processes, an interpreter lock in each, and cores.

Every piece of stage work the stand-ins do (stages.py: an engine iteration, a train step, a reward
call, a weight sync) is a job with an amount of work: the seconds it takes alone. A job runs in a process
and holds that process's interpreter lock for a fraction `lock` of its work (Python code), the rest
running in native code that releases it (torch kernels). Jobs of one process run at one common
rate r, the largest with: the lock busy at most all the time (r x the sum of their lock fractions
<= 1), no job faster than alone (r <= 1); and all jobs of all processes together use at most the
machine's cores (if not, every rate is scaled down alike). Where the lock is oversubscribed (the
sum above 1) the jobs also lose to its handoffs: r is `handoff` / the sum, `handoff` the speed of two
embedded engines decoding in two threads of one process against the same work in turns, timed on
this machine (`Operator.handoff`, lock.py: about 0.75-0.8 here, where two threads bounce the lock
and their caches between the cores), 1 where nothing times it.

The in-process executor runs every stage in one interpreter. The engine's decode loop, rewards,
the run's own bookkeeping hold the lock all their time (lock 1: small models spend their time in
the interpreter): two of them take turns. The train step's fraction is learnt from the run's own
overlaps, or timed where it has none (lock.py). A trainer with `own_process` is a process (and a
lock) of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAIN = "main"


@dataclass
class Job:
    process: str
    lock: float  # the fraction of its work that holds its process's interpreter lock
    left: float  # seconds of work at full speed
    done: Callable[[], None]


class Cpu:
    def __init__(self, cores: float, handoff: float = 1.0) -> None:
        self.cores, self.handoff = cores, handoff
        self.jobs: list[Job] = []

    def add(self, process: str, lock: float, work: float, done: Callable[[], None]) -> None:
        self.jobs.append(Job(process, lock, max(0.0, work), done))

    def rates(self) -> list[float]:
        rate = shares([(j.process, j.lock) for j in self.jobs], self.cores, self.handoff)
        return [rate[j.process] for j in self.jobs]

    def next_done(self) -> float | None:
        """Seconds until the first job ends at today's rates; None without jobs."""
        if not self.jobs:
            return None
        return min(j.left / r for j, r in zip(self.jobs, self.rates(), strict=True))

    def advance(self, seconds: float) -> list[Job]:
        """Run every job for `seconds`; returns (and removes) the jobs that ended."""
        for job, rate in zip(self.jobs, self.rates(), strict=True):
            job.left -= seconds * rate
        ended = [j for j in self.jobs if j.left <= 1e-12]
        self.jobs = [j for j in self.jobs if j.left > 1e-12]
        return ended


def shares(jobs: list[tuple[str, float]], cores: float, handoff: float = 1.0) -> dict[str, float]:
    """The rate of the jobs of each process, given (process, lock fraction) per running job, and the
    lock's `handoff` efficiency where it is oversubscribed."""
    locks: dict[str, float] = {}
    count: dict[str, int] = {}
    for process, lock in jobs:
        locks[process] = locks.get(process, 0.0) + lock
        count[process] = count.get(process, 0) + 1
    rate = {p: 1.0 if locks[p] <= 1.0 else handoff / locks[p] for p in count}
    used = sum(rate[p] * count[p] for p in count)
    scale = min(1.0, cores / used) if used > 0 else 1.0
    return {p: r * scale for p, r in rate.items()}
