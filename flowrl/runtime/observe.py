"""Trace and metrics: where time went, per stage and per step.

`trace.json` is Chrome trace-event JSON (`{"traceEvents": [...]}`, opens in Perfetto and
chrome://tracing), appended during the run and valid after every append (flowrl/runtime/durability/streams.py). One process row (`pid`) per node, named by a metadata event; `tid` is
`replica * 100` for the stage's own loop (waits, weight updates, train steps) and
`replica * 100 + slot` (slot >= 1) for work running concurrently on that replica. Events:
`ph: "X"` spans named `wait` (blocked on input or admission), `generate` / `process` / `train` /
`sync` (operator calls; args hold the record id, step and version), `drain` (a generate stage
finishing in-flight work before a weight update), `update_weights`, `setup` (the operator built and set
up, a checkpoint restored), and `step` (one train step,
start to publish); `ph: "i"` instants `publish v<n>` and `weights v<n>`. The row `runtime` (pid 0)
holds the run's own work: `checkpoint` spans (from the step that made one due until it is written;
train nodes wait meanwhile) and `flush` spans (these files appended). Timestamps are microseconds
since the run's origin (`meta.json`).

`metrics.jsonl` has one JSON object per train step (see flowrl/runtime/__init__.py for the keys),
`samples.jsonl` `run.samples_per_step` trajectories of each trained batch (flowrl/runtime/tracking.py);
the same rows go to each tracker of `run.trackers` (flowrl/trackers/; TensorBoard under
`tensorboard/` by default). All are written by `flush()`, which the runtime calls every few
seconds and at checkpoints, so memory stays bounded in a long run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from flowrl import records
from flowrl.graph.plan import Plan
from flowrl.health import BUILTIN_ROLES, Health
from flowrl.operator import POLICY, WEIGHTS, MetricRoles
from flowrl.records import MetricsRow, SampleRow, StreamSizes, TraceEvent
from flowrl.runtime.clock import WALL, Clock
from flowrl.runtime.durability.streams import TraceFile
from flowrl.runtime.tracking import TIMEOUT_S as TRACKER_TIMEOUT_S
from flowrl.runtime.tracking import Tracking, sample_rows

DEFAULT_TRACKERS = ["tensorboard"]  # run.trackers
SAMPLES_PER_STEP = 4  # run.samples_per_step


def span(pid: int, tid: int, name: str, start: float, end: float, origin: float, **args: Any) -> TraceEvent:
    return TraceEvent(name=name, ph="X", ts=round((start - origin) * 1e6, 1),
                      dur=round(max(end - start, 0.0) * 1e6, 1), pid=pid, tid=tid, args=args)


RUNTIME_PID = 0  # the trace row of the run's own work; nodes are 1, 2, ...


def node_pids(plan: Plan) -> dict[str, int]:
    order = list(plan.order) + [n for n in plan.nodes if n not in plan.order]
    return {n: i + 1 for i, n in enumerate(order)}


@dataclass
class Kept:
    """What a run without a run directory would have written to metrics.jsonl and trace.json, kept
    in memory: the runtime's simulation tests and `flowrl plan` read it."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list)


class Observer:
    def __init__(self, plan: Plan, run_dir: Path | None, origin: float, clock: Clock = WALL) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.origin = origin
        self.clock = clock
        self.kept = Kept() if run_dir is None else None
        self.pids = node_pids(plan)
        self.events: list[TraceEvent] = [
            TraceEvent(name="process_name", ph="M", pid=pid, args={"name": node})
            for node, pid in {"runtime": RUNTIME_PID, **self.pids}.items()
        ]
        self.busy: dict[tuple[str, int], float] = {}
        # Operators' cumulative counters as last reported, per (node, replica).
        self.operators: dict[tuple[str, int], dict[str, float]] = {}
        self.dropped = 0
        self.weight_bytes = 0  # tensor bytes handed to the coordinator on policy / weights ports
        self.last_row: dict[str, Any] | None = None
        self.rows: list[dict[str, Any]] = []
        self._mark = {"time": clock.now(), "busy": {}, "dropped": 0}
        self.samples: list[dict[str, Any]] = []
        self.samples_per_step = int(plan.run.get("samples_per_step", SAMPLES_PER_STEP))
        # Learning health per train node (flowrl/health.py): its events go into the row of the step
        # that found them, so metrics.jsonl holds them as soon as that row is flushed.
        self.health: dict[str, Health] = {}
        self.health_events: list[dict[str, Any]] = []
        self.roles = judged_roles(plan)
        self.trace = TraceFile(run_dir / "trace.json") if run_dir is not None else None
        self.tracking: Tracking | None = None
        if run_dir is not None:
            config = msgspec.json.decode(plan.record())  # environment values redacted
            self.tracking = Tracking(plan.run.get("trackers", DEFAULT_TRACKERS), run_dir, plan.name, origin, config,
                                     float(plan.run.get("tracker_timeout_s", TRACKER_TIMEOUT_S)))

    def runtime(self, name: str, start: float, **args: Any) -> None:
        """A span of the run's own work (a checkpoint, a flush) from `start` until now."""
        self.events.append(span(RUNTIME_PID, 0, name, start, self.clock.now(), self.origin, **args))

    def instant(self, node: str, replica: int, name: str) -> None:
        self.events.append(TraceEvent(name=name, ph="i", s="p", ts=round((self.clock.now() - self.origin) * 1e6, 1),
                                      pid=self.pids[node], tid=replica * 100))

    def train_step(self, node: str, step: int, version: int, work: Any, metrics: dict[str, Any],
                   queues: dict[str, int], counters: dict[str, int]) -> None:
        now = self.clock.now()
        dt = max(now - self._mark["time"], 1e-9)
        values = [v for item in work.value for v in item.values()]
        trajectories = [t for v in values for t in getattr(v, "trajectories", [])]
        rewards = [t.reward for t in trajectories if getattr(t, "reward", None) is not None]
        lags = work.lags
        staleness: dict[str, int] = {}
        for lag in lags:
            staleness[str(lag)] = staleness.get(str(lag), 0) + 1
        idle = {}
        for n, plan in self.plan.nodes.items():
            keys = [k for k in self.busy if k[0] == n]
            busy = sum(self.busy[k] - self._mark["busy"].get(k, 0.0) for k in keys)
            idle[n] = round(min(1.0, max(0.0, 1.0 - busy / (dt * max(1, plan.resources.replicas)))), 4)
        row = MetricsRow(
            step=step, version=version, node=node, time=round(now - self.origin, 4),
            step_seconds=round(dt, 4), groups=len(values), samples_per_s=round(len(values) / dt, 3),
            trajectories_per_s=round(len(trajectories) / dt, 3),
            reward=(sum(rewards) / len(rewards)) if rewards else None,
            reward_max=max(rewards) if rewards else None,  # the batch's best trajectory (flowrl/health.py)
            queues=queues, staleness=staleness, dropped=self.dropped - self._mark["dropped"],
            dropped_total=counters["dropped"], stale_kept_total=counters["stale_kept"],
            rejected_total=counters["rejected"], filtered_total=counters["filtered"],
            # Since the previous row: groups filtered out (e.g. dynamic_sampling's tied groups) and
            # samples issued beyond the step's batch_size or by admission credit (flowrl/runtime/quota.py).
            filtered=counters["filtered"] - self._mark.get("filtered", 0),
            oversampled=counters["oversampled"] - self._mark.get("oversampled", 0),
            oversampled_total=counters["oversampled"],
            coordinator_weight_bytes=self.weight_bytes - self._mark.get("weight_bytes", 0),
            idle=idle, train=numbers(metrics), operators=self._operator_totals(),
        ).as_dict()
        self._mark = {"time": now, "busy": dict(self.busy), "dropped": self.dropped,
                      "filtered": counters["filtered"], "oversampled": counters["oversampled"],
                      "weight_bytes": self.weight_bytes}
        events = self._detector(node).update(row) if node in self.roles else []
        if events:
            row["health"] = [e | {"node": node} for e in events]
            self.health_events += row["health"]
        self.rows.append(row)
        self.samples += sample_rows(node, step, trajectories, self.samples_per_step)
        self.last_row = row
        self.events.append(span(self.pids[node], 0, "step", now - dt, now, self.origin, step=step))

    def _detector(self, node: str) -> Health:
        if node not in self.health:
            self.health[node] = Health(self.roles[node])
        return self.health[node]

    def crossed(self, ports: dict[str, str], outputs: dict[str, Any]) -> None:
        """Count the weight bytes a stage handed the coordinator (its policy and weights outputs).
        In-process these are references to the tensors (nothing is copied); under Ray they were
        pickled into the coordinator actor, unless they came as object refs (ray_stage.py): 0."""
        for port, value in outputs.items():
            if ports.get(port) in (POLICY, WEIGHTS):
                self.weight_bytes += tensor_bytes(value)

    def _operator_totals(self) -> dict[str, dict[str, float]]:
        totals: dict[str, dict[str, float]] = {}
        for (node, _), values in sorted(self.operators.items()):
            mine = totals.setdefault(node, {})
            for key, value in values.items():
                mine[key] = mine.get(key, 0.0) + float(value)
        return totals

    def flush(self) -> None:
        """Append what accumulated to metrics.jsonl, samples.jsonl and trace.json, and hand the
        rows to the run's trackers (TensorBoard's event files among them, by default)."""
        rows, samples, events = self.rows, self.samples, self.events
        self.rows, self.samples, self.events = [], [], []
        if self.kept is not None:
            self.kept.rows += rows
            self.kept.events += events
            return
        start = self.clock.now()
        self.trace.append(events)
        # Typed on the way out: a row the reader (flowrl/records) would refuse fails here, at its writer.
        records.append(self.run_dir / "metrics.jsonl", [msgspec.convert(row, MetricsRow) for row in rows])
        records.append(self.run_dir / "samples.jsonl", [msgspec.convert(sample, SampleRow) for sample in samples])
        if self.tracking is not None:
            self.tracking.log(rows, samples)
        self.runtime("flush", start, rows=len(rows), events=len(events))

    def close(self) -> None:
        self.flush()
        if self.tracking is not None:
            self.tracking.close()

    def offsets(self) -> StreamSizes:
        """Every stream's size now, for a checkpoint (flowrl/runtime/durability/streams.py)."""
        from flowrl.runtime.durability.streams import offsets

        self.flush()
        return offsets(self.run_dir, self.trace, self.run_dir / "tensorboard") if self.run_dir else StreamSizes()

    def state(self) -> dict[str, Any]:
        return {"dropped": self.dropped, "health": {n: h.state() for n, h in self.health.items()},
                "health_events": list(self.health_events)}

    def restore(self, state: dict[str, Any]) -> None:
        self.events = []  # the trace already holds its process names
        self.dropped = state["dropped"]
        for node, values in state.get("health", {}).items():  # a checkpoint from before health: afresh
            if node in self.roles:
                self._detector(node).restore(values)
        self.health_events = list(state.get("health_events", []))


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """A train step's metrics as the row's floats: an int or bool an operator returned (stage.py lets
    Python numbers through) is written as the float it stands for, so the row reads back as written."""
    return {k: float(v) for k, v in metrics.items()}


def judged_roles(plan: Plan) -> dict[str, MetricRoles]:
    """The train nodes health judges, each with the roles of its metrics: as their operators
    declared them (`Plan.metric_roles`), or the built-in names for a plan without declarations."""
    if plan.metric_roles is not None:
        return dict(plan.metric_roles)
    return {name: BUILTIN_ROLES for name, node in plan.nodes.items() if node.kind == "train"}


def tensor_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensors / arrays in `value` (nested lists, tuples, dicts, dataclass
    records such as a transport's); an object ref or anything else counts 0."""
    seen = set() if seen is None else seen
    if hasattr(value, "element_size") and hasattr(value, "data_ptr"):  # a torch tensor
        key, size = value.data_ptr(), value.numel() * value.element_size()
    elif hasattr(value, "nbytes") and hasattr(value, "dtype") and hasattr(value, "ctypes"):  # a numpy array
        key, size = value.ctypes.data, int(value.nbytes)
    elif isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    elif isinstance(value, list | tuple):
        return sum(tensor_bytes(v, seen) for v in value)
    elif hasattr(value, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(value, f), seen) for f in value.__dataclass_fields__)
    else:
        return 0
    if key in seen:  # the same storage twice (e.g. a weights record aliasing the policy's tensors)
        return 0
    seen.add(key)
    return size
