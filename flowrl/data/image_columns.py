"""Images in dataset rows: the column `images:` names (default: a column called `images`).

A row's cell is one image or a list of them, each
- a path, relative to the folder of the file that holds the row (or absolute);
- bytes of any format PIL reads (a parquet binary column);
- a `{"bytes": ..., "path": ...}` dict, as the `datasets` library's `Image` feature stores images;
- a base64 `data:image/...` URL.
Remote URLs are refused: a run reads no network.

The chat messages hold one `{"type": "image"}` part for each image, in order (the convention of
Hugging Face processors); a message's content is text or a list of `{"type": "text", "text": ...}`
and `{"type": "image"}` parts. When a row becomes a sample its images are stored in the run's
image store (`flowrl.data.images`) and the sample carries their `ImageRef`s under `images`, never
the pixels; storing is idempotent (content hashed), so a re-issued or resumed sample is the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl.data import images
from flowrl.data.images import ImageRef
from flowrl.data.readers import SourceError

_PART_TYPES = ("text", "image")


def cell_items(value: Any) -> list[Any]:
    """A cell as a list of image items (None: no images)."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _resolve(item: Any, base: Path, column: str) -> Any:
    """What `ImageStore.put` takes: bytes, a path or a data URL."""
    if isinstance(item, dict):  # the datasets Image feature: bytes, else a path
        item = item.get("bytes") or item.get("path")
    if isinstance(item, bytearray | memoryview):
        item = bytes(item)
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        if item.startswith("data:"):
            return item
        if item.startswith(("http://", "https://")):
            raise SourceError("images", f"column {column!r} holds a remote URL {item[:60]!r}; flowrl reads no "
                                        "network: download the images and give their paths")
        path = Path(item).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise SourceError("images", f"column {column!r}: no image file {str(path)!r} (paths are read "
                                        f"relative to the dataset file's folder, {str(base)!r})")
        return path
    raise SourceError("images", f"column {column!r} must hold image paths, bytes or data URLs, got "
                                f"{type(item).__name__}")


def check_cell(value: Any, base: Path, column: str) -> None:
    """Fail early (at load, not mid-run) when a cell cannot be read as images: each one opened as
    the run would store it, its header's size checked (images.MAX_PIXELS) and its data verified,
    without decoding its pixels."""
    for item in cell_items(value):
        resolved = _resolve(item, base, column)
        try:
            if isinstance(resolved, str):  # a data URL: its base64, then what it holds
                resolved = images.decode_data_url(resolved)
            with images.open_image(resolved) as image:
                image.verify()
        except images.TooLarge as e:
            raise SourceError("images", f"column {column!r} holds an image too large: {e}") from None
        except (ValueError, OSError, SyntaxError) as e:  # PIL's verify raises SyntaxError on a broken PNG
            raise SourceError("images", f"column {column!r} holds something PIL cannot read as an image: {e}") from None


def store_cell(value: Any, base: Path, column: str) -> list[ImageRef]:
    """The cell's images, stored in this process's image store, as references."""
    store = images.store()
    return [store.put(_resolve(item, base, column)) for item in cell_items(value)]


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many `{"type": "image"}` parts the messages hold."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def valid_content(content: Any) -> bool:
    """Text, or a list of text and image parts."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in _PART_TYPES
        and (p["type"] != "text" or isinstance(p.get("text"), str)) for p in content)


def image_column(row: dict[str, Any], name: str | None) -> str | None:
    """Which column holds the images: the one named, else a column called `images`, else none."""
    if name is not None:
        if name not in row:
            columns = ", ".join(map(repr, row)) or "none"
            raise SourceError("images", f"no column {name!r} (columns: {columns})")
        return name
    return "images" if "images" in row else None
