"""Reading a JSON request body on the engine server and the agent proxy: every malformed body a 400
with a message, an oversized one a 413, and the parse off the event loop.

A body is read up to `limit` bytes (413 past it, before the rest is read), decoded as UTF-8 (400
otherwise) and parsed as standard JSON (msgspec: no NaN / Infinity literals, no lone surrogate
escapes, at most MAX_DEPTH levels of nesting) in a worker thread, so that a large body does not stall every other
request the loop serves. `parse_json` raises `bad_request(message)` for a client's mistake.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

# Bodies above this are parsed in a worker thread (below it the thread costs more than the parse).
THREAD_ABOVE = 256 * 1024
MB = 1024**2
# The deepest nesting of arrays and objects a body may have (a tool's JSON schema needs a dozen).
MAX_DEPTH = 128


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body's bytes; 413 once it passes `limit` bytes (its declared length is checked first)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise too_large(limit, size)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int, size: int) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(
        max_size=limit, actual_size=size,
        text=f"the request body ({size} bytes or more) is over this route's limit of {limit // MB} MB")


def parse_json(data: bytes, bad_request: type[Exception]) -> dict[str, Any]:
    """A JSON object from `data`; `bad_request` for anything else (module docs)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})") from None
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__} "
                          f"({data[:40].decode('utf-8', 'replace')!r})")
    if too_deep(body, MAX_DEPTH):
        raise bad_request(f"the request body nests more than {MAX_DEPTH} levels of arrays and objects")
    return body


def too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests containers deeper than `limit` (iteratively: templates, json.dumps and
    the checks after this recurse, and would fail with RecursionError on what passed here)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                pending.append((child, depth + 1))
    return False


async def json_body(request: web.Request, limit: int, bad_request: type[Exception]) -> dict[str, Any]:
    """The request's body as a JSON object: read (`read_body`) and parsed (`parse_json`); {} if it has none."""
    if not request.can_read_body:
        return {}
    data = await read_body(request, limit)
    if not data.strip():
        return {}
    if len(data) > THREAD_ABOVE:
        return await asyncio.to_thread(parse_json, data, bad_request)
    return parse_json(data, bad_request)
