"""`run()`: a plan, a run directory and an executor -> a finished (or interrupted) run."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from flowrl.blame import UserCodeFailed
from flowrl.graph.plan import Plan
from flowrl.records import Meta, RunDir, StreamSizes, encode
from flowrl.runtime.durability import checkpoints, streams
from flowrl.runtime.executors.executor import Executor
from flowrl.runtime.failures import StageFailed, TrainerLost

# How long stages may take to return once stopped: a train step in progress is allowed to finish.
JOIN_TIMEOUT_S = {"done": 10.0, "error": 5.0, "interrupt": 600.0, "time": 600.0, "target": 600.0}
FINISHED = {"done": "steps", "time": "max_seconds", "target": "stop_when"}  # reason -> stopped_by
FLUSH_EVERY_S = 2.0  # record streams reach the disk at least this often


@dataclass
class RunResult:
    status: str  # done (all steps, run.max_seconds spent, run.stop_when reached) | interrupted (SIGINT, max_steps): resumable
    run_dir: Path | None
    steps: int  # train steps completed (the policy version)
    versions: dict[str, int]
    counters: dict[str, int]  # dropped, stale_kept, rejected, filtered
    seconds: float
    checkpoint: Path | None = None
    last: dict[str, Any] | None = field(default=None)  # the last metrics row
    stopped_by: str = "steps"  # steps | max_seconds | stop_when | interrupt (SIGINT or max_steps)
    reached: str | None = None  # with stopped_by stop_when: which target, e.g. "eval_reward 0.94 >= 0.9"
    restarts: int = 0  # times the run restarted from its last checkpoint after losing a train actor
    health: list[dict[str, Any]] = field(default_factory=list)  # the health events (flowrl/health.py)

    def lost(self) -> str:
        """The samples that never reached a train node, in words ("" when none was lost)."""
        counts = [f"{self.counters[k]} {k}" for k in ("rejected", "filtered", "dropped") if self.counters.get(k)]
        if not counts:
            return ""
        return (f"samples lost on the way: {', '.join(counts)} (rejected: a generate workflow returned no "
                "trajectory or all its episodes failed; filtered: by a filter node; dropped: too stale)")


def run(plan: Plan, run_dir: Path | str | None = None, executor: str | None = None, resume: bool = False,
        progress: bool = True, max_steps: int | None = None) -> RunResult:
    """Run a plan to `plan.run["steps"]` train steps.

    executor: "inprocess" or "ray" (default: plan.run["executor"], else inprocess).
    resume: continue from run_dir's latest checkpoint (records waiting in channels included).
    max_steps: stop after this many train steps in total, with a checkpoint, as if interrupted;
    a later resume continues to plan.run["steps"].
    Raises StageFailed when an operator raises. Under Ray, a train actor whose process dies (its
    machine up) restarts the whole run from its last checkpoint, as `--resume` would, at most
    `run.max_restarts` times (default 3; a run without a checkpoint yet starts again from nothing);
    beyond that, TrainerLost names the stage and the checkpoint stays for `flowrl run --resume`.
    """
    run_dir = Path(run_dir) if run_dir else None
    restarts = 0
    while True:
        try:
            result = asyncio.run(_run(plan, run_dir, executor, resume or restarts > 0, progress, max_steps))
        except TrainerLost as e:
            if restarts >= int(plan.run.get("max_restarts", 3)):
                saved = checkpoints.latest(run_dir)  # type: ignore[arg-type] - TrainerLost needs a run_dir
                where = (f"its checkpoint {saved} is intact: `flowrl run --resume` continues from it" if saved
                         else "no checkpoint was written yet: `flowrl run --resume` starts it again")
                raise TrainerLost(f"{e}; restarted {restarts} times (run.max_restarts); {where}") from None
            restarts += 1
            print(f"flowrl: {e}; restarting the run from its last checkpoint ({restarts} of "
                  f"{plan.run.get('max_restarts', 3)})", file=sys.stderr, flush=True)
            continue
        result.restarts = restarts
        return result


def load_plan(run_dir: Path | str) -> Plan:
    """The plan a run directory was started with (plan.json)."""
    return RunDir(run_dir).plan()


latest_checkpoint = checkpoints.latest


async def _run(plan: Plan, run_dir: Path | None, executor: str | None, resume: bool, progress: bool,
               max_steps: int | None) -> RunResult:
    steps = int(plan.run.get("steps", 10))
    executor = executor or plan.run.get("executor", "inprocess")
    started = time.time()
    state, checkpoint, origin = None, None, started
    if run_dir is not None:
        state, checkpoint, origin = _prepare(plan, run_dir, executor, steps, resume, started)
    elif resume:
        raise ValueError("resume needs the run directory of the interrupted run")

    ex = _executor(executor, plan, run_dir, origin)
    try:
        try:
            await ex.start(steps, max_steps, state, checkpoint)
        except UserCodeFailed as e:  # a node's setup() failed: its message names the node
            raise StageFailed(str(e)) from e
        reason = await _supervise(ex, plan, run_dir, progress)
        failures = await ex.join(JOIN_TIMEOUT_S[reason])
        if reason == "error" and ex.lost_train and run_dir is not None:
            await ex.call("close")  # no `end` in the ledger: the run goes on from its checkpoint
            node, replica = ex.lost_train
            raise TrainerLost(f"node '{node}' (replica {replica}): its train actor's process died")
        if reason == "error":
            error = (await ex.call("status"))["error"]
            if not error and failures:
                error = "\n".join(f"node '{n}' failed:\n{t}" for n, t in failures)
            await ex.call("finish")
            error = error or "the run stopped on an error"
            if run_dir is not None:  # what stopped it stays with the run, not only on the screen
                (run_dir / "error.txt").write_text(error + "\n")
            raise StageFailed(error)
        status = await ex.call("status")
        saved = None
        if run_dir is not None:
            saved = await checkpoints.write(ex, run_dir, min(status["versions"].values(), default=0), _keep(plan))
        await ex.call("finish" if reason in FINISHED else "close")
    finally:
        closing = await ex.shutdown()
    if closing:  # e.g. the final export failed: the run did not produce what it reports
        raise StageFailed("\n".join(f"node '{n}' failed while closing:\n{t}" for n, t in closing))
    return RunResult(
        status="interrupted" if reason == "interrupt" else "done", run_dir=run_dir,
        steps=min(status["versions"].values(), default=0), versions=status["versions"],
        counters=status["counters"], seconds=time.time() - started, checkpoint=saved, last=status["last"],
        stopped_by=FINISHED.get(reason, "interrupt"), reached=status.get("reached"), health=status.get("health", []),
    )


def _prepare(plan: Plan, run_dir: Path, executor: str, steps: int, resume: bool,
             started: float) -> tuple[bytes | None, Path | None, float]:
    """Ready the run directory: (coordinator state, checkpoint, origin) to start or resume from.

    Resuming verifies the directory and cuts every record stream back to the checkpoint
    (resume.py); a run killed before its first checkpoint starts again from nothing, and says so."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints.clean_partial(run_dir)
    checkpoints.check_space(run_dir, checkpoints.MARGIN_BYTES)
    if resume:
        from flowrl.runtime.durability import resume as resuming

        found = resuming.prepare(plan, run_dir)
        if found is not None:
            return found
    elif (run_dir / "ledger.jsonl").exists():
        raise FileExistsError(f"{run_dir} already holds a run; resume it or choose another run directory")
    streams.truncate(run_dir, StreamSizes())  # a new run: every stream from nothing
    (run_dir / "plan.json").write_bytes(plan.record())  # environment values redacted
    meta = Meta(name=plan.name, origin=started, executor=executor, steps=steps, format=3, health=1,
                metric_roles=msgspec.to_builtins(plan.metric_roles) if plan.metric_roles is not None else None)
    # health 1: its metrics rows carry the health events (flowrl/health.py); format 3: manifests;
    # metric_roles: what the train nodes' metrics mean, for `flowrl inspect`
    (run_dir / "meta.json").write_bytes(msgspec.json.format(encode(meta), indent=1))
    return None, None, started


def _keep(plan: Plan) -> int:
    return int(plan.run.get("keep_checkpoints") or checkpoints.DEFAULT_KEEP)


def _executor(name: str, plan: Plan, run_dir: Path | None, origin: float) -> Executor:
    if name == "inprocess":
        from flowrl.runtime.executors.inprocess import InProcessExecutor

        return InProcessExecutor(plan, run_dir, origin)
    if name == "ray":
        from flowrl.runtime.executors.ray_executor import RayExecutor

        return RayExecutor(plan, run_dir, origin)
    raise ValueError(f"unknown executor '{name}'; use inprocess or ray")


async def _supervise(ex: Executor, plan: Plan, run_dir: Path | None, progress: bool) -> str:
    """Wait for the run to stop, writing periodic checkpoints and streaming records meanwhile.
    SIGINT and SIGTERM stop it resumably; run.max_seconds ends it (a finished run, as a phase
    bounded by seconds needs), and so does run.stop_when (the coordinator's "target"); the caller
    then writes the final checkpoint. The max_seconds clock starts here, once every stage has set up."""
    loop = asyncio.get_running_loop()
    handled = []

    def interrupt(sig: int) -> None:
        loop.create_task(ex.call("stop", "interrupt"))
        loop.remove_signal_handler(sig)  # a second signal is not caught

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, interrupt, sig)
            handled.append(sig)
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
    stopped = asyncio.Event()
    keeper = None
    if run_dir is not None:
        keeper = loop.create_task(checkpoints.keep_writing(ex, run_dir, _keep(plan), FLUSH_EVERY_S, stopped))
    try:
        reason = await ex.wait()
        stopped.set()
        if keeper is not None:  # a checkpoint being written completes first
            await keeper
        return reason
    finally:
        if keeper is not None and not keeper.done():
            keeper.cancel()
        if view is not None:
            await view.stop()
        if timer is not None:
            timer.cancel()
        for sig in handled:
            loop.remove_signal_handler(sig)
