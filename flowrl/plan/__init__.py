"""`flowrl plan RUN_DIR [key=value ...] [--search]`: predict a pipeline's step time, throughput,
idle per stage and staleness under changes, from one run's records (docs/plan.md).

records.py reads the run, fit.py fits each stage's cost (lock.py: how much of a train step holds
the interpreter lock), changes.py applies the overrides, simulate.py runs the graph on the real
runtime on a virtual clock with stand-in operators (stages.py, their time from the fits and cpu.py,
the machine-share model), search.py tries a small space, report.py prints text or JSON.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flowrl.plan.changes import Scenario
from flowrl.plan.fit import Costs
from flowrl.plan.lock import calibrate
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
    from flowrl.plan import lock, threads
    from flowrl.plan.simulate import run

    if scenario.steps < WARMUP + 2:
        raise UserError(f"simulate at least {WARMUP + 2} steps (run.steps): the first {WARMUP} are warm-up")
    lock.measure(costs, scenario)
    threads.measure(costs, scenario, machine_cores)
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
        "measured": measured,
        "simulated": predict(apply(base.plan, [], steps), costs, machine),
    }
    if overrides:
        result["predicted"] = predict(apply(base.plan, overrides, steps), costs, machine)
    if search:
        from flowrl.plan.search import search as run_search

        result["search"] = run_search(base.plan, costs, overrides, steps, machine, budget, max_replicas, max_staleness)
    # after the predictions: the lock and the threads are timed where a scenario needed them
    result["model"] = {"notes": costs.notes, "cores": machine, "train_lock": costs.train_lock,
                       "parallel": costs.parallel}
    return result
