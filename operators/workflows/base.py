"""The workflow protocol: what a generate node runs once per episode of a sample.

A workflow is an async callable `workflow(ctx, sample)` returning a `Trajectory`, a list of them,
or None (reject). It talks to the engine only through `ctx.generate(input_ids)`, which returns the
engine's own token ids, behaviour logprobs and per-token policy versions; `TrajectoryBuilder` lays
those out with environment tokens in between (loss mask 0) and records the turn spans. Model
output is never re-tokenised: the ids the engine sampled are the ids the trainer sees.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from flowrl.data.images import ImageRef
from flowrl.data.trajectory import SamplingSpan, Trajectory, Turn
from flowrl_operators.chat.images import ImageContentError, has_images, store_images
from flowrl_operators.chat.template import EpisodeError, chat_ids
from flowrl_operators.inference import GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from flowrl_operators.waits import EpisodeWait


class Workflow(Protocol):
    async def __call__(self, ctx: WorkflowContext, sample: dict[str, Any]) -> Trajectory | list[Trajectory] | None: ...


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any printable parts: the same episode draws the same tokens on re-issue."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def resubmit_seed(seed: int | None, generated: int) -> int | None:
    """The seed of a request resubmitted after `generated` tokens. An engine draws each token's
    randomness from the request's seed and the token's index in that request (the embedded engine:
    engine/sampling.py; SGLang: a generator seeded with it), so resubmitting with the same seed would
    draw token generated + i with token i's randomness again; a seed derived from (seed, position) gives
    the tokens ahead fresh noise, the same on every replay."""
    return seed if seed is None or generated == 0 else derive_seed(seed, "resubmit", generated)


async def generate_complete(engine: InferenceEngine, request_id: str, input_ids: list[int],
                            sampling: SamplingParams, max_attempts: int = 1000,
                            images: list[ImageRef] | None = None) -> GenerateResult:
    """One engine call that survives weight updates: a request aborted by one (pause mode "abort")
    is resubmitted with its partial output appended (and a fresh seed, `resubmit_seed`), so the
    caller sees one result whose `versions` say which policy produced each token. Its finish
    reason is never "abort": out of tokens it is "length". An engine error is returned in `error`.
    `images` are the images whose placeholder tokens `input_ids` hold, in order (a resubmission
    appends only text tokens, so they stay the same)."""
    merged = GenerateResult(request_id=request_id, sampling=sampling)  # what the trainer recomputes under
    prefix = list(input_ids)
    for attempt in range(max_attempts):
        done = len(merged.output_ids)
        attempt_sampling = msgspec.structs.replace(sampling, seed=resubmit_seed(sampling.seed, done),
                                                   max_new_tokens=sampling.max_new_tokens - done)
        request = GenerateRequest(request_id=f"{request_id}#{attempt}", input_ids=prefix, sampling=attempt_sampling,
                                  images=list(images or []))
        result = await engine.generate(request)
        merged.output_ids += result.output_ids
        merged.logprobs += result.logprobs
        merged.versions += result.versions
        merged.top_ids += result.top_ids
        merged.top_logprobs += result.top_logprobs
        merged.finish_reason, merged.error = result.finish_reason, result.error
        if result.error or result.finish_reason != "abort":
            return merged
        if len(merged.output_ids) >= sampling.max_new_tokens:
            merged.finish_reason = "length"
            return merged
        prefix = prefix + result.output_ids
    raise EpisodeError(f"request {request_id} was aborted {max_attempts} times; is the engine being closed?")


@dataclass
class WorkflowContext:
    """What one episode gets: the engine (through `generate`), the tokenizer, a seeded RNG, the
    node's sampling defaults, and where it is (sample id, episode index within the group, step)."""

    engine: InferenceEngine
    tokenizer: Any
    sampling: SamplingParams
    sample_id: str
    episode: int = 0
    step: int = 0
    seed: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    services: dict[str, Any] = field(default_factory=dict)  # e.g. "proxy" for agent workflows
    # Prompt ids (and images) by sample object, shared by the episodes of one group (the generate node
    # passes one dict per group): tokenising the same prompt once per episode was ~5% of a quickstart step.
    prompt_cache: dict[int, tuple[dict[str, Any], list[int], list[ImageRef]]] = field(default_factory=dict)
    # What the episode awaits now (flowrl_operators.waits), for the node's slow-episode report;
    # None outside a generate node.
    wait: EpisodeWait | None = None
    calls: int = field(default=0, init=False)
    _rng: random.Random | None = field(default=None, init=False, repr=False)

    @property
    def rng(self) -> random.Random:
        """A random.Random seeded by the run's seed, the sample and the episode (the same on re-issue);
        built on first use: most workflows draw nothing, and seeding one cost ~10 us an episode."""
        if self._rng is None:
            self._rng = random.Random(derive_seed(self.seed, self.sample_id, self.episode, "rng"))
        return self._rng

    def awaiting(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Mark the block as awaiting `what` (engine, environment.step, agent, ...: flowrl_operators.waits),
        so that a node whose episodes hang says which and on what."""
        return self.wait.on(what) if self.wait is not None else contextlib.nullcontext()

    @property
    def version(self) -> int:
        """The policy version the engine serves now."""
        return self.engine.version

    async def generate(self, input_ids: list[int], images: list[ImageRef] | None = None,
                       **overrides: Any) -> GenerateResult:
        """One engine call from token ids. `overrides` replace sampling fields (max_new_tokens, ...).
        `images`: the images whose placeholder tokens `input_ids` hold, in order (a vision-language
        policy; see `vision_prompt` for ids and images from chat messages).

        A request aborted by a weight update (pause mode "abort") is resubmitted with its partial
        output appended, so the caller always sees one complete result whose `versions` say which
        policy produced each token.
        """
        self.calls += 1
        sampling = msgspec.structs.replace(self.sampling, **overrides)
        if sampling.temperature > 0 and sampling.seed is None:
            sampling = msgspec.structs.replace(
                sampling, seed=derive_seed(self.seed, self.sample_id, self.episode, self.calls))
        # Unique even if the same sample runs twice at once (e.g. a greedy evaluation episode).
        request_id = f"{self.sample_id}/{self.episode}/{self.calls}-{uuid.uuid4().hex[:8]}"
        with self.awaiting("engine"):
            result = await generate_complete(self.engine, request_id, input_ids, sampling, images=images)
        if result.error:
            raise EpisodeError(f"engine rejected request {request_id}: {result.error}")
        return result

    # --- text helpers (prompts and observations are text; model output stays as ids) ----------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools)

    def prompt_ids(self, sample: dict[str, Any]) -> list[int]:
        """A sample's prompt: `prompt_ids` (as given), chat `messages` (the chat template, with a
        generation prompt), or `prompt` text (with the tokenizer's special tokens), in that order.
        A sample with images needs them too: use `prompt`."""
        return self.prompt(sample)[0]

    def prompt(self, sample: dict[str, Any]) -> tuple[list[int], list[ImageRef]]:
        """(prompt ids, images): as `prompt_ids`, and for chat messages with image parts (or a
        sample's `images`, flowrl/data/image_columns.py) the images in order, each placeholder the
        template renders expanded for its image; pass both to `generate`."""
        # The entry keeps its sample alive, so no other object can take its id while it is cached.
        cached = self.prompt_cache.get(id(sample))
        if cached is None or cached[0] is not sample:
            cached = self.prompt_cache[id(sample)] = (sample, *self._prompt(sample))
        return list(cached[1]), list(cached[2])

    def _prompt(self, sample: dict[str, Any]) -> tuple[list[int], list[ImageRef]]:
        messages = sample.get("messages")
        if "prompt_ids" not in sample and isinstance(messages, list) and (sample.get("images") or has_images(messages)):
            try:
                messages, images = store_images(messages, sample.get("images"))
            except ImageContentError as e:
                raise EpisodeError(f"sample {self.sample_id}: {e}") from None
            return chat_ids(self.tokenizer, messages, images=images), images
        return self._prompt_ids(sample), []

    def _prompt_ids(self, sample: dict[str, Any]) -> list[int]:
        if "prompt_ids" in sample:
            return list(sample["prompt_ids"])
        if "messages" in sample:
            return self.chat_ids(sample["messages"])
        if "prompt" in sample:
            # With the special tokens the tokenizer's post-processor adds (e.g. Llama's <bos>), as the
            # model saw text in pre-training; chat messages get them from the chat template instead.
            return list(self.tokenizer.encode(sample["prompt"], add_special_tokens=True))
        raise EpisodeError(f"sample has none of prompt_ids, messages, prompt (keys: {sorted(sample)})")


class TrajectoryBuilder:
    """Accumulates one trajectory: prompt, then model turns (loss mask 1) and environment tokens
    (loss mask 0), with turn spans over the response, one reward per turn if given, and the
    sampling parameters of each model turn (from `GenerateResult.sampling`)."""

    def __init__(self, prompt_ids: list[int], images: list[ImageRef] | None = None) -> None:
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # Per response token, the behaviour policy's top tokens and logprobs (sampling.top_logprobs);
        # [] where none were recorded (environment tokens).
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []
        self.turns: list[Turn] = []
        self.sampling: list[SamplingSpan] = []
        self.turn_rewards: list[float] = []
        self.images = list(images or [])  # those whose placeholders are in context_ids, in order
        self.finish_reason = "stop"

    @property
    def context_ids(self) -> list[int]:
        """Everything so far: the next engine call's input."""
        return self.prompt_ids + self.response_ids

    def add_model(self, result: GenerateResult) -> None:
        start = len(self.response_ids)
        self.response_ids += result.output_ids
        self.loss_mask += [1] * len(result.output_ids)
        self.logprobs += result.logprobs
        self.versions += result.versions
        recorded = len(result.top_ids) == len(result.output_ids)
        self.top_ids += result.top_ids if recorded else [[] for _ in result.output_ids]
        self.top_logprobs += result.top_logprobs if recorded else [[] for _ in result.output_ids]
        self.turns.append(Turn(start, len(self.response_ids)))
        self.finish_reason = result.finish_reason
        if result.sampling is not None:
            self.add_sampling(start, result.sampling.temperature, result.sampling.top_p, result.sampling.top_k)

    def add_sampling(self, start: int, temperature: float, top_p: float = 1.0, top_k: int = -1) -> None:
        """Record that response tokens from `start` to the end so far were sampled with these
        parameters; extends the last span when they are the same (the environment tokens in between
        carry no loss, so their parameters do not matter)."""
        end = len(self.response_ids)
        last = self.sampling[-1] if self.sampling else None
        if last is not None and (last.temperature, last.top_p, last.top_k) == (temperature, top_p, top_k):
            self.sampling[-1] = SamplingSpan(last.start, end, temperature, top_p, top_k)
        else:
            self.sampling.append(SamplingSpan(start, end, temperature, top_p, top_k))

    def add_environment(self, ids: list[int], version: int, images: list[ImageRef] | None = None) -> None:
        """Tokens the model did not produce (loss mask 0), with the images whose placeholders they hold."""
        self.images += images or []
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        # Not trained on; stamped with the serving version so every token has one.
        self.versions += [version] * len(ids)
        self.top_ids += [[] for _ in ids]
        self.top_logprobs += [[] for _ in ids]

    def build(self, reward: float | None = None, metadata: dict[str, Any] | None = None,
              turn_rewards: list[float] | None = None) -> Trajectory:
        rewards = turn_rewards if turn_rewards is not None else (self.turn_rewards or None)
        trajectory = Trajectory(
            id="", group_id="", sample_id="", prompt_ids=self.prompt_ids, response_ids=self.response_ids,
            loss_mask=self.loss_mask, behaviour_logprobs=self.logprobs, versions=self.versions,
            turns=self.turns, sampling=self.sampling, reward=reward, turn_rewards=rewards,
            finish_reason=self.finish_reason, images=list(self.images),
            metadata=dict(metadata or {}),
            top_ids=self.top_ids if any(self.top_ids) else None,
            top_logprobs=self.top_logprobs if any(self.top_ids) else None,
        )
        trajectory.validate()
        return trajectory


def is_async_callable(fn: Any) -> bool:
    """An async function, a partial of one, or an object whose `__call__` is async."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def maybe_await(value: Any) -> Any:
    """Environments and agents may be sync or async."""
    if isinstance(value, Awaitable):
        return await value
    return value


WorkflowFactory = Callable[..., Workflow]
