"""Requests with images in the embedded engine: the checks before admission, and the key under which
prefill shares KV between requests (flowrl_operators.engine.embedded.prefill).

A prompt's KV depends on its images as well as its tokens, and two requests with equal token ids
(the same number of placeholder tokens) may hold different images. Prefill therefore compares
`prefix_key`s, not token ids: the tokens with each image's placeholders replaced by a negative
number derived from that image's hash. The KV at a position depends on the tokens and images up
to it, so two requests share exactly the prefix up to their first difference in either: a
multi-turn episode's first image is shared by a group whose later observations differ.
"""

from __future__ import annotations

from typing import Any

from flowrl_operators.inference import GenerateRequest


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


def prefix_key(request: GenerateRequest, tokens: list[int], vision: Any) -> list[int]:
    """`tokens` (the request's prompt and output so far) with each image's placeholders in the prompt
    marked by the image (see the module docs); the tokens themselves for a request without images.
    `vision`: the model's operators/vision.py `Vision` (None for a text model)."""
    if not request.images or vision is None:
        return tokens
    key = list(tokens)
    for ref, (start, end) in zip(request.images, vision.image_runs(request.input_ids), strict=False):
        key[start:end] = [-1 - int(ref.sha256[:15], 16)] * (end - start)
    return key
