"""The rollout store: every batch a train node trained on, appended as the run goes.

`rollouts/<train node>.bin` holds one record per completed train step, in the order the steps
completed: a 12-byte header (magic `FRR1`, payload length, CRC-32 of the payload, big-endian)
and the payload, a msgpack `RolloutStep` (the step, the version it trained at, and the exact
groups, as msgspec Structs: token ids, logprobs, versions, rewards; images by reference). The
files are run streams (streams.py): a checkpoint records their sizes and a resumed run cuts them
back, so a resumed run's store is an uninterrupted run's. `flowrl replay` (flowrl/replay.py)
trains on them again. `run.record_rollouts: false` turns the store off.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from flowrl.data.trajectory import Group
from flowrl.spec.errors import UserError

FOLDER = "rollouts"
MAGIC = b"FRR1"
HEADER = struct.Struct(">4sII")  # magic, payload bytes, crc32 of the payload


class RolloutStep(msgspec.Struct, kw_only=True):
    node: str
    step: int  # the train step (it published version step + 1)
    at: int  # the train node's version when the batch was formed
    groups: list[Group]


class StoreError(ValueError):
    """A rollout store that cannot be read back: the message names the file, byte and record."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RolloutStep)


def path(run_dir: Path, node: str) -> Path:
    return Path(run_dir) / FOLDER / f"{node}.bin"


def encode(step: RolloutStep) -> bytes:
    payload = _encoder.encode(step)
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def append(run_dir: Path, node: str, step: int, at: int, groups: list[Any]) -> int:
    """Append one trained batch (one write: a kill leaves whole records or a cut tail that resume
    removes); returns the bytes written. Values that are not Groups (a plugin's own record type)
    are not recorded: replay says so."""
    kept = [g for g in groups if isinstance(g, Group)]
    data = encode(RolloutStep(node=node, step=step, at=at, groups=kept))
    file = path(run_dir, node)
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "ab") as f:
        f.write(data)
    return len(data)


def read(file: Path) -> Iterator[RolloutStep]:
    """The records of one store file in order; StoreError names where it is cut or damaged."""
    try:
        data = file.read_bytes()
    except OSError as e:
        raise StoreError(f"cannot read the rollout store {file}: {e.strerror or e}") from None
    at, index = 0, 0
    while at < len(data):
        where = f"{file}: record {index} at byte {at}"
        if len(data) - at < HEADER.size:
            raise StoreError(f"{where}: truncated header ({len(data) - at} of {HEADER.size} bytes); the file is cut")
        magic, size, crc = HEADER.unpack_from(data, at)
        if magic != MAGIC:
            raise StoreError(f"{where}: no record starts here (magic {magic!r}, expected {MAGIC!r}); the file is damaged")
        payload = data[at + HEADER.size:at + HEADER.size + size]
        if len(payload) < size:
            raise StoreError(f"{where}: truncated ({len(payload)} of {size} payload bytes); the file is cut")
        if zlib.crc32(payload) != crc:
            raise StoreError(f"{where}: checksum mismatch; the file is damaged")
        try:
            yield _decoder.decode(payload)
        except msgspec.DecodeError as e:
            raise StoreError(f"{where}: cannot decode: {e}") from None
        at += HEADER.size + size
        index += 1


def load(run_dir: Path, node: str, missing: str) -> list[RolloutStep]:
    """Every record of `node`'s store, for a command that needs them: a missing file is a UserError
    ending with `missing` (why the caller needs it), a damaged one a UserError naming where."""
    file = path(run_dir, node)
    if not file.exists():
        raise UserError(f"{file} is missing: {missing}")
    try:
        return list(read(file))
    except StoreError as e:
        raise UserError(str(e)) from None


def sample_ids(steps: list[RolloutStep]) -> list[list[str]]:
    """Per step, the ids of the trajectories trained on, in order."""
    return [[t.id for g in s.groups for t in g.trajectories] for s in steps]


def checksum(ids: list[list[str]]) -> str:
    """One sha256 over the steps' trajectory ids, in order (the same data, the same checksum)."""
    h = hashlib.sha256()
    for i, step in enumerate(ids):
        h.update(f"{i}:{','.join(step)}\n".encode())
    return h.hexdigest()
