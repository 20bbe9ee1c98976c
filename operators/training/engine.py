"""The training-engine seam: what the train, reference and critic nodes ask of a model.

A training engine is one rank of a (possibly sharded) model. The nodes call only the methods of
`TrainingEngine`; which engine they get is a name in their YAML (`engine: fsdp2`, the default),
looked up among the entry points of the group `flowrl.training_engines`. An entry is an
`EngineEntry`: its name and `build(model_path, config, role)`, where `role` says what the node needs
(`policy`: trainable with an LM head; `reference`: frozen; `value`: trainable with a value head,
a `ValueEngine`).
The built-in FSDP2 engine (training/trainer.py) registers as a plugin would (pyproject.toml):

    [project.entry-points."flowrl.training_engines"]
    my_engine = "my_pkg.engine:ENTRY"
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from flowrl import plugins

if TYPE_CHECKING:  # torch loads with an engine, not when a spec is validated
    import torch

GROUP = "flowrl.training_engines"
Role = Literal["policy", "reference", "value"]


@runtime_checkable
class TrainingEngine(Protocol):
    rank: int
    world_size: int

    def forward_backward(self, batch: Any, loss_fn: Callable) -> dict[str, float]:
        """Accumulate the gradient of `loss_fn(output, micro_batch, normaliser)` over the batch's
        micro-batches; returns the loss function's metrics (means over micro-batches and ranks)."""
        ...

    def step(self) -> dict[str, float]:
        """Apply the accumulated gradient (clip, optimizer, schedule); returns lr, grad norm, ..."""
        ...

    def compute_logprobs(self, batch: Any) -> torch.Tensor:
        """Logprobs of the batch's target tokens, (B, T), without gradient."""
        ...

    def named_weights(self, bucket_bytes: int = ...) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights as buckets of (Hugging Face name, tensor)."""
        ...

    def save(self, path: str | Path) -> Path: ...

    def load(self, path: str | Path) -> None: ...

    def export_hf(self, path: str | Path) -> Path:
        """A Hugging Face folder that `from_pretrained` loads."""
        ...


@runtime_checkable
class ValueEngine(TrainingEngine, Protocol):
    """What the `value` role adds (the critic node's model)."""

    def compute_values(self, batch: Any) -> torch.Tensor:
        """Value estimates per target token, (B, T)."""
        ...


@dataclass(frozen=True)
class EngineEntry:
    name: str
    build: Callable[[str, Any, Role], TrainingEngine]  # (model path, TrainerConfig, role) -> engine


@cache
def engines() -> dict[str, EngineEntry]:
    return {name: _entry(name) for name in names()}


def _entry(name: str) -> EngineEntry:
    """The registered engine `name`, loaded alone: another plugin's broken entry point costs only its own name."""
    ep = next(ep for ep in entry_points(group=GROUP) if ep.name == name)
    entry = ep.load()
    if not isinstance(entry, EngineEntry) or entry.name != ep.name:
        raise TypeError(f"entry point {ep.name} = {ep.value} is not an EngineEntry named {ep.name!r}")
    return entry


@cache
def names() -> tuple[str, ...]:
    """The registered engines' names, read from the entry points without loading them (loading
    the built-in one imports torch: `flowrl validate` need not)."""
    return tuple(sorted({ep.name for ep in entry_points(group=GROUP)}))


def check_name(name: str) -> str | None:
    """None if `name` is a registered training engine that loads, else what to say. A plugin's is
    loaded here (`flowrl validate`), flowrl's own not: it imports torch, and ships working."""
    if name not in names():
        return plugins.unknown("training engine", name, names())
    if plugins.targets(GROUP)[name].startswith("flowrl_operators."):
        return None
    try:
        _entry(name)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a plugin may fail in any way as it imports
        return f"training engine '{name}' cannot be loaded: {type(e).__name__}: {e}"
    return None


def build(name: str, model_path: str, config: Any, role: Role) -> TrainingEngine:
    problem = check_name(name)
    if problem:
        raise ValueError(problem)
    return _entry(name).build(model_path, config, role)


def join_group(rank: int, world_size: int) -> None:
    """The ranks of a replicated train node form one torch.distributed group (FSDP2 shards over it);
    the Ray executor sets MASTER_ADDR / MASTER_PORT for the rendezvous."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(f"a train node with replicas: {world_size} needs run.executor: ray, which gives "
                           "its ranks a rendezvous; use replicas: 1 with the in-process executor")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
