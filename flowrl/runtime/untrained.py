"""A run that trains nothing is a failure: errors operators isolated, and empty train steps.

Operators isolate failures of user code (an episode that raised, a reward that returned NaN) and
go on; they hand their descriptions to the runtime (`Operator.errors()`), which appends the first
`KEPT` of each node to `errors.jsonl` in the run directory. When a train node gets no valid sample
for `run.max_empty_steps` steps in a row (every one rejected, filtered, dropped, or invalid: each
of its trajectories marked `INVALID`, e.g. its reward zeroed after the user's function failed),
the run stops with exit 1, showing the first of those errors with their nodes.

The default, 3: one empty step happens in a healthy run (an async batch with nothing deliverable
yet, a filter that drops a whole early batch); three in a row has not been seen without a broken
workflow, reward or filter, and costs three steps of generation before the run says so. A run
shorter than that fails when every one of its steps was empty. 0 turns the check off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl import records
from flowrl.data.trajectory import INVALID
from flowrl.records import ErrorRow
from flowrl.runtime.clock import WALL, Clock

DEFAULT_MAX_EMPTY = 3
KEPT = 20  # errors written to errors.jsonl per node; the rest are only counted
SHOWN = 3  # errors shown in the failure message


class Untrained:
    def __init__(self, run_dir: Path | None, limit: int, steps: int, origin: float, clock: Clock = WALL) -> None:
        self.path = run_dir / "errors.jsonl" if run_dir is not None else None
        self.clock = clock
        self.configured = limit
        self.limit = min(limit, steps)
        self.origin = origin
        self.first: list[tuple[str, str]] = []  # (node, text): the run's first errors, for the message
        self.kept: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.lines: list[ErrorRow] = []
        self.empty: dict[str, list[int]] = {}  # train node -> its empty steps in a row
        self.invalid = 0  # groups trained on whose every trajectory is invalid (no real reward)
        self.bad = 0  # rejected + filtered + invalid + errors seen, at the last step

    def errors(self, node: str, replica: int, texts: list[str]) -> None:
        for text in texts:
            self.seen[node] = self.seen.get(node, 0) + 1
            if len(self.first) < SHOWN:
                self.first.append((node, text))
            if self.kept.get(node, 0) < KEPT:
                self.kept[node] = self.kept.get(node, 0) + 1
                self.lines.append(ErrorRow(node=node, replica=replica, time=round(self.clock.now() - self.origin, 3),
                                           error=text))

    def step(self, node: str, step: int, batch: list[dict[str, Any]], counters: dict[str, int]) -> str | None:
        """Train node `node` finished `step` on `batch` ({port: group} items): the reason to stop,
        if it got no valid sample for `limit` steps in a row."""
        groups = [v for item in batch for v in item.values()]
        invalid = sum(1 for g in groups if _invalid(g))
        self.invalid += invalid
        # Counted every step, so "went bad" means since the step before this one, not since the last empty one.
        bad = sum(counters.get(k, 0) for k in ("rejected", "filtered")) + self.invalid + sum(self.seen.values())
        went_bad, self.bad = bad > self.bad, bad
        if len(groups) > invalid:
            self.empty[node] = []
            return None
        if not went_bad:
            # Empty with no sample rejected, filtered or invalid and no error: samples dropped as too
            # stale (an async run's last steps), the runtime's choice and not a broken workflow.
            return None
        empty = self.empty.setdefault(node, [])
        empty.append(step)
        if not self.limit or len(empty) < self.limit:
            return None
        return self.message(node, empty, counters)

    def message(self, node: str, empty: list[int], counters: dict[str, int]) -> str:
        counts = dict(counters, invalid=self.invalid)
        lost = ", ".join(f"{counts[k]} {k}" for k in ("rejected", "filtered", "dropped", "invalid") if counts.get(k))
        steps = f"step {empty[0]}" if len(empty) == 1 else f"steps {empty[0]}-{empty[-1]}"
        bound = f"run.max_empty_steps {self.configured}" + ("" if self.limit == self.configured else
                                                             ", or every step of a shorter run")
        text = (f"nothing was trained: node '{node}' got no valid sample in {steps} ({bound}); every sample "
                f"was rejected, filtered, dropped or invalid ({lost or 'none arrived'})")
        if not self.first:
            return text + ("; no operator reported an error: a filter node may drop every group, or the "
                           "workflow returns no trajectory")
        where = f" (up to {KEPT} per node in {self.path})" if self.path else ""
        shown = "\n".join(f"- node '{n}': {t}" for n, t in self.first)
        more = sum(self.seen.values()) - len(self.first)
        return f"{text}. The first errors{where}:\n{shown}" + (f"\n... and {more} more" if more > 0 else "")

    def flush(self) -> None:
        if self.path is not None:
            records.append(self.path, self.lines)
        self.lines = []

    def state(self) -> dict[str, Any]:
        return {"kept": dict(self.kept), "seen": dict(self.seen), "empty": {k: list(v) for k, v in self.empty.items()},
                "invalid": self.invalid, "bad": self.bad}

    def restore(self, state: dict[str, Any]) -> None:
        self.kept = dict(state.get("kept", {}))
        self.empty = {k: list(v) for k, v in state.get("empty", {}).items()}
        self.seen = dict(state.get("seen", {}))
        self.invalid = int(state.get("invalid", 0))
        self.bad = int(state.get("bad", 0))


def _invalid(group: Any) -> bool:
    """A group whose every trajectory is marked invalid (INVALID: e.g. its reward failed and was zeroed)."""
    trajectories = getattr(group, "trajectories", None)
    return bool(trajectories) and all(INVALID in getattr(t, "metadata", {}) for t in trajectories)
