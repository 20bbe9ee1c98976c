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
from flowrl.trackers import problem as tracker_problem

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
    final: bool = True  # also evaluate the final policy (the run waits for it)
    samples: PositiveInt = 64
    source: str | None = None  # defaults to the training source with held-out seeds
    # The greedy answers' token budget (default: the generate node's sampling.max_new_tokens).
    max_new_tokens: PositiveInt | None = None
    # Passed to the eval source, but for `reward` (module:attr) and `also` ({name: module:attr}: more
    # scores of the same answers, written to eval.jsonl as `scores`), which the evaluation reads.
    options: dict[str, Any] = {}


class FileSourceSpec(Strict):
    """A dataset file as the data source (flowrl/data/files.py). Paths are read from the working
    directory when relative."""

    file: Annotated[str, Meta(min_length=1)]  # .jsonl, .json (a list of objects), .csv, .parquet, or a datasets save_to_disk folder
    format: Literal["jsonl", "json", "csv", "parquet", "datasets"] | None = None  # default: from the name
    prompt: str | None = None  # column of prompt text (default: a column named prompt)
    messages: str | None = None  # column of chat messages (default: a column named messages)
    images: str | None = None  # column of images, for vision-language rows (default: a column named images)
    # Rows whose images are read at load (validate and each run's start), as every row's prompt is:
    # every row (default), or this many spread over a large file, said on stderr; flowrl/data/files.py.
    check_images: PositiveInt | None = None
    split: str | None = None  # the split of a datasets folder with several (default: train)
    shuffle: bool = True  # a new order every epoch, drawn from run.seed
    # Held-out rows for data.eval: another file, a split of the datasets folder, or rows of this file.
    eval_file: str | None = None
    eval_split: str | None = None
    eval_rows: PositiveInt | None = None
    eval_fraction: Annotated[float, Meta(gt=0, lt=1)] | None = None


class DataSpec(Strict):
    source: str | FileSourceSpec  # builtin:<name>, module:attr, or {file: PATH, ...}
    batch_size: PositiveInt = 16  # samples (prompt groups) per train step
    options: dict[str, Any] = {}  # passed to the source
    eval: EvalSpec | None = None

    def __post_init__(self) -> None:
        source = self.source
        if not isinstance(source, FileSourceSpec):
            return
        if self.options:
            raise ValueError("options: options apply to a module:attr source; a file source takes its keys under source")
        held = (source.eval_file, source.eval_split, source.eval_rows, source.eval_fraction)
        if self.eval is not None and self.eval.source is None and all(h is None for h in held):
            raise ValueError("eval: eval needs held-out rows of the file source: set source.eval_file, eval_split, "
                             "eval_rows or eval_fraction")
        if self.eval is not None and source.eval_rows is not None and self.eval.samples > source.eval_rows:
            raise ValueError(f"eval.samples: eval.samples ({self.eval.samples}) is more than source.eval_rows "
                             f"({source.eval_rows})")


class ClusterSpec(Strict):
    """What the pipeline may use; the compiler rejects nodes asking for more."""

    cpus: Annotated[float, Meta(gt=0)] = 2.0
    gpus: Annotated[float, Meta(ge=0)] = 0.0


class RunSpec(Strict):
    steps: PositiveInt = 10
    executor: Literal["inprocess", "ray"] = "inprocess"
    seed: int = 0
    # Under Ray: restarts of a dead generate actor, and of the run from its last checkpoint after a
    # train actor's process died (flowrl/runtime/run.py).
    max_restarts: NonNegativeInt = 3
    run_dir: Annotated[str, Meta(min_length=1)] | None = None
    # Wall-clock budget; the run ends cleanly (checkpoint, export) when it is spent. The clock
    # starts once every stage has set up (models loaded, the first evaluation done) and the run's
    # stages start taking work; a resumed run gets the whole budget again.
    max_seconds: Annotated[float, Meta(gt=0)] | None = None
    # End the run cleanly (checkpoint, export, exit 0) once a metric reaches a value (>=); with
    # several, when any one does. Names: eval_reward (data.eval), a number of the metrics row
    # (reward, ...), or train.<key> (the train node's metrics). See flowrl/spec/stop_when.py, flowrl/runtime/targets.py.
    stop_when: dict[str, float] = {}
    # Periodic checkpoints while the run goes on (flowrl/runtime/durability/checkpoints.py): every N policy
    # versions and/or every S seconds (neither set: every 1800 s); the newest `keep_checkpoints` stay.
    checkpoint_every: PositiveInt | None = None
    checkpoint_seconds: Annotated[float, Meta(gt=0)] | None = None
    keep_checkpoints: PositiveInt = 2
    # Where step metrics and the sample table go besides metrics.jsonl / samples.jsonl: registered
    # tracker names (tensorboard, wandb, mlflow, or a plugin's) or module:attr (flowrl/trackers/).
    trackers: list[Annotated[str, check_with(tracker_problem)]] = msgspec.field(
        default_factory=lambda: ["tensorboard"])
    samples_per_step: NonNegativeInt = 4  # trajectories of each trained batch in samples.jsonl (0: none)
    # Stop with exit 1 when a train node gets no sample for this many steps in a row (every one
    # rejected, filtered, invalid or dropped), showing the first errors (flowrl/runtime/untrained.py); 0: never.
    max_empty_steps: NonNegativeInt = 3
    # Append every batch a train node trains on to rollouts/<node>.bin, for `flowrl replay`
    # (flowrl/runtime/durability/rollouts.py, docs/runs.md "Replay").
    record_rollouts: bool = True
    # executor: ray attaches to this running cluster ("host:port" of its head, "auto", or
    # "ray://host:port") instead of starting one; RAY_ADDRESS does the same. flowrl never stops it.
    ray_address: Annotated[str, Meta(min_length=1)] | None = None
    # How long one call (open, log, close) of a tracker in `trackers` may take; past it, the tracker
    # is dropped with a warning (flowrl/runtime/tracking.py).
    tracker_timeout_s: Annotated[float, Meta(gt=0)] = 30.0

    def __post_init__(self) -> None:
        from flowrl.spec.stop_when import check_names

        check_names(self.stop_when)
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError("ray_address: ray_address is where the Ray executor runs: set executor: ray, or remove it")
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if twice:
            raise ValueError(f"trackers: {', '.join(twice)} is listed twice")


class EdgeSpec(Strict):
    mode: Literal["sync", "async"] = "sync"
    # Async only (None: unset; the compiler refuses them on a sync or weights edge, where nothing
    # reads them): defaults 1, 64 and drop.
    max_staleness: int | None = None
    capacity: int | None = None
    on_stale: Literal["drop", "keep"] | None = None
    kind: Literal["data", "weights"] = "data"


MIN_PHASE_SECONDS = 1.0


class PhaseSpec(Strict):
    """A phase runs the graph for a number of steps with some keys changed (`set`, dotted keys)."""

    name: str
    steps: PositiveInt | None = None
    seconds: Annotated[float, Meta(gt=0)] | None = None
    set: dict[str, Any] = {}

    def __post_init__(self) -> None:
        # The clock starts once every stage has set up; under a second no train step of a real
        # model finishes, and the phase would export nothing for the next one.
        if self.seconds is not None and self.seconds < MIN_PHASE_SECONDS:
            raise ValueError(f"seconds: phase '{self.name}' lasts {self.seconds:g} s, too short to train a step "
                             f"(at least {MIN_PHASE_SECONDS:g} s); give it more seconds, or steps")


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

    def __post_init__(self) -> None:
        if "eval_reward" in self.run.stop_when and self.data.eval is None:
            raise ValueError("run.stop_when.eval_reward: eval_reward needs data.eval (the periodic evaluation it reads)")
