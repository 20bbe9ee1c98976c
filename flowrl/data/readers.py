"""Reading a dataset file as rows: `read_rows(path, format, split)` -> a sized, indexable table.

jsonl, json (a list of objects) and csv are read with the standard library into a list of dicts.
parquet (pyarrow) and `datasets` folders written by `save_to_disk` (the `datasets` package) come
with the `data` extra (`pip install 'flowrl[data]'`); their rows are read one at a time when asked
for, so a large file is not copied into Python objects up front.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMATS = ("jsonl", "json", "csv", "parquet", "datasets")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
EXTRA = "pip install 'flowrl[data]'  (datasets and pyarrow)"


class SourceError(ValueError):
    """A problem with a file source: `key` is the offending key under `data.source` and `detail`
    what to change (a validator locates it at data.source.<key>); str() has both."""

    def __init__(self, key: str, message: str) -> None:
        self.key, self.detail = key, message
        super().__init__(f"data.source.{key}: {message}")


Rows = Sequence[dict[str, Any]]


def detect_format(path: Path, key: str) -> str:
    if path.is_dir():
        return "datasets"
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise SourceError("format", f"cannot tell the format of {str(path)!r} from its name; "
                                    f"set format: one of {', '.join(FORMATS)}")
    return fmt


def read_rows(file: str, fmt: str | None, split: str | None, key: str = "file", split_key: str = "split") -> Rows:
    """The rows of `file` (a path relative to the working directory, or absolute); `key` and
    `split_key` name the keys that gave `file` and `split`, for messages."""
    path = Path(file).expanduser()
    if not path.exists():
        raise SourceError(key, f"no such file or folder {str(path)!r} (relative paths are read from "
                               f"the working directory, {str(Path.cwd())!r})")
    fmt = fmt or detect_format(path, key)
    if split is not None and fmt != "datasets":
        raise SourceError(split_key, f"applies to a datasets folder with several splits; {str(path)!r} is {fmt}")
    try:
        if fmt == "jsonl":
            return _jsonl(path, key)
        if fmt == "json":
            return _json(path, key)
        if fmt == "csv":
            with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: a BOM is read as such
                return list(csv.DictReader(f))
        if fmt == "parquet":
            return ParquetRows(_require("pyarrow.parquet", fmt, key).read_table(path))
        return _datasets_folder(path, split, key, split_key)
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(key, f"cannot read {str(path)!r} as {fmt}: {e}") from None


def _jsonl(path: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(key, f"{path}:{number}: not a JSON object: {e.msg}") from None
            if not isinstance(row, dict):
                raise SourceError(key, f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _json(path: Path, key: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise SourceError(key, f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise SourceError(key, f"{path} must hold a JSON list of objects (one per row); for one object "
                                  "per line use a .jsonl file")
    return data


def _require(module: str, fmt: str, key: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SourceError(key, f"reading {fmt} needs the data extra: {EXTRA}") from None


class ParquetRows(Sequence):
    """A pyarrow table's rows as dicts, converted one at a time."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.table.slice(i, 1).to_pylist()[0]


def _datasets_folder(path: Path, split: str | None, key: str, split_key: str) -> Rows:
    datasets = _require("datasets", "a datasets folder", key)
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise SourceError(key, f"{str(path)!r} is not a folder written by datasets' save_to_disk: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise SourceError(split_key, f"{str(path)!r} has no split {split!r}; it has {', '.join(loaded)}")
        return loaded[split]
    if split is not None:
        raise SourceError(split_key, f"{str(path)!r} holds one dataset, not several splits; remove {split_key}")
    return loaded
