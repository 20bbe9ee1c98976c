"""What a span of the fitted run would have taken alone, under the machine-share model (cpu.py).

A span's wall time includes the time other work held the interpreter lock or the cores. Its work,
the amount a stand-in does (stages.py), is the integral of the rate the model gave it while it ran:
two lock-bound jobs of one process ran at 1/2 each. A sweep over the span boundaries computes it
for every span at once.
"""

from __future__ import annotations

from flowrl.plan.cpu import Load, shares

Interval = tuple[Load, float, float]  # (its load, start, end)


def solo_work(intervals: list[Interval], cores: float, handoff: float = 1.0) -> list[float]:
    """The work of each interval (same order) when all of them shared the machine as they overlapped
    (with the lock's `handoff` efficiency: cpu.py)."""
    edges = sorted({t for _, s, e in intervals for t in (s, e)})
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][1])
    work = [0.0] * len(intervals)
    active: list[int] = []
    nxt = 0
    for left, right in zip(edges, edges[1:], strict=False):
        while nxt < len(order) and intervals[order[nxt]][1] <= left:
            active.append(order[nxt])
            nxt += 1
        active = [i for i in active if intervals[i][2] > left]
        if not active:
            continue
        for i, rate in zip(active, shares([intervals[i][0] for i in active], cores, handoff), strict=True):
            work[i] += (right - left) * rate
    return work
