"""The coordinator: channels, the version clock, the ledger and stopping, in one place.

Stages never talk to each other; they call the coordinator's stage-facing methods (`attach`,
`take`, `complete`, `loaded_weights`, `report` for trace events, `fail`). In-process the
stages call the object directly; under Ray it is an async actor and the stages call it through
`RemoteCoordinator`, so the stage code is the same in both executors.

What a node is handed and when it finishes a step is the business of its kind's role, looked up
in one table (`roles`): generate nodes in samples.py (with admission.py), train nodes in
batches.py, sync and all other nodes in joins.py. A role sees this class only as a
`CoordinatorView` (role.py), the typed list of what it may read and call: the run's
configuration, the shared state and the methods under "what the roles share" below. The graph
facts the roles use (budgets, staleness limits, which generate nodes feed which train nodes) are
in `plan.facts` (flowrl/graph/facts.py). The rules here:
- Version clock: a train node at version v runs step v and publishes version v+1 with its
  policy record. The clock is the lowest version of all train nodes.
- Staleness (`deliver`): a consumer at version v (a train node's own version; the clock for other
  stages) that takes a record from an async edge with version < v - limit (`Channel.limit`)
  applies the edge's `on_stale`: `drop` (ledger `drop`, counted) or `keep` (delivered, counted).
- A sample that will never reach a train node (rejected, filtered, dropped: `lose`) is told to
  the admission of every generate node upstream and to every train node downstream.
- A stage finishes step s (`end`) as its role says; a train node's step ends its output edges'
  step, and a consumer re-checks its own steps whenever a producer ends one.
- Completing work is atomic: its input records are consumed and its outputs emitted together;
  it waits while an async output channel is full (sync edges are bounded by admission instead).
- The run is done when every train node has reached `steps` (without train nodes: when every
  sink has ended `steps` steps) and the final policy is evaluated (`data.eval.final`); it stops
  earlier on an error, `max_seconds`, `stop_when` or an interrupt.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

from flowrl.data.source import batch_size
from flowrl.graph.plan import EdgePlan, Plan
from flowrl.records import TraceEvent
from flowrl.runtime.batches import Batches
from flowrl.runtime.channel import Channel, Record, Work
from flowrl.runtime.clock import WALL, Clock
from flowrl.runtime.durability import rollouts, snapshot
from flowrl.runtime.durability.checkpoints import Pacing
from flowrl.runtime.durability.ledger import Ledger
from flowrl.runtime.joins import Joins, Policies
from flowrl.runtime.observe import Observer
from flowrl.runtime.role import Role
from flowrl.runtime.samples import Samples
from flowrl.runtime.targets import Targets
from flowrl.runtime.untrained import DEFAULT_MAX_EMPTY, Untrained
from flowrl.runtime.waits import Waits


class Coordinator:
    def __init__(self, plan: Plan, run_dir: str | None, steps: int, stop_at: int | None = None,
                 origin: float | None = None, state: bytes | None = None, clock: Clock = WALL) -> None:
        self.plan = plan
        self.steps = steps
        self.stop_at = stop_at if stop_at is not None else steps
        self.batch_size = batch_size(plan.data)
        self.run_dir = Path(run_dir) if run_dir else None
        self.time = clock  # what time it is (clock.py); `clock` below is the version clock
        self.origin = origin if origin is not None else clock.now()
        self.ins = {n: [e for e in plan.edges if e.dst == n and e.kind == "data"] for n in plan.nodes}
        self.outs = {n: [e for e in plan.edges if e.src == n] for n in plan.nodes}
        self.channels = {e.label: Channel(e, plan.facts.limits[e.label]) for e in plan.edges if e.kind == "data"}
        self.trains = plan.facts.trains
        # State that a checkpoint keeps (snapshot.py), with the roles' own.
        self.versions = {t: 0 for t in self.trains}
        self.ended: dict[str, set[int]] = {n: set() for n in plan.nodes}
        self.counters = {"dropped": 0, "stale_kept": 0, "rejected": 0, "filtered": 0, "oversampled": 0}
        self.resumes = 0
        self.record_rollouts = self.run_dir is not None and bool(plan.run.get("record_rollouts", True))
        self.pacing = Pacing(plan.run.get("checkpoint_every"), plan.run.get("checkpoint_seconds"), clock.now())
        # Transient state.
        self.held: dict[str, dict[str, tuple[int, Work]]] = {n: {} for n in plan.nodes}
        self.stopping: str | None = None  # done | time (max_seconds) | target (stop_when) | interrupt | error
        self.targets = Targets(plan.run.get("stop_when") or {})
        self.error: str | None = None
        self._event: asyncio.Event | None = None
        self._dropped = False  # a take dropped a record: that may have finished a step
        self.ledger = Ledger(self.run_dir / "ledger.jsonl" if self.run_dir else None)
        self.observe = Observer(plan, self.run_dir, self.origin, clock)
        self.untrained = Untrained(self.run_dir, int(plan.run.get("max_empty_steps", DEFAULT_MAX_EMPTY)), steps,
                                   self.origin, clock)
        self.waits = Waits(self.run_dir, self.origin, clock)
        self.samples, joins = Samples(self), Joins(self)
        self.batches = Batches(self, self.samples)
        table = {"generate": self.samples, "train": self.batches, "sync": Policies(self)}  # the one dispatch on kind
        self.roles: dict[str, Role] = {n: table.get(p.kind, joins) for n, p in plan.nodes.items()}
        if state is not None:
            snapshot.restore(self, state)
        self._check_done()

    # ---- stage-facing API -------------------------------------------------------------------

    async def attach(self, node: str, replica: int, version: int) -> None:
        """A stage (re)starts, or died (version -1): the work it held is handed out again."""
        self._release(node, replica)
        self.roles[node].attach(node, replica, version)
        self.notify()

    async def take(self, node: str, replica: int) -> Work | None:
        """The next unit of work for a stage; waits for one. None: the run is stopping."""
        while True:
            if self.stopping:
                return None
            self._dropped = False
            work = self.roles[node].take(node, replica)
            if self._dropped:  # a drop made room and may have finished a step
                self.roles[node].advance(node)
                self._check_done()
                self.notify()
            if work is not None:
                self.notify()  # it made room in a channel
                return work
            await self._wait()

    async def complete(self, node: str, replica: int, work_id: str, outputs: dict[str, Any],
                       version: int | None = None, metrics: dict[str, Any] | None = None,
                       busy: float = 0.0, counters: dict[str, float] | None = None,
                       errors: list[str] | None = None) -> bool:
        """A stage finished a unit of work: consume its inputs and emit its outputs, atomically.
        `counters`: its operator's `metrics()` after the work, so that the next step's
        metrics.jsonl row counts it (reports come only every REPORT_EVERY_S); `errors`: what its
        operator isolated meanwhile (Operator.errors), kept before the step that may need them ends.

        Waits while an async output channel is full. False if the work no longer counts (the
        run is stopping, or the work was handed to another replica meanwhile).
        """
        self.observe.busy[(node, replica)] = busy
        if counters:
            self.observe.operators[(node, replica)] = counters
        if errors:
            self.untrained.errors(node, replica, errors)
        while any(self.channels[e.label].full for e in self.outs[node]
                  if e.kind == "data" and outputs.get(e.src_port) is not None):
            if self.stopping or work_id not in self.held[node]:
                return False
            await self._wait()
        if self.stopping == "error" or work_id not in self.held[node]:
            return False
        gathered = self.roles[node].gather(node, replica, outputs, metrics or {})
        if gathered is None:  # other ranks of its train group still work on the step
            return True
        _, work = self.held[node].pop(work_id)
        self._complete(node, work, *gathered, version)
        self.notify()
        return True

    async def loaded_weights(self, node: str, replica: int, version: int) -> None:
        """A generate replica applied weights of `version`."""
        self.samples.loaded_weights(node, replica, version)
        self.observe.instant(node, replica, f"weights v{version}")
        self._check_done()  # the final evaluation may have been all the run waited for
        self.notify()

    async def report(self, node: str, replica: int, events: list[TraceEvent], busy: float,
                     metrics: dict[str, float] | None = None, errors: list[str] | None = None,
                     waits: list[dict[str, Any]] | None = None) -> None:
        """A stage's periodic report: trace events, busy time, its operator's counters, the errors
        it isolated, and what it awaits too long now (Operator.waits; runtime/waits.py)."""
        self.observe.busy[(node, replica)] = busy
        self.waits.report(node, replica, waits or [])
        if errors:
            self.untrained.errors(node, replica, errors)
        self.observe.events.extend(events)
        if metrics:
            self.observe.operators[(node, replica)] = metrics
            if self.targets.operators(metrics):
                self.stop("target")

    async def fail(self, node: str, replica: int, message: str) -> None:
        await self.abort(f"node '{node}' (replica {replica}) failed:\n{message}")

    def stage_ended(self, node: str, replica: int, error: str | None) -> None:
        """A stage's loop returned or raised (`error`: its message, if any). Once the run is stopping
        that is how a stage ends; while it goes on, it is an error that names the stage."""
        if self.stopping is None:
            said = f": {error}" if error else " (its loop returned)"
            self.error = self.error or f"node '{node}' (replica {replica}) stopped while the run went on{said}"
            self.stop("error")

    async def abort(self, message: str) -> None:
        """Stop the run on an error that is no stage's (e.g. a checkpoint could not be written)."""
        if self.error is None:
            self.error = message
        self.stop("error")

    # ---- driver-facing API ------------------------------------------------------------------

    async def request(self, method: str, *args: Any) -> Any:
        """The executors' single entry for driver calls, so that under Ray even the plain methods
        run on the actor's event loop."""
        result = getattr(self, method)(*args)
        return await result if inspect.isawaitable(result) else result

    def stop(self, reason: str) -> None:
        """reason: done | time | target | interrupt | error. An error overrides; otherwise the first holds."""
        if self.stopping is None or reason == "error":
            self.stopping = reason
        self.notify()

    async def wait_stopping(self) -> str:
        await self._until(lambda: self.stopping)
        return self.stopping

    async def status(self) -> dict[str, Any]:
        return {"versions": dict(self.versions), "steps": self.steps, "stopping": self.stopping, "error": self.error,
                "queues": self._queues(), "last": self.observe.last_row, "counters": dict(self.counters),
                "reached": self.targets.reached, "health": self.observe.health_events, "waits": self.waits.status()}

    async def snapshot(self) -> dict[str, Any]:
        """What a checkpoint needs, taken without stopping anything (snapshot.py): the state, and
        how far each record stream had got (streams.py), both as of this instant."""
        self.ledger.flush()
        self.untrained.flush()
        return {"state": snapshot.take(self), "streams": self.observe.offsets()}

    async def wait_checkpoint(self, timeout: float) -> int | None:
        """The version a periodic checkpoint is due at (train nodes wait for it), or None after
        `timeout` seconds without one."""
        try:
            await asyncio.wait_for(self._until(lambda: self.pacing.due is not None or self.stopping), timeout)
        except asyncio.TimeoutError:
            pass
        return None if self.stopping else self.pacing.due

    def checkpoint_done(self) -> None:
        self.observe.runtime("checkpoint", self.pacing.since, version=self.pacing.due)
        self.pacing.done(self.time.now())
        self.notify()

    async def _until(self, condition: Any) -> None:
        while not condition():
            await self._wait()

    async def finish(self) -> dict[str, Any]:
        """Close the ledger of a finished run: what is left anywhere is recorded as pending."""
        channels, samples = snapshot.outstanding(self)
        for label, records in channels.items():
            for r in records:
                self.ledger.write("pending", label, r.id, r.step, r.version)
        for node, works in samples.items():
            for work in works:
                self.ledger.write("pending", f"data -> {node}", work.id, work.step, work.version)
        self.ledger.write("end", "", "", 0, 0)
        self.flush()
        self.observe.close()
        return {"versions": dict(self.versions), "counters": dict(self.counters)}

    def flush(self) -> None:
        self.ledger.flush()
        self.untrained.flush()
        self.observe.flush()

    def close(self) -> None:
        """Write everything out without closing the ledger (an interrupted run resumes later)."""
        self.ledger.flush()
        self.untrained.flush()
        self.observe.close()

    # ---- what the roles share --------------------------------------------------------------

    async def _wait(self) -> None:
        """Wait until the state changes (every waiter re-checks its own condition)."""
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    @property
    def clock(self) -> int:
        return min(self.versions.values()) if self.versions else 0

    @property
    def checkpoint_due(self) -> bool:
        return self.pacing.due is not None

    def count(self, counter: str) -> None:
        self.counters[counter] += 1

    def hold(self, node: str, replica: int, work: Work) -> Work:
        self.held[node][work.id] = (replica, work)
        return work

    def deliver(self, ch: Channel, record: Record, version: int) -> bool:
        """True if the record may be delivered: fresh, or stale on an `on_stale: keep` edge."""
        if not ch.stale(record, version):
            return True
        if ch.edge.on_stale == "keep":
            self.counters["stale_kept"] += 1
            return True
        self.drop(ch, record, "stale", consumer_version=version)
        return False

    def drop(self, ch: Channel, record: Record, reason: str, **extra: Any) -> None:
        self._dropped = True
        self.counters["dropped"] += 1
        self.observe.dropped += 1
        self.lose(ch.edge.dst, record.id, arrived=ch.edge.label == self.plan.facts.nodes[ch.edge.dst].input)
        self.ledger.write("drop", ch.edge.label, record.id, record.step, record.version, reason=reason, **extra)

    def lose(self, node: str, sample_id: str, arrived: bool = False) -> None:
        """Sample `sample_id` will not reach the train nodes after `node` (rejected or filtered by it,
        or dropped on its way in; `arrived`: dropped from a train node's own input)."""
        self.samples.lose(node, sample_id, arrived)
        if not arrived:
            self.batches.lose(node, sample_id)

    def trained(self, node: str, work: Work, metrics: dict[str, Any]) -> None:
        """A train node finished step `work.step`: the clock may move, a checkpoint may be due."""
        version = work.step + 1
        self.versions[node] = version
        if self.record_rollouts:  # before the row: a checkpoint taken after it covers the batch
            rollouts.append(self.run_dir, node, work.step, work.at,  # type: ignore[arg-type]
                            [next(iter(item.values())) for item in work.value or []])
        self.observe.train_step(node, work.step, version, work, metrics, self._queues(), self.counters)
        self.observe.instant(node, 0, f"publish v{version}")
        nothing = self.untrained.step(node, work.step, work.value or [], self.counters)
        if nothing:  # a run that trains nothing is a failure, with the errors that explain it
            self.error = self.error or nothing
            self.stop("error")
        self.flush()  # each step's records reach the disk with it, whatever the periodic flush does
        if self.targets.row(self.observe.last_row):
            self.stop("target")
        elif self.targets.unread:
            self.error = self.error or self.targets.unread
            self.stop("error")
        if version >= self.stop_at and version < self.steps:
            self.stop("interrupt")
        elif self.clock < self.steps and self.run_dir is not None:  # without a directory no checkpoint is written
            self.pacing.step(self.clock, self.time.now())

    def end(self, node: str, step: int) -> None:
        """`node` has finished `step`; so has each of its data output edges."""
        self.ended[node].add(step)
        for edge in self.outs[node]:
            if edge.kind == "data":
                self.channels[edge.label].ended.add(step)
                self.roles[edge.dst].advance(edge.dst)

    # ---- internals --------------------------------------------------------------------------

    def _complete(self, node: str, work: Work, outputs: dict[str, Any], metrics: dict[str, Any],
                  version: int | None) -> None:
        for label, records in work.records.items():
            for r in records:
                self.ledger.write("consume", label, r.id, r.step, r.version, consumer=node, consumer_version=work.at)
        if work.kind == "sample":
            self.ledger.write("consume", f"data -> {node}", work.id, work.step, work.version)
        role = self.roles[node]
        self.observe.crossed(self.plan.nodes[node].outputs, outputs)  # before completed() writes the row
        out_version, record_id = role.completed(node, work, version, metrics)
        for port, value in outputs.items():
            if value is None and role.withheld(node, work):
                continue
            for edge in self.outs[node]:
                if edge.src_port == port:
                    self._emit(edge, Record(record_id, work.step, out_version, value))
        role.advance(node)
        for g in self.samples.refilled_by[node]:  # a sample arrived or was lost: its step may end, or want more
            self.samples.advance(g)
        self._check_done()

    def _emit(self, edge: EdgePlan, record: Record) -> None:
        weights = edge.kind == "weights"
        self.ledger.write("produce", edge.label, record.id, record.step, record.version,
                          **({"weights": True} if weights else {}))
        if weights:
            self.samples.latest_weights[edge.label] = record
            return
        self.channels[edge.label].put(record)
        if edge.label == self.plan.facts.nodes[edge.dst].input:
            self.batches.arrive(edge.dst)
            self.samples.arrived(edge.dst, record.step)

    def _check_done(self) -> None:
        sinks = [n for n in self.plan.nodes if not any(e.kind == "data" for e in self.outs[n])]
        done = all(v >= self.steps for v in self.versions.values()) if self.trains else all(
            len(self.ended[n]) >= self.steps for n in sinks)
        if done and not self.stopping and not self.samples.final_eval_pending(self.steps):
            self.stop("done")

    def _queues(self) -> dict[str, int]:
        return {k: len(c) for k, c in self.channels.items()}

    def _release(self, node: str, replica: int) -> None:
        """Hand back the work a replica held (it died, or the run is being checkpointed)."""
        role = self.roles[node]
        for wid, (r, work) in list(self.held[node].items()):
            if r == replica or role.shared:
                del self.held[node][wid]
                role.hand_back(node, work)
        role.released(node)
