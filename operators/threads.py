"""Daemon threads for user code that must not run on the event loop (sync rewards, eval rewards,
environments, agents).

A thread cannot be killed, so a call that hangs is abandoned in its thread. `concurrent.futures`'
ThreadPoolExecutor (and asyncio's default executor, `asyncio.to_thread`) joins its threads when
the interpreter exits, so one hung call there keeps a finished run's process alive forever.
`DaemonExecutor` runs calls on daemon threads of its own instead: the interpreter exits without
waiting for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()  # tells one idle worker to exit
_names = itertools.count()


class DaemonExecutor:
    """Up to `max_workers` daemon threads (None: as many as calls in flight), started on demand
    and reused while idle. A worker stuck in a hung call holds its slot, as in a thread pool; the
    calls queued behind it wait for another worker."""

    def __init__(self, max_workers: int | None = None, name: str = "flowrl") -> None:
        self.max_workers, self.name = max_workers, name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            self._queue.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1  # that worker takes the call
            elif self.max_workers is None or self._workers < self.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name=f"{self.name}-{next(_names)}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args, kwargs = item
            del item  # an idle worker must not keep the last call's arguments alive
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to the caller, whatever it is
                    future.set_exception(exc)
            del future, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def close(self, cancel_pending: bool = False) -> None:
        """Workers exit once the calls queued before this have run (or, with `cancel_pending`,
        been cancelled). Never waits for them: a hung call would block the caller."""
        with self._lock:
            self._closed = True
            workers = self._workers
        if cancel_pending:
            while True:
                try:
                    self._queue.get_nowait()[0].cancel()
                except queue.Empty:
                    break
        for _ in range(workers):
            self._queue.put(_STOP)  # after every call queued so far; a hung worker never takes its own


async def call_in_thread(executor: DaemonExecutor, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on one of `executor`'s threads; cancelling the await abandons the call."""
    return await asyncio.wrap_future(executor.submit(fn, *args))
