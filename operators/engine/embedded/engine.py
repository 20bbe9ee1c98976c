"""The embedded inference engine: continuous batching on flowrl's own torch forward pass.

How it runs. Requests wait in a queue; a scheduler task on the asyncio loop repeats *steps*. Each
step (1) gives waiting requests free KV-cache slots, (2) prefills every request that has no KV yet
(each distinct prompt once, copying prefixes already cached, in as few right-padded forwards as
padding allows: prefill.py; this also samples each one's next token), and (3) decodes one token for
every other running request in a single batched forward over slots 0..hi. Rows of that block that
are not decoding (free slots, slots prefilled in this step) write only the cache's scratch position,
so no request's KV is ever written by another request's work. A request that finishes frees its
slot at once and the next step refills it (continuous batching). New requests take the lowest free
slot and decoding requests move down into freed ones (KV copied), so the decoded block stays short.
Steps run on one dedicated worker thread so the event loop (and the HTTP server) stays responsive;
everything that changes the engine's state (pause, abort, weight update) waits for the step lock
and so happens *between* steps.

Logprobs. Each output token's logprob is taken from the distribution it was sampled from:
log_softmax(logits / temperature), restricted to the top_k / top_p set and renormalised. With
temperature 1 and no top-k/top-p that is exactly the model's distribution (what a trainer's
teacher-forced forward computes). Greedy requests (temperature 0) report the untempered
log_softmax(logits) of the chosen token, since the point mass they sample from has logprob 0.

Weights and the KV cache. `update_weights` stages every incoming tensor off to the side while the
engine keeps serving (a copy, or the tensor itself when the stream says the version owns it), and
only when the whole version has arrived and checked out swaps the staged tensors in as the live
parameters between two steps; an error leaves the old weights untouched (a version may also carry
LoRA adapters: flowrl_operators.engine.embedded.weights). KV entries already computed by the old weights
are *kept* ("in_place", cheap) unless the engine was paused with mode "retract": then each running
request's prompt and output so far are prefilled again at resume, so its next tokens equal what the new weights produce from that prefix.

A request inside the engine (`Sequence`) and the checks it passes before it joins a batch: requests.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterable

import torch

from flowrl_operators.engine.embedded import weights
from flowrl_operators.engine.embedded.load import load_model
from flowrl_operators.engine.embedded.model import CausalLM, end_token_ids
from flowrl_operators.engine.embedded.prefill import PrefillStats, compact, prefill
from flowrl_operators.engine.embedded.requests import (  # noqa: F401 - check_max_context, MIN_TEMPERATURE: named here too
    MIN_TEMPERATURE,
    Sequence,
    check_max_context,
    check_sampling,
    is_int,
)
from flowrl_operators.engine.embedded.stats import StepStats
from flowrl_operators.engine.embedded.vl_requests import check_images
from flowrl_operators.inference import (
    PAUSE_MODES,
    Buckets,
    GenerateRequest,
    GenerateResult,
    PauseMode,
)
from flowrl_operators.memory import configure, release
from flowrl_operators.models import resolve_model
from flowrl_operators.sampling import sample, top_logprobs
from flowrl_operators.tokenizer import silence_hf
from flowrl_operators.transport.base import Stream


class EmbeddedEngine:
    """flowrl's torch engine for Llama / Qwen2 / Qwen3 checkpoints (implements `InferenceEngine`).

    `max_slots` bounds the requests decoded together (the rest queue); `max_context` bounds prompt +
    output per request (default: the model's max_position_embeddings; a prompt that leaves no room is
    refused, output stops there with finish_reason "length"). Neither is allocated up front: the KV
    cache grows to the slots and lengths (prompt + max_new_tokens) of the requests it admits. `threads` sets
    torch's intra-op threads for the process (one per process is fastest when processes share cores).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        max_slots: int = 32,
        max_context: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        silence_hf()
        if threads is not None:
            torch.set_num_threads(threads)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.folder = resolve_model(model)
        self.model: CausalLM = load_model(self.folder, dtype, self.device)
        # Large blocks as their own mappings: freed memory leaves the process (memory.py; not for a small model).
        configure(sum(p.numel() * p.element_size() for p in self.model.parameters()))
        config = self.model.config
        self.vocab_size = config.vocab_size
        self.eos_ids = end_token_ids(self.folder, config)
        self.max_context = check_max_context(max_context, config)
        self.max_slots = max_slots
        self.cache = self.model.cache_class(config, max_slots, self.max_context, dtype, self.device)
        self._version = version
        self._rng = random.Random(seed)
        self._waiting: deque[Sequence] = deque()
        self._slots: list[Sequence | None] = [None] * max_slots
        self._by_id: dict[str, Sequence] = {}
        self._paused = False
        self._lock: asyncio.Lock | None = None  # created on first use, inside the serving loop
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flowrl-engine")
        self._closed = False
        self._epoch = 0  # bumped by every weight swap: only KV of the current weights is shared
        self.prefill_stats = PrefillStats()
        self.step_stats = StepStats()

    # --- InferenceEngine ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def paused(self) -> bool:
        return self._paused

    def named_parameters(self):
        """(HF name, live tensor) pairs, e.g. to compare with a trainer bit for bit."""
        return self.model.named_parameters()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._start()
        problem = self._check(request)
        if problem:
            return GenerateResult(request_id=request.request_id, finish_reason="abort", error=problem)
        params = request.sampling
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            request=request,
            future=asyncio.get_running_loop().create_future(),
            seed=seed,
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids),
            tokens=list(request.input_ids),
        )
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            # The caller went away (e.g. an HTTP client disconnected): free the slot.
            await self.abort(request.request_id)
            raise

    async def pause(self, mode: PauseMode = "retract") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        self._start()
        async with self._lock:
            self._paused = True
            if mode == "retract":
                for seq in self._running():
                    seq.needs_prefill = True
            elif mode == "abort":
                for seq in list(self._waiting) + self._running():
                    self._finish(seq, "abort")

    async def resume(self) -> None:
        self._start()
        async with self._lock:
            self._paused = False
            self._wake.set()

    async def update_weights(self, buckets: Buckets, version: int) -> None:
        """Apply a complete new version between two steps, or nothing (see the module docs)."""
        owned = isinstance(buckets, Stream) and buckets.owned  # a stream of tensors nobody changes later
        staged: dict[str, torch.Tensor] = {}
        if isinstance(buckets, AsyncIterable):
            async for bucket in buckets:
                staged.update(await asyncio.to_thread(self.stage, bucket, owned))
        else:
            for bucket in buckets:
                staged.update(await asyncio.to_thread(self.stage, bucket))
        await self.commit(staged, version)

    def stage(self, bucket, owned: bool = False) -> dict[str, torch.Tensor]:
        """Check one bucket of (HF name, tensor) against the model and set it aside, on the engine's
        device and dtype (a copy, or with `owned` the tensor itself); touches nothing live
        (flowrl_operators.engine.embedded.weights, which also takes LoRA adapters)."""
        return weights.stage(self.model, bucket, self.device, owned)

    async def commit(self, staged: dict[str, torch.Tensor], version: int) -> None:
        """Swap staged tensors in as the live weights between two steps and stamp `version`."""
        weights.check(self.model, staged)  # a bad version raises here, before anything changes
        self._start()
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._apply, staged)
            self._version = version

    async def set_version(self, version: int) -> None:
        """Relabel the current weights (SGLang's /update_weight_version)."""
        self._start()
        async with self._lock:
            self._version = version

    def request_ids(self) -> list[str]:
        return list(self._by_id)

    async def abort(self, request_id: str) -> GenerateResult | None:
        self._start()
        async with self._lock:
            seq = self._by_id.get(request_id)
            if seq is None:
                return None
            self._finish(seq, "abort")
            return seq.result()

    async def abort_all(self) -> list[GenerateResult]:
        self._start()
        async with self._lock:
            seqs = list(self._waiting) + self._running()
            for seq in seqs:
                self._finish(seq, "abort")
            return [seq.result() for seq in seqs]

    def snapshot(self, request_id: str) -> GenerateResult | None:
        """The request's output so far (finish_reason not final), or None if it is not in flight."""
        seq = self._by_id.get(request_id)
        return None if seq is None else seq.result()

    async def load_weights_from_disk(self, model: str | os.PathLike, version: int) -> None:
        """Replace the weights with another checkpoint of the same architecture (same atomicity)."""
        folder = resolve_model(model)
        fresh = await asyncio.to_thread(load_model, folder, self.cache.keys[0].dtype, torch.device("cpu"))
        await self.update_weights([list(fresh.named_parameters())], version)

    def stats(self) -> dict:
        return {"running": len(self._running()), "waiting": len(self._waiting), "paused": self._paused,
                "version": self._version, "max_slots": self.max_slots, "max_context": self.max_context,
                "cache_slots": self.cache.slots, "cache_positions": self.cache.capacity, "cache_bytes": self.cache.nbytes(),
                **self.prefill_stats.as_dict(), **self.step_stats.as_dict()}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lock is not None:
            await self.abort_all()
        if self._scheduler is not None:
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # --- request checks ------------------------------------------------------------------------------

    def _check(self, request: GenerateRequest) -> str | None:
        """Why this request cannot run, or None. Bad requests fail alone; the engine serves on."""
        ids, params = request.input_ids, request.sampling
        if self._closed:
            return "the engine is closed"
        if request.request_id in self._by_id:
            return f"request id {request.request_id!r} is already in flight; use a unique id"
        if not ids:
            return "empty prompt: input_ids must hold at least one token id"
        if len(ids) >= self.max_context:  # first: the cheap check that bounds the others' cost
            return (f"prompt of {len(ids)} tokens leaves no room in the context of {self.max_context} "
                    "tokens; shorten the prompt or raise max_context")
        bad = [t for t in ids if not is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
        return check_sampling(params, self.vocab_size) or check_images(self.model, request)

    # --- weights -------------------------------------------------------------------------------------

    def _apply(self, staged: dict[str, torch.Tensor]) -> None:
        weights.apply(self.model, staged)
        self._epoch += 1
        release()  # the replaced version's tensors, freed: back to the OS (flowrl_operators.memory)

    # --- scheduling ------------------------------------------------------------------------------------

    def _start(self) -> None:
        """Create the lock and the scheduler task in the running loop (on first use)."""
        loop = asyncio.get_running_loop()
        if self._scheduler is None:
            self._lock, self._wake = asyncio.Lock(), asyncio.Event()
            self._scheduler = loop.create_task(self._schedule())
        elif self._scheduler.get_loop() is not loop:
            raise RuntimeError("an EmbeddedEngine serves the event loop it first ran in; create one engine "
                               "per event loop (e.g. per asyncio.run)")

    def _running(self) -> list[Sequence]:
        return [seq for seq in self._slots if seq is not None]

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            async with self._lock:
                if self._paused or not (self._waiting or any(self._slots)):
                    self._wake.clear()
                    continue
                self._admit()
                running = self._running()
                prefilled, start = any(seq.needs_prefill for seq in running), time.perf_counter()
                try:
                    await loop.run_in_executor(self._executor, self._step, running)
                    self.step_stats.add(time.perf_counter() - start, prefilled)
                except Exception as exc:  # a bug in a batched forward: fail this batch, keep serving
                    for seq in running:
                        if seq.finish_reason is None:
                            seq.error = f"engine step failed: {exc!r}"
                            self._finish(seq, "abort")
                for seq in running:
                    if seq.finish_reason is not None:
                        self._finish(seq, seq.finish_reason)
            await asyncio.sleep(0)  # let pause/abort/update callers take the lock between steps

    def _admit(self) -> None:
        for slot in range(self.max_slots):
            if not self._waiting:
                break
            if self._slots[slot] is None:
                seq = self._waiting.popleft()
                seq.slot, seq.needs_prefill = slot, True
                self._slots[slot] = seq
                self.step_stats.admitted += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Release the request's slot and hand its result to the caller (event-loop thread only)."""
        seq.finish_reason = reason
        if seq.slot is not None:
            self._slots[seq.slot] = None
            seq.slot = None
        if seq in self._waiting:
            self._waiting.remove(seq)
        self._by_id.pop(seq.request.request_id, None)
        if not seq.future.done():
            seq.future.set_result(seq.result())

    # --- one step (runs on the engine thread) --------------------------------------------------------

    @torch.no_grad()
    def _step(self, running: list[Sequence]) -> None:
        # Room for every admitted request's whole length before any forward writes the cache.
        self.cache.ensure(max(seq.slot for seq in running) + 1, max(seq.need for seq in running))
        prefill = [seq for seq in running if seq.needs_prefill]
        decode = [seq for seq in running if not seq.needs_prefill]
        if prefill:
            try:
                self._prefill(prefill)
            except Exception:  # find the culprit: one request's failure must not fail the others
                for seq in prefill:
                    try:
                        self._prefill([seq])
                    except Exception as exc:
                        seq.error, seq.finish_reason = f"prefill failed: {exc!r}", "abort"
        if decode:
            # One token per row over slots 0..hi (a slice: no gather of the cache). Rows not decoding
            # (free slots, or slots prefilled just above) feed a dummy token at the cache's scratch
            # position, which no request ever attends to; their logits are ignored.
            compact(self._slots, decode, self.cache)  # decoding requests move down into freed slots
            hi = max(seq.slot for seq in decode) + 1
            tokens, start = [0] * hi, [self.cache.scratch] * hi
            for seq in decode:
                tokens[seq.slot], start[seq.slot] = seq.tokens[-1], len(seq.tokens) - 1
            logits = self.model(
                torch.tensor(tokens, device=self.device)[:, None],
                torch.tensor(start, device=self.device),
                self.cache, slice(0, hi), max(len(seq.tokens) for seq in decode),
            )
            rows = torch.tensor([seq.slot for seq in decode], device=self.device)
            self._emit(decode, logits[rows])

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill requests into their slots, each distinct prompt computed once (prefill.py), reusing
        the prefixes that decoding requests cached under the current weights."""
        donors = [seq for seq in self._running() if not seq.needs_prefill and seq.epoch == self._epoch]
        order, logits = prefill(self.model, self.cache, seqs, donors, self.prefill_stats)
        for seq in order:
            seq.needs_prefill, seq.epoch = False, self._epoch
        self._emit(order, logits)

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence from its logits row; append it and check stop conditions."""
        params = [seq.request.sampling for seq in seqs]
        try:
            tokens, logprobs = sample(logits, params, [seq.seed for seq in seqs], [len(seq.output) for seq in seqs])
            tops = top_logprobs(logits, params)
        except Exception:  # find the culprit: one request's sampling must not fail the others
            tokens, logprobs, tops = self._sample_alone(seqs, logits)
        for seq, token, logprob, p, top in zip(seqs, tokens, logprobs, params, tops, strict=True):
            if seq.finish_reason == "abort":
                continue
            if not 0 <= token < self.vocab_size or math.isnan(logprob):
                seq.error = (f"sampling failed: token {token}, logprob {logprob} "
                             f"(temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p})")
                seq.finish_reason = "abort"
                continue
            if top is not None:
                seq.top_ids.append(top[0])
                seq.top_logprobs.append(top[1])
            seq.tokens.append(token)
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self._version)
            if token in seq.stop_ids:
                seq.finish_reason = "stop"
            elif len(seq.output) >= p.max_new_tokens or len(seq.tokens) >= self.max_context:
                seq.finish_reason = "length"

    def _sample_alone(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float], list]:
        """Each row sampled on its own (token, logprob, top logprobs); a row whose sampling raises
        aborts its request alone."""
        tokens, logprobs, tops = [], [], []
        for i, seq in enumerate(seqs):
            try:
                token, logprob = sample(logits[i:i + 1], [seq.request.sampling], [seq.seed], [len(seq.output)])
                top = top_logprobs(logits[i:i + 1], [seq.request.sampling])
            except Exception as exc:
                seq.error, seq.finish_reason = f"sampling failed: {exc!r}", "abort"
                token, logprob, top = [-1], [float("nan")], [None]
            tokens.append(token[0])
            logprobs.append(logprob[0])
            tops.append(top[0])
        return tokens, logprobs, tops
