"""The operator protocol: what every node of a pipeline is an instance of.

An operator declares, as class attributes, what the compiler needs without instantiating it:
its node `kind`, typed input and output ports, a msgspec `Config` schema for its YAML keys, and
default resources. The runtime instantiates it inside a stage with the validated config.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec

# Port types: an edge may only join an output and an input of the same type.
PROMPTS = "prompts"  # samples from a data source
TRAJECTORIES = "trajectories"  # groups of generated trajectories
POLICY = "policy"  # a new policy version published by a trainer
WEIGHTS = "weights"  # weights delivered to engines (the one allowed back edge)
PORT_TYPES = (PROMPTS, TRAJECTORIES, POLICY, WEIGHTS)

KINDS = ("generate", "reward", "reference", "train", "sync", "transform")


class Resources(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What one replica of a stage needs. Fractional CPUs let a 2-core laptop host a pipeline."""

    cpus: Annotated[float, msgspec.Meta(ge=0)] = 0.25
    gpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Ray placement, read by the Ray executor only (flowrl/runtime/executors/ray_placement.py). `custom`:
    # Ray custom resources each replica needs, as Ray's own `resources=` option (a node offers them
    # with `ray start --resources`); `labels`: the node labels a replica's Ray node must carry, as
    # Ray's `label_selector` (`ray start --labels`); `placement`: how the replicas spread over Ray
    # nodes (the strategy of the node's placement group).
    custom: dict[str, float] = {}  # amounts > 0 (flowrl/graph/compile.py checks them)
    labels: dict[str, str] = {}
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"


class EmptyConfig(msgspec.Struct, forbid_unknown_fields=True):
    pass


class OperatorContext(msgspec.Struct, kw_only=True):
    """What a stage hands its operator: where it is and what the pipeline shares."""

    node: str
    run_dir: Path | None = None
    seed: int = 0
    # The pipeline-level `model` and `data` sections, already validated.
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    rank: int = 0
    world_size: int = 1
    # The run this stage belongs to (one phase of a file with phases): its length in train steps
    # (None when only `seconds` bounds it), the phase's name and the executor.
    steps: int | None = None
    phase: str = "main"
    executor: str = "inprocess"
    # Torch threads a train step runs with (torch's count is per OS thread, so the operator sets it
    # in the thread each step runs in): `flowrl replay` gives the recorded run's count, since a
    # float sum's order depends on it. None: the process's own.
    threads: int | None = None


class Knobs(msgspec.Struct, frozen=True, kw_only=True):
    """How the runtime drives an operator; its class says, from its config (`Operator.knobs`)."""

    concurrency: int = 16  # calls in flight at once: samples (generate) or records (transforms)
    partial_rollout: bool = False  # generate: weights are updated while generations are in flight
    # Trajectory fields this node fills with its config, beyond its class's `provides` (a generate
    # node's greedy baseline rows), for the graph checks downstream (GraphFacts.upstream_provides).
    provides: frozenset[str] = frozenset()


class CostShape(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a node's cost, as `flowrl plan` models it (flowrl/plan/, docs/plan.md); its class
    says, from its config (`Operator.cost_shape`), so that plan reads no config key by name."""

    concurrency: int = 16  # calls in flight per replica, as `Knobs.concurrency`
    partial_rollout: bool = False  # generate: as `Knobs.partial_rollout`
    group_size: int = 1  # generate: trajectories per sample
    # generate: rows its engine decodes together in one iteration (the rest wait for a slot); None:
    # no limit known, every admitted row is decoded at once.
    slots: int | None = None
    # train: the step runs in a child process of its own with this many threads, beside the run's
    # process (no interpreter lock shared with the other stages); None: in the stage's process.
    process_threads: int | None = None
    # generate: the threads its engine's process decodes with (its per-row work runs over them,
    # docs/plan.md "Engine threads"); None: not known, one.
    threads: int | None = None
    # train: a step's passes over its tokens in forward-pass units (a forward 1, a backward 2): 3 a
    # plain step; a step's time scales with it between configurations. None: not known, unchanged.
    passes: float | None = None


class MetricRoles(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which of a train node's step metrics (`TrainResult.metrics`) plays which part in its learning
    health (flowrl/health.py) and in `flowrl inspect`'s columns; its class says, from its config
    (`Operator.metric_roles`). Each field names a metric; None: the node reports none that plays it."""

    entropy: str | None = None  # the policy's mean token entropy on the step's tokens
    clip_fraction: str | None = None  # the share of tokens whose ratio the trust region clipped
    mismatch: str | None = None  # train/inference mismatch: mean |trainer - engine| logprob a token
    tied_groups: str | None = None  # the share of groups whose rewards all tie
    policy_kl: str | None = None  # KL between the policy before and after the step
    grad_norm: str | None = None
    # A metric only a policy-gradient step reports: a step without it is not judged (a supervised
    # step drives entropy down and its reward to a ceiling by design). None: every step is judged.
    policy_gradient: str | None = None

    def names(self) -> dict[str, str]:
        """role -> the metric that plays it, for the roles declared."""
        return {role: name for role in self.__struct_fields__ if isinstance(name := getattr(self, role), str)}


class GraphFacts(msgspec.Struct, frozen=True):
    """What the compiler knows about a node's place in the graph, for `Operator.check_graph`."""

    async_upstream: bool = False  # an async edge feeds this node, directly or further up
    partial_rollout_upstream: bool = False  # an upstream generate node continues across updates
    executor: str = "inprocess"  # run.executor: whether the stages share one process
    # Trajectory fields filled by upstream nodes (their operators' `provides`), e.g. values.
    upstream_provides: frozenset[str] = frozenset()
    replicas: int = 1  # the node's own resources.replicas
    model_path: str = ""  # model.path of the spec, for checks against the model's config (no weights)


class DataFacts(msgspec.Struct, frozen=True):
    """The pipeline's `data` and `model` sections as a run would use them, for `Operator.check_data`."""

    data: dict[str, Any]  # the `data` section, as plain data
    seed: int = 0  # run.seed
    model: dict[str, Any] | None = None  # the `model` section; None where model.path is wrong (reported)
    source: Any = None  # the training data source as built, None if it could not be built


class ConfigError(Exception):
    """A node's config that its setup found wrong (e.g. a model path that cannot serve): raised from
    `setup()` with the node's name and the key path inside its config, it is reported like a
    validation error, at that key of the spec file, without a traceback (in-process executor)."""

    def __init__(self, node: str, key: tuple[str | int, ...], message: str) -> None:
        super().__init__(f"nodes.{node}.{'.'.join(map(str, key))}: {message}")
        self.node, self.key, self.message = node, key, message


class TrainResult(msgspec.Struct, kw_only=True):
    """What a train step returns: the new policy record (opaque; sent on the `policy` port) and
    numbers for metrics.jsonl."""

    policy: Any
    metrics: dict[str, float] = {}


class Operator:
    """Base class of every operator. Subclasses set the class attributes below.

    `process` is the transform shape (reward, reference, filters): it takes a dict of input port
    name to value and returns a dict of output port name to value. Long-running node kinds
    (generate, train, sync) implement the methods the runtime documents for their kind.

    What the runtime calls, per kind (flowrl/runtime/stage.py is the caller):
    - generate: `generate(sample, step=, sample_id=)` once per sample, many concurrently (up to
      `knobs(config).concurrency`); `update_weights(weights, version)` when a newer weights
      record arrives, after the in-flight `generate` calls have returned; with
      `knobs(config).partial_rollout` instead `pause()`, `update_weights(...)`, `resume()` while they
      are still in flight (they continue under the new weights).
    - reward, reference, transform: `process({port: value}) -> {port: value}` once per record
      (a Group), concurrently up to `knobs(config).concurrency` (default 16). A port missing from the
      result, or None, filters the record out on that port.
    - train: `train(groups, step=)` once per step, one at a time, with the step's groups (up to
      `data.batch_size`; fewer, even none, if some were rejected, filtered or dropped as stale);
      returns a TrainResult (with `context.threads` set, each step runs with that many torch
      threads, set in the thread it runs in). The runtime publishes policy version step + 1 with its `policy`
      (None is allowed, e.g. nothing to train on: the record still goes out and carries the version).
      With `resources.replicas: N`, the N replicas are the ranks of one model: each gets the same
      groups (shard them by `context.rank`), the policy and metrics of rank 0 are published, and
      under Ray each rank finds MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set for
      `torch.distributed.init_process_group(init_method="env://")` in `setup()`.
    - sync: `sync(policy, version=)` per policy record, returns the weights record that the
      `kind: weights` edge delivers to generate's `update_weights`. Both records are opaque to
      the runtime (a weight-transport handle, for example); under Ray they must pickle.
    Checkpoints call `state_dict()` (pickled; keep it small) and `save(path)`, a directory of the
    operator's own, for heavy state such as a sharded model; resume calls `load(path)`, then
    `load_state_dict(state)`, after `setup()`.
    """

    kind: ClassVar[str] = "transform"
    Config: ClassVar[type[msgspec.Struct]] = EmptyConfig
    inputs: ClassVar[dict[str, str]] = {}
    outputs: ClassVar[dict[str, str]] = {}
    resources: ClassVar[Resources] = Resources()
    # Trajectory fields this operator fills (e.g. `values`, `reference_logprobs`), so that a node
    # downstream that needs them can say in `check_graph` when none is upstream.
    provides: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def knobs(cls, config: msgspec.Struct) -> Knobs:
        """How the runtime drives this operator (flowrl/runtime/stage.py; the compiler's GraphFacts)."""
        del config
        return Knobs()

    @classmethod
    def check_graph(cls, config: msgspec.Struct, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        """Rules that need the graph (e.g. a loss must correct stale data). Returns (key path, message)."""
        del config, facts
        return []

    @classmethod
    def check_data(cls, config: msgspec.Struct, facts: DataFacts) -> list[tuple[tuple[str, ...], str]]:
        """What this node's use of the data would meet (e.g. generate: `data.eval`'s held-out source
        and reward; images for a text-only model). Returns (key path from the spec's root, message)."""
        del config, facts
        return []

    @classmethod
    def reported_metrics(cls, config: msgspec.Struct) -> frozenset[str] | None:
        """A train node: the names its steps' `TrainResult.metrics` may hold, so that `flowrl validate`
        refuses a `run.stop_when: {train.<key>: ...}` no step would report. None (the default): not
        declared, nothing is checked."""
        del config
        return None

    @classmethod
    def metric_roles(cls, config: msgspec.Struct) -> MetricRoles | None:
        """A train node: which of its reported metrics plays which part in judging its learning
        health (flowrl/health.py). None (the default): not declared, and health judges none of its steps."""
        del config
        return None

    @classmethod
    def cost_shape(cls, config: msgspec.Struct) -> CostShape:
        """The shape of this node's cost for `flowrl plan`: slots, group size, concurrency, a
        process of its own. The default: what `knobs(config)` says, one trajectory per sample, no
        slot limit, in the stage's process."""
        knobs = cls.knobs(config)
        return CostShape(concurrency=knobs.concurrency, partial_rollout=knobs.partial_rollout)

    @classmethod
    def export_difference(cls, recorded: Path, replayed: Path) -> float | None:
        """A train node: the largest |difference| of any parameter between two of its final exports
        (what its `close()` wrote), for `flowrl replay`'s reproduction check; raises ValueError where
        they hold different parameters. None (the default): it writes none that can be compared."""
        del recorded, replayed
        return None

    @classmethod
    def pass_timer(cls, model: str, rows: int, length: int) -> Callable[[int], float] | None:
        """For `flowrl plan`'s thread gain (flowrl/plan/threads.py): a function `threads -> seconds`
        that runs this node's torch work once on that many torch threads (a train step: a forward
        and backward pass; an engine iteration: a forward pass) over `rows` rows of `length` tokens
        of the model at `model` (a folder or `builtin:<name>`). None (the default): nothing to
        time, and plan scales the node's work linearly with its threads."""
        del model, rows, length
        return None

    @classmethod
    def handoff(cls, model: str, rows: int) -> float | None:
        """For `flowrl plan`'s interpreter lock (flowrl/plan/cpu.py): how fast two of this node's
        engines, each decoding `rows` rows of the model at `model`, run in two threads of one process
        against the same work in turns (1: handing the lock over costs nothing; below 1, it costs
        that share). None (the default): nothing to time, and plan takes handoffs as free."""
        del model, rows
        return None

    @classmethod
    def oversampling(cls, config: msgspec.Struct) -> tuple[float, float] | None:
        """A filter that drops groups may ask generate to over-sample: (samples issued per step at
        first, at most) as multiples of data.batch_size (see flowrl/runtime/coordinator.py)."""
        del config
        return None

    def __init__(self, config: msgspec.Struct, context: OperatorContext) -> None:
        self.config = config
        self.context = context

    async def setup(self) -> None:
        """Heavy initialisation (models, engines); called once inside the stage's process."""

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} does not implement process()")

    # -- generate kind ------------------------------------------------------------------------
    async def generate(self, sample: dict[str, Any], *, step: int, sample_id: str) -> Any:
        """One sample -> a `Group` (stamped with the policy version it was generated with), or None
        to reject the sample."""
        raise NotImplementedError(f"{type(self).__name__} does not implement generate()")

    async def update_weights(self, weights: Any, version: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement update_weights()")

    async def pause(self) -> None:
        """Partial rollout: stop between decode steps, keeping in-flight requests."""
        raise NotImplementedError(f"{type(self).__name__} does not implement pause() (needed by partial_rollout)")

    async def resume(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement resume() (needed by partial_rollout)")

    # -- train kind ---------------------------------------------------------------------------
    async def train(self, groups: list[Any], *, step: int) -> TrainResult:
        raise NotImplementedError(f"{type(self).__name__} does not implement train()")

    async def publish(self) -> TrainResult:
        """The current policy record again, without training: a resumed run sends the restored
        policy to the engines before anything is generated (flowrl/runtime/durability/snapshot.py)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement publish() (needed to resume)")

    # -- sync kind ----------------------------------------------------------------------------
    async def sync(self, policy: Any, *, version: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement sync()")

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write heavy state into the directory `path` (it exists)."""
        del path

    def load(self, path: Path) -> None:
        del path

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (errors, timeouts, drops, ...), summed over replicas into each
        metrics.jsonl row under `operators.<node>`."""
        return {}

    def errors(self) -> list[str]:
        """Failures of user code this operator isolated since the last call (an episode that
        raised, a reward that returned NaN), one text each naming the sample; the call drains them.
        The runtime keeps the first few of a run in errors.jsonl and shows them when nothing is
        trained (run.max_empty_steps). Keep the texts short: the user's frames, not the library's
        (flowrl.blame.describe)."""
        return []

    def waits(self) -> list[dict[str, Any]]:
        """What this operator's work has awaited too long now (a generate node's slow episodes:
        flowrl_operators.waits), one dict each with at least `awaits` (what it waits on) and
        `waited_s`, plus what names the work (e.g. `sample_id`, `episode`, `turn`). Asked about once
        a second; the runtime writes each wait to waits.jsonl when it first and last appears, and
        the live view names the longest."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    async def close(self) -> None:
        """Release processes, servers and threads."""


def summary(op: type[Operator]) -> str:
    """The first line of an operator's docstring."""
    doc = (op.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""
