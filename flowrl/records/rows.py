"""The rows of a run directory's files, as msgspec Structs that its writers encode and RunDir decodes.

One definition per file, so a writer and a reader cannot disagree on a key or a type. Unknown keys
are ignored when read (a newer writer's additions do not break an older reader); a key of the wrong
type is an error naming the file, the line and the key (flowrl/records/lines.py). Fields added to a
file after its first format have defaults, so a run written before them still opens. Where a row
holds numbers an operator or the user names (the train node's metrics, an operator's counters),
the field is an open dict of numbers: `None` stands for a value JSON cannot hold (NaN, infinity),
which msgspec writes as null.

A field that only some rows carry is `UNSET` when absent: it is then left out when written, as
the writers always did (a metrics row's `health` exists only on the steps that found something).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

Numbers = dict[str, float | None]  # an open dict of named metrics; None: NaN or infinity


class Row(msgspec.Struct, kw_only=True):
    """Every record row: a plain mapping of what it holds, for code that takes dicts (trackers,
    health, the live view) or prints JSON."""

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class HealthEvent(Row):
    """A learning-health condition that began or ended (flowrl/health.py), in a metrics row."""
    condition: str  # entropy_collapse | tied_groups | reward_plateau | mismatch_growth | high_clip
    event: str  # began | ended
    step: int  # the step it began (or ended) at
    at: int | None = None  # the step that found it
    message: str = ""
    node: str | UnsetType = UNSET  # the train node; set by the coordinator


class MetricsRow(Row):
    """metrics.jsonl: one row per train step (flowrl/runtime/observe.py), or per replayed step."""
    step: int
    version: int = 0  # the version the step published (step + 1)
    node: str = ""  # the train node
    time: float = 0.0  # seconds since the run's origin; a replay's: since the replay began
    step_seconds: float = 0.0
    groups: int = 0
    samples_per_s: float = 0.0
    trajectories_per_s: float = 0.0
    reward: float | None = None
    reward_max: float | None = None
    queues: dict[str, int] = {}
    staleness: dict[str, int] = {}  # lag (train version - record version) -> groups
    dropped: int = 0
    dropped_total: int = 0
    stale_kept_total: int = 0
    rejected_total: int = 0
    filtered_total: int = 0
    filtered: int = 0
    oversampled: int = 0
    oversampled_total: int = 0
    coordinator_weight_bytes: int = 0
    idle: dict[str, float] = {}
    train: Numbers = {}  # the train operator's TrainResult.metrics
    operators: dict[str, Numbers] = {}  # node -> its operator's cumulative counters
    health: list[HealthEvent] | UnsetType = UNSET  # only on rows whose step found an event
    replay: bool | UnsetType = UNSET  # True on `flowrl replay`'s rows


class EvalRow(Row):
    """eval.jsonl: one greedy evaluation (operators/evaluate.py)."""
    version: int
    eval_reward: float | None
    scores: Numbers | UnsetType = UNSET  # data.eval.options.also
    samples: int = 0
    time: float = 0.0
    seconds: float = 0.0


class SampleRow(Row):
    """samples.jsonl: a trajectory of a trained batch (flowrl/runtime/tracking.py)."""
    step: int
    node: str
    id: str
    version: int | None = None
    reward: float | None = None
    prompt: str | None = None
    response: str | None = None
    prompt_ids: list[int] | UnsetType = UNSET  # when the records carry no text
    response_ids: list[int] | UnsetType = UNSET


class TraceEvent(Row):
    """An event of trace.json (Chrome trace format, flowrl/runtime/observe.py)."""
    name: str
    ph: str = ""  # X: a span, i: an instant, M: a process name (every event flowrl writes has one)
    ts: float | UnsetType = UNSET  # microseconds since the run's origin; a process name has none
    dur: float | UnsetType = UNSET  # a span's
    pid: int = 0
    tid: int = 0
    args: dict[str, Any] = {}
    s: str | UnsetType = UNSET  # an instant's scope

    @property
    def start_us(self) -> float:
        return 0.0 if self.ts is UNSET else self.ts

    @property
    def dur_us(self) -> float:
        return 0.0 if self.dur is UNSET else self.dur


class Trace(msgspec.Struct):
    """trace.json as a whole."""
    traceEvents: list[TraceEvent] = []  # noqa: N815 - Chrome's key
    displayTimeUnit: str = "ms"  # noqa: N815


class LedgerEntry(Row):
    """ledger.jsonl: a record produced, consumed, dropped, ... (flowrl/runtime/durability/ledger.py)."""
    event: str  # produce | consume | drop | pending | issue | reissue | admit | end | resume
    edge: str
    id: str
    step: int
    version: int
    admitted_version: int | UnsetType = UNSET  # issue
    budget: int | UnsetType = UNSET  # issue
    credit: int | UnsetType = UNSET  # issue
    replica: int | UnsetType = UNSET  # issue, reissue
    reason: str | UnsetType = UNSET  # drop
    weights: bool | UnsetType = UNSET  # an event of a weights edge
    consumer: str | UnsetType = UNSET  # consume
    consumer_version: int | UnsetType = UNSET  # consume



class ErrorRow(Row):
    """errors.jsonl: a failure of user code a node isolated (flowrl/runtime/untrained.py)."""
    node: str
    replica: int
    time: float
    error: str


class WaitRow(Row):
    """waits.jsonl: a wait that passed `slow_episode_s`, or ended (flowrl/runtime/waits.py). The
    wait's own keys (sample_id, episode, turn, awaits, waited_s, episode_s) are the operator's."""
    event: str  # began | ended
    node: str
    replica: int
    time: float
    awaits: str | None = None  # what it waits on
    waited_s: float | None = None
    sample_id: Any = None  # what names the work: the operator's choice (Operator.waits)
    episode: Any = None
    turn: Any = None
    episode_s: float | None = None


class Meta(msgspec.Struct, kw_only=True):
    """meta.json (flowrl/runtime/run.py)."""
    name: str
    origin: float  # epoch seconds: trace and metrics times count from it
    executor: str = "inprocess"
    steps: int = 0
    format: int = 2  # 3: checkpoints hold manifest.json
    health: int = 0  # 1: its metrics rows carry the health events
    # What each train node's metrics mean (`Operator.metric_roles`, as JSON); None: not declared
    metric_roles: dict[str, dict[str, Any]] | None = None


class Launch(msgspec.Struct, kw_only=True):
    """launch.json: how `flowrl run` was called, for `--resume` (flowrl/launch.py)."""
    file: str
    overrides: list[str]
    executor: str | None = None


class PhaseDone(msgspec.Struct, kw_only=True):
    """phase.json: a finished phase (flowrl/launch.py)."""
    status: str
    export: str | None = None  # the exported policy's folder
    seconds: float = 0.0


class ReplayInfo(msgspec.Struct, kw_only=True):
    """replay.json of a replay directory (flowrl/replay.py)."""
    source: str
    node: str
    overrides: list[str]
    steps: int
    ids_sha256: str


class StreamSizes(msgspec.Struct, kw_only=True, rename={"ledger": "ledger.jsonl", "metrics": "metrics.jsonl",
                                                        "samples": "samples.jsonl", "errors": "errors.jsonl",
                                                        "trace": "trace.json"}):
    """A checkpoint's streams.json: how long each record stream was when it was taken
    (flowrl/runtime/durability/streams.py), so a resume cuts them back to it. Keyed by file name;
    tensorboard/ and rollouts/ by the names of their files."""
    ledger: int = 0
    metrics: int = 0
    samples: int = 0
    errors: int = 0
    trace: int = 0
    tensorboard: dict[str, int] = {}
    rollouts: dict[str, int] = {}

    def of(self, file: str) -> int:
        """The size recorded for the stream named `file` (e.g. "metrics.jsonl"); 0 if none."""
        return msgspec.to_builtins(self).get(file, 0)

    def folder(self, name: str) -> dict[str, int]:
        """{file name: size} for the folder `name` ("tensorboard" or "rollouts")."""
        return msgspec.to_builtins(self).get(name, {})


# A checkpoint's manifest.json: {path relative to the checkpoint: [size in bytes, sha256 hex]}.
Manifest = dict[str, tuple[int, str]]


class TrackerEntry(Row):
    """One tracker in trackers.json (flowrl/runtime/tracking.py): the state its `open` returned (a
    run id, say) and, per train node, the last step it was sent."""
    state: dict[str, Any] = {}
    steps: dict[str, int] = {}
