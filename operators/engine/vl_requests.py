"""Requests with images in the embedded engine: the checks before admission, and the key under which
prefill shares KV between requests (flowrl_operators.engine.prefill).

A prompt's KV depends on its images as well as its tokens, and two requests with equal token ids
(the same number of placeholder tokens) may hold different images. Prefill therefore compares
`prefix_key`s, not token ids: the tokens with every image placeholder of the prompt replaced by a
negative number derived from the hashes of all the request's images. Text before the first image
is shared between any requests; the rest only between requests with the same images.
"""

from __future__ import annotations

import hashlib
from typing import Any

from flowrl_operators.engine.base import GenerateRequest


def check_images(model: Any, request: GenerateRequest) -> str | None:
    """Why the request's images cannot run on this model, or None."""
    vision = getattr(model, "vision", None)
    if not request.images and vision is None:
        return None
    if vision is None:
        return (f"the request has {len(request.images)} images but the model is text-only (model_type "
                f"{getattr(model.config, 'model_type', '?')!r}); images need a vision-language model such "
                "as builtin:tiny-qwen2-vl")
    runs = len(vision.image_runs(request.input_ids))
    if runs != len(request.images):
        return (f"the prompt has placeholders for {runs} images, {len(request.images)} were given; build "
                "prompts with flowrl_operators.vision.vision(model).prompt(messages, images)")
    try:
        vision.spans(request.input_ids, request.images)
    except ValueError as exc:
        return f"images do not match the prompt's placeholders: {exc}"
    from flowrl.data.images import store

    missing = [ref for ref in request.images if not store().path(ref).is_file()]
    if missing:
        return (f"image {missing[0].sha256[:12]} is not in the image store {store().root}; put images with "
                "flowrl.data.images.store().put(...) before sending their references")
    return None


def prefix_key(request: GenerateRequest, tokens: list[int], image_token_id: int | None) -> list[int]:
    """`tokens` (the request's prompt and output so far) with the prompt's image placeholders marked
    by its images (see the module docs); the tokens themselves for a request without images."""
    if not request.images or image_token_id is None:
        return tokens
    digest = hashlib.sha256("".join(ref.sha256 for ref in request.images).encode()).hexdigest()
    mark = -1 - int(digest[:15], 16)
    prompt = len(request.input_ids)
    return [mark if i < prompt and t == image_token_id else t for i, t in enumerate(tokens)]
