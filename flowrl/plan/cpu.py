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
from typing import NamedTuple

MAIN = "main"


class Load(NamedTuple):
    """What a job asks of the machine at full speed."""

    process: str
    lock: float  # the share of its time it holds its process's interpreter lock
    cores: float = 1.0  # the cores it keeps busy
    # The share of its time this machine's work takes; the rest waits elsewhere at its own pace (a
    # multi-turn group's tools, beside its engine's decoding): only this share slows down.
    bound: float = 1.0
    # Jobs on one thread (the groups one engine decodes in its batches): their lock and cores add up
    # to at most one thread's.
    thread: str | None = None


@dataclass
class Job:
    load: Load
    left: float  # seconds of work at full speed
    done: Callable[[], None]


class Cpu:
    def __init__(self, cores: float, handoff: float = 1.0) -> None:
        self.cores, self.handoff = cores, handoff
        self.jobs: list[Job] = []

    def add(self, load: Load, work: float, done: Callable[[], None]) -> None:
        self.jobs.append(Job(load, max(0.0, work), done))

    def rates(self) -> list[float]:
        return shares([j.load for j in self.jobs], self.cores, self.handoff)

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


def shares(loads: list[Load], cores: float, handoff: float = 1.0) -> list[float]:
    """The rate of each running job, given its load, with the lock's `handoff` efficiency where it
    is oversubscribed."""
    locks: dict[str, float] = {}
    busy: dict[str, float] = {}
    threads: dict[str, list[Load]] = {}
    for load in loads:
        if load.thread is None:
            locks[load.process] = locks.get(load.process, 0.0) + load.lock
            busy[load.process] = busy.get(load.process, 0.0) + load.cores
        else:
            threads.setdefault(load.thread, []).append(load)
    for mine in threads.values():
        process = mine[0].process
        locks[process] = locks.get(process, 0.0) + min(1.0, sum(load.lock for load in mine))
        busy[process] = busy.get(process, 0.0) + min(1.0, sum(load.cores for load in mine))
    rate = {p: 1.0 if locks[p] <= 1.0 else handoff / locks[p] for p in busy}
    used = sum(rate[p] * busy[p] for p in busy)
    scale = min(1.0, cores / used) if used > 0 else 1.0
    return [1.0 / ((1.0 - load.bound) + load.bound / (rate[load.process] * scale)) for load in loads]
