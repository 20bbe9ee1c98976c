"""One pass of a node's torch work, timed on a given number of threads, for `flowrl plan`'s thread
gain (`Operator.pass_timer`; flowrl/plan/threads.py alternates the thread counts and takes medians).

A train step is a forward and backward pass over its batch; an engine iteration's per-row work a
forward of one token a row. The model is loaded once per process, as the trainer loads it (a model
that cannot be loaded or run here raises: plan then keeps linear scaling and says why).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

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
