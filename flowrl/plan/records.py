"""What `flowrl plan` reads of a run: its plan, the spans of every stage, the groups it trained on,
and the measured figures (seconds per step, samples/s, idle per stage, staleness) of its steady steps.

The files are read by RunDir (flowrl/records); a multi-phase run is read at its last phase.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from flowrl.graph.plan import Plan
from flowrl.records import RunDir, TraceEvent, as_dicts
from flowrl.report import union
from flowrl.spec.errors import UserError

WARMUP = 2  # steps left out of every figure: the first ones pay for setup and the first weight loads


@dataclass(frozen=True)
class Span:
    node: str
    replica: int
    name: str  # generate | process | train | sync | update_weights | drain | wait | step ...
    start: float
    end: float
    step: int | None
    sample: str | None  # args.id
    lock: float | None = None  # the share of it its process's interpreter lock was held (lockprobe.py)
    version: int | None = None  # args.version: the policy version a weight load brought

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Baseline:
    directory: Path
    plan: Plan
    rows: list[dict[str, Any]]  # metrics.jsonl rows of the train node's steps
    spans: list[Span]
    rows_of: dict[str, list[int]]  # sample id -> tokens of each of its trajectories (the rollout store)
    batches: dict[int, list[str]]  # train step -> the sample ids it trained on
    row_length: float = 1.0  # a trained row's mean tokens, prompt included (the shape threads.py times)
    evaluated: frozenset[int] = frozenset()  # the policy versions eval.jsonl holds (data.eval)

    def spans_named(self, node: str, name: str) -> list[Span]:
        return [s for s in self.spans if s.node == node and s.name == name]


def load(run_dir: Path) -> Baseline:
    """The run in `run_dir` (its last phase), or a located UserError saying what is missing."""
    run = RunDir(run_dir).last()
    directory = run.path
    try:
        plan = run.plan()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise UserError(f"cannot read {directory / 'plan.json'}: {e}") from None
    trains = plan.facts.trains
    if len(trains) != 1:
        raise UserError(f"{directory / 'plan.json'}: plan simulates a pipeline with one train node; this one has "
                        f"{len(trains)} ({', '.join(trains) or 'none'})")
    unsupported(plan, directory, trains[0])
    rows = [r for r in _rows(run) if r.get("node") == trains[0]]
    if len(rows) < WARMUP + 2:
        raise UserError(f"{directory / 'metrics.jsonl'}: {len(rows)} train steps recorded; plan needs at least "
                        f"{WARMUP + 2} (the first {WARMUP} are warm-up) to fit its cost models")
    evaluated = frozenset(e.version for e in run.evals()) if run.has("eval.jsonl") else frozenset()
    return Baseline(directory, plan, rows, _spans(run), *_group_rows(directory, trains[0]), evaluated=evaluated)


def unsupported(plan: Plan, directory: Path, train: str) -> None:
    """What plan does not model, refused with where it is (docs/plan.md, "Accuracy and limits")."""
    where = directory / "plan.json"
    if plan.nodes[train].resources.replicas > 1:
        raise UserError(f"{where}: node '{train}' has replicas: {plan.nodes[train].resources.replicas}; plan "
                        "simulates a train node of one rank")
    filters = [n for n, p in plan.nodes.items() if p.oversampling]
    if filters:
        raise UserError(f"{where}: node '{filters[0]}' over-samples (a filter asking for more samples per step); "
                        "plan does not simulate filters")
    joins = [n for n in plan.nodes if sum(e.dst == n and e.kind == "data" for e in plan.edges) > 1]
    if joins:
        raise UserError(f"{where}: node '{joins[0]}' joins two data inputs; plan simulates nodes with one")
    executor = RunDir(directory).meta().executor if (directory / "meta.json").exists() else None
    if executor == "ray":
        raise UserError(f"{directory / 'meta.json'}: the run used the Ray executor; plan models the in-process "
                        "one (every stage in one interpreter)")


def significant(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: a rate of 0.0439 groups/s keeps its precision, which
    two decimals would round to 0.04, and the time to a target computed from it 10 % off."""
    return float(f"{value:.{digits}g}")


def _rows(run: RunDir) -> list[dict[str, Any]]:
    """metrics.jsonl's rows as mappings, as a simulated run keeps them (simulate.py)."""
    file = run.file("metrics.jsonl")
    if not file.exists():
        raise UserError(f"{file} is missing: plan fits its models on a run's metrics, trace and rollouts")
    return as_dicts(run.metrics())


def _spans(run: RunDir) -> list[Span]:
    file = run.file("trace.json")
    if not file.exists():
        raise UserError(f"{file} is missing: plan fits its models on the spans of every stage")
    return spans(run.trace())


def spans(events: list[TraceEvent]) -> list[Span]:
    """The spans of trace events (a run's trace.json, or a simulated run's kept events), by start."""
    names = {e.pid: e.args["name"] for e in events if e.ph == "M"}
    out = []
    for e in events:
        if e.ph != "X" or e.pid not in names:
            continue
        start = e.start_us / 1e6
        out.append(Span(names[e.pid], e.tid // 100, e.name, start, start + e.dur_us / 1e6,
                        e.args.get("step"), e.args.get("id"), e.args.get("lock"), e.args.get("version")))
    return sorted(out, key=lambda s: s.start)


def _group_rows(directory: Path, node: str) -> tuple[dict[str, list[int]], dict[int, list[str]], float]:
    """Per sample id (a group), the model tokens of each trajectory (what its engine decoded); per
    train step, the sample ids of its batch; a trajectory's mean tokens, prompt included."""
    from flowrl.runtime.durability import rollouts

    steps = rollouts.load(directory, node, "plan reads each group's token counts from the rollout store "
                          "(run.record_rollouts: false turns it off)")
    out: dict[str, list[int]] = {}
    batches: dict[int, list[str]] = {}
    lengths = []
    for step in steps:
        for group in step.groups:
            if group.trajectories:
                sample = group.trajectories[0].sample_id
                out[sample] = [max(1, sum(t.loss_mask)) for t in group.trajectories]
                batches.setdefault(step.step, []).append(sample)
                lengths += [len(t.prompt_ids) + len(t.response_ids) for t in group.trajectories]
    return out, batches, sum(lengths) / len(lengths) if lengths else 1.0


TIMED = {"generate", "process", "train", "sync"}  # the spans a stage's busy time counts (stage.py _timed)


def measured(base: Baseline) -> dict[str, Any]:
    """The run's own figures over its steady steps (`steady`)."""
    return steady(base.plan, base.rows, base.spans)


def steady(plan: Plan, rows: list[dict[str, Any]], spans: list[Span]) -> dict[str, Any]:
    """The figures of a run's steps after the first WARMUP, from its metrics rows and trace spans: a
    real run's and a simulated one's alike. Idle is computed from the spans: metrics.jsonl's `idle`
    credits a stage's busy time only when its last piece of work in flight ends, so a stage that is
    never empty shows idle 1.0 and 0.0 in turn (and the excess over a step is clipped); the spans
    give each step its own share."""
    before = rows[WARMUP - 1]["time"]
    after = [r for r in rows if r["step"] >= WARMUP]
    out = figures(after, before)
    out["idle"] = trace_idle(plan, spans, [before] + [r["time"] for r in after])
    return out


def trace_idle(plan: Plan, spans: list[Span], times: list[float]) -> dict[str, float]:
    """Each node's idle fraction over the steps between `times` (observe.py's formula per step,
    weighted by the step's seconds)."""
    idle = {}
    for name, node in plan.nodes.items():
        mine = [s for s in spans if s.node == name and s.name in TIMED]
        replicas = max(1, node.resources.replicas)
        fractions = []
        for left, right in zip(times, times[1:], strict=False):
            busy = sum(union([(max(s.start, left), min(s.end, right)) for s in mine
                               if s.replica == r and s.end > left and s.start < right]) for r in range(replicas))
            fractions.append(min(1.0, max(0.0, 1.0 - busy / (max(right - left, 1e-9) * replicas))) * (right - left))
        idle[name] = round(sum(fractions) / max(times[-1] - times[0], 1e-9), 3)
    return idle


def figures(rows: list[dict[str, Any]], before: float) -> dict[str, Any]:
    """Seconds per step, samples/s, idle fraction per stage (each step's weighted by its seconds)
    and the staleness histogram of metrics rows (`before`: the time of the row before the first)."""
    seconds = (rows[-1]["time"] - before) / len(rows)
    staleness: Counter[int] = Counter()
    for r in rows:
        staleness.update({int(k): int(v) for k, v in (r.get("staleness") or {}).items()})
    nodes = list(rows[0].get("idle", {}))
    spans = [b["time"] - a for a, b in zip([before] + [r["time"] for r in rows], rows, strict=False)]
    total = max(sum(spans), 1e-9)  # idle weighted by each step's seconds: a step of 1 ms weighs 1 ms
    idle = {n: round(sum(r["idle"][n] * w for r, w in zip(rows, spans, strict=True)) / total, 3) for n in nodes}
    groups = sum(r.get("groups", 0) for r in rows)
    return {"step_seconds": round(seconds, 4), "samples_per_s": significant(groups / (rows[-1]["time"] - before)),
            "idle": idle, "staleness": dict(sorted(staleness.items()))}
