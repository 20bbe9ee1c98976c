"""Both executors meet the Executor protocol that run.py drives (flowrl/runtime/executors/executor.py)."""

from __future__ import annotations

import inspect

import pytest
import runtime_ops as ops

from flowrl.runtime.executors.executor import Executor
from flowrl.runtime.executors.inprocess import InProcessExecutor
from flowrl.runtime.executors.ray_executor import RayExecutor

MEMBERS = [n for n in vars(Executor) if not n.startswith("_")]


@pytest.mark.parametrize("cls", [InProcessExecutor, RayExecutor])
def test_an_executor_has_every_member_of_the_protocol_with_its_signature(cls):
    ex = cls(ops.grpo("sync", steps=2, batch_size=1), None, 0.0)  # constructing starts nothing
    assert isinstance(ex, Executor) and ex.lost_train is None
    assert set(MEMBERS) == {"start", "call", "wait", "join", "save", "shutdown"}
    for name in MEMBERS:
        wanted = inspect.signature(getattr(Executor, name))
        given = inspect.signature(getattr(cls, name))
        assert list(given.parameters) == list(wanted.parameters), (cls, name)
        assert inspect.iscoroutinefunction(getattr(cls, name)), (cls, name)
