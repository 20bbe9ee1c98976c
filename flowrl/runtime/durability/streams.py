"""Run records as files that grow during the run and can be cut back to a checkpoint.

Each stream appends whole lines (or whole TensorBoard records) and reports its size; a checkpoint
stores the sizes (`offsets()`), and `truncate(run_dir, offsets)` cuts every stream back to them
before a resumed run appends again, so a resumed run's records are exactly an uninterrupted run's.

`TraceFile` keeps `trace.json` valid Chrome trace JSON (`{"traceEvents": [...]}`) after every
append: each append overwrites the closing tail with the new events plus the tail, in one write.
The trace is an observation, not state: a resume never waits on it; one deleted or shorter than
the checkpoint recorded is started anew.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from flowrl.records import StreamSizes, TraceEvent, encode

TRACE_HEAD = b'{"displayTimeUnit": "ms", "traceEvents": [\n'
TRACE_TAIL = b"\n]}\n"
STREAMS = ("ledger.jsonl", "metrics.jsonl", "samples.jsonl", "errors.jsonl")
ROLLOUTS = "rollouts"  # the rollout store, one file per train node (rollouts.py)


def append_lines(path: Path, lines: list[bytes]) -> None:
    """One write of whole lines: a kill leaves complete lines (or none of this batch)."""
    if lines:
        with open(path, "ab") as f:
            f.write(b"\n".join(lines) + b"\n")


class TraceFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0  # bytes before the tail: where the next events go

    def _open(self) -> None:
        if self.size:
            return
        if self.path.exists() and self.path.stat().st_size >= len(TRACE_HEAD) + len(TRACE_TAIL):
            self.size = self.path.stat().st_size - len(TRACE_TAIL)
        else:
            self.path.write_bytes(TRACE_HEAD + TRACE_TAIL)
            self.size = len(TRACE_HEAD)

    def append(self, events: list[TraceEvent]) -> None:
        self._open()
        if not events:
            return
        first = self.size == len(TRACE_HEAD)
        body = (b"" if first else b",\n") + b",\n".join(encode(e) for e in events)
        with open(self.path, "r+b") as f:
            f.seek(self.size)
            f.write(body + TRACE_TAIL)
        self.size += len(body)

    def offset(self) -> int:
        self._open()
        return self.size


def offsets(run_dir: Path, trace: TraceFile, tensorboard: Path) -> StreamSizes:
    """Sizes of every stream now (call after flushing them)."""
    sizes = {name: _size(run_dir / name) for name in STREAMS}
    sizes["trace.json"] = trace.offset()
    sizes["tensorboard"] = {p.name: p.stat().st_size for p in sorted(tensorboard.glob("events.*"))} \
        if tensorboard.exists() else {}
    store = run_dir / ROLLOUTS
    sizes[ROLLOUTS] = {p.name: p.stat().st_size for p in sorted(store.glob("*.bin"))} if store.exists() else {}
    return msgspec.convert(sizes, StreamSizes)


def shortfall(run_dir: Path, sizes: StreamSizes) -> str | None:
    """Why the streams cannot be cut back to `sizes` (from `offsets`): one is shorter than the
    checkpoint recorded (cutting would pad it with NUL bytes), or does not end a line there."""
    wanted = [(run_dir / name, sizes.of(name)) for name in STREAMS]  # not trace.json: see truncate
    for folder in ("tensorboard", ROLLOUTS):
        wanted += [(run_dir / folder / name, size) for name, size in sizes.folder(folder).items()]
    for path, size in wanted:
        have = _size(path)
        if have < size:
            return f"{path} is {have} bytes, shorter than the {size} bytes it had at the checkpoint"
        if path.suffix == ".jsonl" and size > 0:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    return f"{path} does not end a line at byte {size}, where the checkpoint left it"
    return None


def truncate(run_dir: Path, sizes: StreamSizes) -> None:
    """Cut every stream back to `sizes` (from `offsets`); files the checkpoint did not know go."""
    for name in STREAMS:
        _cut(run_dir / name, sizes.of(name))
    trace, recorded = run_dir / "trace.json", sizes.trace
    if recorded > len(TRACE_HEAD) and _size(trace) >= recorded:
        _cut(trace, recorded)
        with open(trace, "ab") as f:
            f.write(TRACE_TAIL)
    elif trace.exists():  # nothing to keep, or too short to cut back (cutting would pad it): anew
        trace.unlink()
    for folder, pattern in (("tensorboard", "events.*"), (ROLLOUTS, "*.bin")):
        if (run_dir / folder).exists():
            known = sizes.folder(folder)
            for path in (run_dir / folder).glob(pattern):
                if path.name in known:
                    _cut(path, known[path.name])
                else:
                    path.unlink()


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _cut(path: Path, size: int) -> None:
    if not path.exists():
        return
    if size <= 0:
        path.unlink()
        return
    with open(path, "r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())
