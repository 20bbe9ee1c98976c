"""Token ids of chat text with images: each image placeholder expanded for its image.

The chat template writes one placeholder token per image (`<|image_pad|>` for the Qwen2-VL
families); the model needs as many as the image has tokens after its vision tower merges patches,
which depends on the image's size (`flowrl_operators.vision`). Workflows tokenise pieces of
rendered chat text (a prompt, the continuation after a model turn, the text between spliced
replies in the proxy), so the expansion works on any piece, taking the images in order.
"""

from __future__ import annotations

from typing import Any

from flowrl.data.images import ImageRef
from flowrl_operators.chat.images import ImageContentError


def encode_with_images(tokenizer: Any, text: str, pending: list[ImageRef]) -> list[int]:
    """Tokens of `text`; each image placeholder in it is expanded for the next of `pending`,
    which it consumes. Without pending images the text is encoded as it is (text-only models
    never reach the vision operators)."""
    if not pending:
        return list(tokenizer.encode(text, add_special_tokens=False))
    facts = require_vision(tokenizer)
    pieces = text.split(facts.image_token)
    if len(pieces) - 1 > len(pending):
        raise ImageContentError(f"the chat text holds {len(pieces) - 1} image placeholders for {len(pending)} images")
    expanded = pieces[0]
    for piece in pieces[1:]:
        expanded += facts.image_token * facts.image_tokens(pending.pop(0)) + piece
    return list(tokenizer.encode(expanded, add_special_tokens=False))


def require_vision(tokenizer: Any) -> Any:
    """The vision facts of the checkpoint the tokenizer was loaded from (`flowrl_operators.vision`);
    ImageContentError for a text-only model, before any chat template meets image parts."""
    from flowrl_operators.vision import vision

    try:
        return vision(tokenizer.name_or_path)  # load_tokenizer loads from the checkpoint folder
    except (ValueError, OSError) as e:
        raise ImageContentError(str(e)) from None
