"""Tool calls in generated text: Qwen-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks read as OpenAI `tool_calls`. The agent proxy and the engine server's chat route share this
reading, so one model answer becomes the same tool calls on both."""

from __future__ import annotations

import json
import re
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The text outside the blocks that parse as tool calls (stripped), and those calls in OpenAI's
    shape. A block that is not a JSON object with a string `name` stays in the text, unread."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    end = 0
    for i, match in enumerate(_TOOL_CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append({"id": f"call_{i}", "type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    kept.append(text[end:])
    return "".join(kept).strip(), calls


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls in `text` (`split_tool_calls`), in order."""
    return split_tool_calls(text)[1]
