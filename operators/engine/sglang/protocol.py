"""The wire format of SGLang's /generate as the adapter (adapter.py) speaks it: flowrl's sampling
fields as `sampling_params`, and an answer (token ids, logprobs, weight versions, finish reason,
top tokens, an error's message) read back into a `GenerateResult`."""

from __future__ import annotations

from typing import Any

from flowrl_operators.engine.sglang.weights import ServerError
from flowrl_operators.inference import FinishReason, GenerateResult, SamplingParams


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """flowrl's sampling fields -> SGLang's `sampling_params` (same names, seed -> sampling_seed)."""
    body: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                            "max_new_tokens": params.max_new_tokens, "ignore_eos": params.ignore_eos}
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        body["sampling_seed"] = params.seed
    return body


def token_versions(meta: dict, count: int) -> list[int]:
    """The weight version of each of `count` output tokens from an answer's meta_info.

    `weight_versions` is either spans [{"version", "start", "end"}] or one version per token; without
    it every token gets `weight_version` (SGLang before 0.5.20: the version at the end).
    """
    spans = meta.get("weight_versions")
    if spans and isinstance(spans[0], dict):
        versions: list[int] = []
        for span in spans:
            versions += [int(span["version"])] * (int(span["end"]) - int(span["start"]))
        if len(versions) == count:
            return versions
        raise ServerError(f"meta_info.weight_versions covers {len(versions)} tokens, the output has {count}")
    if spans:
        if len(spans) != count:
            raise ServerError(f"meta_info.weight_versions has {len(spans)} entries, the output has {count}")
        return [int(v) for v in spans]
    return [int(meta.get("weight_version") or 0)] * count


def finish_reason(meta: dict) -> FinishReason:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    # None means SGLang stopped without saying why (e.g. a closed stream): treat as cut short.
    return "abort"


def parse_answer(request_id: str, answer: dict, top: int = 0) -> GenerateResult:
    """One /generate answer -> GenerateResult (token ids, behaviour logprobs, versions, finish, and
    the `top` most likely tokens per output token when asked for)."""
    meta = answer.get("meta_info") or {}
    output = [int(t) for t in answer.get("output_ids") or []]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ServerError("the server answered without meta_info.output_token_logprobs; send return_logprob")
    if [int(t[1]) for t in triples] != output:
        raise ServerError("meta_info.output_token_logprobs does not name the same tokens as output_ids")
    reason = finish_reason(meta)
    error = None
    if reason == "abort" and isinstance(meta.get("finish_reason"), dict):
        message = meta["finish_reason"].get("message")
        # Aborts by pause or abort_request are normal; anything else the server calls an error.
        if message and "abort" not in str(message).lower():
            error = str(message)
    top_ids, top_logprobs = top_tokens(meta, len(output), top)
    return GenerateResult(request_id=request_id, output_ids=output, logprobs=[float(t[0]) for t in triples],
                          versions=token_versions(meta, len(output)), top_ids=top_ids, top_logprobs=top_logprobs,
                          finish_reason=reason, error=error)


def top_tokens(meta: dict, count: int, top: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each output token's `top` most likely (ids, logprobs) from meta_info.output_top_logprobs
    (per token a list of (logprob, token id, text)); ([], []) when none were asked for."""
    if top <= 0:
        return [], []
    rows = meta.get("output_top_logprobs")
    if rows is None or len(rows) != count:
        found = "none" if rows is None else f"{len(rows)} entries"
        raise ServerError(f"asked for top_logprobs_num {top}, meta_info.output_top_logprobs has {found} for "
                          f"{count} output tokens")
    if any(row is None or len(row) != top for row in rows):
        raise ServerError(f"meta_info.output_top_logprobs has an entry without {top} tokens")
    return [[int(t[1]) for t in row] for row in rows], [[float(t[0]) for t in row] for row in rows]


def error_message(answer: Any) -> str:
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        return str(answer.get("message") or error or answer)
    return str(answer).strip()
