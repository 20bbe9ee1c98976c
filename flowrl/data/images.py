"""Images in records, kept by reference.

A vision-language sample carries images in its prompt and, in multi-turn episodes, in the
environment's observations. Records never hold pixels: they hold an `ImageRef` (a content hash and
the size) and the pixels live once in an `ImageStore`, a folder of PNG files named by that hash. A
run's store is `<run_dir>/images/`, so the ledger, checkpoints and `--resume` keep every image a
record names, and a crash never leaves a record pointing at an image that is not on disk (the file
is written, atomically, before its reference is returned).

The hash is over the decoded pixels (mode, size, raw bytes), not over an encoding, so the same
picture sent as PNG, as JPEG-decoded pixels or as a PIL image gets one reference.
Under Ray every node must see the run folder (one machine, or a shared file system, as for
checkpoints).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Union

import msgspec

if TYPE_CHECKING:
    from PIL import Image as PILImage

ImageInput = Union[bytes, str, os.PathLike, "PILImage.Image"]


class ImageRef(msgspec.Struct, frozen=True, array_like=True):
    """One image: the sha256 of its RGB pixels (with the size), and its width and height."""

    sha256: str
    width: int
    height: int


def _as_rgb(image: ImageInput) -> PILImage.Image:
    from PIL import Image

    if isinstance(image, str) and image.startswith("data:"):
        image = decode_data_url(image)
    if isinstance(image, bytes | str | os.PathLike):
        image = open_image(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be bytes, a path, a data URL or a PIL image, not {type(image).__name__}")
    check_pixels(image.width, image.height)  # from the header, before the pixels are decoded
    try:
        return image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ValueError(str(e)) from None
    except OSError as e:  # a header that opens, pixels that do not (a truncated file)
        raise ValueError(f"the image's pixels cannot be decoded: {e}") from None


def open_image(source: bytes | str | os.PathLike) -> PILImage.Image:
    """PIL's lazy open (the header only) of bytes or a path, its size checked (`check_pixels`)
    before any pixel is decoded. ValueError for what is no image or too large (PIL's own bomb
    refusal, past twice its limit, included)."""
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():  # PIL's bomb warning at open: check_pixels refuses with a message
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        except Image.DecompressionBombError as e:
            found = re.search(r"\((\d+) pixels\)", str(e))
            said = f"{int(found.group(1))} pixels" if found else "too many pixels"
            raise TooLarge(f"the image declares {said}, over the limit of {MAX_PIXELS} pixels (6000x6000); "
                             "scale it down") from None
        except UnidentifiedImageError:
            raise ValueError("the data is not an image PIL can read (PNG, JPEG, ...)") from None
    try:
        check_pixels(image.width, image.height)
    except ValueError:
        image.close()  # the lazily opened file, when source was a path
        raise
    return image


# The most pixels an image may have (6000 x 6000; its RGB is 3 bytes a pixel, 108 MB). Checked from
# the file's header before decoding: a 165 KB PNG may declare 12000 x 12000 pixels (432 MB decoded).
# Vision models scale images down to far fewer pixels (Qwen2-VL: 12.8 M at most) anyway.
MAX_PIXELS = 6000 * 6000


class TooLarge(ValueError):
    """An image over MAX_PIXELS (a client's or a dataset's mistake: 413 on a server)."""


def check_pixels(width: int, height: int) -> None:
    """A TooLarge (ValueError) for an image over MAX_PIXELS."""
    if width * height > MAX_PIXELS:
        raise TooLarge(f"the image is {width}x{height} pixels, over the limit of {MAX_PIXELS} pixels "
                         f"(6000x6000); scale it down")


def _digest(image: PILImage.Image) -> str:
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URL (what the OpenAI API sends)."""
    head, sep, body = url.partition(",")
    if not (url.startswith("data:image/") and sep and head.endswith(";base64")):
        raise ValueError("an image URL must be a base64 data URL (data:image/png;base64,...)")
    try:
        return base64.b64decode(body, validate=True)
    except ValueError as e:
        raise ValueError(f"the image data URL is not valid base64: {e}") from None


class ImageStore:
    """A folder of PNG images named by content hash."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, ref: ImageRef) -> Path:
        return self.root / ref.sha256[:2] / f"{ref.sha256}.png"

    def put(self, image: ImageInput) -> ImageRef:
        """Store an image (bytes of any format PIL reads, a path, a data URL or a PIL image)."""
        rgb = _as_rgb(image)
        ref = ImageRef(_digest(rgb), rgb.width, rgb.height)
        target = self.path(ref)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                rgb.save(f, format="PNG")
            os.replace(tmp, target)
        return ref

    def get(self, ref: ImageRef) -> PILImage.Image:
        from PIL import Image

        try:
            with Image.open(self.path(ref)) as image:
                return image.convert("RGB")
        except FileNotFoundError:
            raise FileNotFoundError(f"image {ref.sha256[:12]} is not in the image store {self.root}") from None

    def png(self, ref: ImageRef) -> bytes:
        return self.path(ref).read_bytes()

    def data_url(self, ref: ImageRef) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png(ref)).decode("ascii")


_lock = threading.Lock()
_store: ImageStore | None = None


def default_root() -> Path:
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "images"


def use_store(root: str | os.PathLike) -> ImageStore:
    """Make `root` this process's image store (a stage calls it with `<run_dir>/images`)."""
    global _store
    with _lock:
        _store = ImageStore(root)
        return _store


def store() -> ImageStore:
    """This process's image store: the run's, once a stage set it, else one under the flowrl cache."""
    global _store
    with _lock:
        if _store is None:
            _store = ImageStore(default_root())
        return _store
