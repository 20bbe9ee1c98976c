"""The engine server's wire: SGLang sampling parameters and weight versions parsed from a body, and
the JSON answers (success, ok, the 400/413/500 error shape) every route of server.py gives."""

from __future__ import annotations

import msgspec
from aiohttp import web

from flowrl_operators.chat import http_body
from flowrl_operators.inference import SamplingParams

# SGLang sampling keys this engine honours, and keys it may safely ignore at their defaults.
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos",
                 "sampling_seed", "seed"}
HARMLESS_DEFAULTS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                     "repetition_penalty": 1.0, "n": 1, "skip_special_tokens": None,
                     "spaces_between_special_tokens": None, "no_stop_trim": None, "min_new_tokens": 0,
                     "stop": None}


# Body limits: a request (prompts, inline images) and a weight update (base64 safetensors).
BODY_LIMIT = 64 * http_body.MB
WEIGHTS_LIMIT = 1 << 34


class BadRequest(ValueError):
    """A client error: answered 400 with its message."""


def sampling_from(raw: dict | None) -> SamplingParams:
    raw = dict(raw or {})
    for key, default in HARMLESS_DEFAULTS.items():
        value = raw.pop(key, default)
        if default is not None and value != default and value not in (None, [], ""):
            raise BadRequest(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
        if key == "stop" and value not in (None, [], ""):
            raise BadRequest("sampling_params.stop (stop strings) is not supported; use stop_token_ids")
    unknown = sorted(set(raw) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unsupported sampling_params {unknown}; supported: {sorted(SAMPLING_KEYS)}")
    if "sampling_seed" in raw:
        raw["seed"] = raw.pop("sampling_seed")
    if raw.get("stop_token_ids") is None:
        raw.pop("stop_token_ids", None)
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"sampling_params: {exc}") from None


def parse_version(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"weight_version {value!r} must be an integer (as a string or a number)") from None


def version_spans(versions: list[int], current: int) -> list[dict]:
    """Per-token versions -> SGLang's meta_info.weight_versions: [{version, start, end}] runs."""
    spans: list[dict] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]


@web.middleware
async def errors_as_json(request: web.Request, handler):
    """Client mistakes -> 400 with SGLang's error shape; anything else -> 500 with the message."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return web.json_response({"error": {"message": exc.text}, "success": False, "message": exc.text},
                                 status=413)
    except web.HTTPException:
        raise
    except KeyError as exc:  # a missing body field, or an unknown weight name from engine.stage
        message = exc.args[0] if exc.args and " " in str(exc.args[0]) else f"missing field {exc}"
        return web.json_response({"error": {"message": message}, "success": False, "message": message},
                                 status=400)
    except (BadRequest, ValueError, FileNotFoundError, msgspec.ValidationError) as exc:
        return web.json_response({"error": {"message": str(exc)}, "success": False, "message": str(exc)},
                                 status=400)
    except Exception as exc:
        return web.json_response({"error": {"message": f"{type(exc).__name__}: {exc}"}, "success": False,
                                  "message": str(exc)}, status=500)


async def json_body(request: web.Request, limit: int = BODY_LIMIT) -> dict:
    """The body as a JSON object: a 400 naming what is wrong, a 413 past `limit` (http_body.py)."""
    return await http_body.json_body(request, limit, BadRequest)


def ok(message: str) -> web.Response:
    return web.json_response({"message": message, "status": "ok"})


def success(message: str, **extra) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})
