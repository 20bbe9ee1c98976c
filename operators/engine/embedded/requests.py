"""A request inside the embedded engine (`Sequence`: its tokens so far and where its KV lives) and the
checks a request passes before it joins a batch (engine.py), so that no value one request sends
reaches the batched sampler."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from flowrl_operators.inference import GenerateRequest, GenerateResult, SamplingParams


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: its tokens so far and where its KV lives."""

    request: GenerateRequest
    future: asyncio.Future
    seed: int  # the request's sampling seed (engine/sampling.py draws token i from uniform(seed, i))
    stop_ids: frozenset[int]
    tokens: list[int]  # prompt + output; the cache holds KV for all but the last one
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)  # sampling.top_logprobs > 0 only
    top_logprobs: list[list[float]] = field(default_factory=list)
    slot: int | None = None
    needs_prefill: bool = True
    epoch: int = -1  # the engine's weight epoch when this request's KV was computed (prefix sharing)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def need(self) -> int:
        """Cache positions this request may use: its prompt and every token it may still add."""
        return len(self.request.input_ids) + self.request.sampling.max_new_tokens

    def result(self) -> GenerateResult:
        return GenerateResult(
            request_id=self.request.request_id,
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            top_ids=list(self.top_ids),
            top_logprobs=list(self.top_logprobs),
            finish_reason=self.finish_reason or "abort",
            error=self.error,
        )


# The smallest temperature sampled: logits / temperature stays finite in fp32 above it (a smaller
# one is greedy in all but name; send 0 for greedy).
MIN_TEMPERATURE = 1e-5


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_sampling(params: SamplingParams, vocab_size: int) -> str | None:
    """Why these sampling parameters cannot run, or None. Checked per request before it joins a batch,
    so that no value one request sends (NaN, a top_k past the vocabulary) reaches the batched sampler."""
    t, p, k = params.temperature, params.top_p, params.top_k
    if not is_number(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
        return f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}"
    if not is_number(p) or not 0 < p <= 1:
        return f"top_p must be a finite number in (0, 1], got {p!r}"
    if not is_int(params.top_logprobs) or not 0 <= params.top_logprobs <= vocab_size:
        return f"top_logprobs must be an integer in [0, {vocab_size}], got {params.top_logprobs!r}"
    if not is_int(k) or k > vocab_size:
        return f"top_k must be an integer <= the vocabulary size {vocab_size} (<= 0: no limit), got {k!r}"
    if not is_int(params.max_new_tokens) or params.max_new_tokens < 1:
        return f"max_new_tokens must be an integer >= 1, got {params.max_new_tokens!r}"
    if params.seed is not None and not is_int(params.seed):
        return f"seed must be an integer, got {params.seed!r}"
    bad = [t for t in params.stop_token_ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        return f"stop token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
    return None


def check_max_context(max_context: int | None, config) -> int:
    """The context limit: `max_context`, or the model's max_position_embeddings, which it may not exceed
    (RoPE was trained up to there)."""
    limit = config.max_position_embeddings
    if max_context is None:
        return limit
    if not 2 <= max_context <= limit:
        raise ValueError(f"max_context {max_context} must be between 2 and the model's max_position_embeddings "
                         f"({limit}); lower it")
    return max_context
