"""The stand-in operators `flowrl plan` runs the real runtime with: each call takes the time its
fitted cost (fit.py) says on the machine-share model (cpu.py), on the virtual clock
(flowrl/runtime/clock.py). What they are handed and when is the runtime's own business: the
coordinator, its roles and the stages are the real ones (simulate.py).

- generate: the group's rows (resampled from the run's groups, fit.group_pool) join the replica's
  engine, which decodes one token for every row in its slots per iteration (a + b x rows seconds,
  p more where it admits rows, whose prompts it prefills, and r per row admitted;
  the per-row part b runs over the engine's threads, so it scales with the cores they get against
  the cores the fitted run's engine had, as threads.py measured it scales: shapes.engine_cores,
  docs/plan.md "Engine threads");
  a multi-turn group also waits on its environment for its resampled wait, its engine decoding the
  fitted share of it (fit.wait_share: one engine thread's lock and core for all the groups of a
  replica, so where the lock is oversubscribed that share of the wait stretches and what runs
  beside it slows). A weight load costs
  its mean; with partial rollout the engine pauses between iterations meanwhile.
- reward, reference, transform: a resampled measured call (a reference scales with the model).
- train: c + k x the batch's tokens, over its threads as the engine's per-row part is
  (shapes.train_cores, threads.py), times its passes over them against the fitted run's (CostShape.passes),
  holding the interpreter lock the fitted fraction of it, in a process of its own where the node
  declares one; then the run's own writing of the step's records (`Flushing`), before the policy
  goes on and the next batch is taken.
- sync: its mean.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from typing import Any

from flowrl.data.trajectory import Group
from flowrl.operator import CostShape, Knobs, Operator, OperatorContext, TrainResult
from flowrl.plan.changes import Scenario
from flowrl.plan.cpu import MAIN, Cpu, Load
from flowrl.plan.fit import Costs, EngineCost, waits_thread
from flowrl.plan.shapes import engine_cores, processes, shapes, slots, train_cores
from flowrl.plan.threads import factor


class Prompts:
    """The data source: the stand-ins read no prompt."""

    def __init__(self, seed: int = 0) -> None:
        del seed

    def sample(self, step: int, index: int) -> dict[str, Any]:
        return {}


class Machine:
    """cpu.py's machine on the event loop: `run` returns once a job's work is done, at the rates the
    share model gives it among the jobs running meanwhile (recomputed whenever one starts or ends)."""

    def __init__(self, cores: float, handoff: float = 1.0) -> None:
        self.cpu = Cpu(cores, handoff)
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None

    async def run(self, load: Load, work: float) -> None:
        done = self.loop.create_future()
        self._advance()
        self.cpu.add(load, work, lambda: done.done() or done.set_result(None))
        self._schedule()
        await done

    def _advance(self) -> None:
        now = self.loop.time()
        for job in self.cpu.advance(now - self.last):
            job.done()
        self.last = now

    def _schedule(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        wait = self.cpu.next_done()
        self.timer = None if wait is None else self.loop.call_at(self.last + wait, self._tick)

    def _tick(self) -> None:
        self._advance()
        self._schedule()


class StandIns:
    """Builds each stage's stand-in (a stage's `build`, flowrl/runtime/stage.py); what they share:
    the machine, the resampling's random numbers, each group's tokens."""

    def __init__(self, scenario: Scenario, costs: Costs, cores: float, seed: int) -> None:
        self.scenario, self.costs, self.cores = scenario, costs, cores
        self.scale = scenario.scale
        self.shapes = scenario.shapes or shapes(scenario.plan)
        self.own = processes(scenario.plan, self.shapes)
        self.rng = random.Random(seed)
        self.tokens: dict[str, int] = {}  # group id -> its model tokens (what a train step costs)
        self.machine: Machine | None = None  # made on the simulation's event loop, at its first job

    def __call__(self, context: OperatorContext) -> Operator:
        kind = self.scenario.plan.nodes[context.node].kind
        made = {"generate": Generate, "train": Train, "sync": Sync}.get(kind, Transform)
        return made(self.shapes[context.node], context, self)

    def connect(self, coord: Any, node: str) -> Any:
        """What the stages of `node` call (inprocess.simulate's `connect`)."""
        return Flushing(coord, self) if self.scenario.plan.nodes[node].kind == "train" else coord

    async def work(self, seconds: float, load: Load = Load(MAIN, 1.0)) -> None:
        """`seconds` of work alone, asking of the machine what `load` says (by default: the main
        process, holding its interpreter lock all the time)."""
        if self.machine is None:
            self.machine = Machine(self.cores, self.costs.handoff)
        await self.machine.run(load, seconds)


class Flushing:
    """The coordinator as a train stage calls it: the results of a step go on once the run has
    written the step's records (its flush, after each train step: in a real run it blocks the
    run's process that long; on a virtual clock it takes no time, so its fitted cost is spent here)."""

    def __init__(self, coord: Any, sim: StandIns) -> None:
        self.coord, self.sim = coord, sim

    def __getattr__(self, name: str) -> Any:
        return getattr(self.coord, name)

    async def complete(self, *args: Any, **kwargs: Any) -> bool:
        await self.sim.work(self.sim.costs.flush_s)
        return await self.coord.complete(*args, **kwargs)


class StandIn(Operator):
    Config = CostShape

    def __init__(self, config: CostShape, context: OperatorContext, sim: StandIns) -> None:
        super().__init__(config, context)
        self.sim = sim
        self.node = context.node

    @classmethod
    def knobs(cls, config: CostShape) -> Knobs:
        return Knobs(concurrency=config.concurrency, partial_rollout=config.partial_rollout)


class Generate(StandIn):
    def __init__(self, config: CostShape, context: OperatorContext, sim: StandIns) -> None:
        super().__init__(config, context, sim)
        self.cost: EngineCost = sim.costs.engines[self.node]
        cores = engine_cores(sim.scenario.plan, self.node, sim.cores, sim.shapes)
        self.engine = Engine(sim, self.cost, slots(config), factor(sim.costs, self.node, self.cost.cores, cores))
        self.group_size = config.group_size
        self.fitted_size = int(sim.costs.group_size.get(self.node, config.group_size))
        self.version = 0
        self.evaluated: set[int] = set()

    async def generate(self, sample: dict[str, Any], *, step: int, sample_id: str) -> Group:
        rows, wait = self.draw()
        loop = asyncio.get_running_loop()
        until = loop.time() + wait  # a multi-turn group: its environment's turns take this at least
        await self.engine.decode(rows)
        share, thread = self.cost.wait_lock, waits_thread(self.node, self.context.rank)
        if until > loop.time() and share:  # its engine decoding a share of it (fit.wait_share)
            await self.sim.work(until - loop.time(), Load(MAIN, share, share, share, thread))
        elif until > loop.time():
            await asyncio.sleep(until - loop.time())
        self.sim.tokens[sample_id] = sum(rows)
        return Group(id=sample_id, step=step, trajectories=[])

    def draw(self) -> tuple[list[int], float]:
        """A group of the fitted run, resampled; with another group_size, its rows drawn from all
        groups' rows (a multi-turn group: as many rows per episode as the drawn group had)."""
        rng, pool = self.sim.rng, self.sim.costs.groups[self.node]
        rows, wait = rng.choice(pool)
        size = self.group_size
        count = size if len(rows) == self.fitted_size else max(1, round(len(rows) * size / self.fitted_size))
        if count == len(rows):
            return list(rows), wait
        return [rng.choice(rng.choice(pool)[0]) for _ in range(count)], wait

    async def update_weights(self, weights: Any, version: int) -> None:
        await self.sim.work(self.sim.scale * self.cost.update_s)
        self.version = version
        await self.evaluate()

    async def pause(self) -> None:
        self.engine.running.clear()

    async def resume(self) -> None:
        self.engine.running.set()
        await self.evaluate()

    async def evaluate(self) -> None:
        """Replica 0's evaluation (fit.weight_loads), where the generate operator runs it: after a
        load, or at resume where the load paused the engine (partial rollout), the engine then
        decoding in-flight groups beside it."""
        every = self.cost.eval_every
        if self.engine.running.is_set() and self.context.rank == 0 and every and self.version % every == 0 \
                and self.version not in self.evaluated:
            self.evaluated.add(self.version)
            await self.sim.work(self.sim.scale * self.cost.eval_s)


class Engine:
    """One replica's engine: rows wait for a slot (first come, first served); an iteration decodes
    one token of each row in a slot."""

    def __init__(self, sim: StandIns, cost: EngineCost, slots: int, per_row: float = 1.0) -> None:
        self.sim, self.cost, self.slots = sim, cost, slots
        self.per_row = per_row  # the fitted per-row cost's factor on this engine's cores (threads.factor)
        self.waiting: deque[list[Any]] = deque()  # [tokens left, its group's [rows left, future]]
        self.active: list[list[Any]] = []
        self.running = asyncio.Event()  # cleared while paused (partial rollout's weight load)
        self.running.set()
        self.decoding: asyncio.Task | None = None

    async def decode(self, rows: list[int]) -> None:
        if not rows:
            return
        group = [len(rows), asyncio.get_running_loop().create_future()]
        self.waiting.extend([tokens, group] for tokens in rows)
        if self.decoding is None:
            self.decoding = asyncio.get_running_loop().create_task(self.iterate())
        await group[1]

    async def iterate(self) -> None:
        while self.waiting or self.active:
            await self.running.wait()
            admitted = min(len(self.waiting), self.slots - len(self.active))
            self.active += [self.waiting.popleft() for _ in range(admitted)]
            cost = self.cost.a + self.cost.b * self.per_row * len(self.active) + (self.cost.p + self.cost.r * admitted
                                                                                   if admitted else 0.0)
            await self.sim.work(self.sim.scale * cost)
            for row in self.active:
                row[0] -= 1
                if row[0] <= 0:
                    row[1][0] -= 1
                    if row[1][0] == 0:
                        row[1][1].set_result(None)
            self.active = [row for row in self.active if row[0] > 0]
        self.decoding = None


class Transform(StandIn):
    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        kind = self.sim.scenario.plan.nodes[self.node].kind
        scale = self.sim.scale if kind == "reference" else 1.0
        await self.sim.work(scale * self.sim.rng.choice(self.sim.costs.process[self.node]))
        group = next(iter(inputs.values()))
        return {port: group for port in self.sim.scenario.plan.nodes[self.node].outputs}


class Train(StandIn):
    def __init__(self, config: CostShape, context: OperatorContext, sim: StandIns) -> None:
        super().__init__(config, context, sim)
        # Its torch work runs over its threads (as threads.py measured they scale, from the fitted
        # run's cores to the ones it gets here) and grows with its passes over the tokens (epochs, a
        # proximal forward: CostShape.passes).
        cores = train_cores(sim.scenario.plan, self.node, sim.cores, sim.shapes)
        threads = factor(sim.costs, self.node, sim.costs.train_cores, cores)
        fitted, passes = sim.costs.train_passes, config.passes
        self.factor = sim.scale * threads * (passes / fitted if passes and fitted else 1.0)

    async def train(self, groups: list[Any], *, step: int) -> TrainResult:
        sim = self.sim
        c, k = sim.costs.train
        tokens = sum(sim.tokens.pop(g.id, 0) for g in groups)
        work = self.factor * (c + k * tokens) if groups else 0.0  # an empty batch: no update
        await sim.work(work, Load(self.node, 1.0) if self.node in sim.own else Load(MAIN, sim.costs.train_lock))
        return TrainResult(policy=step + 1)


class Sync(StandIn):
    async def sync(self, policy: Any, *, version: int) -> Any:
        await self.sim.work(self.sim.scale * self.sim.costs.sync_s.get(self.node, 0.0))
        return version
