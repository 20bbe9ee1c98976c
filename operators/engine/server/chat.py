"""The engine server's `POST /v1/chat/completions`: OpenAI chat through the tokenizer's chat template.

The request rules (every key honoured or refused with a 400 that names it; messages, images,
tools and tool calls, stop, logprobs) are chat/request.py's, shared with the agent proxy,
so a request reads alike on both. What is this route's own:
- `max_tokens` defaults to 128 and sampling to temperature 1 (SamplingParams' defaults); the proxy
  takes its defaults from the generate node's `sampling` instead.
- `n` choices (at most MAX_COMPLETIONS), choice i sampled with `seed` + i when a seed is given (the proxy records one call
  per request: `n` 1 only).
- Images are put in this process's image store and generated with, as on `/generate` with
  `image_data`: the prompt is the chat template's, each image's placeholder expanded to the
  image's token count (chat/template.py `chat_ids`), and the request carries the `ImageRef`s.
- Nothing is recorded: the answer is for the caller only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from jinja2 import TemplateError

from flowrl.data.images import ImageRef
from flowrl_operators.chat.images import ImageContentError, store_images
from flowrl_operators.chat.request import (
    MAX_COMPLETIONS,
    check_keys,
    check_length,
    check_messages,
    check_rendered,
    choice,
    flag,
    number,
    off_loop,
    sampling,
    stop_ids,
    template_error,
    tools_of,
)
from flowrl_operators.chat.template import EpisodeError, chat_ids
from flowrl_operators.inference import GenerateRequest


def prompt(tokenizer: Any, messages: list[Any], bad_request: type[Exception],
           tools: list[dict] | None = None) -> tuple[list[int], list[ImageRef]]:
    """The prompt's token ids and its images in placeholder order, for messages `check_messages` read."""
    try:
        stored, refs = store_images(messages)
        check_rendered(tokenizer, stored, tools, bad_request)
        return chat_ids(tokenizer, stored, images=refs, tools=tools), refs
    except (ImageContentError, EpisodeError) as e:
        raise bad_request(str(e)) from None
    except TemplateError as e:
        raise template_error(e, bad_request) from None


async def complete(engine: Any, tokenizer: Any, body: dict[str, Any], model_name: str,
                   bad_request: type[Exception]) -> dict[str, Any]:
    """The answer to one chat completions request (module docs); `bad_request` is raised for a 400."""
    check_keys(body, bad_request)
    messages = check_messages(tokenizer, body.get("messages"), bad_request)
    logprobs = flag(body, "logprobs", bad_request)
    n = number(body, "n", 1, bad_request, integer=True, low=1, high=MAX_COMPLETIONS)
    tools, read_calls = tools_of(body, bad_request)
    check_length([messages, tools], tokenizer, getattr(engine, "max_context", None), bad_request)
    ids, images = await off_loop(prompt, tokenizer, messages, bad_request, tools)
    params = sampling(body, stop_ids(body, tokenizer, bad_request), bad_request)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    results = await asyncio.gather(*[engine.generate(GenerateRequest(
        request_id=f"{rid}-{i}", input_ids=ids, images=images,
        sampling=msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + i)))
        for i in range(n)])
    for result in results:
        if result.error:
            raise bad_request(result.error)
    completion = sum(len(result.output_ids) for result in results)
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model") or model_name,
        "choices": [choice(i, result, tokenizer, logprobs, read_calls) for i, result in enumerate(results)],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion},
    }
