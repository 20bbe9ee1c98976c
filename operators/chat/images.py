"""Images in chat messages: where they come from, and what the chat template sees instead.

A message's content is text or a list of parts. Image parts take three shapes:
- `{"type": "image", "image": X}`: X a PIL image, bytes, a path, a base64 data URL or an `ImageRef`
  (an environment's observation; a sample built in Python);
- `{"type": "image"}`: the next of the sample's `images` (`ImageRef`s, in order: a dataset row,
  flowrl/data/image_columns.py);
- `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`: the OpenAI API's
  shape (the proxy). Only data URLs: flowrl fetches nothing from the network.

`store_images` puts every image in the run's image store and returns the messages with each image
part as a bare `{"type": "image"}` (what Hugging Face vision chat templates render as the image's
placeholder) and the `ImageRef`s in order. Content without images becomes plain text, so text-only
chat templates render lists of text parts too.
"""

from __future__ import annotations

from typing import Any

from flowrl.data import images
from flowrl.data.images import ImageRef


class ImageContentError(ValueError):
    """Message content that cannot be read (a remote image URL, an unknown part type)."""


def as_ref(value: Any) -> ImageRef | None:
    """An `ImageRef`, also after a JSON round trip (it travels as `[sha256, width, height]`)."""
    if isinstance(value, ImageRef):
        return value
    if isinstance(value, list | tuple) and len(value) == 3 and isinstance(value[0], str) and len(value[0]) == 64:
        return ImageRef(value[0], int(value[1]), int(value[2]))
    return None


def data_url(part: dict[str, Any]) -> str:
    """An image_url part's URL; an ImageContentError unless it is a data URL (flowrl fetches nothing)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise ImageContentError("an image_url part needs image_url.url")
    if not url.startswith("data:"):
        raise ImageContentError(f"image URL {url[:60]!r} is not a data URL: flowrl fetches no remote images; "
                                "send the image inline as data:image/png;base64,...")
    return url


def _stored(part: dict[str, Any], given: list[ImageRef], used: int) -> ImageRef:
    kind = part.get("type")
    if kind == "image_url":
        try:
            return images.store().put(data_url(part))
        except (ValueError, OSError) as e:
            raise ImageContentError(f"cannot read the image: {e}") from None
    value = part.get("image")
    if value is None:
        if used >= len(given):
            raise ImageContentError(f"the messages have more {{type: image}} parts than the sample's {len(given)} "
                                    "images")
        return given[used]
    ref = as_ref(value)
    if ref is not None:
        return ref
    try:
        return images.store().put(value)
    except (TypeError, ValueError, OSError) as e:
        raise ImageContentError(f"cannot read the image: {e}") from None


def store_images(messages: list[dict[str, Any]], given: list[Any] | None = None
                 ) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """(messages for the chat template, the images in order); see the module docs."""
    refs = [as_ref(g) for g in given or []]
    if any(r is None for r in refs):
        raise ImageContentError("a sample's images must be ImageRefs (flowrl.data.images)")
    out: list[dict[str, Any]] = []
    found: list[ImageRef] = []
    used = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image", "image_url"):
                found.append(_stored(part, refs, used))
                used += part.get("image") is None and kind == "image"
                parts.append({"type": "image"})
            else:
                raise ImageContentError(f"unknown content part {kind!r}: use text, image or image_url parts")
        if all(p["type"] == "text" for p in parts):
            out.append({**message, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({**message, "content": parts})
    if used < len(refs):
        raise ImageContentError(f"the sample has {len(refs)} images but its messages only {used} {{type: image}} parts")
    return out, found


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message has an image part (any of the three shapes)."""
    return any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])
