"""How much faster a train step or an engine iteration runs on more threads, measured on this machine.

The fits (fit.py) give a train step's work and an engine iteration's per-row work at the threads the
run had. A what-if that gives them other threads (an engine's `threads`, a trainer's own process)
needs the work at those. Linear scaling (twice the threads, half the time) is what large matmuls
approach; a small model's do not: the quickstart's tiny model trains about 1.45x faster on two threads
than on one, and plan charged its one-thread async trainer twice the two-thread sync one's time
(docs/plan.md, "Threads"). One run, at one thread count, cannot tell the curve. So plan times it, as
Vidur profiles a model's operators on the hardware it predicts for: the node's operator runs its torch
work on the run's model (`Operator.pass_timer`; the built-ins: operators/timing.py), on a batch shaped
like the run's (`Probe`), on one thread and on n, and plan takes Amdahl's law through the two,

    time(threads) = time(1) x ((1 - p) + p / threads),   p the parallel fraction, in [0, 1].

A train step is a forward and backward pass; an engine iteration a forward pass of one token a row.
The probe runs once per operator, model and shape in a process (`_timed`), before the simulation,
only where a what-if changes a node's threads (`measure`). An operator that times nothing, or a
model it cannot load here, keeps the linear law (p = 1), and the notes say so.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fit.py imports Probe from here
    from flowrl.plan.changes import Scenario
    from flowrl.plan.fit import Costs

LINEAR = 1.0  # the parallel fraction where none was measured: time falls as 1 / threads
MAX_TOKENS = 4096  # a probe batch's tokens at most: a large model's step would take minutes
REPEATS = 7  # timed calls per thread count (the median), after one untimed
LONG_S = 1.0  # an untimed call longer than this: one timed call per thread count is enough


@dataclass(frozen=True)
class Probe:
    """What to time for a node: its operator's (`op`, the registry's name) pass over `rows` rows of
    `length` tokens."""

    op: str
    rows: int
    length: int


def measure(costs: Costs, scenario: Scenario, cores: float) -> None:
    """Time the thread gain of each node whose cores `scenario` changes from the fitted run's (an
    engine's, the trainer's), once per costs. Called before the simulation starts, so the model is
    timed alone, not beside the runtime's own threads."""
    from flowrl.plan.shapes import engine_cores, train_cores

    plan, known = scenario.plan, scenario.shapes
    changed = {name: (engine.cores, engine_cores(plan, name, cores, known)) for name, engine in costs.engines.items()}
    train = plan.facts.trains[0]
    changed[train] = (costs.train_cores, train_cores(plan, train, cores, known))
    for node, (fitted, now) in changed.items():
        if not math.isclose(fitted, now) and node not in costs.parallel:
            costs.parallel[node] = _parallel(costs, node, max(fitted, now))


def factor(costs: Costs, node: str, fitted: float, cores: float) -> float:
    """A node's work on `cores` cores over its work on the `fitted` run's: g(cores) / g(fitted),
    g(n) = (1 - p) + p / n, with the node's parallel fraction p (`measure`; a test may set it)."""
    if math.isclose(fitted, cores):
        return 1.0
    p = costs.parallel[node]
    return ((1.0 - p) + p / cores) / ((1.0 - p) + p / fitted)


def amdahl(one: float, many: float, threads: int) -> float:
    """The parallel fraction p that makes a step of `one` seconds on one thread take `many` on
    `threads`, clipped to [0, 1] (timing noise can put it outside)."""
    if threads <= 1 or one <= 0:
        return LINEAR
    return min(1.0, max(0.0, (1.0 - many / one) / (1.0 - 1.0 / threads)))


def _parallel(costs: Costs, node: str, cores: float) -> float:
    threads = min(math.ceil(cores), os.cpu_count() or 1)
    if threads < 2:
        return LINEAR
    timed = _attempt(costs, node, threads)
    if not isinstance(timed, tuple):
        if timed:
            costs.notes.append(f"{node}: its threads scale linearly (assumed: {timed})")
        return LINEAR
    one, many = timed
    p = amdahl(one, many, threads)
    probe = costs.probes[node]
    costs.notes.append(f"{node}: its torch work runs {one / many:.2f}x as fast on {threads} threads as on 1 "
                       f"(parallel fraction {p:.2f}: timed here, {probe.rows} rows of {probe.length} tokens)")
    return p


def pass_seconds(costs: Costs, node: str, cores: float) -> float | None:
    """The median seconds of `node`'s pass (its probe) on the torch threads of `cores` here; None,
    with a note saying why, where it cannot be timed (lock.py)."""
    timed = _attempt(costs, node, max(1, min(round(cores), os.cpu_count() or 1)))
    if not isinstance(timed, tuple):
        if timed:
            costs.notes.append(f"{node}: its pass was not timed ({timed})")
        return None
    return timed[1]


def _attempt(costs: Costs, node: str, threads: int) -> tuple[float, float] | str | None:
    """`_timed` for `node`'s probe; else why it cannot be timed here, or None where plan has no
    probe or model for it (nothing to say)."""
    probe = costs.probes.get(node)
    if probe is None or not costs.model:
        return None
    try:
        timed = _timed(costs.model, probe, threads)
    except Exception as e:  # a model the operator cannot load here (a VL policy, a missing folder)
        return f"its model could not be timed here: {type(e).__name__}: {str(e)[:120]}"
    return "its operator times no pass" if timed is None else timed


_SECONDS: dict[tuple[str, Probe, int], tuple[float, float] | None] = {}


def _timed(model: str, probe: Probe, threads: int) -> tuple[float, float] | None:
    """The median seconds of the probe's pass on one torch thread and on `threads`, once per
    process; None where its operator times none. The two alternate, call by call, so a drift
    in the machine's speed meets both."""
    key = (model, probe, threads)
    if key not in _SECONDS:
        from flowrl import registry

        once = registry.resolve(probe.op).pass_timer(model, probe.rows, probe.length)
        _SECONDS[key] = None if once is None else _alternating(once, threads)
    return _SECONDS[key]


def _alternating(once: Callable[[int], float], threads: int) -> tuple[float, float]:
    """The medians of REPEATS timed calls on each thread count, after one untimed call each (the
    thread pool starts); one timed call each where the untimed one took over LONG_S, so timing a
    large model costs a few of its steps, not sixteen."""
    times: dict[int, list[float]] = {1: [], threads: []}
    repeats = REPEATS
    for repeat in range(REPEATS + 1):
        for n in times:
            took = once(n)
            if repeat:
                times[n].append(took)
            elif took > LONG_S:
                repeats = 1
        if repeat >= repeats:
            break
    return statistics.median(times[1]), statistics.median(times[threads])
