"""Reading and writing a run's JSON files: one place for the rules every reader needs.

- A JSON-lines file is read lazily, line by line, each line decoded into its row Struct.
- A run can be killed mid-write: each write appends whole lines, so a final line without its newline
  was cut, and is skipped (so are blank lines, and the NUL bytes a filesystem may leave after a
  crash). Any other line that is not JSON is damage, an error naming `file:line`; so is a line that
  is JSON but not the row (a key of the wrong type).
- Runs written before the writers used msgspec wrote NaN and Infinity as bare tokens (Python's
  json), which msgspec refuses: such a line is parsed by the json module and then typed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from flowrl.spec.errors import UserError

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


class RecordError(UserError, ValueError):
    """A run file that does not read back: the message starts with `file:line:`."""


def encode(row: Any) -> bytes:
    """One row as JSON, without the newline (a Struct, or builtins; NaN and infinity as null)."""
    return _encoder.encode(row)


def append(path: Path, rows: Iterable[Any]) -> None:
    """Rows appended as whole lines in one write: a kill leaves complete lines, or a torn last one."""
    data = b"".join(encode(row) + b"\n" for row in rows)
    if data:
        with open(path, "ab") as f:
            f.write(data)


def decode(data: bytes, kind: type[T], where: str) -> T:
    """`data` as a `kind`; RecordError prefixed by `where` when it is not JSON or not that row."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise RecordError(f"{where}: {kind.__name__}: {e}") from None
    except msgspec.DecodeError as e:
        try:  # the json module's tokens of earlier runs (NaN, Infinity)
            value = json.loads(data)
        except ValueError:
            raise RecordError(f"{where}: not a JSON line ({e})") from None
        try:
            return msgspec.convert(value, kind)
        except msgspec.ValidationError as e:
            raise RecordError(f"{where}: {kind.__name__}: {e}") from None


def lines(path: Path, kind: type[T]) -> Iterator[T]:
    """The rows of a JSON-lines file, in order; a cut final line is skipped (module docstring)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip(b" \t\r\n\x00"):
                continue
            try:
                yield decode(line, kind, f"{path}:{number}")
            except RecordError:
                if line.endswith(b"\n") or _is_json(line):
                    raise
                # The last line, without its newline: the write was cut by a kill.


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def document(path: Path, kind: type[T]) -> T:
    """A JSON file as a `kind`; RecordError names the file and line of what is wrong."""
    data = path.read_bytes()
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise RecordError(f"{path}: {kind.__name__}: {e}") from None
    except msgspec.DecodeError as e:
        raise RecordError(f"{path}:{_line_of(data, str(e))}: not JSON ({e})") from None


def _line_of(data: bytes, message: str) -> int:
    """The line of the byte a msgspec message names ("... (byte 123)"), else 1."""
    found = re.search(r"byte (\d+)", message)
    return data.count(b"\n", 0, int(found.group(1))) + 1 if found else 1
