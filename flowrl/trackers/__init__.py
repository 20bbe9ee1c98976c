"""Experiment trackers: where a run's step metrics and sample table go besides its own files.

    run: {trackers: [tensorboard, wandb, mlflow], samples_per_step: 4}

A tracker is a class that satisfies `Tracker` (open / log / close), registered by name in the
entry-point group `flowrl.trackers` or named by `module:attr`. The built-ins register through
pyproject.toml exactly as a plugin would:

    [project.entry-points."flowrl.trackers"]
    neptune = "my_pkg.tracking:Neptune"

Each tracker receives what metrics.jsonl and samples.jsonl receive, at the same flushes (every
~2 s while the run goes, flowrl/runtime/tracking.py): the metrics rows, whose numbers `scalars(row)`
flattens to TensorBoard's names (`runtime/reward`, `train/loss`, `queues/<edge>`, ...), and the
sample rows (step, id, version, reward, prompt, response; flowrl/runtime/observe.py). The run's
own files stay the record: a tracker that fails while the run goes is warned about and dropped.

`requires` names the modules a tracker imports; `flowrl validate` reports a missing one at
`run.trackers[i]` with what to install, before anything loads. An optional class attribute
`rewound = True` says the tracker's files are cut back to the checkpoint on resume like the run's
record streams (TensorBoard's event files), so it is sent the steps after the checkpoint again;
otherwise a resumed run sends it only steps it has not had (flowrl/runtime/tracking.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from flowrl import plugins
from flowrl.registry import OperatorError, import_path

GROUP = "flowrl.trackers"
# The pip package that provides each module a built-in tracker needs.
INSTALL = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
ROW_SCALARS = ("samples_per_s", "trajectories_per_s", "reward", "dropped", "step_seconds")
SAMPLE_COLUMNS = ("step", "id", "version", "reward", "prompt", "response")


@dataclass(frozen=True)
class TrackerContext:
    run_dir: Path
    name: str  # the run's (plan's) name
    # The run directory's name, and a phase's "<run>/<phase folder>": how a tracker names its run.
    label: str
    group: str | None  # a phased run's directory name, the same for its phases (wandb groups by it)
    origin: float  # the run's start, epoch seconds (a row's `time` counts from it)
    config: dict[str, Any]  # the plan as recorded in plan.json (environment values redacted)
    # What this tracker's `open` returned when it last opened in this run directory (a resume):
    # e.g. the run id to continue. Empty on a fresh run.
    state: dict[str, Any] = field(default_factory=dict)
    # run.tracker_timeout_s: how long the run waits for one call; a tracker whose client has its own
    # network timeouts may set them to it, so that a call it was dropped for does not linger.
    timeout_s: float = 30.0


@runtime_checkable
class Tracker(Protocol):
    requires: ClassVar[tuple[str, ...]]  # modules it imports (checked by `flowrl validate`)

    def open(self, context: TrackerContext) -> dict[str, Any]:
        """Start (or continue, from `context.state`) logging; returns the state to keep for a resume."""
        ...

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        """Metrics rows (metrics.jsonl's) and sample rows (samples.jsonl's) of steps not sent before."""
        ...

    def close(self) -> None: ...


class TrackerError(ValueError):
    """A tracker name that is not registered or not installed, or a class that breaks the protocol."""


def names() -> list[str]:
    return sorted(plugins.targets(GROUP))


def resolve(name: str) -> type[Tracker]:
    """The tracker class for a registered name or a `module:attr` path."""
    target = name if ":" in name else plugins.targets(GROUP).get(name)
    if target is None:
        raise TrackerError(plugins.unknown("tracker", name, names()))
    try:
        cls = import_path(target)
    except OperatorError as e:
        raise TrackerError(str(e)) from e
    check(cls, name)
    return cls  # type: ignore[return-value]


def check(cls: Any, name: str) -> None:
    """The contract every tracker class satisfies (tests/test_trackers.py runs it on all)."""
    if not isinstance(cls, type):
        raise TrackerError(f"tracker '{name}' is a {type(cls).__name__}, not a class")
    missing = [m for m in ("open", "log", "close") if not callable(getattr(cls, m, None))]
    if missing:
        raise TrackerError(f"tracker '{name}' ({cls.__name__}) has no {', '.join(missing)} method")
    requires = getattr(cls, "requires", None)
    if not (isinstance(requires, tuple) and all(isinstance(r, str) for r in requires)):
        raise TrackerError(f"tracker '{name}' ({cls.__name__}): `requires` must be a tuple of the module "
                           "names it imports (() for none)")


def problem(name: str, section: Any = None) -> str | None:
    """What is wrong with `run.trackers` naming `name` (None: it can run): for `flowrl validate`."""
    del section
    try:
        cls = resolve(name)
    except TrackerError as e:
        return str(e)
    absent = [m for m in cls.requires if not _installed(m)]
    if not absent:
        return None
    packages = " ".join(INSTALL.get(m, m) for m in absent)
    extra = " (or pip install 'flowrl[trackers]')" if name in ("wandb", "mlflow") else ""
    return f"tracker '{name}' needs {', '.join(absent)}, which is not installed: pip install {packages}{extra}"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers under TensorBoard's names, for every tracker alike."""
    out = {f"runtime/{key}": float(row[key]) for key in ROW_SCALARS if _number(row.get(key))}
    for group in ("queues", "idle", "train"):
        out.update({f"{group}/{key}": float(v) for key, v in (row.get(group) or {}).items() if _number(v)})
    for node, counters in (row.get("operators") or {}).items():
        out.update({f"{node}/{key}": float(v) for key, v in counters.items() if _number(v)})
    return out


def sample_cells(sample: dict[str, Any]) -> list[Any]:
    """One sample row as table cells (SAMPLE_COLUMNS); token ids stand in for text a record lacks."""
    cells = [sample.get(c) for c in SAMPLE_COLUMNS]
    for i, key in ((4, "prompt"), (5, "response")):
        if cells[i] is None and sample.get(f"{key}_ids") is not None:
            cells[i] = f"ids: {sample[f'{key}_ids']}"
    return cells


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return False


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
