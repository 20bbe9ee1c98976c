"""The pipeline spec schema: msgspec Structs, strict (unknown keys are errors).

Node entries are validated in two passes: the keys below (`op`, `resources`) here, and every
other key by the operator's own `Config` once the compiler has resolved the operator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from flowrl.operator import Resources
from flowrl.spec.refs import check_with, model_folder

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelSpec(Strict):
    path: Annotated[str, check_with(model_folder)]  # a local Hugging Face directory, or builtin:<name>
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class EvalSpec(Strict):
    """Periodic greedy evaluation on held-out samples."""

    every: PositiveInt = 10  # steps
    samples: PositiveInt = 64
    source: str | None = None  # defaults to the training source with held-out seeds
    options: dict[str, Any] = {}


class DataSpec(Strict):
    source: str  # builtin:<name> or module:attr
    batch_size: PositiveInt = 16  # samples (prompt groups) per train step
    options: dict[str, Any] = {}  # passed to the source
    eval: EvalSpec | None = None


class ClusterSpec(Strict):
    """What the pipeline may use; the compiler rejects nodes asking for more."""

    cpus: Annotated[float, Meta(gt=0)] = 2.0
    gpus: Annotated[float, Meta(ge=0)] = 0.0


class RunSpec(Strict):
    steps: PositiveInt = 10
    executor: Literal["inprocess", "ray"] = "inprocess"
    seed: int = 0
    max_restarts: NonNegativeInt = 3  # of a dead generate actor under the Ray executor
    run_dir: str | None = None
    # Wall-clock budget; the run ends cleanly (checkpoint, export) when it is spent.
    max_seconds: Annotated[float, Meta(gt=0)] | None = None


class EdgeSpec(Strict):
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int | None = None
    capacity: int = 64
    on_stale: Literal["drop", "keep"] = "drop"
    kind: Literal["data", "weights"] = "data"


class PhaseSpec(Strict):
    """A phase runs the graph for a number of steps with some keys changed (`set`, dotted keys)."""

    name: str
    steps: PositiveInt | None = None
    seconds: Annotated[float, Meta(gt=0)] | None = None
    set: dict[str, Any] = {}


class NodeSpec(msgspec.Struct, kw_only=True):
    """`op` and `resources`; all other keys of a node belong to its operator's Config."""

    op: str
    resources: Resources | None = None


class PipelineSpec(Strict):
    flowrl: Literal[1]
    name: str
    model: ModelSpec
    data: DataSpec
    nodes: dict[str, Any]  # name -> {op, resources, ...operator config}; checked by the compiler
    # Entries are `"a -> b"` or `{"a -> b": {mode: ...}}`; the compiler parses them with positions.
    edges: list[str | dict[str, Any]]
    cluster: ClusterSpec = msgspec.field(default_factory=ClusterSpec)
    run: RunSpec = msgspec.field(default_factory=RunSpec)
    phases: list[PhaseSpec] = []
    description: str = ""
