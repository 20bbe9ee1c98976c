"""Token ids of chat text with images: each image placeholder expanded for its image.

(Filled in against the vision operators once they land.)
"""

from __future__ import annotations

from typing import Any

from flowrl.data.images import ImageRef


def encode_with_images(tokenizer: Any, text: str, pending: list[ImageRef]) -> list[int]:
    """Tokens of `text`; each image placeholder in it is expanded for the next of `pending`,
    which it consumes."""
    return list(tokenizer.encode(text, add_special_tokens=False))
