"""How much of a train step holds its process's interpreter lock (cpu.py's `lock` of a train job), and
what handing the lock over between the jobs of one process costs (cpu.py's `handoff`).

A train step in the run's own process shares the interpreter lock with the engine's decoding there:
the more of the step is Python (batching, the loss's bookkeeping, metrics, a small model's
optimizer), the more the two take turns when async overlaps them. Where to learn it:

1. The run's own overlaps (`calibrate`): the lock under which the fitted costs scatter least
   between spans that overlapped other work and spans that did not. An async run can tell it.
2. Where nothing overlapped (a sync run), the share of a train step outside its forward and
   backward pass (`measure`): the train operator times that pass on the run's model here
   (`Operator.pass_timer`, threads.py), on the run's batch shape and threads, and what the run's
   mean step spends beyond it is taken to hold the lock; the pass is taken as native (torch kernels
   release the lock). Timed only when a simulated scenario overlaps training with other work in the
   run's process (async): a sync scenario never needs it.
3. Where the pass cannot be timed (an operator that times none, a model not on this machine): the
   lock probe's share in the run's train spans (runtime/lockprobe.py), else 1 (it takes turns). The
   probe counts only holds longer than 0.5 ms, and a small model's step holds the lock in many short
   stretches: on the digit runs it read 4-5 %, where the timed pass left about 20 % and the async
   runs' overlaps fit 40-50 % (docs/plan.md, "Accuracy and limits").

The handoff (`handoff`), before any fit: the run's in-process generate node's operator runs two of
its engines on the run's model, in two threads and in turns (`Operator.handoff`), once per process.
Without it (an operator that times none, a model not on this machine) handoffs are free (1).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from flowrl.plan.fit import Costs, batch_rows, fit
from flowrl.plan.records import WARMUP, Baseline
from flowrl.plan.shapes import declared, processes, slots
from flowrl.plan.threads import pass_seconds

if TYPE_CHECKING:
    from flowrl.plan.changes import Scenario

LOCKS = [round(1.0 - 0.1 * i, 1) for i in range(11)]  # train_lock values tried, 1 first
TOLD = 0.01  # the spread of the fits' scatter over LOCKS below which the run cannot tell the lock


def calibrate(base: Baseline, machine: float) -> Costs:
    """The costs fitted with the train step's lock share where the run's overlaps tell it; else
    fitted under 1 (without overlap the work is the same under any share), with what `measure`
    needs to learn it once a scenario overlaps training. Both under the lock's handoff, timed here."""
    timed, said = handoff(base)
    tried = [(scatter, lock, costs) for lock in LOCKS
             for costs, scatter in [fit(base, machine, lock, scatter=True, handoff=timed)]]
    for _, _, costs in tried:
        costs.notes.append(said)
    best = min(tried, key=lambda t: t[0])
    if max(t[0] for t in tried) - best[0] >= TOLD:
        best[2].notes.append(f"a train step holds the interpreter lock {best[1]:.0%} of its time (fitted on how "
                             f"its spans and the engine's overlapped)")
        return best[2]
    costs = tried[0][2]
    trains = main_process_trains(base)
    if trains:
        probed = [s.lock for s in trains if s.lock is not None]
        costs.untold = (statistics.mean(s.seconds for s in trains),
                        round(statistics.median(probed), 3) if probed else None)
        costs.notes.append("the run's overlaps cannot tell how much of a train step holds the interpreter lock: "
                           "learnt where a scenario overlaps training (docs/plan.md, \"The machine\")")
    return costs


def main_process_trains(base: Baseline) -> list[Any]:
    """The steady train spans of trainers in the run's own process (a trainer with a process of its
    own has its own lock: nothing to learn)."""
    own = processes(base.plan)
    return [s for s in base.spans if s.name == "train" and s.node not in own and (s.step or 0) >= WARMUP]


def overlaps(scenario: Scenario) -> bool:
    """Whether `scenario` runs training beside other work of the run's process: an async input edge
    of a trainer that has no process of its own."""
    plan = scenario.plan
    own = processes(plan, scenario.shapes)
    return any(e.kind == "data" and e.dst in plan.facts.trains and e.dst not in own and e.mode == "async"
               for e in plan.edges)


def measure(costs: Costs, scenario: Scenario) -> None:
    """Learn the lock share the run could not tell (module docs, 2 and 3), once per costs, where
    `scenario` needs it."""
    if costs.untold is None or not overlaps(scenario):
        return
    step, probed = costs.untold
    costs.untold = None
    passed = pass_seconds(costs, scenario.plan.facts.trains[0], costs.train_cores)
    if passed is not None:
        costs.train_lock = min(1.0, max(0.0, 1.0 - passed / step))
        costs.notes.append(f"a train step holds the interpreter lock {costs.train_lock:.0%} of its time (its time "
                           f"outside the forward and backward pass: {passed * 1e3:.1f} ms of {step * 1e3:.1f} ms "
                           "timed here; no work the model times overlapped it to fit the lock from)")
    elif probed is not None:
        costs.train_lock = probed
        costs.notes.append(f"a train step holds the interpreter lock {probed:.0%} of its time (the lock probe in "
                           "the run's train steps; its pass could not be timed here, and no work the model "
                           "times overlapped it to fit it from)")
    else:
        costs.notes.append("a train step takes turns with the other stages for the interpreter (the run has too "
                           "little overlap to tell otherwise, its pass could not be timed here, and its train "
                           "spans measured no lock share)")


_HANDOFF: dict[tuple[str, str, int], float | str] = {}


def handoff(base: Baseline) -> tuple[float, str]:
    """The lock's handoff efficiency in the run's process and a note saying where it comes from:
    its first generate node's operator times two of its engines side by side on the run's model
    and slots (as many as a batch fills), once per process."""
    model, own = base.plan.model.get("path"), processes(base.plan)
    generate = [(name, node) for name, node in base.plan.nodes.items() if node.kind == "generate" and name not in own]
    if not generate or not model:
        return 1.0, "the interpreter lock's handoffs are taken as free (no engine in the run's process to time)"
    name, node = generate[0]
    rows = max(1, min(slots(declared(node)), batch_rows(base)))
    key = (node.op, model, rows)
    if key not in _HANDOFF:
        from flowrl import registry

        try:
            _HANDOFF[key] = registry.resolve(node.op).handoff(model, rows) or "its operator times none"
        except Exception as e:  # a model the operator cannot run here (a VL policy, a missing folder)
            _HANDOFF[key] = f"its engines could not run here: {type(e).__name__}: {str(e)[:120]}"
    timed = _HANDOFF[key]
    if isinstance(timed, str):
        return 1.0, f"the interpreter lock's handoffs are taken as free ({name}: {timed})"
    timed = min(1.0, max(0.1, timed))
    return timed, (f"two {name} engines in one process run at {timed:.2f} of the speed of taking turns (timed here, "
                   f"{rows} rows each): where the interpreter lock is oversubscribed, its jobs run that much slower")
