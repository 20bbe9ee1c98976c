"""The ledger: every record id produced, consumed, dropped or left pending, per edge.

`ledger.jsonl` in the run directory holds one JSON object per line:

    {"event": "produce" | "consume" | "drop" | "pending" | "issue" | "reissue" | "admit" | "end" | "resume",
     "edge": "<src>.<port> -> <dst>.<port>"  (samples use "data -> <generate node>"),
     "id": "<step>:<index>" | "v<version>", "step": int, "version": int, ...}

`issue` is the produce event of a sample on its `data -> node` edge and carries `admitted_version`
(the policy version the generate replica had) and `budget` (its admission budget). `reissue`
hands a sample out again after its actor died or the run resumed; `drop` carries a `reason`
(stale, superseded, unjoined); `pending` lists what was still in a channel or in flight when the
run ended; `end` closes a finished run and `resume` marks where a resumed run picked up.

`check(run_dir)` reads it back and says whether anything was lost or duplicated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.records import LedgerEntry, RunDir, encode


class Ledger:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[bytes] = []

    def write(self, event: str, edge: str, id: str, step: int, version: int, **extra: Any) -> None:
        if self.path is not None:  # a keyword LedgerEntry lacks is a TypeError here, not a row no one reads
            self.lines.append(encode(LedgerEntry(event=event, edge=edge, id=id, step=step, version=version, **extra)))

    def flush(self) -> None:
        if self.path is None or not self.lines:
            return
        with open(self.path, "ab") as f:
            f.write(b"\n".join(self.lines) + b"\n")
        self.lines.clear()


@dataclass
class LedgerReport:
    produced: int = 0
    consumed: int = 0
    dropped: int = 0
    pending: int = 0
    ended: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger's events as mappings (each holds only the keys its event has)."""
    return [e.as_dict() for e in _entries(run_dir)]


def _entries(run_dir: Path) -> list[LedgerEntry]:
    run = RunDir(run_dir)
    if not run.has("ledger.jsonl"):  # a run always writes one: its absence is not "nothing happened"
        raise FileNotFoundError(f"{run.file('ledger.jsonl')} is missing")
    return list(run.ledger())


def check(run_dir: Path, weights: bool = False) -> LedgerReport:
    """Nothing lost, nothing duplicated: per data edge, every produced id is consumed, dropped or
    (only after the run ended) pending, exactly once. Weights edges are skipped unless asked:
    a newer weights record legitimately supersedes an older one for each replica.
    """
    events = _entries(run_dir)
    report = LedgerReport(ended=any(e.event == "end" for e in events))
    produced: dict[str, set[str]] = defaultdict(set)
    outcome: dict[str, dict[str, str]] = defaultdict(dict)
    for e in events:
        kind, edge, rid = e.event, e.edge, e.id
        if e.weights is True and not weights:
            continue
        if kind in ("produce", "issue"):
            if rid in produced[edge]:
                report.problems.append(f"{edge}: {rid} produced twice")
            produced[edge].add(rid)
            report.produced += 1
        elif kind in ("consume", "drop", "pending"):
            if rid not in produced[edge]:
                report.problems.append(f"{edge}: {rid} {kind}d but never produced")
            if rid in outcome[edge]:
                report.problems.append(f"{edge}: {rid} {kind}d after it was already {outcome[edge][rid]}d")
            outcome[edge][rid] = kind
            report.consumed += kind == "consume"
            report.dropped += kind == "drop"
            report.pending += kind == "pending"
    if report.ended:
        for edge, ids in produced.items():
            lost = sorted(ids - set(outcome[edge]))
            if lost:
                report.problems.append(f"{edge}: {len(lost)} ids never consumed, dropped or pending: {lost[:5]}")
    return report
