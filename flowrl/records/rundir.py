"""`RunDir`: one typed reader of a run directory (docs/runs.md has the layout).

A run directory is one run (plan.json, meta.json, metrics.jsonl, ...) or a phased run whose phases
are runs under `phases/<i>-<name>/`. Every command that reads runs (inspect, replay, plan, resume,
the tools) opens them here, so "is this a run" and "which phase" are decided once, and every file
is decoded into the Structs its writer encodes (flowrl/records/rows.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.records.lines import RecordError, decode, document, lines
from flowrl.records.rows import (
    ErrorRow,
    EvalRow,
    Launch,
    LedgerEntry,
    Meta,
    MetricsRow,
    PhaseDone,
    ReplayInfo,
    SampleRow,
    Trace,
    TraceEvent,
    TrackerEntry,
    WaitRow,
)
from flowrl.spec.errors import UserError

if TYPE_CHECKING:
    from flowrl.graph.plan import Plan
    from flowrl.records.rollouts import RolloutStep

TRACKERS = "trackers.json"
MARKERS = ("plan.json", "meta.json")  # written together when a run starts (flowrl/runtime/run.py)


class NotARun(UserError, FileNotFoundError):
    """A directory that holds no run: neither a run's files nor phases/*/ with them."""


class RunDir:
    """A run directory, or one phase of a phased run. Readers return rows lazily where a file is a
    stream (a long run's samples.jsonl is read line by line, not kept)."""

    def __init__(self, path: Path | str, name: str = "main") -> None:
        self.path = Path(path)
        self.name = name  # "main" for a run of one phase, else the phase's name

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def is_run(self) -> bool:
        """Whether this directory is itself a run (or one phase of one)."""
        return any((self.path / m).exists() for m in MARKERS)

    def phases(self) -> list[RunDir]:
        """The runs in this directory in order: its phases (phases/<i>-<name>/ that hold a run),
        else itself. NotARun when there is none."""
        folder = self.path / "phases"
        found = sorted((p for p in folder.glob("*-*") if p.name.split("-", 1)[0].isdigit()),
                       key=lambda p: int(p.name.split("-", 1)[0])) if folder.is_dir() else []
        runs = [RunDir(p, p.name.split("-", 1)[1]) for p in found]
        runs = [r for r in runs if r.is_run()]
        if runs:
            return runs
        if self.is_run():
            return [self]
        raise NotARun(f"{self.path} is not a run directory (no plan.json or meta.json, nor phases/*/ with them)")

    def last(self) -> RunDir:
        """The run whose plan a command acts on: this directory, if a run, else its last phase."""
        return self if self.is_run() else self.phases()[-1]

    def meta(self) -> Meta:
        return document(self.path / "meta.json", Meta)

    def plan(self) -> Plan:
        """plan.json: the compiled plan the run started with."""
        from flowrl.graph.plan import Plan

        return document(self.path / "plan.json", Plan)

    def plan_record(self) -> dict[str, Any]:
        """plan.json as plain JSON values (to compare with another plan key by key)."""
        return document(self.path / "plan.json", dict[str, Any])

    def metrics(self) -> Iterator[MetricsRow]:
        return self._rows("metrics.jsonl", MetricsRow)

    def evals(self) -> Iterator[EvalRow]:
        return self._rows("eval.jsonl", EvalRow)

    def samples(self) -> Iterator[SampleRow]:
        return self._rows("samples.jsonl", SampleRow)

    def ledger(self) -> Iterator[LedgerEntry]:
        return self._rows("ledger.jsonl", LedgerEntry)

    def errors(self) -> Iterator[ErrorRow]:
        return self._rows("errors.jsonl", ErrorRow)

    def waits(self) -> Iterator[WaitRow]:
        return self._rows("waits.jsonl", WaitRow)

    def _rows(self, name: str, kind: type[Any]) -> Iterator[Any]:
        """A JSON-lines file's rows; none when the run did not write it."""
        path = self.path / name
        return lines(path, kind) if path.exists() else iter(())

    def trackers(self) -> dict[str, TrackerEntry]:
        """trackers.json: what each tracker was sent (flowrl/runtime/tracking.py); {} before the first."""
        path = self.path / TRACKERS
        return document(path, dict[str, TrackerEntry]) if path.exists() else {}

    def trace(self) -> list[TraceEvent]:
        """trace.json's events; none without one. A trace cut by a kill mid-append reads up to the cut."""
        path = self.path / "trace.json"
        if not path.exists():
            return []
        try:
            return document(path, Trace).traceEvents
        except RecordError as whole:
            if path.read_bytes().lstrip().startswith(b"["):  # a bare list of events: Chrome reads that too
                return document(path, list[TraceEvent])
            return _trace_lines(path, whole)

    def placement(self) -> dict[str, Any]:
        """placement.json (Ray executor): where each stage replica ran; {} without one."""
        path = self.path / "placement.json"
        return document(path, dict[str, Any]) if path.exists() else {}

    def launch(self) -> Launch:
        """launch.json: the spec file, overrides and executor the run was started with."""
        return document(self.path / "launch.json", Launch)

    def phase_done(self) -> PhaseDone | None:
        """phase.json: written when the phase finished; None while it has not."""
        path = self.path / "phase.json"
        return document(path, PhaseDone) if path.exists() else None

    def replay_info(self) -> ReplayInfo | None:
        """replay.json of a `flowrl replay` directory; None for a recorded run."""
        path = self.path / "replay.json"
        return document(path, ReplayInfo) if path.exists() else None

    def error_text(self) -> str | None:
        """error.txt: what stopped a run that failed."""
        path = self.path / "error.txt"
        return path.read_text(errors="replace").strip() if path.is_file() else None

    def rollouts(self, node: str) -> Iterator[RolloutStep]:
        """The rollout store of train node `node` (flowrl/records/rollouts.py; StoreError names damage)."""
        from flowrl.records import rollouts

        return rollouts.read(rollouts.path(self.path, node))


def _trace_lines(path: Path, whole: RecordError) -> list[TraceEvent]:
    """The events of a trace.json whose closing tail is missing: the writer puts one event on each
    line (flowrl/runtime/durability/streams.py), so the events up to a torn last line are read line by line."""
    with open(path, "rb") as f:
        text = f.read().split(b"\n")
    if not text or b'"traceEvents"' not in text[0]:
        raise whole
    events: list[TraceEvent] = []
    body = [(n, line.rstrip(b",\r")) for n, line in enumerate(text[1:], 2) if line.strip(b" \t\r\x00")]
    for i, (number, line) in enumerate(body):
        if line.startswith(b"]"):
            break
        try:
            events.append(decode(line, TraceEvent, f"{path}:{number}"))
        except RecordError:
            if i + 1 < len(body) and not body[i + 1][1].startswith(b"]"):
                raise
    return events


def as_dicts(rows: Iterable[msgspec.Struct]) -> list[dict[str, Any]]:
    """Rows as plain mappings, for code that also takes rows not read from a file (health, a
    simulated run's rows, trackers)."""
    return [msgspec.to_builtins(r) for r in rows]
