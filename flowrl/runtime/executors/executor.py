"""What runs a plan's stages: the protocol run.py drives, met by InProcessExecutor (inprocess.py,
stages as tasks of this process) and RayExecutor (ray_executor.py, stages as Ray actors)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


def task_error(task: asyncio.Task) -> str | None:
    """What a finished stage task (an executor's run of one stage) ended with: the message it
    returned or the exception it raised; None for a clean return."""
    error = task.exception() or task.result()
    if isinstance(error, BaseException):
        return str(error) or type(error).__name__
    return str(error) if error else None


@runtime_checkable
class Executor(Protocol):
    # A train stage whose process died while its machine stayed up, as (node, replica): the run
    # ends resumably (TrainerLost, failures.py) instead of failing. None where no such loss is seen.
    lost_train: tuple[str, int] | None

    async def start(self, steps: int, stop_at: int | None, state: bytes | None, checkpoint: Path | None) -> None:
        """Build the coordinator (from `state` when resuming) and set up and start every stage."""

    async def call(self, method: str, *args: Any) -> Any:
        """Call a Coordinator method, wherever the coordinator lives."""

    async def wait(self) -> str:
        """Until the run stops; its reason (done | time | target | interrupt | error)."""

    async def join(self, timeout: float) -> list[tuple[str, str]]:
        """Let the stages return within `timeout` s; (node, message) for each that failed."""

    async def save(self, directory: Path) -> None:
        """Every stage's state into directory/NODE/rREPLICA (a checkpoint's stage part)."""

    async def shutdown(self) -> list[tuple[str, str]]:
        """Close every stage; (node, message) for each whose close failed."""
