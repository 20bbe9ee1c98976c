"""The machine-share model of `flowrl plan`: processor sharing over processes and cores.

Every piece of stage work the simulator runs (an engine iteration, a train step, a reward call, a
weight sync) is a job with an amount of work: the seconds it took in the fitted run, where it ran
(nearly) alone. A job runs in a process; a process executes at most `capacity` cores of work at a
time, shared equally by its jobs; when the processes together ask for more than the machine's
cores, every one slows down in proportion. The in-process executor runs every stage in one Python
interpreter: its capacity is MAIN_CORES (one core: the small models of a CPU run spend their time
in the interpreter, holding its lock, so a second thread adds little); a trainer with
`own_process: {threads: N}` is a process of its own with capacity N.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAIN_CORES = 1.0
MAIN = "main"


@dataclass
class Job:
    process: str
    left: float  # seconds of work at full speed
    done: Callable[[], None]


class Cpu:
    def __init__(self, cores: float, processes: dict[str, float]) -> None:
        self.cores = cores
        self.capacity = {MAIN: MAIN_CORES, **processes}
        self.jobs: list[Job] = []

    def add(self, process: str, work: float, done: Callable[[], None]) -> None:
        self.jobs.append(Job(process, max(0.0, work), done))

    def rates(self) -> list[float]:
        rate = shares([j.process for j in self.jobs], self.capacity, self.cores)
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


def shares(processes: list[str], capacity: dict[str, float], cores: float) -> dict[str, float]:
    """The rate of one job of each process, with one entry in `processes` per running job."""
    count: dict[str, int] = {}
    for p in processes:
        count[p] = count.get(p, 0) + 1
    demand = {p: min(capacity.get(p, 1.0), n) for p, n in count.items()}
    share = min(1.0, cores / max(sum(demand.values()), 1e-12))
    return {p: demand[p] * share / count[p] for p in count}
