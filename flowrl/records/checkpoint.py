"""A checkpoint folder's own records: `streams.json` (how long each record stream was) and
`manifest.json` (the size and SHA-256 of every other file), read and written here with their row
types (flowrl/records/rows.py), so the checkpoint writer and resume cannot disagree on them.
What a checkpoint means, and when one is trusted, is flowrl/runtime/durability/."""

from __future__ import annotations

from pathlib import Path

from flowrl.records.lines import document, encode
from flowrl.records.rows import Manifest, StreamSizes

STREAMS = "streams.json"
MANIFEST = "manifest.json"


class Checkpoint:
    """`checkpoints/step-<version>/` of a run (or its `.tmp` folder while it is written)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r})"

    def streams(self) -> StreamSizes:
        return document(self.path / STREAMS, StreamSizes)

    def manifest(self) -> Manifest:
        return document(self.path / MANIFEST, Manifest)

    def write_streams(self, sizes: StreamSizes) -> None:
        (self.path / STREAMS).write_bytes(encode(sizes))

    def write_manifest(self, entries: Manifest) -> None:
        # One file per line: a damaged entry is found by line, and a diff of two manifests reads.
        body = b",\n".join(encode(name) + b": " + encode(entry) for name, entry in entries.items())
        (self.path / MANIFEST).write_bytes(b"{\n" + body + b"\n}\n")
