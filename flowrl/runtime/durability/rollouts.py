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
import zlib
from pathlib import Path
from typing import Any

import msgspec

from flowrl.data.trajectory import Group

# The store's format and reader live with the other records (flowrl/records/rollouts.py); they are
# named here too, so that a writer and its readers keep using `rollouts.<name>`.
from flowrl.records.rollouts import FOLDER, HEADER, MAGIC, RolloutStep, StoreError, path, read
from flowrl.spec.errors import UserError

__all__ = ["FOLDER", "HEADER", "MAGIC", "RolloutStep", "StoreError", "append", "checksum", "encode", "load",
           "path", "read", "sample_ids"]

_encoder = msgspec.msgpack.Encoder()


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
