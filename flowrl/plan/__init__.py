"""`flowrl plan RUN_DIR [key=value ...] [--search]`: predict a pipeline's step time, throughput,
idle per stage and staleness under changes, from one run's records (docs/plan.md).

records.py reads the run, fit.py fits each stage's cost, changes.py applies the overrides,
simulate.py (with cpu.py, the machine-share model) replays the graph under the runtime's rules,
search.py tries a small space, report.py prints text or JSON.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flowrl.plan.changes import Scenario
from flowrl.plan.fit import Costs
from flowrl.plan.records import WARMUP, figures


MIN_STEPS = 40  # steps simulated at least (unless run.steps says): resampled tails need a few to average


def cores(plan: Any) -> float:
    """The machine's cores as the run had them: cluster.cpus, else this machine's count."""
    return float(plan.cluster.get("cpus") or os.cpu_count() or 1)


def predict(scenario: Scenario, costs: Costs, machine_cores: float, seed: int = 0) -> dict[str, Any]:
    """The simulated figures of `scenario` (records.figures of its steady steps)."""
    from flowrl.plan.simulate import Sim

    rows = Sim(scenario, costs, machine_cores, seed).run()
    if len(rows) < WARMUP + 2:
        raise ValueError(f"simulate at least {WARMUP + 2} steps (run.steps)")
    return figures(rows[WARMUP:], rows[WARMUP - 1]["time"])


def plan_run(run_dir: Path, overrides: list[str], search: bool = False, budget: float | None = None,
             max_replicas: int = 4, max_staleness: int = 4) -> dict[str, Any]:
    """Fit the run in `run_dir`, simulate it as it ran and with `overrides` (and `--search`)."""
    from flowrl.plan import records
    from flowrl.plan.changes import apply
    from flowrl.plan.cpu import MAIN_CORES
    from flowrl.plan.fit import fit

    base = records.load(run_dir)
    machine = cores(base.plan)
    costs = fit(base, machine)
    steps = max(len(base.rows), MIN_STEPS)
    result: dict[str, Any] = {
        "run": str(run_dir), "name": base.plan.name, "steps": [WARMUP, len(base.rows) - 1], "changes": list(overrides),
        "model": {"notes": costs.notes, "cores": machine, "main_cores": MAIN_CORES},
        "measured": records.measured(base),
        "simulated": predict(apply(base.plan, [], steps), costs, machine),
    }
    if overrides:
        result["predicted"] = predict(apply(base.plan, overrides, steps), costs, machine)
    if search:
        from flowrl.plan.search import search as run_search

        result["search"] = run_search(base.plan, costs, overrides, steps, machine, budget, max_replicas, max_staleness)
    return result
