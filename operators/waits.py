"""What a generate node's in-flight episodes await now, and which of them wait too long.

Each episode has an `EpisodeWait` from start to end: its sample id, episode index, the engine
calls it began (`turn`), and what it awaits now with since when. The workflow helpers mark it
(`WorkflowContext.awaiting`): `engine` (a model call, `ctx.generate` or the agent proxy's),
`environment.reset` / `environment.step` / `environment.close` (an environment's method: a tool
call is an environment step), `agent` (a user agent's own code, between its proxy calls), and
`workflow` (a workflow's own code, whatever no helper marked). The marks are a few attribute
writes per engine or environment call, nothing per token; `Episodes.slow()` walks the in-flight
episodes only when the runtime asks (each report, about once a second).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)  # by identity: a member of Episodes.running
class EpisodeWait:
    sample_id: str
    episode: int
    started: float = field(default_factory=time.monotonic)
    awaits: str = "workflow"
    since: float = field(default_factory=time.monotonic)
    turn: int = 0  # engine calls begun so far

    @contextlib.contextmanager
    def on(self, what: str) -> Iterator[None]:
        """Awaiting `what` inside the block; what it awaited before, from the block's end on."""
        outer, self.awaits, self.since = self.awaits, what, time.monotonic()
        if what == "engine":
            self.turn += 1
        try:
            yield
        finally:
            self.awaits, self.since = outer, time.monotonic()


class Episodes:
    """The in-flight episodes of one generate node replica."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.running: set[EpisodeWait] = set()

    def begin(self, sample_id: str, episode: int) -> EpisodeWait:
        wait = EpisodeWait(sample_id, episode)
        self.running.add(wait)
        return wait

    def end(self, wait: EpisodeWait) -> None:
        self.running.discard(wait)

    def slow(self) -> list[dict[str, Any]]:
        """The episodes that have awaited one thing for at least `threshold_s`, longest first:
        {sample_id, episode, turn, awaits, waited_s, episode_s}. All of them: a healthy run has none,
        and a hung environment a few hundred at most (max_concurrency x group_size)."""
        if not self.threshold_s:
            return []
        now = time.monotonic()
        slow = sorted((w for w in self.running if now - w.since >= self.threshold_s), key=lambda w: w.since)
        return [{"sample_id": w.sample_id, "episode": w.episode, "turn": w.turn, "awaits": w.awaits,
                            "waited_s": round(now - w.since, 1), "episode_s": round(now - w.started, 1)}
                for w in slow]
