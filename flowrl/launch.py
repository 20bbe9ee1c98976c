"""`flowrl run`: a spec file -> its phases run one after another in a run directory.

The run directory keeps what resume needs: `spec.yaml` (the file as given) and `launch.json`
(the command-line overrides and executor). A phase is done when its directory holds
`phase.json`; `resume()` skips done phases and resumes the first unfinished one from its latest
checkpoint (or starts it, if it has none).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from flowrl.graph.compile import compile_spec
from flowrl.operator import ConfigError
from flowrl.records import Launch, PhaseDone, RunDir, encode
from flowrl.spec import guard, semantics
from flowrl.spec.errors import SpecError, UserError
from flowrl.spec.load import LoadedSpec, load
from flowrl.spec.phases import expand, phase_dir
from flowrl.spec.schema import PhaseSpec

if TYPE_CHECKING:
    from flowrl.runtime.run import RunResult


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def start(file: str, overrides: list[str], run_dir: Path | None = None, executor: str | None = None,
          progress: bool = True) -> list:
    """Run every phase of `file` from scratch; returns the phases' RunResults."""
    if executor:  # as an override, so that the graph checks see it (e.g. a transport that needs one process)
        overrides = [*overrides, f"run.executor={executor}"]
    loaded = load(file, overrides)
    # Every phase must compile and pass the semantic checks before anything runs.
    semantics.check([(phase, compile_spec(phase_loaded)) for phase, phase_loaded in expand(loaded)])
    run_dir = Path(run_dir or loaded.spec.run.run_dir or default_run_dir(loaded.spec.name))
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"the run directory {run_dir} is a file; choose another --run-dir")
    if (run_dir / "launch.json").exists():
        raise UserError(f"{run_dir} already holds a run; continue it with `flowrl run --resume {run_dir}` or "
                        "choose another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "spec.yaml").write_text(guard.read_text(file))
        (run_dir / "launch.json").write_bytes(encode(Launch(file=file, overrides=overrides, executor=executor)))
    except OSError as e:
        raise UserError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from e
    return _run_phases(loaded, run_dir, executor, progress)


def resume(run_dir: Path, progress: bool = True) -> list:
    """Continue an interrupted `start()` from its run directory."""
    launch = _launch_record(run_dir)
    loaded = load(str(run_dir / "spec.yaml"), launch.overrides)
    phases = expand(loaded)
    single = not loaded.spec.phases
    if all(((run_dir if single else phase_dir(run_dir, i, phase)) / "phase.json").exists()
           for i, (phase, _) in enumerate(phases)):
        raise UserError(f"the run in {run_dir} has finished; nothing to resume (start a new run instead)")
    return _run_phases(loaded, run_dir, launch.executor, progress, resuming=True)


def _launch_record(run_dir: Path) -> Launch:
    """launch.json of a run directory, or a UserError saying why `run_dir` is not one."""
    if not run_dir.is_dir():
        raise UserError(f"no run directory {run_dir}; --resume takes the directory of an earlier `flowrl run`")
    record = run_dir / "launch.json"
    if not record.is_file() or not (run_dir / "spec.yaml").is_file():
        raise UserError(f"{run_dir} is not a run directory (no launch.json and spec.yaml); --resume takes the "
                        "directory of an earlier `flowrl run`")
    try:
        return RunDir(run_dir).launch()
    except OSError as e:
        raise UserError(f"cannot read {record}: {e}") from e
    except ValueError as e:  # a RecordError: it names the file and what is wrong
        raise UserError(f"cannot read {e}") from e


def _too_short(phase: PhaseSpec, result: RunResult) -> str:
    return (f"phase '{phase.name}' ran out of its {phase.seconds:g} s before one train step finished "
            f"(it ran {result.seconds:.2g} s after setting up): nothing was trained, so it exported no policy "
            "for the next phase; give it more seconds (or steps)")


def _run_phases(loaded: LoadedSpec, run_dir: Path, executor: str | None, progress: bool,
                resuming: bool = False) -> list:
    from flowrl.runtime import StageFailed, run

    results = []
    model_path: str | None = None
    exported: dict[str, str | None] = {}  # each finished phase's export, for `phase:<name>` model paths
    single = not loaded.spec.phases
    for index in range(len(loaded.spec.phases) or 1):
        phase, phase_loaded = expand(loaded, model_path, index, exported)[0]
        directory = run_dir if single else phase_dir(run_dir, index, phase)
        marker = directory / "phase.json"
        if marker.exists():  # finished before an interruption
            exported[phase.name] = RunDir(directory).phase_done().export  # type: ignore[union-attr] - it exists
            model_path = exported[phase.name] or model_path
            continue
        plan = compile_spec(phase_loaded).plan
        if not single:
            plan.run["phase"] = phase.name  # shown by the live view
        # Resumed from its latest checkpoint; one killed before its first starts again from nothing.
        again = resuming and (directory / "plan.json").exists()
        try:
            result = run(plan, run_dir=directory, executor=executor, resume=again, progress=progress)
        except ConfigError as e:  # a node's setup refused its config: point at the key
            raise SpecError([phase_loaded.locator.diagnostic(("nodes", e.node, *e.key), e.message)]) from None
        results.append(result)
        if result.status != "done":  # interrupted (a phase's `seconds` running out counts as done)
            break  # resume() continues here
        exports = [directory / "export" / n for n, node in plan.nodes.items() if node.kind == "train"]
        export = next((str(p) for p in exports if (p / "config.json").exists()), None)
        if exports and export is None and index + 1 < len(loaded.spec.phases):
            if result.steps == 0 and result.stopped_by == "max_seconds":  # the phase's clock, not a fault
                raise SpecError([phase_loaded.locator.diagnostic(("phases", index, "seconds"), _too_short(phase, result))])
            # The next phase would silently start from an older model.
            lost = result.lost()
            raise StageFailed(f"phase {phase.name} finished without exporting its policy "
                              f"({', '.join(map(str, exports))} holds no config.json)" + (f"; {lost}" if lost else ""))
        marker.write_bytes(encode(PhaseDone(status="done", export=export, seconds=result.seconds)))
        exported[phase.name] = export
        model_path = export or model_path
    return results
