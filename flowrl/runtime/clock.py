"""The runtime's clock: what time it is, and the event loop its waits run on.

Every stage, the coordinator and the observer read the time through a `Clock` (`now()`) and run on
its event loop (`run()`); their waits (`sleep()`, `asyncio.wait_for`, `loop.call_later`) are that
loop's timers. A real run uses `WALL`: wall-clock seconds and asyncio's own loop.

`VirtualClock` is a discrete-event clock: its loop never sleeps. When every task waits, time
jumps to the next timer, so a run whose operators only await timers (`asyncio.sleep`) and each
other takes milliseconds of real time for hours of virtual time, and the same run twice takes
the same course. `flowrl plan` runs the real coordinator and stages on it with stand-in operators
(flowrl/plan/simulate.py); the runtime's simulation tests run toy operators on it. A task that
waits on a thread or a socket has no place on it: a loop with nothing to run and no timer set
raises `Stalled` (on the wall clock the run would hang).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float:
        """Seconds: since the epoch on the wall clock, since the start on a virtual one."""

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock (the caller must run on `run()`'s loop)."""

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run `main` to its end on an event loop whose timers keep this clock's time."""


class WallClock:
    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(main)


WALL = WallClock()


class Stalled(RuntimeError):
    """Every task of a virtual run waits and no timer will wake one: the run would hang."""


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.time = start

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # the loop's timers are this clock's (run())

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        with asyncio.Runner(loop_factory=lambda: _Loop(self)) as runner:
            return runner.run(main)


class _Jump(selectors.DefaultSelector):
    """The loop's wait for I/O or its next timer: nothing is awaited, the clock jumps instead."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)  # the loop's own wake-ups (a signal) are still seen at once
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Stalled(f"at {self.clock.time:.3f} virtual seconds every task waits and no timer is set")
        self.clock.time += timeout
        return []


class _Loop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_Jump(clock))
        self._virtual = clock

    def time(self) -> float:
        return self._virtual.time
