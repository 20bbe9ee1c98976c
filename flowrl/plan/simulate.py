"""A simulated run (`flowrl plan`): the run's graph on the real runtime, on a virtual clock.

The coordinator with its roles (admission, batch forming, joins, staleness, weight versions) and
the stages (concurrency, weights before samples, draining before a weight load) are the
runtime's own code, run in process on a virtual clock by flowrl/runtime/executors/inprocess.py
`simulate`. Only the operators are stand-ins, whose calls take their fitted time (stages.py).
Plan keeps no rule of its own: change one in the runtime and the prediction follows. The figures
are read off the simulated run's records as a real run's are (records.steady).
"""

from __future__ import annotations

from typing import Any

import msgspec

from flowrl.graph.plan import Plan
from flowrl.plan.changes import Scenario
from flowrl.plan.fit import Costs
from flowrl.plan.records import spans, steady
from flowrl.plan.stages import StandIns
from flowrl.runtime.executors.inprocess import simulate


def run(scenario: Scenario, costs: Costs, cores: float, seed: int) -> dict[str, Any]:
    """The figures of one simulated run of `scenario` (`seed`: the resampling's)."""
    plan = stand_in(scenario)
    stand_ins = StandIns(scenario, costs, cores, seed)
    kept = simulate(plan, stand_ins, connect=stand_ins.connect).coord.observe.kept
    assert kept is not None  # a run without a run directory keeps its records
    return steady(plan, kept.rows, spans(kept.events))


def stand_in(scenario: Scenario) -> Plan:
    """The scenario's plan as the stand-ins run it: their data source, its steps, and nothing that
    would end it otherwise (stop_when, max_seconds: plan predicts the steps given)."""
    plan = scenario.plan
    data: dict[str, Any] = {"source": "flowrl.plan.stages:Prompts", "batch_size": plan.data["batch_size"]}
    if plan.data.get("eval"):  # a final evaluation: the run ends once the engine has loaded the last policy
        data["eval"] = plan.data["eval"]
    return msgspec.structs.replace(plan, data=data, run={"steps": scenario.steps, "samples_per_step": 0})
