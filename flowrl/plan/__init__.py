"""`flowrl plan RUN_DIR [key=value ...] [--search]`: predict a pipeline's step time, throughput,
idle per stage and staleness under changes, from one run's records (docs/plan.md).

records.py reads the run, fit.py fits each stage's cost, changes.py applies the overrides,
simulate.py runs the graph on the real runtime on a virtual clock with stand-in operators
(stages.py, their time from the fits and cpu.py, the machine-share model), search.py tries a
small space, report.py prints text or JSON.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flowrl.plan.changes import Scenario
from flowrl.plan.fit import Costs
from flowrl.plan.records import WARMUP, significant
from flowrl.spec.errors import UserError

MIN_STEPS = 40  # steps simulated at least, over repeats: resampled tails need a few to average


def cores(plan: Any) -> float:
    """The machine's cores as the run had them: cluster.cpus, else this machine's count."""
    return float(plan.cluster.get("cpus") or os.cpu_count() or 1)


def predict(scenario: Scenario, costs: Costs, machine_cores: float) -> dict[str, Any]:
    """The simulated figures of `scenario`: records.figures of its steady steps, averaged over
    enough repeats (seeds) to cover MIN_STEPS steps. Each repeat runs the scenario's own number of
    steps, so the end of a run (its last, possibly short batches) weighs as it does in a real run."""
    from flowrl.plan.simulate import run
    from flowrl.plan.threads import measure

    if scenario.steps < WARMUP + 2:
        raise UserError(f"simulate at least {WARMUP + 2} steps (run.steps): the first {WARMUP} are warm-up")
    measure(costs, scenario, machine_cores)
    repeats = -(-MIN_STEPS // scenario.steps)
    return average([run(scenario, costs, machine_cores, seed) for seed in range(repeats)])


def average(runs: list[dict[str, Any]]) -> dict[str, Any]:
    staleness: dict[int, int] = {}
    for r in runs:
        for lag, count in r["staleness"].items():
            staleness[lag] = staleness.get(lag, 0) + count
    return {"step_seconds": round(sum(r["step_seconds"] for r in runs) / len(runs), 4),
            "samples_per_s": significant(sum(r["samples_per_s"] for r in runs) / len(runs)),
            "idle": {n: round(sum(r["idle"][n] for r in runs) / len(runs), 3) for n in runs[0]["idle"]},
            "staleness": dict(sorted(staleness.items()))}


def plan_run(run_dir: Path, overrides: list[str], search: bool = False, budget: float | None = None,
             max_replicas: int = 4, max_staleness: int = 4) -> dict[str, Any]:
    """Fit the run in `run_dir`, simulate it as it ran and with `overrides` (and `--search`)."""
    from flowrl.plan import records
    from flowrl.plan.changes import apply
    base = records.load(run_dir)
    machine = cores(base.plan)
    steps = len(base.rows)
    measured = records.measured(base)
    costs = calibrate(base, machine)
    result: dict[str, Any] = {
        "run": str(run_dir), "name": base.plan.name, "steps": [WARMUP, len(base.rows) - 1], "changes": list(overrides),
        "model": {"notes": costs.notes, "cores": machine, "train_lock": costs.train_lock,
                  "parallel": costs.parallel},  # filled where a what-if's threads were timed (threads.measure)
        "measured": measured,
        "simulated": predict(apply(base.plan, [], steps), costs, machine),
    }
    if overrides:
        result["predicted"] = predict(apply(base.plan, overrides, steps), costs, machine)
    if search:
        from flowrl.plan.search import search as run_search

        result["search"] = run_search(base.plan, costs, overrides, steps, machine, budget, max_replicas, max_staleness)
    return result


LOCKS = [round(1.0 - 0.1 * i, 1) for i in range(11)]  # train_lock values tried, 1 first
TOLD = 0.01  # the spread of the fits' scatter over LOCKS below which the run cannot tell the lock


def calibrate(base: Any, machine: float) -> Costs:
    """The costs fitted with the train step's interpreter lock fraction (cpu.py) under which the
    run's spans agree best with the cost models: the engine's work per iteration and the train's
    per token vary least between spans that overlapped other work and spans that did not
    (fit.scatter). A run where training never overlaps other work cannot tell: there the share its
    train steps measured (their spans' `lock`, runtime/lockprobe.py), else 1 (it takes turns)."""
    from flowrl.plan.fit import fit

    tried = [(scatter, lock, costs) for lock in LOCKS for costs, scatter in [fit(base, machine, lock, scatter=True)]]
    best = min(tried, key=lambda t: t[0])
    if max(t[0] for t in tried) - best[0] >= TOLD:
        best[2].notes.append(f"a train step holds the interpreter lock {best[1]:.0%} of its time (fitted on how "
                             f"its spans and the engine's overlapped)")
        return best[2]
    measured = measured_lock(base)
    if measured is None:
        costs = tried[0][2]
        costs.notes.append("a train step takes turns with the other stages for the interpreter (the run has too "
                           "little overlap to tell otherwise, and its train spans measured no lock share)")
        return costs
    costs = fit(base, machine, measured)
    costs.notes.append(f"a train step holds the interpreter lock {measured:.0%} of its time (the lock probe in the "
                       f"run's train steps; no work the model times overlapped them to fit it from)")
    return costs


def measured_lock(base: Any) -> float | None:
    """The median lock share of the steady train steps run in the main process; None where none
    measured it (a run from before the probe, a trainer in a process of its own)."""
    from statistics import median

    from flowrl.plan.shapes import processes

    own = processes(base.plan)
    shares = [s.lock for s in base.spans if s.name == "train" and s.lock is not None and s.node not in own
              and (s.step or 0) >= WARMUP]
    return round(median(shares), 3) if shares else None
