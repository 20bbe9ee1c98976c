"""The inference-engine interface every generate engine implements (embedded torch engine, SGLang
adapter), and the plain records that cross it.

Token-in / token-out: requests carry prompt token ids and results carry output token ids, so text is
never re-tokenised between generation and training.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from typing import Literal, Protocol, runtime_checkable

import msgspec

from flowrl.data.images import ImageRef

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["in_place", "retract", "abort"]
PAUSE_MODES: tuple[str, ...] = ("in_place", "retract", "abort")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request. Names follow SGLang's `sampling_params`.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters. Generation stops at
    any of `stop_token_ids` and, unless `ignore_eos`, at the model's end-of-sequence tokens; the stop
    token is part of the output. `seed` makes a sampled request reproducible whatever else is in the
    batch. `top_logprobs` K > 0 also reports, at each output token, the K most likely tokens and their
    logprobs under softmax(logits / temperature) (temperature 1 when greedy; before the top-k / top-p
    filter): what a top-K divergence (loss dppo_tv_topk) compares the trained policy with. SGLang
    takes it beside `sampling_params`, as `top_logprobs_num`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0


class GenerateRequest(msgspec.Struct, kw_only=True):
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # The images whose placeholder tokens appear in `input_ids`, in order (vision-language models);
    # the pixels are in the run's image store (flowrl.data.images).
    images: list[ImageRef] = []


class GenerateResult(msgspec.Struct, kw_only=True):
    """One finished request.

    `logprobs[i]` is the log-probability of `output_ids[i]` under the distribution the engine sampled
    it from (see the engine's docs for temperature / top-k / top-p); `versions[i]` is the policy
    (weight) version that produced it. A request the engine rejected has `error` set, finish reason
    "abort" and no output. With `sampling.top_logprobs` K > 0, `top_ids[i]` / `top_logprobs[i]` are
    the K most likely tokens at output token i, most likely first, and their logprobs (see
    `SamplingParams`); empty otherwise.
    """

    request_id: str
    output_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    finish_reason: FinishReason = "stop"
    error: str | None = None
    # The parameters the tokens were drawn with, set by `WorkflowContext.generate` (engines leave it
    # unset); `TrajectoryBuilder.add_model` records it on the trajectory for the trainer.
    sampling: SamplingParams | None = None


# A bucket is one list of (Hugging Face parameter name, tensor); a version streams several.
Bucket = list  # list[tuple[str, torch.Tensor]]; kept untyped so this module does not import torch
Buckets = Iterable[Bucket] | AsyncIterable[Bucket]


@runtime_checkable
class InferenceEngine(Protocol):
    """What a generate node needs from an engine.

    Pause modes (SGLang's `/pause_generation`): "in_place" stops between decode steps and keeps every
    request and its KV cache; "retract" also keeps the requests but recomputes their KV cache (prompt +
    output so far) under the weights current at resume; "abort" finishes every request with finish
    reason "abort" and its partial output. In all modes the engine stays paused until `resume()`.
    `update_weights` applies a complete version or none: if the buckets are malformed or the iterator
    raises, the engine keeps serving the old version with its old weights.
    """

    @property
    def version(self) -> int: ...

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def pause(self, mode: PauseMode = "retract") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, buckets: Buckets, version: int) -> None: ...

    async def abort(self, request_id: str) -> GenerateResult | None: ...

    async def close(self) -> None: ...
