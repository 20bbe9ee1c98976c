"""The coordinator: channels, version clock, admission control and the ledger, in one place.

Stages never talk to each other; they call the coordinator's stage-facing methods (`attach`,
`take`, `complete`, `loaded_weights`, `report` for trace events, `fail`). In-process the
stages call the object directly; under Ray it is an async actor and the stages call it through
`RemoteCoordinator`, so the stage code is the same in both executors.

Rules (see also flowrl/runtime/__init__.py):
- Version clock: a train node at version v runs step v and publishes version v+1 with its
  policy record. The clock is the lowest version of all train nodes.
- Admission control: a generate replica is handed sample j of step i only while
  i * batch_size + j < (v + budget + 1) * batch_size + lost, with v = min(the policy version it
  has loaded, the clock) (the clock alone for a generate node without a weights input).
  `budget` is the smallest, over the data paths from the generate node to a train node, of the
  sum of `max_staleness` of the path's async edges (sync edges add 0). `lost` counts this
  generate node's samples that will never reach a train node (rejected, filtered, dropped), and
  only where budget > 0 and every train node it feeds has an async input (a sync input takes
  exactly its step's records): an async train step fills its batch from later steps, so without it one
  lost sample keeps every later batch one sample short of what was admitted, and with budget 1
  the trainer waits each step for a sample that only its next version admits (AReaL's
  StalenessManager counts accepted samples for the same reason). A generate node that reaches
  no train node is not limited. A filter that over-samples (dynamic_sampling) turns batch_size
  here into the step's initial sample count and caps the credit (flowrl/runtime/quota.py); over a
  sync input a lost sample is replaced by an extra sample of the same step instead.
- Staleness: a consumer at version v (a train node's own version; the clock for other stages)
  that takes a record from an async edge with version < v - limit (`Channel.limit`) applies the
  edge's `on_stale`: `drop` (ledger `drop`, counted) or `keep` (delivered, counted).
- Train steps: over a sync edge, step t takes exactly the records of step t, once the producer
  has finished step t (sorted by id, so the batch is deterministic). Over an async edge, step t
  takes the first `batch_size` fresh records in arrival order; if fewer can still come
  (nothing is in flight towards it and no generate node upstream may issue more before this step
  ends, its credit counted) it takes a short batch, possibly empty.
- A stage finishes step s when its inputs have finished step s and it holds no record of s;
  a generate stage when every sample of s has been completed.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path
from typing import Any

import networkx as nx

from flowrl.data.source import batch_size, load_source
from flowrl.graph.plan import EdgePlan, Plan
from flowrl.runtime import snapshot
from flowrl.runtime.channel import Channel, Record, Work
from flowrl.runtime.checkpoints import Pacing
from flowrl.runtime.ledger import Ledger
from flowrl.runtime.observe import Observer
from flowrl.runtime.quota import Quota
from flowrl.runtime.targets import Targets


def admission_budgets(plan: Plan) -> tuple[dict[str, int | None], dict[str, int | None]]:
    """(budget per generate node, staleness limit per data edge label)."""
    data = [e for e in plan.edges if e.kind == "data"]
    graph = nx.DiGraph()
    graph.add_nodes_from(plan.nodes)
    for e in data:
        k = e.max_staleness if e.mode == "async" else 0
        # Parallel edges between two nodes: the tighter one bounds admission.
        if not graph.has_edge(e.src, e.dst) or graph[e.src][e.dst]["k"] > k:
            graph.add_edge(e.src, e.dst, k=k)
    gens = [n for n, p in plan.nodes.items() if p.kind == "generate"]
    trains = [n for n, p in plan.nodes.items() if p.kind == "train"]
    budgets: dict[str, int | None] = {}
    for g in gens:
        lengths = nx.single_source_dijkstra_path_length(graph, g, weight="k")
        reach = [lengths[t] for t in trains if t in lengths]
        budgets[g] = min(reach) if reach else None
    # Longest staleness sum from any generate node up to each node (a DAG, so one pass).
    longest = {n: 0 for n in plan.nodes}
    for n in nx.topological_sort(graph):
        for e in data:
            if e.src == n:
                k = e.max_staleness if e.mode == "async" else 0
                longest[e.dst] = max(longest[e.dst], longest[n] + k)
    limits = {e.label: (longest[e.src] + e.max_staleness if e.mode == "async" else None) for e in data}
    return budgets, limits


class Coordinator:
    def __init__(self, plan: Plan, run_dir: str | None, steps: int, stop_at: int | None = None,
                 origin: float | None = None, state: bytes | None = None) -> None:
        self.plan = plan
        self.steps = steps
        self.stop_at = stop_at if stop_at is not None else steps
        self.batch_size = batch_size(plan.data)
        self.source = load_source(plan.data, plan.seed, plan.model) if any(
            n.kind == "generate" for n in plan.nodes.values()) else None
        self.run_dir = Path(run_dir) if run_dir else None
        self.origin = origin or time.time()
        self.budget, limits = admission_budgets(plan)
        self.ins = {n: [e for e in plan.edges if e.dst == n and e.kind == "data"] for n in plan.nodes}
        self.outs = {n: [e for e in plan.edges if e.src == n] for n in plan.nodes}
        self.weights_in = {n: next((e for e in plan.edges if e.dst == n and e.kind == "weights"), None)
                           for n in plan.nodes}
        self.channels = {e.label: Channel(e, limits[e.label]) for e in plan.edges if e.kind == "data"}
        self.trains = [n for n, p in plan.nodes.items() if p.kind == "train"]
        for t in self.trains:
            if len(self.ins[t]) != 1:
                raise ValueError(f"train node '{t}' needs exactly one data input edge, has {len(self.ins[t])}")
        graph = nx.DiGraph([(e.src, e.dst) for e in plan.edges if e.kind == "data"])

        def path(a: str, b: str) -> bool:
            return a == b or (a in graph and b in graph and nx.has_path(graph, a, b))

        gens = [n for n, p in plan.nodes.items() if p.kind == "generate"]
        self.upstream = {t: [g for g in gens if path(g, t)] for t in self.trains}
        # Losses credit a generate node's admission only if every train node it feeds fills its
        # batches from later steps (an async input): a sync input takes exactly its step's records.
        credited = {g for g in gens if self.budget[g] and all(
            self.ins[t][0].mode == "async" for t in self.trains if path(g, t))}
        self.credits_to = {n: [g for g in gens if g in credited and path(g, n)] for n in plan.nodes}
        self.downstream = {n: [t for t in self.trains if path(n, t)] for n in plan.nodes}
        self.quota = {g: self._quota(g, g in credited, path) for g in gens}
        # Generate nodes whose step t waits for replacements of its samples lost at (or before) a node.
        self.refilled_by = {n: [g for g in gens if self.quota[g].refills and path(g, n)] for n in plan.nodes}
        # State that a checkpoint keeps (see snapshot()).
        self.versions = {t: 0 for t in self.trains}
        self.latest_weights: dict[str, Record] = {}
        self.cursor = {n: [0, 0] for n, p in plan.nodes.items() if p.kind == "generate"}
        self.reissue: dict[str, list[Work]] = {n: [] for n in self.cursor}
        self.ended: dict[str, set[int]] = {n: set() for n in plan.nodes}
        self.counters = {"dropped": 0, "stale_kept": 0, "rejected": 0, "filtered": 0, "oversampled": 0}
        # Sample ids that will never reach a train node: per credited generate node (its admission
        # credit), and per train node those lost before its input channel (what is not in flight).
        self.lost: dict[str, set[str]] = {n: set() for n in self.cursor}
        self.lost_before: dict[str, set[str]] = {t: set() for t in self.trains}
        self.arrived = {t: 0 for t in self.trains}  # records put on the train node's input channel
        self.resumes = 0
        # After a resume: train nodes that publish their restored policy before training, and the
        # version each generate node's engine must hold before it is handed work (snapshot.py).
        self.republish: set[str] = set()
        self.required: dict[str, int] = {}
        self.pacing = Pacing(plan.run.get("checkpoint_every"), plan.run.get("checkpoint_seconds"))
        # Transient state.
        self.held: dict[str, dict[str, tuple[int, Work]]] = {n: {} for n in plan.nodes}
        self.buffers: dict[str, list[Record]] = {t: [] for t in self.trains}
        # Train groups: every rank takes the same batch; the step completes when all have.
        self.group_size = {t: plan.nodes[t].resources.replicas for t in self.trains}
        self.group_taken: dict[str, set[int]] = {t: set() for t in self.trains}
        self.group_done: dict[str, dict[int, tuple[dict[str, Any], dict[str, Any] | None]]] = {
            t: {} for t in self.trains}
        self.loaded: dict[tuple[str, int], int] = {}
        self.stopping: str | None = None  # done | time (max_seconds) | target (stop_when) | interrupt | error
        self.targets = Targets(plan.run.get("stop_when") or {})
        self.error: str | None = None
        self._event: asyncio.Event | None = None
        self.ledger = Ledger(self.run_dir / "ledger.jsonl" if self.run_dir else None)
        self.observe = Observer(plan, self.run_dir, self.origin)
        if state is not None:
            snapshot.restore(self, state)
        self._check_done()

    # ---- stage-facing API -------------------------------------------------------------------

    async def attach(self, node: str, replica: int, version: int) -> None:
        """A stage (re)starts: work its previous incarnation held is handed out again."""
        self._release(node, replica)
        if self.plan.nodes[node].kind == "generate":
            self.loaded[(node, replica)] = version
        self._notify()

    async def take(self, node: str, replica: int) -> Work | None:
        """The next unit of work for a stage; waits for one. None: the run is stopping."""
        while True:
            if self.stopping:
                return None
            dropped = self.counters["dropped"]
            work = self._try_take(node, replica)
            if self.counters["dropped"] != dropped:  # a stale drop made room and may have finished a step
                self._advance(node)
                self._check_done()
                self._notify()
            if work is not None:
                self._notify()  # it made room in a channel
                return work
            await self._wait()

    async def complete(self, node: str, replica: int, work_id: str, outputs: dict[str, Any],
                       version: int | None = None, metrics: dict[str, Any] | None = None,
                       busy: float = 0.0, counters: dict[str, float] | None = None) -> bool:
        """A stage finished a unit of work: consume its inputs and emit its outputs, atomically.
        `counters`: its operator's `metrics()` after the work, so that the next step's
        metrics.jsonl row counts it (reports come only every REPORT_EVERY_S).

        Waits while an async output channel is full. False if the work no longer counts (the
        run is stopping, or the work was handed to another replica meanwhile).
        """
        self.observe.busy[(node, replica)] = busy
        if counters:
            self.observe.operators[(node, replica)] = counters
        while any(self.channels[e.label].full for e in self.outs[node]
                  if e.kind == "data" and outputs.get(e.src_port) is not None):
            if self.stopping or work_id not in self.held[node]:
                return False
            await self._wait()
        if self.stopping == "error" or work_id not in self.held[node]:
            return False
        if self.plan.nodes[node].kind == "train" and self.group_size[node] > 1:
            # A train group (ranks of one sharded model) finishes a step when every rank has;
            # rank 0 holds the full policy and reports the metrics.
            self.group_done[node][replica] = (outputs, metrics)
            if len(self.group_done[node]) < self.group_size[node]:
                return True
            outputs, metrics = self.group_done[node][0]
        if self.plan.nodes[node].kind == "train":
            self.group_done[node], self.group_taken[node] = {}, set()
        _, work = self.held[node].pop(work_id)
        self._complete(node, work, outputs, version, metrics or {})
        self._notify()
        return True

    async def loaded_weights(self, node: str, replica: int, version: int) -> None:
        """A generate replica applied weights of `version`."""
        self.loaded[(node, replica)] = version
        edge = self.weights_in[node]
        self.ledger.write("consume", edge.label if edge else node, f"v{version}@{replica}", version,
                          version, weights=True)
        self.observe.instant(node, replica, f"weights v{version}")
        self._notify()

    async def report(self, node: str, replica: int, events: list[dict[str, Any]], busy: float,
                     metrics: dict[str, float] | None = None) -> None:
        self.observe.busy[(node, replica)] = busy
        self.observe.events.extend(events)
        if metrics:
            self.observe.operators[(node, replica)] = metrics
            if self.targets.operators(metrics):
                self.stop("target")

    async def fail(self, node: str, replica: int, message: str) -> None:
        await self.abort(f"node '{node}' (replica {replica}) failed:\n{message}")

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
        self._notify()

    async def wait_stopping(self) -> str:
        while not self.stopping:
            await self._wait()
        return self.stopping

    async def status(self) -> dict[str, Any]:
        return {
            "versions": dict(self.versions), "steps": self.steps, "stopping": self.stopping,
            "error": self.error, "queues": {k: len(c) for k, c in self.channels.items()},
            "last": self.observe.last_row, "counters": dict(self.counters), "reached": self.targets.reached,
        }

    async def snapshot(self) -> dict[str, Any]:
        """What a checkpoint needs, taken without stopping anything (snapshot.py): the state, and
        how far each record stream had got (streams.py), both as of this instant."""
        self.ledger.flush()
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
        self.pacing.done()
        self._notify()

    async def _until(self, condition: Any) -> None:
        while not condition():
            await self._wait()

    async def finish(self) -> dict[str, Any]:
        """Close the ledger of a finished run: what is left anywhere is recorded as pending."""
        for name, ch in self.channels.items():
            for r in list(ch.records.values()):
                self.ledger.write("pending", name, r.id, r.step, r.version)
        for t in self.trains:
            for r in self.buffers[t]:
                self.ledger.write("pending", self.ins[t][0].label, r.id, r.step, r.version)
        for node, held in self.held.items():
            for _, work in held.values():
                self._write_pending(node, work)
        for node, works in self.reissue.items():
            for work in works:
                self._write_pending(node, work)
        self.ledger.write("end", "", "", 0, 0)
        self.flush()
        self.observe.close()
        return {"versions": dict(self.versions), "counters": dict(self.counters)}

    def flush(self) -> None:
        self.ledger.flush()
        self.observe.flush()

    def close(self) -> None:
        """Write everything out without closing the ledger (an interrupted run resumes later)."""
        self.ledger.flush()
        self.observe.close()

    # ---- internals --------------------------------------------------------------------------

    async def _wait(self) -> None:
        """Wait until the state changes (every waiter re-checks its own condition)."""
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    def _notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    @property
    def clock(self) -> int:
        return min(self.versions.values()) if self.versions else 0

    def _try_take(self, node: str, replica: int) -> Work | None:
        kind = self.plan.nodes[node].kind
        if kind == "generate":
            return self._take_sample(node, replica)
        if kind == "train":
            return self._take_batch(node, replica)
        if kind == "sync":
            ch = self.channels[self.ins[node][0].label]
            if not ch.records:
                return None
            record = ch.pop(next(iter(ch.records)))
            return self._hold(node, replica, Work(record.id, "policy", record.step, record.version,
                                                  record.value, {ch.edge.label: [record]}))
        return self._take_record(node, replica)

    def _hold(self, node: str, replica: int, work: Work) -> Work:
        self.held[node][work.id] = (replica, work)
        return work

    def _take_sample(self, node: str, replica: int) -> Work | None:
        edge = self.weights_in[node]
        have = self.loaded.get((node, replica), 0)
        if edge is not None and edge.label in self.latest_weights:
            latest = self.latest_weights[edge.label]
            if latest.version > have:
                return Work(latest.id, "weights", latest.step, latest.version, latest.value)
        if edge is not None and have < self.required.get(node, 0):
            return None  # resumed: the engine must hold the restored policy first
        version = min(have, self.clock) if edge is not None else self.clock
        if self.reissue[node]:
            work = self.reissue[node].pop(0)
            work.version = version
            self.ledger.write("reissue", f"data -> {node}", work.id, work.step, version, replica=replica)
            return self._hold(node, replica, work)
        budget, credit, quota = self.budget[node], len(self.lost[node]), self.quota[node]
        issued = self._issued(node)
        refill = quota.refill_step(self.cursor[node][0], self.ended[node])
        if refill is not None:  # a replacement for a lost sample of an earlier step (flowrl/runtime/quota.py)
            step, index = refill, quota.issue(refill)
        else:
            step, index = self.cursor[node]
            if issued >= self._limit(node) or (budget is not None and issued >= self._admitted(node, version)):
                return None
            self.cursor[node] = [step, index + 1] if index + 1 < quota.per_step else [step + 1, 0]
            if quota.refills:
                quota.issue(step)
        if index >= self.batch_size or (node in self.credits_to[node] and refill is None
                                        and issued >= (version + budget + 1) * quota.per_step):
            self.counters["oversampled"] += 1  # beyond the step's batch_size, or admitted by credit
        sample = self.source.sample(step, index)
        work = Work(f"{step}:{index}", "sample", step, version, sample)
        self.ledger.write("issue", f"data -> {node}", work.id, step, version, admitted_version=version,
                          budget=budget, credit=credit, replica=replica)
        return self._hold(node, replica, work)

    def _take_batch(self, node: str, replica: int) -> Work | None:
        t = self.versions[node]
        if self.pacing.due is not None or replica in self.group_taken[node]:
            return None  # a checkpoint is being written: the trainer's state must stay at its version
        if node in self.republish and not self.held[node]:
            self.republish.discard(node)
            self.group_taken[node].add(replica)
            return self._hold(node, replica, Work(f"v{t}:r{self.resumes}", "publish", t - 1, t, None))
        if t >= self.steps:
            return None
        if self.held[node]:  # the group's batch for step t, formed when its first rank asked
            self.group_taken[node].add(replica)
            return next(iter(self.held[node].values()))[1]
        work = self._form_batch(node, t)
        if work is not None:
            self.group_taken[node].add(replica)
        return work

    def _form_batch(self, node: str, t: int) -> Work | None:
        replica = 0
        ch = self.channels[self.ins[node][0].label]
        if ch.edge.mode == "sync":
            if t not in ch.ended:
                return None
            records = [ch.pop(r.id) for r in ch.of_step(t)]
            if self._oversampled(node):  # the first batch_size by index; the rest were not needed
                for record in records[self.batch_size:]:
                    self._drop(ch, record, "surplus")
                records = records[:self.batch_size]
        else:
            buffer = self.buffers[node]
            for rid in list(ch.records):
                if len(buffer) >= self.batch_size:
                    break
                record = ch.pop(rid)
                self._notify()  # room in the channel for a waiting producer
                if self._deliverable(ch, record, t):
                    buffer.append(record)
            if len(buffer) < self.batch_size and self._more_may_come(node, t):
                return None
            if not buffer and self._oversampled(node):  # wait for more (flowrl/runtime/quota.py)
                for g in self.upstream[node]:
                    if self.quota[g].declared:
                        self.quota[g].starved()
                self._notify()
                return None
            records, self.buffers[node] = buffer, []
        work = Work(f"v{t + 1}", "batch", t, t, [{ch.edge.dst_port: r.value} for r in records],
                    {ch.edge.label: records}, at=t, lags=[t - r.version for r in records])
        return self._hold(node, replica, work)

    def _issued(self, node: str) -> int:
        """Samples a generate node has been handed so far (replacements of lost ones aside)."""
        return self.cursor[node][0] * self.quota[node].per_step + self.cursor[node][1]

    def _admitted(self, node: str, version: int) -> int:
        """Samples a generate node (with a budget) may have been handed at `version` (the docstring's rule)."""
        steps = version + self.budget[node] + 1
        return steps * self.quota[node].per_step + self.quota[node].credit(len(self.lost[node]), steps)

    def _limit(self, node: str) -> int:
        """Samples a generate node may be handed in the whole run (replacements aside)."""
        quota = self.quota[node]
        extra = quota.credit(len(self.lost[node]), self.steps) if quota.declared else 0
        return self.steps * quota.per_step + extra

    def _quota(self, node: str, credited: bool, path: Any) -> Quota:
        filters = [n for n in self.plan.order if self.plan.nodes[n].oversampling and path(node, n) and self.downstream[n]]
        oversampling = self.plan.nodes[filters[0]].oversampling if filters else None
        return Quota(self.batch_size, oversampling, refills=not credited, filter_node=filters[0] if filters else None)

    def _oversampled(self, node: str) -> bool:
        return any(self.quota[g].declared for g in self.upstream[node])

    def _more_may_come(self, node: str, t: int) -> bool:
        """Whether records for train step t can still arrive: some are in flight, or a generate node
        upstream may issue more before the step ends (admission at version t, credit included)."""
        issued = sum(self._issued(g) for g in self.upstream[node])
        if any(self._issued(g) < min(self._limit(g), self._admitted(g, t)) or self.reissue[g]
               for g in self.upstream[node]):
            return True
        return issued - self.arrived[node] - len(self.lost_before[node]) > 0

    def _take_record(self, node: str, replica: int) -> Work | None:
        edges = self.ins[node]
        channels = [self.channels[e.label] for e in edges]
        first = channels[0]
        for rid in list(first.records):
            # Group integrity across a join: take a record only when every input has its copy.
            if rid not in first.records or not all(rid in c.records for c in channels[1:]):
                continue
            records = [c.pop(rid) for c in channels]
            fresh = [self._deliverable(c, r, self.clock) for c, r in zip(channels, records, strict=True)]
            if not all(fresh):
                for c, r, ok in zip(channels, records, fresh, strict=True):
                    if ok:
                        self._drop(c, r, "unjoined")
                continue
            work = Work(rid, "record", records[0].step, min(r.version for r in records),
                        {e.dst_port: r.value for e, r in zip(edges, records, strict=True)},
                        {e.label: [r] for e, r in zip(edges, records, strict=True)}, at=self.clock)
            return self._hold(node, replica, work)
        return None

    def _deliverable(self, ch: Channel, record: Record, version: int) -> bool:
        """True if the record may be delivered: fresh, or stale on an `on_stale: keep` edge."""
        if not ch.stale(record, version):
            return True
        if ch.edge.on_stale == "keep":
            self.counters["stale_kept"] += 1
            return True
        self._drop(ch, record, "stale", consumer_version=version)
        return False

    def _drop(self, ch: Channel, record: Record, reason: str, **extra: Any) -> None:
        self.counters["dropped"] += 1
        self.observe.dropped += 1
        self._lose(ch.edge.dst, record.id, arrived=ch.edge.dst in self.trains)
        self.ledger.write("drop", ch.edge.label, record.id, record.step, record.version, reason=reason, **extra)

    def _complete(self, node: str, work: Work, outputs: dict[str, Any], version: int | None,
                  metrics: dict[str, Any]) -> None:
        kind = self.plan.nodes[node].kind
        for label, records in work.records.items():
            for r in records:
                self.ledger.write("consume", label, r.id, r.step, r.version, consumer=node,
                                  consumer_version=work.at)
        if work.kind == "sample":
            self.ledger.write("consume", f"data -> {node}", work.id, work.step, work.version)
        if work.kind == "publish":  # a resumed train node's restored policy, sent again
            out_version = work.version
        elif kind == "train":
            out_version = work.step + 1
            self.versions[node] = out_version
            self.observe.train_step(node, work.step, out_version, work, metrics, self._queues(), self.counters)
            self.observe.instant(node, 0, f"publish v{out_version}")
            if self.targets.row(self.observe.last_row):
                self.stop("target")
            if out_version >= self.stop_at and out_version < self.steps:
                self.stop("interrupt")
            elif self.clock < self.steps:
                self.pacing.step(self.clock)
        else:
            out_version = version if version is not None and work.kind == "sample" else work.version
        record_id = f"v{out_version}" if kind in ("train", "sync") and work.kind != "publish" else work.id
        for port, value in outputs.items():
            edges = [e for e in self.outs[node] if e.src_port == port]
            if value is None and kind not in ("train", "sync"):  # policy/weights records always go: they carry the version
                self.counters["rejected" if kind == "generate" else "filtered"] += 1
                self._lose(node, work.id)
                continue
            for edge in edges:
                record = Record(record_id, work.step, out_version, value)
                self._emit(edge, record)
        if kind == "train" and work.kind != "publish":
            self._end(node, work.step)
        self._advance(node)
        for g in self.refilled_by[node]:  # a sample arrived or was lost: its step may end, or want more
            self._advance(g)
        self._check_done()

    def _emit(self, edge: EdgePlan, record: Record) -> None:
        weights = edge.kind == "weights"
        self.ledger.write("produce", edge.label, record.id, record.step, record.version,
                          **({"weights": True} if weights else {}))
        if weights:
            self.latest_weights[edge.label] = record
        else:
            self.channels[edge.label].put(record)
            if edge.dst in self.arrived:
                self.arrived[edge.dst] += 1
                for g in self.refilled_by[edge.dst]:
                    self.quota[g].arrived(record.step)

    def _lose(self, node: str, sample_id: str, arrived: bool = False) -> None:
        """Sample `sample_id` will not reach the train nodes after `node` (rejected or filtered by it,
        or dropped on its way in; `arrived`: dropped from a train node's own input)."""
        for g in self.credits_to[node]:
            self.lost[g].add(sample_id)
        if not arrived:
            for t in self.downstream[node]:
                self.lost_before[t].add(sample_id)
            for g in self.refilled_by[node]:
                self.quota[g].lost(int(sample_id.split(":")[0]))

    def _end(self, node: str, step: int) -> None:
        self.ended[node].add(step)
        for edge in self.outs[node]:
            if edge.kind == "data":
                self.channels[edge.label].ended.add(step)
                self._advance(edge.dst)

    def _advance(self, node: str) -> None:
        """End every step the node has finished (see the module docstring)."""
        kind = self.plan.nodes[node].kind
        if kind in ("train", "sync"):  # train ends a step when it completes it; sync feeds no data edge
            return
        if kind == "generate":
            busy = {w.step for _, w in self.held[node].values()} | {w.step for w in self.reissue[node]}
            for s in sorted(set(range(self.cursor[node][0])) - self.ended[node] - busy):
                if self.quota[node].settled(s):  # no replacement of a lost sample may still be wanted
                    self.quota[node].forget(s)
                    self._end(node, s)
            return
        channels = [self.channels[e.label] for e in self.ins[node]]
        for s in sorted(set.intersection(*(c.ended for c in channels)) - self.ended[node]):
            if self._holds_step(node, s):
                continue
            if any(c.has_step(s) for c in channels):
                copies = [{r.id for r in c.of_step(s)} for c in channels]
                if set.intersection(*copies):
                    continue  # joinable records of s still wait to be taken
                for c in channels:  # a join partner was filtered or dropped upstream
                    for r in c.of_step(s):
                        self._drop(c, c.pop(r.id), "unjoined")
            self._end(node, s)

    def _holds_step(self, node: str, step: int) -> bool:
        return any(w.step == step for _, w in self.held[node].values())

    def _check_done(self) -> None:
        if self.trains:
            done = all(v >= self.steps for v in self.versions.values())
        else:
            sinks = [n for n in self.plan.nodes if not any(e.kind == "data" for e in self.outs[n])]
            done = all(len(self.ended[n]) >= self.steps for n in sinks)
        if done and not self.stopping:
            self.stop("done")

    def _queues(self) -> dict[str, int]:
        return {k: len(c) for k, c in self.channels.items()}

    def _release(self, node: str, replica: int) -> None:
        """Hand back the work a replica held (it died, or the run is being checkpointed)."""
        group = self.plan.nodes[node].kind == "train"  # a train group's batch is shared by all ranks
        for wid, (r, work) in list(self.held[node].items()):
            if r != replica and not group:
                continue
            del self.held[node][wid]
            if work.kind == "sample":
                self.reissue[node].append(work)
            else:
                for label, records in work.records.items():
                    for record in reversed(records):
                        self.channels[label].put(record, front=True)
        if self.plan.nodes[node].kind == "train":
            self._return_buffer(node)
            self.group_taken[node], self.group_done[node] = set(), {}

    def _return_buffer(self, node: str) -> None:
        label = self.ins[node][0].label
        for record in reversed(self.buffers[node]):
            self.channels[label].put(record, front=True)
        self.buffers[node] = []

    def _write_pending(self, node: str, work: Work) -> None:
        if work.kind == "sample":
            self.ledger.write("pending", f"data -> {node}", work.id, work.step, work.version)
        for label, records in work.records.items():
            for r in records:
                self.ledger.write("pending", label, r.id, r.step, r.version)
