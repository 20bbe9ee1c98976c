"""A discrete-event simulation of a run under the runtime's rules (`flowrl plan`).

What is the runtime's own code, and what is a model of it:
- Admission (which sample a generate replica is handed, and whether now) is the runtime's own
  `Admission` (flowrl/runtime/admission.py) with the plan's facts (flowrl/graph/facts.py: budget,
  credit, staleness limits), called exactly where the runtime calls it (runtime/samples.py).
- Modelled after runtime/samples.py, batches.py and stage.py: weights are taken before samples; a
  replica without partial rollout drains its groups before loading them; samples go to the least
  loaded replica; the node's declared concurrency (`CostShape`, shapes.py) in groups per replica; a sync train input takes step t's records
  once all have arrived, an async one the first batch_size deliverable records in arrival order,
  dropping those older than the edge's limit (credited to admission as the coordinator does), or
  a short batch when no more may come.
- Modelled: the stages' work (fit.py) on a shared machine (cpu.py); the run's per-step flush.
Filters that over-sample, joins (a node with two data inputs) and train replicas are not simulated.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flowrl.graph.plan import EdgePlan
from flowrl.plan.changes import Scenario
from flowrl.plan.cpu import MAIN, Cpu
from flowrl.plan.fit import Costs
from flowrl.plan.shapes import processes, shapes, slots
from flowrl.runtime.admission import Admission
from flowrl.runtime.quota import Quota
from flowrl.spec.errors import UserError

MAX_EVENTS = 5_000_000  # a guard: a simulation that runs this long is a planner bug


@dataclass
class Group:
    id: str
    step: int
    version: int  # the weights its replica had loaded when it started (the record's version)
    rows: list[int]
    left: int = 0
    until: float = 0.0  # a multi-turn group also waits on its environment until then


@dataclass
class Busy:
    """A replica's busy seconds: time with one piece of work at least in flight (as observe.py counts)."""
    total: float = 0.0
    since: float | None = None
    count: int = 0

    def start(self, now: float) -> None:
        if self.count == 0:
            self.since = now
        self.count += 1

    def stop(self, now: float) -> None:
        self.count -= 1
        if self.count == 0:
            self.total += now - self.since

    def at(self, now: float) -> float:
        return self.total + (now - self.since if self.count else 0.0)


class Sim:
    def __init__(self, scenario: Scenario, costs: Costs, cores: float, seed: int = 0) -> None:
        self.plan, self.costs, self.scale = scenario.plan, costs, scenario.scale
        self.steps = scenario.steps
        self.batch = int(self.plan.data.get("batch_size", 1))
        self.rng = random.Random(seed)
        self.now = 0.0
        self.train = next(n for n, f in self.plan.facts.nodes.items() if f.input is not None)
        self.input = next(e for e in self.plan.edges if e.label == self.plan.facts.nodes[self.train].input)
        self.cpu = Cpu(cores)
        self.shapes = scenario.shapes or shapes(self.plan)
        self.own = processes(self.plan, self.shapes)
        self.channels: dict[str, deque[Group]] = {e.label: deque() for e in self.plan.edges if e.kind == "data"}
        self.version, self.training, self.buffer, self.arrived = 0, False, [], 0
        self.weights: dict[str, int] = {}  # generate node -> newest published version
        self.rows: list[dict[str, Any]] = []
        self.busy: dict[tuple[str, int], Busy] = {}
        self.mark: tuple[float, dict[tuple[str, int], float]] = (0.0, {})
        self.admission = {g: Admission(self.batch, self.steps, f.budget, f.credited,
                                       Quota(self.batch, None, refills=not f.credited))
                          for g, f in self.plan.facts.generate.items()}
        self.replicas: list[Any] = []
        self.timers: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        for name, node in self.plan.nodes.items():
            for r in range(node.resources.replicas if node.kind not in ("train", "sync") else 1):
                self.busy[(name, r)] = Busy()
                if node.kind == "generate":
                    self.replicas.append(Engine(self, name, r))
                elif node.kind not in ("train", "sync"):
                    self.replicas.append(Transform(self, name, r))

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        for _ in range(MAX_EVENTS):
            self.pump()
            if self.version >= self.steps:
                return self.rows
            wait = self.cpu.next_done()
            timer = self.timers[0][0] - self.now if self.timers else None
            if wait is None and timer is None:
                raise RuntimeError(f"the simulation stalled at step {self.version} (a planner bug)")
            step = min(w for w in (wait, timer) if w is not None)
            self.now += max(step, 0.0)
            for job in self.cpu.advance(max(step, 0.0)):
                job.done()
            while self.timers and self.timers[0][0] <= self.now + 1e-12:
                heapq.heappop(self.timers)[2]()
        raise RuntimeError("the simulation did not end (a planner bug)")

    def at(self, when: float, fn: Any) -> None:
        heapq.heappush(self.timers, (when, next(self._seq), fn))

    def pump(self) -> None:
        """Let every stage take work until none can (the coordinator's take, for all stages)."""
        moved = True
        while moved:
            moved = any([r.take() for r in self.replicas]) | self.take_batch()

    # ---- what the stages share ----------------------------------------------------------------

    def emit(self, node: str, group: Group) -> None:
        for edge in self.plan.edges:
            if edge.src == node and edge.kind == "data":
                self.channels[edge.label].append(group)
                if edge is self.input:
                    self.arrived += 1

    def upstream(self) -> list[str]:
        return self.plan.facts.nodes[self.train].generators

    @property
    def clock(self) -> int:
        return self.version

    # ---- the train node (runtime/batches.py) --------------------------------------------------

    def take_batch(self) -> bool:
        if self.training or self.version >= self.steps:
            return False
        batch = self.form(self.channels[self.input.label], self.version)
        if batch is None:
            return False
        self.training = True
        self.busy[(self.train, 0)].start(self.now)
        c, k = self.costs.train
        work = self.scale * (c + k * sum(sum(g.rows) for g in batch)) if batch else 0.0  # an empty batch: no update
        if self.train in self.own:
            self.cpu.add(self.train, 1.0, work, lambda: self.trained(batch))
        else:
            self.cpu.add(MAIN, self.costs.train_lock, work, lambda: self.trained(batch))
        return True

    def form(self, channel: deque[Group], t: int) -> list[Group] | None:
        if self.input.mode == "sync":
            mine = [g for g in channel if g.step == t]
            if len(mine) < self.batch:
                return None
            for g in mine:
                channel.remove(g)
            return mine
        limit = self.plan.facts.limits[self.input.label]
        while channel and len(self.buffer) < self.batch:
            g = channel.popleft()
            if limit is not None and g.version < t - limit and self.input.on_stale == "drop":
                for name in self.upstream():
                    self.admission[name].lose(g.id, True)
            else:
                self.buffer.append(g)
        if len(self.buffer) < self.batch and self.more_may_come(t):
            return None
        batch, self.buffer = self.buffer, []
        return batch

    def more_may_come(self, t: int) -> bool:
        gens = self.upstream()
        if any(self.admission[g].more_may_come(t) for g in gens):
            return True
        return sum(self.admission[g].issued for g in gens) - self.arrived > 0

    def trained(self, batch: list[Group]) -> None:
        t = self.version
        self.busy[(self.train, 0)].stop(self.now)
        self.version = t + 1
        self.row(t, batch)
        # The coordinator writes the step's records before it hands the policy on (coordinator.trained).
        self.cpu.add(MAIN, 1.0, self.costs.flush_s, lambda: self.flushed(t))

    def flushed(self, t: int) -> None:
        self.training = False
        for edge in (e for e in self.plan.edges if e.src == self.train):
            if edge.kind == "weights":  # straight to a generate node, no sync node between
                self.weights[edge.dst] = t + 1
            elif self.plan.nodes[edge.dst].kind == "sync":
                sync = edge.dst
                self.busy[(sync, 0)].start(self.now)
                work = self.scale * self.costs.sync_s.get(sync, 0.0)
                self.cpu.add(MAIN, 1.0, work, lambda s=sync: self.publish(s, t + 1))

    def publish(self, sync: str, version: int) -> None:
        self.busy[(sync, 0)].stop(self.now)
        for edge in self.plan.edges:
            if edge.src == sync and edge.kind == "weights":
                self.weights[edge.dst] = version

    def row(self, step: int, batch: list[Group]) -> None:
        """The metrics row observe.py writes for a train step (the fields plan compares)."""
        before, marks = self.mark
        dt = max(self.now - before, 1e-9)
        idle = {}
        for name in self.plan.nodes:
            keys = [k for k in self.busy if k[0] == name]
            busy = sum(self.busy[k].at(self.now) - marks.get(k, 0.0) for k in keys)
            idle[name] = min(1.0, max(0.0, 1.0 - busy / (dt * max(1, len(keys)))))
        lags: dict[str, int] = {}
        for g in batch:
            lags[str(step - g.version)] = lags.get(str(step - g.version), 0) + 1
        self.rows.append({"step": step, "time": self.now, "groups": len(batch), "idle": idle, "staleness": lags})
        self.mark = (self.now, {k: b.at(self.now) for k, b in self.busy.items()})


class Engine:
    """One replica of a generate node: the stage loop (runtime/stage.py) and its engine's slots."""

    def __init__(self, sim: Sim, node: str, index: int) -> None:
        self.sim, self.node, self.index = sim, node, index
        shape = sim.shapes[node]
        self.cost = sim.costs.engines[node]
        self.slots = slots(shape)
        self.partial = shape.partial_rollout
        self.concurrency = shape.concurrency
        self.group_size = shape.group_size
        self.fitted_size = int(sim.costs.group_size.get(node, self.group_size))
        self.loaded, self.updating, self.iterating = 0, False, False
        self.inflight: dict[str, Group] = {}
        self.waiting: deque[list[Any]] = deque()  # [group, tokens left] per row not yet in a slot
        self.active: list[list[Any]] = []

    def take(self) -> bool:
        sim = self.sim
        if self.updating:
            return False
        newest = sim.weights.get(self.node, 0)
        if newest > self.loaded:
            if self.inflight and not self.partial:
                return False  # drains its groups first (stage.py _update_weights)
            self.updating = True
            sim.cpu.add(MAIN, 1.0, sim.scale * self.cost.update_s, lambda: self.updated(newest))
            return True
        if len(self.inflight) >= self.concurrency or not self.least_loaded():
            return False
        issued = sim.admission[self.node].issue(min(self.loaded, sim.clock), set())
        if issued is None:
            return False
        step, index, _ = issued
        rows, wait = self.draw()
        group = Group(f"{step}:{index}", step, self.loaded, rows, len(rows), sim.now + wait)
        self.inflight[group.id] = group
        sim.busy[(self.node, self.index)].start(sim.now)
        self.waiting.extend([group, t] for t in rows)
        self.kick()
        return True

    def draw(self) -> tuple[list[int], float]:
        """A group of the fitted run, resampled; with another group_size, its rows drawn from all
        groups' rows (a multi-turn group: as many rows per episode as the drawn group had)."""
        rng, pool = self.sim.rng, self.sim.costs.groups[self.node]
        rows, wait = rng.choice(pool)
        if len(rows) == self.fitted_size:
            count = self.group_size
        else:
            count = max(1, round(len(rows) * self.group_size / self.fitted_size))
        if count == len(rows):
            return list(rows), wait
        return [rng.choice(rng.choice(pool)[0]) for _ in range(count)], wait

    def least_loaded(self) -> bool:
        mine = len(self.inflight)
        return all(mine <= len(r.inflight) for r in self.sim.replicas if isinstance(r, Engine) and r.node == self.node)

    def updated(self, version: int) -> None:
        self.loaded, self.updating = version, False
        self.kick()

    def kick(self) -> None:
        """Start the engine's next iteration: admit waiting rows into free slots, decode one token each."""
        if self.iterating or self.updating or not (self.waiting or self.active):
            return
        while self.waiting and len(self.active) < self.slots:
            self.active.append(self.waiting.popleft())
        self.iterating = True
        work = self.sim.scale * (self.cost.a + self.cost.b * len(self.active))
        self.sim.cpu.add(MAIN, 1.0, work, self.iterated)

    def iterated(self) -> None:
        self.iterating = False
        still = []
        for row in self.active:
            row[1] -= 1
            if row[1] > 0:
                still.append(row)
                continue
            group = row[0]
            group.left -= 1
            if group.left == 0 and group.until <= self.sim.now:
                self.finished(group)
            elif group.left == 0:
                self.sim.at(group.until, lambda g=group: self.finished(g))
        self.active = still
        self.kick()

    def finished(self, group: Group) -> None:
        del self.inflight[group.id]
        self.sim.busy[(self.node, self.index)].stop(self.sim.now)
        self.sim.emit(self.node, group)


@dataclass
class Transform:
    """One replica of a reward / reference / transform node: up to `concurrency` groups at once."""
    sim: Sim
    node: str
    index: int
    running: int = 0
    concurrency: int = field(init=False)

    def __post_init__(self) -> None:
        ins = [e for e in self.sim.plan.edges if e.dst == self.node and e.kind == "data"]
        if len(ins) != 1:
            raise UserError(f"node '{self.node}' has {len(ins)} data inputs: plan simulates nodes with one")
        self.edge: EdgePlan = ins[0]
        self.concurrency = self.sim.shapes[self.node].concurrency

    def take(self) -> bool:
        channel = self.sim.channels[self.edge.label]
        if self.running >= self.concurrency or not channel:
            return False
        group = channel.popleft()
        self.running += 1
        self.sim.busy[(self.node, self.index)].start(self.sim.now)
        scale = self.sim.scale if self.sim.plan.nodes[self.node].kind == "reference" else 1.0
        work = scale * self.sim.rng.choice(self.sim.costs.process[self.node])
        self.sim.cpu.add(MAIN, 1.0, work, lambda: self.done(group))
        return True

    def done(self, group: Group) -> None:
        self.running -= 1
        self.sim.busy[(self.node, self.index)].stop(self.sim.now)
        self.sim.emit(self.node, group)
