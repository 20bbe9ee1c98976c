"""One pass of a node's torch work, timed on a given number of threads, for `flowrl plan`'s thread
gain (`Operator.pass_timer`; flowrl/plan/threads.py alternates the thread counts and takes medians);
and two embedded engines decoding side by side, for its interpreter lock's handoff
(`Operator.handoff`; flowrl/plan/cpu.py).

A train step is a forward and backward pass over its batch; an engine iteration's per-row work a
forward of one token a row. The model is loaded once per process, as the trainer loads it (a model
that cannot be loaded or run here raises: plan then keeps linear scaling and says why).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

HANDOFF_TOKENS = 4  # tokens a handoff call decodes for each of its requests
HANDOFF_ROUNDS = 3  # rounds of turns-then-threads; the median ratio
HANDOFF_ROUND_S = 0.1  # each engine's calls in a round last about this long (at least one call)

_MODELS: dict[str, Any] = {}


def pass_timer(model: str, rows: int, length: int, backward: bool) -> Callable[[int], float]:
    """A function `threads -> seconds` of one pass over `rows` rows of `length` tokens (random ids),
    with a backward pass where `backward`."""
    import torch

    net = _load(model)
    ids = torch.randint(0, net.config.vocab_size, (max(rows, 1), max(length, 1)))

    def once(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        if backward:
            net(ids).logits.float().logsumexp(-1).mean().backward()
            net.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                net(ids)
        return time.perf_counter() - start

    return once


def train_pass(cls: type, model: str, rows: int, length: int) -> Callable[[int], float]:
    """`Operator.pass_timer` of the train node: a forward and backward pass over the batch."""
    del cls
    return pass_timer(model, rows, length, backward=True)


def engine_pass(cls: type, model: str, rows: int, length: int) -> Callable[[int], float]:
    """`Operator.pass_timer` of the generate node: a forward pass (plan asks for one token a row,
    what a decoding iteration runs)."""
    del cls
    return pass_timer(model, rows, length, backward=False)


def _load(model: str) -> Any:
    """The policy as its trainer loads it (training/model_load.py), once per process."""
    if model not in _MODELS:
        from flowrl_operators.models import resolve_model
        from flowrl_operators.training.model_load import load_model

        _MODELS[model] = load_model(resolve_model(model), "policy")
    return _MODELS[model]


def engine_handoff(cls: type, model: str, rows: int) -> float:
    """`Operator.handoff` of the generate node: two embedded engines of `model` (one thread each, an
    event loop each), each decoding `rows` requests of HANDOFF_TOKENS tokens a call; the seconds of
    their calls in turns over the seconds of the same calls in two threads at once, the median of
    HANDOFF_ROUNDS rounds (1: handing the interpreter lock over between them costs nothing)."""
    del cls
    one, two = Decoder(model, rows), Decoder(model, rows)
    try:
        warm = max(one(), two(), 1e-6)  # allocations, the KV cache's growth
        calls = max(1, min(16, round(HANDOFF_ROUND_S / warm)))
        return statistics.median(turns_over_threads(one, two, calls) for _ in range(HANDOFF_ROUNDS))
    finally:
        one.close()
        two.close()


def turns_over_threads(one: Callable[[], float], two: Callable[[], float], calls: int) -> float:
    """Seconds of `calls` calls of each in turns, over the seconds of the same in two threads."""
    start = time.perf_counter()
    for _ in range(calls):
        one()
        two()
    turns = time.perf_counter() - start
    workers = [threading.Thread(target=lambda f=f: [f() for _ in range(calls)]) for f in (one, two)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return turns / (time.perf_counter() - start)


class Decoder:
    """An embedded engine of its own on an event loop of its own: each call decodes `rows` requests
    of `tokens` tokens and returns the seconds per iteration; `close()` shuts both down."""

    def __init__(self, model: str, rows: int, tokens: int = HANDOFF_TOKENS) -> None:
        from flowrl_operators.engine.embedded.engine import EmbeddedEngine
        from flowrl_operators.inference import SamplingParams

        self.engine, self.loop = EmbeddedEngine(model, max_slots=rows, threads=1), asyncio.new_event_loop()
        self.rows, self.tokens, self.ids = rows, tokens, itertools.count()
        self.sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)

    async def _batch(self) -> None:
        from flowrl_operators.inference import GenerateRequest

        call = next(self.ids)
        await asyncio.gather(*(self.engine.generate(GenerateRequest(request_id=f"{call}-{i}", input_ids=[1, 2, 3, 4],
                                                                    sampling=self.sampling))
                               for i in range(self.rows)))

    def __call__(self) -> float:
        start = time.perf_counter()
        self.loop.run_until_complete(self._batch())
        return (time.perf_counter() - start) / self.tokens

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()
