"""The rollout store's format and its reader: `rollouts/<train node>.bin`, one record per completed
train step, each a 12-byte header (magic `FRR1`, payload length, CRC-32 of the payload,
big-endian) and a msgpack `RolloutStep`. The run writes it (flowrl/runtime/durability/rollouts.py);
`RunDir.rollouts(node)`, `flowrl replay` and `flowrl plan` read it back through `read`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec

from flowrl.data.trajectory import Group

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


_decoder = msgspec.msgpack.Decoder(RolloutStep)


def path(run_dir: Path, node: str) -> Path:
    return Path(run_dir) / FOLDER / f"{node}.bin"


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
