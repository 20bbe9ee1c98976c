"""The service's worker pool and its latency record: at most `workers` calls run at once, each on a
slot of its own (its own uid); the rest wait in FIFO order, and the wait is measured per call.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from flowrl_operators.tools.execute import Call, Limits, run_call

KEPT = 20_000  # the latest calls whose timings /stats summarises


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class Stats:
    def __init__(self) -> None:
        self.timings: dict[str, deque[float]] = {k: deque(maxlen=KEPT) for k in ("queue_s", "start_s", "run_s")}
        self.outcomes: Counter[str] = Counter()
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.waiting = 0

    def record(self, result: dict[str, Any]) -> None:
        self.calls += 1
        self.outcomes[result["error"] or "ok"] += 1
        for key, value in result["timing"].items():
            self.timings[key].append(value)

    def summary(self) -> dict[str, Any]:
        latency = {key: {"median": percentile(list(v), 0.5), "p90": percentile(list(v), 0.9),
                         "p99": percentile(list(v), 0.99), "max": max(v, default=0.0), "n": len(v)}
                   for key, v in self.timings.items()}
        return {"calls": self.calls, "outcomes": dict(self.outcomes), "running": self.running,
                "max_running": self.max_running, "waiting": self.waiting, "latency": latency}


class Pool:
    """Runs calls on `workers` slots. `uids[i]` is slot i's uid (-1: none, the service not root)."""

    def __init__(self, python: str, bwrap: bool, root: Path, limits: Limits, uids: list[int], service_pid: int) -> None:
        self.python, self.bwrap, self.root, self.limits = python, bwrap, root, limits
        self.uids, self.service_pid = uids, service_pid
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(len(uids)):
            self.free.put_nowait(slot)
        self.ids = itertools.count()
        self.stats = Stats()

    async def run(self, code: str, wall_s: float | None = None) -> dict[str, Any]:
        """One call: waits for a free slot, runs `code` there, returns its result with `timing.queue_s`."""
        wall = min(wall_s or self.limits.wall_s, self.limits.wall_s)
        arrived = time.monotonic()
        self.stats.waiting += 1
        try:
            slot = await self.free.get()
        finally:
            self.stats.waiting -= 1
        queued = time.monotonic() - arrived
        self.stats.running += 1
        self.stats.max_running = max(self.stats.max_running, self.stats.running)
        try:
            call = Call(self.python, self.bwrap, self.root, self.limits, slot, self.uids[slot], self.service_pid)
            result = await run_call(call, next(self.ids), code, wall)
        finally:
            self.stats.running -= 1
            self.free.put_nowait(slot)
        result["timing"]["queue_s"] = round(queued, 6)
        self.stats.record(result)
        return result
