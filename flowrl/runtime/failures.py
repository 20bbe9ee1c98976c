"""How a run fails: the errors run.py raises and the executors raise for it to see (a module of its
own, so that the executors need not import run.py, which picks them)."""

from __future__ import annotations


class StageFailed(RuntimeError):
    """A stage's operator raised; the message names the node and carries the original traceback."""


class TrainerLost(StageFailed):
    """Under Ray, a train actor's process died while its machine stayed up (killed, out of memory):
    `run()` restarts the run from its last checkpoint, up to `run.max_restarts` times."""
