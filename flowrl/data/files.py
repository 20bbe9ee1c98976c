"""A dataset file as a data source: `data.source: {file: PATH, ...}` (see flowrl/data/source.py).

Each row becomes one sample: the row's columns as they are, plus the prompt under `prompt` (text)
or `messages` (a chat list of `{role, content}`), taken from the column `prompt:` / `messages:`
name (default: a column called `messages`, else one called `prompt`). The generate node's
workflow turns `messages` into tokens with the tokenizer's chat template and a text `prompt` with
the tokenizer's special tokens; every column reaches the reward as `trajectory.metadata["sample"]`.
Rows of a vision-language dataset also hold images (the column `images:` names, default one called
`images`): see flowrl/data/image_columns.py; the sample carries them as `ImageRef`s under `images`.

Order: sample `(step, index)` is row position `p = step * batch_size + index` of epoch
`p // len(self)`. With `shuffle` (the default) each epoch is its own permutation of the training
rows, drawn from (run seed, epoch); so `sample` is a pure function of (seed, step, index) and a
resumed or re-issued sample is the same row. Held-out rows for `data.eval` come from `eval_file`,
from `eval_split` (a split of a `datasets` folder), or from the file itself (`eval_rows` or
`eval_fraction`: a fixed choice of rows that depends only on the file's length, never drawn for
training whatever the seed).
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from flowrl.data import image_columns
from flowrl.data.readers import ParquetRows, Rows, SourceError, read_rows


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


class _Subset(Sequence):
    def __init__(self, rows: Rows, indices: list[int]) -> None:
        self.rows, self.indices = rows, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        return self.rows[self.indices[i]]


class FileSource:
    """Samples from a jsonl, json, csv or parquet file or a `datasets` folder (module docs)."""

    def __init__(self, seed: int = 0, batch_size: int = 1, *, file: str, format: str | None = None,
                 prompt: str | None = None, messages: str | None = None, split: str | None = None,
                 eval_file: str | None = None, eval_split: str | None = None, eval_rows: int | None = None,
                 eval_fraction: float | None = None, shuffle: bool = True, images: str | None = None,
                 check_images: int | None = None) -> None:
        self.seed, self.batch_size, self.shuffle = seed, batch_size, shuffle
        self.check_images = check_images
        self.file = file
        rows = read_rows(file, format, split)
        if len(rows) == 0:
            raise SourceError("file", f"{file!r} holds no rows")
        self.key, self.column = _prompt_column(rows[0], prompt, messages, "file")
        _check_rows(rows, self.key, self.column, file)
        self.images = image_columns.image_column(rows[0], images)
        # Image paths are relative to the folder of the file holding the row.
        self.base = self.eval_base = Path(file).expanduser().parent
        if eval_file is not None:
            self.eval_base = Path(eval_file).expanduser().parent
        self._check_images(rows, self.base, file)
        held = [k for k, v in (("eval_file", eval_file), ("eval_split", eval_split), ("eval_rows", eval_rows),
                               ("eval_fraction", eval_fraction)) if v is not None]
        if len(held) > 1 and held != ["eval_file", "eval_split"]:
            raise SourceError(held[1], f"give one of eval_file, eval_split, eval_rows, eval_fraction (got {', '.join(held)})")
        self.eval: Rows = []
        if eval_file is not None or eval_split is not None:
            key = "eval_file" if eval_file is not None else "eval_split"
            self.eval = read_rows(eval_file or file, None if eval_file else format, eval_split, key, "eval_split")
            if len(self.eval) == 0:
                raise SourceError(key, "the held-out rows are empty")
            _prompt_column(self.eval[0], self.column if self.key == "prompt" else None,
                           self.column if self.key == "messages" else None, key)
            _check_rows(self.eval, self.key, self.column, eval_file or file, key)
            self._check_images(self.eval, self.eval_base, eval_file or file)
        self.train = rows
        if eval_rows is not None or eval_fraction is not None:
            self.train, self.eval = _hold_out(rows, eval_rows, eval_fraction)
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Training rows (one epoch)."""
        return len(self.train)

    def sample(self, step: int, index: int) -> dict[str, Any]:
        if not 0 <= index < self.batch_size or step < 0:
            raise IndexError(f"sample ({step}, {index}) is outside steps >= 0 and batch size {self.batch_size}")
        epoch, offset = divmod(step * self.batch_size + index, len(self.train))
        return self._sample(self.train[self._order(epoch)[offset] if self.shuffle else offset], self.base)

    def eval_sample(self, index: int) -> dict[str, Any]:
        """Held-out row `index`, in file order."""
        if not self.eval:
            raise SourceError("eval_file", "data.eval needs held-out rows: set data.source.eval_file, eval_split, "
                                           "eval_rows or eval_fraction")
        if not 0 <= index < len(self.eval):
            raise ValueError(f"data.eval.samples asks for held-out sample {index}, but data.source holds "
                             f"{len(self.eval)} held-out rows; lower data.eval.samples")
        return self._sample(self.eval[index], self.eval_base)

    def _order(self, epoch: int) -> list[int]:
        """The permutation of epoch `epoch` (the two latest are kept: samples of two epochs may be in
        flight at once; an older one asked for again, e.g. on re-issue, is drawn again, identically)."""
        if epoch not in self._orders:
            order = list(range(len(self.train)))
            random.Random(_seed("flowrl-file-source", self.seed, epoch)).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1} | {epoch: order}
        return self._orders[epoch]

    def _sample(self, row: dict[str, Any], base: Path) -> dict[str, Any]:
        value = row.get(self.column)
        _check_value(self.key, value, self.column)
        sample = dict(row)
        sample.pop("prompt" if self.key == "messages" else "messages", None)  # the workflow uses the chosen one
        sample[self.key] = value
        if self.images is not None:  # references replace the pixels (or paths) the column held
            cell = sample.pop(self.images)
            sample["images"] = image_columns.store_cell(cell, base, self.images)
            _check_image_count(self.key, value, len(sample["images"]), self.images)
        return sample

    def _check_images(self, rows: Rows, base: Path, file: str) -> None:
        """Every row's images, as every row's prompt (_check_rows): a missing, corrupt or non-image
        file, or a wrong image count, deep in the file is found at load, located, not at its step."""
        if self.images is None:
            _check_no_image_parts(rows, self.key, self.column, file, list(rows[0]))
            return
        for number in _spread(len(rows), self.check_images, file):
            row = rows[number]
            try:
                image_columns.check_cell(row.get(self.images), base, self.images)
                count = len(image_columns.cell_items(row.get(self.images)))
                _check_image_count(self.key, row.get(self.column), count, self.images)
            except SourceError as e:
                raise SourceError(e.key, f"{file}: row {number + 1}: {e.detail}") from None


_SAID: set[tuple[str, int]] = set()  # (file, rows) sampled and said so, once per process


def _spread(n: int, k: int | None, file: str) -> list[int]:
    """Which of `n` rows to check: all, or `k` spread evenly (first and last included), said once."""
    if k is None or k >= n:
        return list(range(n))
    if (file, k) not in _SAID:
        _SAID.add((file, k))
        print(f"flowrl: {file}: the images of {k} of its {n} rows were checked (data.source.check_images); "
              "a bad image in another row stops the run when that row is drawn", file=sys.stderr)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def _prompt_column(row: dict[str, Any], prompt: str | None, messages: str | None, where: str) -> tuple[str, str]:
    """(sample key, column): which column holds the prompt, checked on the first row."""
    columns = ", ".join(map(repr, row)) or "none"
    if prompt is not None and messages is not None:
        raise SourceError("messages", "name either prompt (a text column) or messages (a chat column), not both")
    if messages is not None or prompt is not None:
        key, column = ("messages", messages) if messages is not None else ("prompt", prompt)
        if column not in row:
            raise SourceError(key if where == "file" else where, f"no column {column!r} (columns: {columns})")
    elif "messages" in row:
        key, column = "messages", "messages"
    elif "prompt" in row:
        key, column = "prompt", "prompt"
    else:
        raise SourceError(where if where != "file" else "prompt",
                          f"the rows have no 'messages' or 'prompt' column (columns: {columns}); name the "
                          "prompt's column with prompt: <column> (text) or messages: <column> (chat list)")
    _check_value(key, row[column], column)
    return key, column


def _check_rows(rows: Rows, key: str, column: str, file: str, where: str | None = None) -> None:
    """Every row's prompt, not the first alone: a bad row deep in the file would otherwise stop the
    run when its step comes. A parquet table is read a batch of values at a time, a `datasets`
    folder row by row, so a large file is checked without copying it into Python objects whole."""
    if isinstance(rows, ParquetRows) and (missing := rows.table.column(column).null_count):
        raise SourceError(where or key, f"{file}: column {column!r} has no value in {missing} row(s)")
    for number, value in enumerate(_values(rows, column), 1):
        try:
            _check_value(key, value, column)
        except SourceError as e:
            raise SourceError(where or e.key, f"{file}: row {number}: {e.detail}") from None


def _values(rows: Rows, column: str) -> Iterator[Any]:
    """The column's value in each row, in order."""
    if isinstance(rows, ParquetRows):
        for batch in rows.table.select([column]).to_batches(max_chunksize=1024):
            yield from batch.column(0).to_pylist()
    elif isinstance(rows, list):
        yield from (row.get(column) for row in rows)
    else:
        yield from (rows[i].get(column) for i in range(len(rows)))


# The chat roles chat templates know: the OpenAI API's (flowrl_operators.chat.request), its newer
# `developer`, and Llama 3's `ipython` (a tool's output).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def _check_value(key: str, value: Any, column: str) -> None:
    if key == "prompt" and not isinstance(value, str):
        raise SourceError("prompt", f"column {column!r} must hold text, got {type(value).__name__} {value!r:.60}")
    if key == "prompt" and not value.strip():
        raise SourceError("prompt", f"column {column!r} holds an empty prompt {value!r}; the model would be "
                                    "given nothing to answer: fill it in or remove the row")
    if key == "messages" and not (isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and image_columns.valid_content(m.get("content"))
            for m in value)):
        raise SourceError("messages", f"column {column!r} must hold a non-empty list of {{role, content}} "
                                      "messages (content: text, or a list of {type: text, text} and {type: image} "
                                      f"parts), got {value!r:.80}")
    if key == "messages" and (bad := [m["role"] for m in value if m["role"] not in ROLES]):
        raise SourceError("messages", f"column {column!r} holds a message with the role {bad[0]!r}; a role is one "
                                      f"of {', '.join(ROLES)}")


def _check_image_count(key: str, prompt: Any, count: int, column: str) -> None:
    """Each image needs its place in the prompt: one {type: image} part per image, in order."""
    parts = image_columns.image_parts(prompt) if key == "messages" else 0
    if parts != count:
        raise SourceError("images", f"a row holds {count} image(s) in column {column!r} but its messages have "
                                    f"{parts} {{type: image}} part(s); give one part per image, in order")


def _check_no_image_parts(rows: Rows, key: str, column: str, file: str, columns: list[str]) -> None:
    """Rows without an images column whose messages still hold {type: image} parts: the model would
    get placeholders without pictures. Rows in memory are checked one by one, a parquet file's first."""
    if key != "messages":
        return
    for number, row in enumerate(rows if isinstance(rows, list) else [rows[0]], 1):
        if parts := image_columns.image_parts(row.get(column) or []):
            raise SourceError("images", f"{file}: row {number}: its messages have {parts} {{type: image}} part(s) "
                              f"but the rows have no images column (columns: {', '.join(map(repr, columns))}); "
                              "add an 'images' column, name yours with images: <column>, or remove the parts")


def _hold_out(rows: Rows, count: int | None, fraction: float | None) -> tuple[Rows, Rows]:
    """(train, eval): `count` rows (or `fraction` of them, at least one) held out by a permutation
    that depends only on the number of rows; both keep file order."""
    n = len(rows)
    k = count if count is not None else max(1, round(n * fraction))
    if not 0 < k < n:
        key = "eval_rows" if count is not None else "eval_fraction"
        raise SourceError(key, f"holds out {k} of {n} rows; leave at least one row for training and hold out at least one")
    order = list(range(n))
    random.Random(_seed("flowrl-held-out", n)).shuffle(order)
    return _Subset(rows, sorted(order[k:])), _Subset(rows, sorted(order[:k]))
