"""The in-process executor: every stage is an asyncio task in the caller's process.

For debugging (one process, breakpoints work) and fast tests. Operators that do blocking CPU
work should hand it to a thread (`asyncio.to_thread`) so the other stages keep running.

On a virtual clock (flowrl/runtime/clock.py) `simulate` runs a plan without a run directory to its
end: `flowrl plan` with stand-in operators (`build`), the runtime's simulation tests with toy ones.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowrl.graph.plan import Plan
from flowrl.runtime.clock import WALL, Clock, Stalled, VirtualClock
from flowrl.runtime.coordinator import Coordinator
from flowrl.runtime.executors.executor import task_error
from flowrl.runtime.failures import StageFailed
from flowrl.runtime.stage import Build, Stage

Connect = Callable[[Coordinator, str], Any]  # (the coordinator, a node) -> what that node's stages call


class InProcessExecutor:
    def __init__(self, plan: Plan, run_dir: Path | None, origin: float, clock: Clock = WALL,
                 build: Build | None = None, connect: Connect | None = None) -> None:
        """`build`: makes each stage's operator from its context (stage.py); None: the nodes' own.
        `connect`: what the stages of a node call, given the coordinator and the node; None: the
        coordinator itself (flowrl plan adds the cost of the run's own work there)."""
        self.plan = plan
        self.run_dir = run_dir
        self.origin = origin
        self.clock = clock
        self.build = build
        self.connect = connect or (lambda coord, node: coord)
        self.coord: Coordinator | None = None
        self.stages: list[Stage] = []
        self.tasks: dict[asyncio.Task, Stage] = {}
        self.lost_train: tuple[str, int] | None = None  # never set: a lost trainer here fails the run

    async def start(self, steps: int, stop_at: int | None, state: bytes | None, checkpoint: Path | None) -> None:
        self.coord = Coordinator(self.plan, str(self.run_dir) if self.run_dir else None, steps, stop_at,
                                 self.origin, state, self.clock)
        run_dir = str(self.run_dir) if self.run_dir else None
        names = self.plan.order + [n for n in self.plan.nodes if n not in self.plan.order]
        self.stages = [Stage(self.plan, name, replica, self.connect(self.coord, name), run_dir, self.origin,
                             "inprocess", self.clock, self.build)
                       for name in names for replica in range(self.plan.nodes[name].resources.replicas)]
        # Set up together: a trainer's child process imports torch and builds its model while the
        # engine loads here (measured: ~6 s of each async quickstart phase). shutdown() closes
        # every stage, one whose setup failed included.
        started = await asyncio.gather(*(
            s.start(str(checkpoint / s.node.name / f"r{s.replica}") if checkpoint else None) for s in self.stages),
            return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        self.tasks = {asyncio.get_running_loop().create_task(s.run()): s for s in self.stages}

    async def call(self, method: str, *args: Any) -> Any:
        return await self.coord.request(method, *args)

    async def wait(self) -> str:
        """Until the coordinator stops (done, interrupt, error) or a stage ends on its own."""
        stopping = asyncio.get_running_loop().create_task(self.coord.wait_stopping())
        done, _ = await asyncio.wait([stopping, *self.tasks], return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():  # a stage ended first: an error unless the run is already stopping
            stopping.cancel()
            for task in done:
                self.coord.stage_ended(self.tasks[task].node.name, self.tasks[task].replica, task_error(task))
        return self.coord.stopping

    async def join(self, timeout: float) -> list[tuple[str, str]]:
        """Let the stages return; cancel those that do not in time. Returns (node, traceback) failures."""
        done, pending = await asyncio.wait(self.tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failures = []
        for task in done:
            error = task_error(task)
            if error:
                failures.append((self.tasks[task].node.name, error))
        return failures

    async def save(self, directory: Path) -> None:
        for stage in self.stages:
            stage.save(str(directory / stage.node.name / f"r{stage.replica}"))

    async def shutdown(self) -> list[tuple[str, str]]:
        """Close every stage; returns (node, traceback) for those whose close failed."""
        failures = []
        for stage in self.stages:
            try:
                await stage.close()
            except Exception:
                failures.append((stage.node.name, traceback.format_exc()))
        return failures



STALL_S = 86_400.0  # virtual seconds without a train step after which a simulated run is stuck, not slow


def simulate(plan: Plan, build: Build | None = None, clock: VirtualClock | None = None,
             connect: Connect | None = None) -> InProcessExecutor:
    """Run `plan` (its `run.steps`) in process on a virtual clock, without a run directory; returns
    the executor once its stages have ended: the coordinator's records are in `coord.observe.kept`.
    Raises StageFailed as run() does, and Stalled where the run would hang."""
    clock = clock or VirtualClock()
    ex = InProcessExecutor(plan, None, clock.now(), clock, build, connect)
    clock.run(_drive(ex, int(plan.run.get("steps", 10))))
    return ex


async def _drive(ex: InProcessExecutor, steps: int) -> None:
    await ex.start(steps, None, None, None)
    loop = asyncio.get_running_loop()
    stopped, stuck = loop.create_task(ex.wait()), loop.create_task(_stuck(ex.coord))
    await asyncio.wait([stopped, stuck], return_when=asyncio.FIRST_COMPLETED)
    if stuck.done():
        ex.coord.stop("error")
        await ex.join(1.0)
        raise Stalled(f"a simulated run made no train step in {STALL_S:g} virtual seconds, at versions "
                      f"{ex.coord.versions}")
    stuck.cancel()
    failures = await ex.join(10.0)
    if stopped.result() == "error":
        raise StageFailed(ex.coord.error or "\n".join(f"node '{n}' failed:\n{t}" for n, t in failures))
    await ex.coord.finish()
    await ex.shutdown()


async def _stuck(coord: Coordinator) -> None:
    """Returns once the train nodes made no step for STALL_S (the stages' heartbeats keep timers
    set, so the clock of a run that hangs would go on without end); never without train nodes."""
    while True:
        before = dict(coord.versions)
        await asyncio.sleep(STALL_S)
        if coord.trains and coord.versions == before:
            return
