"""Work that waits too long, recorded as the run goes: `waits.jsonl` and the live view.

Operators report what they have awaited too long (`Operator.waits`: a generate node's episodes
awaiting one thing past its `slow_episode_s`) with every report, about once a second. Each report
replaces that node replica's list. A wait gets a row in `waits.jsonl` when it first appears
(`"event": "began"`, with how long it had waited) and when it no longer does (`"ended"`: the
episode moved on, finished or timed out; `waited_s` as last reported, so up to a report's period
short). The rows are written at once: a run that hangs writes nothing else. The file is an
observation of wall time, like `trace.json`: a resumed run appends to it and does not cut it back.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import msgspec

from flowrl import records
from flowrl.records import WaitRow
from flowrl.runtime.clock import WALL, Clock

NAMES = ("sample_id", "episode", "turn", "awaits")  # what makes a wait the same one across reports


class Waits:
    def __init__(self, run_dir: Path | None, origin: float, clock: Clock = WALL) -> None:
        self.path = run_dir / "waits.jsonl" if run_dir is not None else None
        self.origin = origin
        self.clock = clock
        self.now: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def report(self, node: str, replica: int, waits: list[dict[str, Any]]) -> None:
        before = {_key(w): w for w in self.now.get((node, replica), [])}
        after = {_key(w): w for w in waits}
        rows = [self._row("began", node, replica, w) for k, w in after.items() if k not in before]
        rows += [self._row("ended", node, replica, w) for k, w in before.items() if k not in after]
        if waits:
            self.now[(node, replica)] = list(waits)
        else:
            self.now.pop((node, replica), None)
        if self.path is not None:
            records.append(self.path, [r for r in rows if r is not None])

    def _row(self, event: str, node: str, replica: int, wait: dict[str, Any]) -> WaitRow | None:
        row = {"event": event, "node": node, "replica": replica, "time": round(self.clock.now() - self.origin, 3)}
        try:  # typed as the reader will read it (flowrl/records); keys of the operator's own are not kept
            return msgspec.convert(row | wait, WaitRow)
        except msgspec.ValidationError as e:  # an operator's report of the wrong shape: the run goes on
            warnings.warn(f"node '{node}': a wait it reported is not written to waits.jsonl: {e}", stacklevel=2)
            return None

    def status(self) -> dict[str, list[dict[str, Any]]]:
        """Per node, its waits now over all replicas, longest first."""
        out: dict[str, list[dict[str, Any]]] = {}
        for (node, replica), waits in sorted(self.now.items()):
            out.setdefault(node, []).extend(w | {"replica": replica} for w in waits)
        for waits in out.values():
            waits.sort(key=lambda w: -float(w.get("waited_s", 0.0)))
        return out


def _key(wait: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(wait.get(name)) for name in NAMES)


def warning(node: str, waits: list[dict[str, Any]]) -> str:
    """The live view's line for a node with waits, naming the longest."""
    longest = waits[0]
    what = ", ".join(f"{label} {longest[name]}" for name, label in (("sample_id", "sample"), ("episode", "episode"),
                                                                     ("turn", "turn")) if name in longest)
    count = f"{len(waits)} episode{'s' if len(waits) != 1 else ''} waiting"
    return (f"{node}: {count}; the longest {float(longest.get('waited_s', 0.0)):.0f} s on "
            f"{longest.get('awaits', '?')}" + (f" ({what})" if what else ""))
