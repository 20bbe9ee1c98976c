"""How much of a span of time this process's interpreter lock was held: `flowrl plan` needs it for
a train step (plan/cpu.py), and a run that never overlaps training with other work cannot show it.

A thread wakes at random moments (exponential gaps, so the moments are independent of what the
process does) and notes how late it woke. Waking needs the interpreter lock, so a late wake is a
moment another thread held it: Python code holds it, torch kernels release it. The late share of the
wakes estimates the held share of the time. The thread knocks only while a span is open (`open` /
`close`), and a knock costs the holder a few microseconds.
"""

from __future__ import annotations

import random
import threading
import time

MEAN_GAP_S = 0.005  # ~200 knocks a second while a span is open
LATE_S = 0.0005  # a wake this late found the lock held (an idle core wakes a sleeper within ~0.1 ms)


class LockProbe:
    def __init__(self, mean_gap_s: float = MEAN_GAP_S, late_s: float = LATE_S, seed: int = 0) -> None:
        self.mean_gap_s = mean_gap_s
        self.late_s = late_s
        self.counts = (0, 0)  # (late knocks, knocks): rebound as one tuple, so a reader sees a pair
        self._open = 0
        self._active = threading.Event()
        self._stop = threading.Event()
        self._rng = random.Random(seed)
        self._thread: threading.Thread | None = None  # started at the first span

    def open(self) -> tuple[int, int]:
        """Knock from now on (until every open span is closed); the counts to hand to `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._knock, name="flowrl-lock-probe", daemon=True)
            self._thread.start()
        self._open += 1
        self._active.set()
        return self.counts

    def close(self, opened: tuple[int, int]) -> float | None:
        """The held share of the knocks since `opened` (open's return); None with no knock."""
        self._open = max(0, self._open - 1)
        if self._open == 0:
            self._active.clear()
        late, knocks = (now - then for now, then in zip(self.counts, opened, strict=True))
        return late / knocks if knocks else None

    def stop(self) -> None:
        self._stop.set()
        self._active.set()
        if self._thread is not None:
            self._thread.join()

    def _knock(self) -> None:
        late = knocks = 0
        while True:
            self._active.wait()
            gap = self._rng.expovariate(1.0 / self.mean_gap_s)
            due = time.perf_counter() + gap
            if self._stop.wait(gap):  # a sleep that stop() cuts short
                return
            knocks += 1
            late += time.perf_counter() - due > self.late_s
            self.counts = (late, knocks)
