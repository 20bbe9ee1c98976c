"""The chat template on token ids: what the engine server's chat route, the agent proxy and the
workflows all tokenise a conversation with, images placed (`images`, `vision_prompt`)."""

from __future__ import annotations

from typing import Any

from flowrl.data.images import ImageRef
from flowrl_operators.chat.images import ImageContentError
from flowrl_operators.chat.vision_prompt import encode_with_images, require_vision


class EpisodeError(RuntimeError):
    """An episode that cannot produce a trajectory (engine rejection, environment failure)."""



def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
             tools: list[dict] | None = None, images: list[ImageRef] | None = None) -> list[int]:
    """The chat template's text, tokenised (the template's special tokens map to their ids). With
    `images` (the messages' `{"type": "image"}` parts, in order: `store_images`), each image
    placeholder is expanded to its image's tokens."""
    _check_vision(tokenizer, images)
    return _encode(tokenizer, chat_text(tokenizer, messages, add_generation_prompt, tools), images)


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
              tools: list[dict] | None = None) -> str:
    """The chat template's text for `messages` (and `tools`), as `chat_ids` tokenises it."""
    return tokenizer.apply_chat_template(
        [_plain(m) for m in messages], tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)


def _check_vision(tokenizer: Any, images: list[ImageRef] | None) -> None:
    if images:
        try:
            require_vision(tokenizer)
        except ImageContentError as e:
            raise EpisodeError(str(e)) from None


def _encode(tokenizer: Any, text: str, images: list[ImageRef] | None) -> list[int]:
    if not images:
        return list(tokenizer.encode(text, add_special_tokens=False))
    pending = list(images)
    try:
        ids = encode_with_images(tokenizer, text, pending)
    except ImageContentError as e:
        raise EpisodeError(str(e)) from None
    if pending:
        raise EpisodeError(f"the chat template placed {len(images) - len(pending)} of {len(images)} images; "
                           "is the model a vision-language one?")
    return ids


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    # Templates concatenate content; OpenAI clients send None for tool-call-only assistant messages.
    return {**message, "content": message.get("content") or ""}


_PLACEHOLDER = "\u0001FLOWRL\u0001"  # assistant content the template never produces on its own


def continuation_ids(tokenizer: Any, history: list[dict[str, Any]], observation: list[dict[str, Any]],
                     model_ids: list[int], images: list[ImageRef] | None = None) -> list[int]:
    """Tokens that follow the model's last turn up to the next assistant prompt.

    Renders `history + [assistant: PLACEHOLDER] + observation` with a generation prompt and keeps the
    text after the placeholder: the template's end of the assistant turn, the observation messages
    and the next assistant header. If the model already produced the end-of-turn token (its stop
    token), that part is not repeated. Only this text is tokenised; the model's ids are kept as is.
    `images`: the observation's images in order (`store_images`), their placeholders expanded.
    """
    _check_vision(tokenizer, images)
    rendered = tokenizer.apply_chat_template(
        [_plain(m) for m in history] + [{"role": "assistant", "content": _PLACEHOLDER}]
        + [_plain(m) for m in observation], add_generation_prompt=True, tokenize=False)
    if rendered.count(_PLACEHOLDER) != 1:
        raise EpisodeError("the chat template does not render assistant content verbatim; "
                           "write a workflow that builds observation tokens itself")
    tail = rendered.split(_PLACEHOLDER, 1)[1]
    if model_ids:
        last = tokenizer.decode([model_ids[-1]], skip_special_tokens=False)
        if last and tokenizer.convert_ids_to_tokens(model_ids[-1]) in tokenizer.all_special_tokens \
                and tail.startswith(last):
            tail = tail[len(last):]
    return _encode(tokenizer, tail, images)
