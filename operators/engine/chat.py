"""The engine server's `POST /v1/chat/completions`: OpenAI chat through the tokenizer's chat template.

Honoured request keys: `messages`, `temperature`, `top_p`, `max_tokens` / `max_completion_tokens`
(default 128), `n`, `seed`, `stop` and `logprobs`. Refused with a 400, never ignored: `stream`,
`top_logprobs` above 0 (the engine returns the sampled token's logprob only), a `stop` string
that is not exactly one token, and content parts it cannot read (below).

- `messages`: a message's content is a string or a list of OpenAI parts, `{"type": "text", "text"}`
  and `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`. Images are put in
  this process's image store and generated with, as on `/generate` with `image_data` and in the
  agent proxy: the prompt is the chat template's, each image's placeholder expanded to the image's
  token count (workflows/base.py `chat_ids`), and the request carries the `ImageRef`s. A 400: an
  image for a text-only model, an image URL that is not a data URL (the server fetches nothing), or
  any other part type (also flowrl's own `{"type": "image"}`, which may name a file on this host).
- `stop`: a string or a list of strings and/or token ids (vLLM's `stop_token_ids` is read too).
  Generation stops at any of them, or at the model's end-of-sequence tokens; as in OpenAI, the
  stop token is not part of the returned content and `finish_reason` is "stop".
- `logprobs: true`: each choice gets OpenAI's `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": []}]}`, one entry per token of the returned content.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec

from flowrl.data.images import ImageRef
from flowrl_operators.engine.base import GenerateRequest, GenerateResult, SamplingParams
from flowrl_operators.workflows.base import EpisodeError, chat_ids
from flowrl_operators.workflows.vision_messages import ImageContentError, store_images
from flowrl_operators.workflows.vision_prompt import require_vision


def stop_ids(body: dict[str, Any], tokenizer: Any, bad_request: type[Exception]) -> list[int]:
    """The request's `stop` (strings of one token, or token ids) and `stop_token_ids`, as ids."""
    stop = body.get("stop")
    items = [] if stop is None else [stop] if isinstance(stop, str | int) else stop
    if not isinstance(items, list):
        raise bad_request(f"stop must be a string or a list of strings / token ids, got {stop!r}")
    ids = list(body.get("stop_token_ids") or [])
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise bad_request(f"stop entries are strings or token ids, got {item!r}")
        if isinstance(item, int):
            ids.append(item)
            continue
        encoded = tokenizer.encode(item, add_special_tokens=False)
        if len(encoded) != 1:
            raise bad_request(f"stop string {item!r} is {len(encoded)} tokens; the embedded engine stops on "
                              "single tokens: give strings of one token (e.g. '<|im_end|>') or token ids")
        ids.append(encoded[0])
    return ids


def prompt(tokenizer: Any, messages: list[Any], bad_request: type[Exception]) -> tuple[list[int], list[ImageRef]]:
    """The prompt's token ids and its images in placeholder order (module docs: `messages`)."""
    images = False
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{m}] must be an object {{role, content}}, got {message!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(f"messages[{m}].content must be a string or a list of parts, got {content!r}")
        for p, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image_url"):  # {type: image} may name a path: not from a client
                raise bad_request(f"messages[{m}].content[{p}]: part type {kind!r} is not read; use "
                                  "{type: text} or {type: image_url, image_url: {url: data:...}}")
            images = images or kind == "image_url"
    if images:  # before anything is stored, and before a text template meets image parts
        try:
            require_vision(tokenizer)
        except ImageContentError as e:
            raise bad_request(f"this model takes no images: {e}") from None
    try:
        stored, refs = store_images(messages)
        return chat_ids(tokenizer, stored, images=refs), refs
    except (ImageContentError, EpisodeError) as e:
        raise bad_request(str(e)) from None


def sampling(body: dict[str, Any], stops: list[int]) -> SamplingParams:
    return SamplingParams(
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        max_new_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 128),
        seed=body.get("seed"),
        stop_token_ids=stops,
    )


def choice(index: int, result: GenerateResult, tokenizer: Any, logprobs: bool) -> dict[str, Any]:
    ids, lps = list(result.output_ids), list(result.logprobs)
    if result.finish_reason == "stop" and ids:  # the stop token (an end token or a requested stop)
        ids, lps = ids[:-1], lps[:-1]
    content = tokenizer.decode(ids, skip_special_tokens=True)
    entries = None
    if logprobs:
        entries = {"content": [
            {"token": (text := tokenizer.decode([t], skip_special_tokens=False)), "logprob": lp,
             "bytes": list(text.encode("utf-8")), "top_logprobs": []} for t, lp in zip(ids, lps, strict=True)]}
    return {"index": index, "message": {"role": "assistant", "content": content},
            "finish_reason": "stop" if result.finish_reason == "stop" else "length", "logprobs": entries}


async def complete(engine: Any, tokenizer: Any, body: dict[str, Any], model_name: str,
                   bad_request: type[Exception]) -> dict[str, Any]:
    """The answer to one chat completions request (module docs); `bad_request` is raised for a 400."""
    if body.get("stream"):
        raise bad_request("stream=true is not supported by the embedded engine")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content}")
    if body.get("top_logprobs"):
        raise bad_request("top_logprobs is not supported: the engine returns the sampled token's logprob "
                          "only (logprobs: true)")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {logprobs!r}")
    ids, images = prompt(tokenizer, messages, bad_request)
    params = sampling(body, stop_ids(body, tokenizer, bad_request))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    results = await asyncio.gather(*[engine.generate(GenerateRequest(
        request_id=f"{rid}-{i}", input_ids=ids, images=images,
        sampling=msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + i)))
        for i in range(int(body.get("n", 1)))])
    for result in results:
        if result.error:
            raise bad_request(result.error)
    completion = sum(len(result.output_ids) for result in results)
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", model_name),
        "choices": [choice(i, result, tokenizer, logprobs) for i, result in enumerate(results)],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion},
    }
