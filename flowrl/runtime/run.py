"""`run()`: a plan, a run directory and an executor -> a finished (or interrupted) run."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from flowrl.graph.plan import Plan

# How long stages may take to return once stopped: a train step in progress is allowed to finish.
JOIN_TIMEOUT_S = {"done": 10.0, "error": 5.0, "interrupt": 600.0, "time": 600.0}


class StageFailed(RuntimeError):
    """A stage's operator raised; the message names the node and carries the original traceback."""


@dataclass
class RunResult:
    status: str  # done (all steps, or run.max_seconds spent) | interrupted (SIGINT, max_steps): resumable
    run_dir: Path | None
    steps: int  # train steps completed (the policy version)
    versions: dict[str, int]
    counters: dict[str, int]  # dropped, stale_kept, rejected, filtered
    seconds: float
    checkpoint: Path | None = None
    last: dict[str, Any] | None = field(default=None)  # the last metrics row
    stopped_by: str = "steps"  # steps | max_seconds | interrupt (SIGINT or max_steps)


def run(plan: Plan, run_dir: Path | str | None = None, executor: str | None = None, resume: bool = False,
        progress: bool = True, max_steps: int | None = None) -> RunResult:
    """Run a plan to `plan.run["steps"]` train steps.

    executor: "inprocess" or "ray" (default: plan.run["executor"], else inprocess).
    resume: continue from run_dir's latest checkpoint (records waiting in channels included).
    max_steps: stop after this many train steps in total, with a checkpoint, as if interrupted;
    a later resume continues to plan.run["steps"].
    Raises StageFailed when an operator raises.
    """
    return asyncio.run(_run(plan, Path(run_dir) if run_dir else None, executor, resume, progress, max_steps))


def load_plan(run_dir: Path | str) -> Plan:
    """The plan a run directory was started with (plan.json)."""
    return msgspec.json.decode((Path(run_dir) / "plan.json").read_bytes(), type=Plan)


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    return run_dir / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


async def _run(plan: Plan, run_dir: Path | None, executor: str | None, resume: bool, progress: bool,
               max_steps: int | None) -> RunResult:
    steps = int(plan.run.get("steps", 10))
    executor = executor or plan.run.get("executor", "inprocess")
    started = time.time()
    state, checkpoint, origin = None, None, started
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            checkpoint = latest_checkpoint(run_dir)
            if checkpoint is None:
                raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from (checkpoints/latest)")
            state = (checkpoint / "coordinator.pkl").read_bytes()
            origin = json.loads((run_dir / "meta.json").read_text())["origin"]
        else:
            if (run_dir / "ledger.jsonl").exists():
                raise FileExistsError(f"{run_dir} already holds a run; resume it or choose another run directory")
            (run_dir / "plan.json").write_bytes(plan.record())  # environment values redacted
            meta = {"name": plan.name, "origin": origin, "executor": executor, "steps": steps, "format": 1}
            (run_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    elif resume:
        raise ValueError("resume needs the run directory of the interrupted run")

    ex = _executor(executor, plan, run_dir, origin)
    try:
        await ex.start(steps, max_steps, state, checkpoint)
        reason = await _supervise(ex, plan, progress)
        failures = await ex.join(JOIN_TIMEOUT_S[reason])
        if reason == "error":
            error = (await ex.call("status"))["error"]
            if not error and failures:
                error = "\n".join(f"node '{n}' failed:\n{t}" for n, t in failures)
            await ex.call("finish")
            raise StageFailed(error or "the run stopped on an error")
        status = await ex.call("status")
        saved = None
        if run_dir is not None:
            saved = await _checkpoint(ex, run_dir, status["versions"])
        if reason in ("done", "time"):
            await ex.call("finish")
        else:
            await ex.call("close")
    finally:
        await ex.shutdown()
    return RunResult(
        status="interrupted" if reason == "interrupt" else "done", run_dir=run_dir,
        steps=min(status["versions"].values(), default=0), versions=status["versions"],
        counters=status["counters"], seconds=time.time() - started, checkpoint=saved, last=status["last"],
        stopped_by={"done": "steps", "time": "max_seconds"}.get(reason, "interrupt"),
    )


def _executor(name: str, plan: Plan, run_dir: Path | None, origin: float) -> Any:
    if name == "inprocess":
        from flowrl.runtime.inprocess import InProcessExecutor

        return InProcessExecutor(plan, run_dir, origin)
    if name == "ray":
        from flowrl.runtime.ray_executor import RayExecutor

        return RayExecutor(plan, run_dir, origin)
    raise ValueError(f"unknown executor '{name}'; use inprocess or ray")


async def _supervise(ex: Any, plan: Plan, progress: bool) -> str:
    """Wait for the run to stop. SIGINT stops it resumably; run.max_seconds ends it (a finished run,
    as a phase bounded by seconds needs), both with a checkpoint."""
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        loop.create_task(ex.call("stop", "interrupt"))
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C is not caught

    handled = False
    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
        handled = True
    except (RuntimeError, ValueError):  # not the main thread
        pass
    timer = None
    if plan.run.get("max_seconds"):
        timer = loop.call_later(float(plan.run["max_seconds"]), lambda: loop.create_task(ex.call("stop", "time")))
    view = None
    if progress:
        from flowrl.runtime.progress import ProgressView

        view = ProgressView(plan, ex)
        view.start()
    try:
        return await ex.wait()
    finally:
        if view is not None:
            await view.stop()
        if timer is not None:
            timer.cancel()
        if handled:
            loop.remove_signal_handler(signal.SIGINT)


async def _checkpoint(ex: Any, run_dir: Path, versions: dict[str, int]) -> Path:
    """checkpoints/step-<version>/: coordinator.pkl plus <node>/r<replica>/ per stage; `latest` names it."""
    root = run_dir / "checkpoints"
    name = f"step-{min(versions.values(), default=0)}"
    tmp = root / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "coordinator.pkl").write_bytes(await ex.call("snapshot"))
    await ex.save(tmp)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    (root / "latest.tmp").write_text(name)
    (root / "latest.tmp").replace(root / "latest")
    return final
