"""Resume: verify a run directory before trusting it, then ready it to continue.

Checked, in this order, before any weights load:
- the plan compiled now equals the one the run started with (`plan.json`): a node renamed, another
  pipeline or a changed batch_size is refused, naming what changed (keys that only say how long
  and how the run is driven, such as run.steps or run.checkpoint_every, may change);
- the checkpoint: the one `checkpoints/latest` names, every file matching the manifest taken at
  save (checkpoints.py). When `latest` is missing, empty or names no folder, the newest intact
  `step-N` is used and the choice said; a damaged checkpoint that `latest` names is refused with
  the intact one to use instead;
- the record streams: none shorter than the checkpoint recorded (streams.shortfall): cutting them
  back would otherwise pad a torn ledger with NUL bytes;
- the coordinator state and stream index parse.
A directory with no checkpoint at all (a run stopped before its first one) starts again from step
0, as verl's and AReaL's auto-resume do, but says so and keeps the earlier records in `earlier-<n>/`.
Anything else is a `ResumeError`: a message naming the file and what to do, never a traceback.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from flowrl.graph.plan import Plan
from flowrl.records import Checkpoint, Meta, RunDir
from flowrl.records.checkpoint import STREAMS
from flowrl.runtime.durability import checkpoints, streams
from flowrl.spec.errors import UserError

T = TypeVar("T")
MANIFEST_FORMAT = 3  # meta.json "format" from which every checkpoint has a manifest
SHOWN = 6  # differences named when a spec was edited
# Plan fields compared on resume; the others (order, facts) follow from nodes and edges, and
# `cluster` (the machine's size) may change between the two.
COMPARED = ("name", "model", "data", "run", "seed", "phases", "nodes", "edges")
# Run keys that say how long and how the run is driven, not what it computes: they may change.
ADJUSTABLE = {"steps", "max_seconds", "stop_when", "checkpoint_every", "checkpoint_seconds", "keep_checkpoints",
              "trackers", "samples_per_step", "max_restarts", "max_empty_steps", "executor", "ray_address",
              "run_dir", "phase"}
NEW_RUN = "start a new run (flowrl run FILE --run-dir NEW_DIR)"


class ResumeError(UserError):
    """The run directory cannot be resumed as it is: the message names the file and what to do."""


def prepare(plan: Plan, run_dir: Path) -> tuple[bytes, Path, float] | None:
    """(coordinator state, checkpoint, origin) to resume `run_dir` from, its streams cut back to
    the checkpoint; None when it holds no checkpoint (said, and its records set aside)."""
    meta = _meta(run_dir)
    _same_plan(plan, run_dir)
    checkpoint, note = choose(run_dir, meta.format)
    if checkpoint is None:
        _start_again(run_dir)
        return None
    sizes = _record(checkpoint / STREAMS, Checkpoint(checkpoint).streams)
    short = streams.shortfall(run_dir, sizes)
    if short:
        raise ResumeError(f"cannot resume {run_dir} from {checkpoint.name}: {short}; records written before the "
                          "checkpoint were lost or changed since. Restore that file, or " + NEW_RUN)
    state = (checkpoint / "coordinator.pkl").read_bytes()
    try:
        pickle.loads(state)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ResumeError(f"cannot read {checkpoint / 'coordinator.pkl'}: {type(e).__name__}: {e}; "
                          f"{_instead(run_dir, checkpoint)}") from None
    if note:
        print(f"flowrl: {note}", file=sys.stderr, flush=True)
    streams.truncate(run_dir, sizes)
    return state, checkpoint, meta.origin


def choose(run_dir: Path, fmt: int = MANIFEST_FORMAT) -> tuple[Path | None, str | None]:
    """The checkpoint to resume from, and what to say about the choice (None: nothing to say)."""
    pointer = run_dir / "checkpoints" / "latest"
    named = checkpoints.latest(run_dir)
    if named is not None:
        problem = _damage(named, fmt)
        if problem:
            raise ResumeError(f"checkpoint {named} (named by {pointer}) is damaged: {problem}. "
                              + _instead(run_dir, named, fmt))
        return named, None
    found = checkpoints.steps(run_dir)
    if not found and not pointer.exists():
        return None, None
    why = _pointer_problem(pointer)
    skipped = []
    for folder in found:
        problem = _damage(folder, fmt)
        if problem is None:
            also = f" ({'; '.join(skipped)})" if skipped else ""
            return folder, (f"{pointer} {why}; resuming from {folder.name}, the newest intact checkpoint{also}")
        skipped.append(f"{folder.name} is damaged: {problem}")
    detail = "; ".join(skipped) or "no step-N checkpoint folder is left"
    raise ResumeError(f"cannot resume {run_dir}: {pointer} {why} and no intact checkpoint remains ({detail}); "
                      + NEW_RUN)


def _damage(folder: Path, fmt: int) -> str | None:
    if not (folder / "coordinator.pkl").is_file() or not (folder / STREAMS).is_file():
        return f"{folder} lacks {'coordinator.pkl' if not (folder / 'coordinator.pkl').is_file() else STREAMS}"
    return checkpoints.damage(folder) if fmt >= MANIFEST_FORMAT else None  # older runs wrote no manifest


def _pointer_problem(pointer: Path) -> str:
    if not pointer.exists():
        return "is missing"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot be read ({e})"
    return "is empty" if not name else f"names {name[:60]!r}, which is no checkpoint folder"


def _instead(run_dir: Path, bad: Path, fmt: int = MANIFEST_FORMAT) -> str:
    """What to do about damaged checkpoint `bad`: the older intact one to resume from, if any."""
    for folder in checkpoints.steps(run_dir):
        if folder != bad and _damage(folder, fmt) is None:
            return (f"{folder.name} is intact: to resume from it, write {folder.name} into "
                    f"{run_dir / 'checkpoints' / 'latest'} (its later steps are trained again); or " + NEW_RUN)
    return "no other checkpoint is intact: " + NEW_RUN


def _meta(run_dir: Path) -> Meta:
    return _record(run_dir / "meta.json", RunDir(run_dir).meta)


def _record(path: Path, read: Callable[[], T]) -> T:
    """A record of the run (`path`, read by `read`), its absence or damage a ResumeError saying what to do."""
    if not path.exists():
        raise ResumeError(f"{path} is missing: the run directory is incomplete; " + NEW_RUN)
    try:
        return read()
    except (OSError, ValueError) as e:  # a RecordError names the file, line and key
        raise ResumeError(f"cannot read {e}; the file is damaged: " + NEW_RUN) from None


def _same_plan(plan: Plan, run_dir: Path) -> None:
    """Refuse a plan that differs from the one the run started with, naming what changed."""
    then = _record(run_dir / "plan.json", RunDir(run_dir).plan_record)
    now = msgspec.json.decode(plan.record())
    for record in (then, now):
        record["run"] = {k: v for k, v in (record.get("run") or {}).items() if k not in ADJUSTABLE}
    changed: list[str] = []
    for key in COMPARED:
        if key == "edges" and any(c.startswith("nodes:") for c in changed):
            continue  # renamed or added nodes change the edges too
        _diff(then.get(key), now.get(key), key, changed)
    if changed:
        shown = "; ".join(changed[:SHOWN]) + (f"; and {len(changed) - SHOWN} more" if len(changed) > SHOWN else "")
        raise ResumeError(f"the pipeline in {run_dir} is not the one its run started with ({run_dir / 'plan.json'}): "
                          f"{shown}. --resume continues a run unchanged: restore its spec.yaml (and launch.json), or " + NEW_RUN)


def _diff(then: Any, now: Any, path: str, out: list[str]) -> None:
    if isinstance(then, dict) and isinstance(now, dict):
        gone, new = [k for k in then if k not in now], [k for k in now if k not in then]
        if gone or new:
            parts = [f"{k!r} gone" for k in gone] + [f"{k!r} new" for k in new]
            out.append(f"{path}: {', '.join(parts)}")
        for k in then:
            if k in now:
                _diff(then[k], now[k], f"{path}.{k}", out)
    elif isinstance(then, list) and isinstance(now, list) and len(then) == len(now):
        for i, (a, b) in enumerate(zip(then, now, strict=True)):
            _diff(a, b, f"{path}[{i}]", out)
    elif then != now:
        out.append(f"{path} was {_short(then)}, is {_short(now)}")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _start_again(run_dir: Path) -> None:
    """No checkpoint: the run starts again from step 0; an earlier attempt's records are kept."""
    names = [*streams.STREAMS, "trace.json", "tensorboard", streams.ROLLOUTS]
    present = [n for n in names if (run_dir / n).exists()]
    aside = None
    if present:
        n = 1
        while (run_dir / f"earlier-{n}").exists():
            n += 1
        aside = run_dir / f"earlier-{n}"
        aside.mkdir()
        for name in present:
            shutil.move(str(run_dir / name), str(aside / name))
    kept = f"; the earlier attempt's records are in {aside}" if aside else ""
    print(f"flowrl: {run_dir} holds no checkpoint (the run stopped before its first one: see "
          f"run.checkpoint_every); starting it again from step 0{kept}", file=sys.stderr, flush=True)
