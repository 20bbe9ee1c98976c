"""Images on SGLang's `/generate`: the `image_data` field, both ways.

SGLang's `GenerateReqInput.image_data` (0.5.x) holds, for one request, a list of images (or one
image), each a file name, a URL or base64 data, in the order of the image placeholders in the
prompt; for a batch of prompts, one such list per prompt. The placeholders themselves are in
`input_ids`, already expanded to the image's token count (SGLang's Qwen2-VL processor matches a
`<|vision_start|>` run of `<|image_pad|>` tokens `<|vision_end|>` in the ids it is given).

The adapter (`image_data`) sends each image as a PNG data URL read from the run's image store; the
server (`request_images`) stores what it receives in its process's store and hands the engine
`ImageRef`s. Only inline data is accepted: a server on loopback reads no URLs and no files a client
names.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from flowrl.data import images
from flowrl.data.images import ImageRef


def image_data(refs: list[ImageRef]) -> dict[str, Any]:
    """The `/generate` body fields for a request's images (none: no field, a text-only request)."""
    if not refs:
        return {}
    store = images.store()
    return {"image_data": [store.data_url(ref) for ref in refs]}


def _one(item: Any, where: str) -> ImageRef:
    if not isinstance(item, str):
        raise ValueError(f"{where} must be a base64 data URL string, got {type(item).__name__}")
    if not item.startswith("data:"):  # SGLang also takes bare base64 (a URL or file name is not)
        try:
            base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: this server reads images inline only (a data:image/png;base64,... URL "
                             f"or base64), not URLs or file names ({item[:60]!r})") from None
        item = "data:image/png;base64," + item
    try:
        return images.store().put(item)
    except (ValueError, OSError) as e:
        raise ValueError(f"{where} is not an image: {e}") from None


def request_images(raw: Any, prompts: int, batched: bool) -> list[list[ImageRef]]:
    """`image_data` of a `/generate` body as one list of `ImageRef`s per prompt."""
    if raw is None or raw == []:
        return [[] for _ in range(prompts)]
    if not batched:
        items = raw if isinstance(raw, list) else [raw]
        return [[_one(item, f"image_data[{i}]") for i, item in enumerate(items)]]
    if not isinstance(raw, list) or len(raw) != prompts:
        raise ValueError(f"image_data of a batch must be a list with one entry per prompt ({prompts})")
    out = []
    for p, entry in enumerate(raw):
        items = [] if entry is None else entry if isinstance(entry, list) else [entry]
        out.append([_one(item, f"image_data[{p}][{i}]") for i, item in enumerate(items)])
    return out
