"""A live progress view for `flowrl run` (rich): phase, step, policy version, samples/s, reward,
eval reward, queues, and a warning for each health condition on now (flowrl/health.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from flowrl.graph.plan import Plan
from flowrl.health import active
from flowrl.runtime.executors.executor import Executor
from flowrl.runtime.waits import warning

REFRESH_S = 0.5


class ProgressView:
    def __init__(self, plan: Plan, executor: Executor) -> None:
        self.plan = plan
        self.executor = executor
        self.live = Live(self.render(None), refresh_per_second=4, transient=False)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.live.start()
        self.task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        with contextlib.suppress(Exception):  # a last look, if the coordinator still answers
            self.live.update(self.render(await self.executor.call("status")))
        self.live.stop()

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.live.update(self.render(await self.executor.call("status")))
            await asyncio.sleep(REFRESH_S)

    def render(self, status: dict[str, Any] | None) -> Group:
        head = Table.grid(padding=(0, 2))
        for _ in range(7):
            head.add_column()
        steps = self.plan.run.get("steps", "?")
        phase = self.plan.run.get("phase")  # set by flowrl run for phased pipelines
        name = f"[bold]{self.plan.name}[/]" + (f" · {phase}" if phase else "")
        if status is None:
            head.add_row(name, "starting...", "", "", "", "", "")
            return Group(head)
        last = status["last"] or {}
        version = min(status["versions"].values(), default=0)
        reward = last.get("reward")
        evals = [c["eval/reward"] for c in (last.get("operators") or {}).values() if "eval/reward" in c]
        head.add_row(
            name, f"step {version}/{steps}", f"policy v{version}",
            f"{last.get('samples_per_s', 0):.2f} samples/s",
            f"reward {reward:.3f}" if reward is not None else "reward -",
            f"eval {evals[0]:.3f}" if evals else "eval -",
            f"dropped {status['counters']['dropped']}",
        )
        queues = Table("edge", "queued", box=None, pad_edge=False)
        for edge, depth in status["queues"].items():
            queues.add_row(edge, str(depth))
        return Group(head, queues, *warnings(status.get("health") or []), *waiting(status.get("waits") or {}))


def warnings(events: list[dict[str, Any]]) -> list[Text]:
    """One line per health condition on now, as its event said when it began."""
    return [Text(f"! {e.get('node', '')}: {e['message']}", style="bold yellow") for e in active(events).values()]


def waiting(waits: dict[str, list[dict[str, Any]]]) -> list[Text]:
    """One line per node whose work waits too long now (runtime/waits.py)."""
    return [Text(f"! {warning(node, items)}", style="bold yellow") for node, items in waits.items() if items]
