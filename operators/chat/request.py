"""OpenAI chat requests as flowrl reads them: the rules shared by the engine server's
`POST /v1/chat/completions` (operators/engine/server/chat.py) and the agent proxy (workflows/proxy.py),
so one request is read alike on both. Where the routes differ, their modules say so (the proxy:
`n` 1 only, sampling defaults from the generate node, each call recorded, replies spliced back).

Every request key is honoured or refused with a 400 that names it; none is ignored.
- Honoured: `messages`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`
  (<= 0: off), `n`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `logprobs`, `tools`,
  `tool_choice` ("auto" or "none").
- Accepted as metadata (nothing to do for flowrl's engines): `model` (echoed back), `user`,
  `metadata`, `store`, `service_tier`, `prompt_cache_key`, `safety_identifier`.
- Accepted only at the value that changes nothing (`NEUTRAL`), a 400 otherwise: `stream` false,
  `stream_options` absent, `top_logprobs` 0 (the engine returns the sampled token's logprob
  only), `frequency_penalty` / `presence_penalty` 0 and `repetition_penalty` 1 (no penalties),
  `min_p` 0, `logit_bias` empty, `response_format` {"type": "text"} (no constrained decoding),
  `modalities` ["text"], `parallel_tool_calls` true (flowrl cannot hold the model to one call).
- Any other key is a 400 (e.g. `functions` / `function_call`: send `tools`; `tool_choice`
  "required" or a named function: flowrl cannot force a call). A null value is an absent key.

- `messages`: each an object with `role` system, user, assistant or tool (anything else is a 400
  naming `messages[i].role`, before a template could drop it). Content is a string or a list of
  OpenAI parts, `{"type": "text", "text"}` and `{"type": "image_url", "image_url": {"url":
  "data:image/png;base64,..."}}`; the images go to this process's image store and each one's
  placeholder is expanded to its token count. A 400: an image for a text-only model, an image URL
  that is not a data URL (flowrl fetches nothing), or any other part type (also flowrl's own
  `{"type": "image"}`, which may name a file on this host). An assistant message's `tool_calls`
  (`[{type: function, function: {name, arguments}}]`, content may be null) and `tool` messages go
  to the chat template as they are.
- `tools` (`[{type: function, function: {name, description, parameters}}]`) go to the chat
  template. A template that renders the same text without the request's `tools`, or without a
  message's `tool_calls`, would ignore them: that is a 400. With `tool_choice` "auto" (or absent),
  each answer is read for `<tool_call>{"name", "arguments"}</tool_call>` blocks
  (workflows/tool_calls.py): when it holds some, the message has `tool_calls`, its `content` is
  the text outside them (null if none: a client that sends the message back must not have the
  calls rendered twice, once in content and once from `tool_calls`) and `finish_reason` is
  "tool_calls" ("length" if generation was cut after them). With "none", the tools are rendered as
  with "auto" (the model sees the same prompt) and the answer is returned as text, never read.
- `stop`: a string or a list of strings and/or token ids (vLLM's `stop_token_ids` is read too).
  Generation stops at any of them, or at the model's end-of-sequence tokens; as in OpenAI, the
  stop token is not part of the returned content and `finish_reason` is "stop". A stop string
  must be exactly one token (flowrl's engines stop on tokens).
- `logprobs: true`: each choice gets OpenAI's `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": []}]}`, one entry per token of the returned content.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import msgspec
from jinja2 import TemplateError

from flowrl_operators.chat.images import ImageContentError, data_url
from flowrl_operators.chat.template import chat_text
from flowrl_operators.chat.tool_calls import split_tool_calls
from flowrl_operators.chat.vision_prompt import require_vision
from flowrl_operators.inference import GenerateResult, SamplingParams
from flowrl_operators.threads import DaemonExecutor, call_in_thread

ROLES = ("system", "user", "assistant", "tool")
# The most completions one request may ask for: a chat request's `n`, a /generate batch's prompts.
MAX_COMPLETIONS = 256
READ = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed",
        "stop", "stop_token_ids", "ignore_eos", "logprobs", "tools", "tool_choice"}
METADATA = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
# key -> (the values that change nothing, why any other value cannot be honoured)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((False,), "flowrl's chat routes do not stream; call without stream"),
    "stream_options": ((), "flowrl's chat routes do not stream"),
    "top_logprobs": ((0,), "the engine returns the sampled token's logprob only (logprobs: true)"),
    "frequency_penalty": ((0,), "the engine applies no penalties"),
    "presence_penalty": ((0,), "the engine applies no penalties"),
    "repetition_penalty": ((1,), "the engine applies no penalties"),
    "min_p": ((0,), "the engine samples with temperature, top_k and top_p only"),
    "logit_bias": (({},), "the engine has no logit bias"),
    "response_format": (({"type": "text"},), "the engine has no constrained decoding (JSON mode, schemas)"),
    "modalities": ((["text"],), "the engine answers in text only"),
    "parallel_tool_calls": ((True,), "flowrl cannot hold the model to one tool call"),
}
_TOOL_SHAPE = "{type: function, function: {name, description, parameters}}"
# Integer bounds of sampling keys: a value past them could not be recorded (msgspec encodes 64 bits).
INT32, INT64 = 2**31 - 1, 2**63
MAX_STOPS = 64  # stop strings and token ids of one request


def check_keys(body: dict[str, Any], bad_request: type[Exception]) -> None:
    """A 400 for a key the route does not read, or a `NEUTRAL` key at a value it cannot honour."""
    unknown = sorted(k for k, v in body.items() if v is not None and k not in READ | METADATA | set(NEUTRAL))
    if unknown:
        hint = "; send tools instead of functions / function_call" if {"functions", "function_call"} & set(unknown) else ""
        raise bad_request(f"unsupported request keys {unknown}: flowrl's chat routes do not implement them{hint}; "
                          f"accepted: {sorted(READ | METADATA | set(NEUTRAL))} (see operators/chat/request.py)")
    for key, (neutral, why) in NEUTRAL.items():
        value = body.get(key)
        if value is not None and not any(_same(value, n) for n in neutral):
            raise bad_request(f"{key} is not supported: {why} (got {key}={value!r})")


def _is_number(value: Any) -> bool:
    """A JSON number that is finite (NaN would pass every range check: NaN < low is false)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same number, but true is not 1."""
    if _is_number(neutral):
        return _is_number(value) and value == neutral
    return type(value) is type(neutral) and value == neutral


def number(body: dict[str, Any], key: str, default: Any, bad_request: type[Exception], integer: bool = False,
          low: float | None = None, high: float | None = None) -> Any:
    """`body[key]` (`default` when absent or null): a number (an integer if `integer`) in [low, high]."""
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value) or integer and not isinstance(value, int) or \
            low is not None and value < low or high is not None and value > high:
        bounds = f" in [{low}, {high}]" if low is not None and high is not None else \
            f" >= {low}" if low is not None else ""
        raise bad_request(f"{key} must be {'an integer' if integer else 'a number'}{bounds}, got {value!r}")
    return value


def flag(body: dict[str, Any], key: str, bad_request: type[Exception]) -> bool:
    """`body[key]`: true or false (false when absent or null)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false, got {value!r}")
    return bool(value)


def sampling(body: dict[str, Any], stops: list[int], bad_request: type[Exception],
             base: SamplingParams | None = None) -> SamplingParams:
    """The request's sampling parameters (module docs: honoured keys), each checked. A key the request
    leaves out keeps `base`'s value (SamplingParams' defaults: 128 new tokens, temperature 1); `stops`
    are added to `base`'s stop tokens."""
    base = base or SamplingParams()
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return msgspec.structs.replace(
        base,
        temperature=float(number(body, "temperature", base.temperature, bad_request, low=0)),
        top_p=float(number(body, "top_p", base.top_p, bad_request, low=0, high=1)),
        top_k=number(body, "top_k", base.top_k, bad_request, integer=True, low=-INT32, high=INT32),
        max_new_tokens=number(body, limit, base.max_new_tokens, bad_request, integer=True, low=1, high=INT32),
        seed=number(body, "seed", base.seed, bad_request, integer=True, low=-INT64, high=INT64 - 1),
        stop_token_ids=list(dict.fromkeys([*base.stop_token_ids, *stops])),
        ignore_eos=base.ignore_eos if body.get("ignore_eos") is None else flag(body, "ignore_eos", bad_request),
    )


def stop_ids(body: dict[str, Any], tokenizer: Any, bad_request: type[Exception]) -> list[int]:
    """The request's `stop` (strings of one token, or token ids) and `stop_token_ids`, as ids."""
    stop = body.get("stop")
    items = [] if stop is None else [stop] if isinstance(stop, str | int) else stop
    if not isinstance(items, list):
        raise bad_request(f"stop must be a string or a list of strings / token ids, got {stop!r}")
    extra = body.get("stop_token_ids") or []
    if not isinstance(extra, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in extra):
        raise bad_request(f"stop_token_ids must be a list of token ids, got {extra!r}")
    if len(items) + len(extra) > MAX_STOPS:
        raise bad_request(f"stop and stop_token_ids hold {len(items) + len(extra)} entries; at most {MAX_STOPS}")
    ids = list(extra)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise bad_request(f"stop entries are strings or token ids, got {item!r}")
        if isinstance(item, int):
            ids.append(item)
            continue
        one = "flowrl's engines stop on single tokens: give strings of one token (e.g. '<|im_end|>') or token ids"
        if len(item) > longest_token(tokenizer):  # refused without tokenising it
            raise bad_request(f"stop string {item!r:.60} is longer than any one token; {one}")
        encoded = tokenizer.encode(item, add_special_tokens=False)
        if len(encoded) != 1:
            raise bad_request(f"stop string {item!r} is {len(encoded)} tokens; {one}")
        ids.append(encoded[0])
    return ids


def tools_of(body: dict[str, Any], bad_request: type[Exception]) -> tuple[list[dict] | None, bool]:
    """The request's tools for the chat template (None for none), and whether answers are read for calls."""
    tools, choice_ = body.get("tools"), body.get("tool_choice")
    if choice_ is not None and choice_ not in ("auto", "none"):
        raise bad_request(f"tool_choice {choice_!r} is not supported: flowrl cannot force a tool "
                          "call (no constrained decoding); use 'auto' or 'none'")
    if not tools:
        return None, False
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of {_TOOL_SHAPE}, got {tools!r}")
    for t, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{t}] must be {_TOOL_SHAPE}, got {tool!r}")
    return tools, choice_ != "none"


def check_message(m: int, message: Any, bad_request: type[Exception]) -> bool:
    """A 400 for a message the template cannot be given; True when it has image parts."""
    if not isinstance(message, dict):
        raise bad_request(f"messages[{m}] must be an object {{role, content}}, got {message!r}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"messages[{m}].role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise bad_request(f"messages[{m}].content must be a string or a list of parts, got {content!r}")
    images = False
    for p, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image_url"):  # {type: image} may name a path: not from a client
            raise bad_request(f"messages[{m}].content[{p}]: part type {kind!r} is not read; use "
                              "{type: text} or {type: image_url, image_url: {url: data:...}}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{m}].content[{p}].text must be a string, got {part.get('text')!r:.80}")
        if kind == "image_url":  # a remote URL is refused whatever the model, before any is stored
            try:
                data_url(part)
            except ImageContentError as e:
                raise bad_request(f"messages[{m}].content[{p}]: {e}") from None
            images = True
    calls = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise bad_request(f"messages[{m}].tool_calls: only an assistant message has tool_calls, a list of "
                          "{type: function, function: {name, arguments}}")
    for c, call in enumerate(calls or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str | dict) or call.get("type", "function") != "function":
            raise bad_request(f"messages[{m}].tool_calls[{c}] must be {{type: function, function: {{name, "
                              f"arguments}}}}, got {call!r}")
    return images


def check_messages(tokenizer: Any, messages: Any, bad_request: type[Exception]) -> list[dict]:
    """`messages` (module docs) checked one by one; a 400 for images sent to a text-only model, before
    anything is stored and before a text template meets image parts."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content}")
    images = False
    for m, message in enumerate(messages):
        images = check_message(m, message, bad_request) or images
    if images:
        try:
            require_vision(tokenizer)
        except ImageContentError as e:
            raise bad_request(f"this model takes no images: {e}") from None
    return messages


def check_length(parts: Any, tokenizer: Any, max_context: int | None, bad_request: type[Exception]) -> None:
    """A 400, before any template renders or tokeniser runs, for text that cannot fit `max_context`
    tokens: more characters than `max_context` times the tokeniser's longest token. A token of n
    characters covers at most n characters of text (byte-level BPE: n bytes), so such a prompt is
    certainly too long, and tokenising megabytes to find out costs seconds. `parts`: the messages
    and tools (every string in them counts, except image data), or a list of prompt texts."""
    if not max_context:
        return
    limit = max_context * longest_token(tokenizer)
    chars = text_chars(parts, limit)
    if chars > limit:
        raise bad_request(f"the prompt's text is over {limit} characters, more than a context of {max_context} "
                          f"tokens can hold ({longest_token(tokenizer)} characters at most per token); shorten it")


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` spells (special tokens included)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def text_chars(value: Any, stop: int) -> int:
    """Characters of the strings in `value` (JSON: dicts, lists, strings), counting until past `stop`;
    image_url parts are not text. Iterative: a client's nesting depth is not this process's stack."""
    total, pending = 0, [value]
    while pending and total <= stop:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            if item.get("type") != "image_url":
                pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total


_TOKENISER = DaemonExecutor(1, "flowrl-tokenize")


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` (templates, tokenising, decoding images) off the event loop, so that a large request
    does not stall the others: on one daemon thread, since a tokeniser is not safe to share across
    threads (requests queue behind each other there, as they would on the loop)."""
    return await call_in_thread(_TOKENISER, fn, *args)


def template_error(e: TemplateError, bad_request: type[Exception]) -> Exception:
    """The 400 for the template's own raise_exception (e.g. a role order it refuses)."""
    return bad_request(f"the chat template cannot render these messages: {e}")


def check_rendered(tokenizer: Any, messages: list[dict], tools: list[dict] | None,
                    bad_request: type[Exception]) -> None:
    """A 400 where the chat template renders the same text without the request's tools or without a
    message's tool_calls: the model would answer as if they had not been sent."""
    calls = [m for m, message in enumerate(messages) if message.get("tool_calls")]
    if not tools and not calls:  # nothing to check: no extra rendering for plain chat
        return
    full = chat_text(tokenizer, messages, tools=tools)
    if tools and chat_text(tokenizer, messages) == full:
        raise bad_request("tools: this model's chat template does not render tools, so the model would never "
                          "see them; use a model whose template takes tools, or send none")
    bare = [{k: v for k, v in message.items() if k != "tool_calls"} for message in messages]
    if calls and chat_text(tokenizer, bare, tools=tools) == full:  # one render for all: templates treat calls alike
        raise bad_request(f"messages[{calls[0]}].tool_calls: this model's chat template does not render tool "
                          "calls; send the call as the message's content instead")


def choice(index: int, result: GenerateResult, tokenizer: Any, logprobs: bool,
           read_calls: bool = False) -> dict[str, Any]:
    """One OpenAI choice; with `read_calls`, tool-call blocks in the answer become `tool_calls`."""
    ids, lps = list(result.output_ids), list(result.logprobs)
    if result.finish_reason == "stop" and ids:  # the stop token (an end token or a requested stop)
        ids, lps = ids[:-1], lps[:-1]
    content = tokenizer.decode(ids, skip_special_tokens=True)
    finish = "stop" if result.finish_reason == "stop" else "length"
    message: dict[str, Any] = {"role": "assistant", "content": content}
    text, calls = split_tool_calls(content) if read_calls else (content, [])
    if calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": calls}
        finish = "tool_calls" if finish == "stop" else finish
    entries = None
    if logprobs:
        entries = {"content": [
            {"token": (token := tokenizer.decode([t], skip_special_tokens=False)), "logprob": lp,
             "bytes": list(token.encode("utf-8")), "top_logprobs": []} for t, lp in zip(ids, lps, strict=True)]}
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": entries}


