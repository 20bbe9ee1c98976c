"""A stage: one replica of one node. Pulls work from the coordinator, calls the operator, pushes
the results back, and records busy and wait intervals. Both executors run this very code; only
the `coord` object differs (the Coordinator itself, or a RemoteCoordinator for a Ray actor).
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from flowrl import registry
from flowrl.blame import UserCodeFailed, describe, user_frames
from flowrl.data import images
from flowrl.graph.plan import Plan
from flowrl.operator import ConfigError, Operator, OperatorContext, TrainResult
from flowrl.records import TraceEvent
from flowrl.runtime import ports
from flowrl.runtime.channel import Work
from flowrl.runtime.clock import WALL, Clock
from flowrl.runtime.durability import faults
from flowrl.runtime.lockprobe import LockProbe
from flowrl.runtime.observe import node_pids, span
from flowrl.spec.phases import UNBOUNDED_STEPS

REPORT_EVERY_S = 1.0
# How long a stage stays silent before reporting with no work ended. Its own figure, not REPORT_EVERY_S:
# a test that reports after every call (REPORT_EVERY_S = 0) must not turn the heartbeat into a busy loop.
HEARTBEAT_S = 1.0


Build = Callable[[OperatorContext], Operator]  # a stage's operator made from its context


class Stage:
    def __init__(self, plan: Plan, node: str, replica: int, coord: Any, run_dir: str | None,
                 origin: float, executor: str = "inprocess", clock: Clock = WALL, build: Build | None = None) -> None:
        """`build`: makes the operator (flowrl plan's stand-ins); None: the node's `op` with its config."""
        self.plan = plan
        self.clock = clock
        self.build = build
        self.executor = executor
        self.node = plan.nodes[node]
        self.replica = replica
        self.coord = coord
        self.run_dir = Path(run_dir) if run_dir else None
        if self.run_dir is not None:  # images in this run's records live in the run folder
            images.use_store(self.run_dir / "images")
        self.origin = origin
        self.pid = node_pids(plan)[node]
        self.op: Operator | None = None
        self.version = 0  # policy version of the weights a generate stage has loaded
        self.tasks: set[asyncio.Task] = set()
        self.slots: set[int] = set()
        self.events: list[TraceEvent] = []
        self.busy = 0.0
        self._busy_since: float | None = None
        self._in_flight = 0
        self._failure: str | None = None
        self._reported = clock.now()
        # A real train step's spans record the share of it its process's interpreter lock was held
        # (`lock`, lockprobe.py): what `flowrl plan` cannot see in a run that never overlaps training.
        self.probe = LockProbe() if self.node.kind == "train" and build is None else None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self, checkpoint: str | None = None) -> None:
        """Build and set up the operator; restore it from a checkpoint directory if given."""
        start = self.clock.now()
        self.op = self.build(self.context()) if self.build is not None else self._operator()
        await self._setup()
        if checkpoint is not None:
            self._restore(Path(checkpoint))
        if self.build is None:
            # What setup built (models, tokenizers, libraries' modules) lives for the whole run: move it
            # out of the collector's reach, or each full collection walks it again (measured: periodic
            # pauses of 0.3-0.5 s every ~17 quickstart steps). Not a built one: a planner runs many
            # short runs in one process, each left to the collector.
            gc.freeze()
        self.events.append(span(self.pid, self.replica * 100, "setup", start, self.clock.now(), self.origin))
        await self.coord.attach(self.node.name, self.replica, self.version)
        await self._report()  # what setup measured (e.g. the first evaluation), before any work

    def _operator(self) -> Operator:
        cls = registry.resolve(self.node.op)
        return cls(msgspec.convert(self.node.config, cls.Config), self.context())

    async def _setup(self) -> None:
        """The operator's setup(); a failure is reported naming the node and the user's frames (a
        plugin's bug, a model it cannot load), not as flowrl's own. ConfigError keeps its key path."""
        try:
            await self.op.setup()
        except (ConfigError, UserCodeFailed, KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - said with the node; --debug keeps the whole traceback
            raise UserCodeFailed(f"node '{self.node.name}' (replica {self.replica}): "
                                 f"{type(self.op).__name__}.setup() failed: {describe(e)}") from e

    def _restore(self, path: Path) -> None:
        """Load the operator's checkpoint. Its files matched their checksums (resume.py), so a failure
        here is a checkpoint this operator cannot read: said with the folder, not as a flowrl bug."""
        from flowrl.runtime.durability.resume import ResumeError

        try:
            self.op.load(path)
            state = pickle.loads((path / "state.pkl").read_bytes())
            self.op.load_state_dict(state["op"])
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            lines = str(e).strip().splitlines() or [""]  # some carry a whole traceback: its first and last lines
            why = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
            raise ResumeError(f"cannot restore node '{self.node.name}' (replica {self.replica}) from {path}: "
                              f"{type(e).__name__}: {why}; resume from an older checkpoint (write its name into "
                              f"{path.parents[2] / 'latest'}) or start a new run") from None
        # self.version stays 0: an engine is rebuilt from model.path, whatever it held before;
        # the coordinator has it load the restored policy before any work (runtime/durability/snapshot.py).

    def context(self) -> OperatorContext:
        """What the operator learns about its place in the run."""
        return OperatorContext(
            node=self.node.name, run_dir=self.run_dir, seed=self.plan.seed, model=self.plan.model,
            data=self.plan.data, rank=self.replica, world_size=self.node.resources.replicas,
            steps=run_steps(self.plan), phase=str(self.plan.run.get("phase", "main")), executor=self.executor,
        )

    async def run(self) -> str | None:
        """Work until the coordinator says stop. Returns None, or the traceback of a failure."""
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat())
        try:
            loop = {"generate": self._generate_loop, "train": self._train_loop, "sync": self._sync_loop}
            await loop.get(self.node.kind, self._transform_loop)()
        except Exception as exc:
            self._failure = self._failure or failure_text(exc)
            await self.coord.fail(self.node.name, self.replica, self._failure)
        finally:
            heartbeat.cancel()
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self._report()
        return self._failure

    def save(self, path: str) -> None:
        """Checkpoint the operator into the directory `path`."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self.op.save(directory)
        state = {"op": self.op.state_dict()}
        (directory / "state.pkl").write_bytes(pickle.dumps(state))

    async def close(self) -> None:
        if self.probe is not None:
            self.probe.stop()
        if self.op is not None:
            await self.op.close()

    # ---- loops per node kind -------------------------------------------------------------------

    async def _generate_loop(self) -> None:
        knobs = self.op.knobs(self.op.config)
        limit, partial = knobs.concurrency, knobs.partial_rollout
        port = next(iter(self.node.outputs))
        while True:
            await self._wait_for_room(limit)
            work = await self._take()
            if work is None:
                return
            if work.kind == "weights":
                await self._update_weights(work, partial)
            else:
                self._spawn(self._generate_one(work, port))

    async def _generate_one(self, work: Work, port: str) -> None:
        version = self.version
        group = await self._timed(self.op.generate(work.value, step=work.step, sample_id=work.id),
                                  "generate", work)
        self._check_outputs("generate", work, {port: group})
        faults.reached("generate")
        await self.coord.complete(self.node.name, self.replica, work.id, {port: group}, version=version,
                                  busy=self.busy, counters=self.op.metrics(), errors=self.op.errors())

    async def _update_weights(self, work: Work, partial: bool) -> None:
        if partial:
            start = self.clock.now()
            await self.op.pause()
            await self.op.update_weights(work.value, work.version)
            await self.op.resume()
        else:
            if self.tasks:  # finish the in-flight generations under the weights they started with
                start = self.clock.now()
                await asyncio.wait(set(self.tasks))
                self.events.append(span(self.pid, self.replica * 100, "drain", start, self.clock.now(), self.origin))
                self._raise_failure()
            start = self.clock.now()
            await self.op.update_weights(work.value, work.version)
        self.version = work.version
        self.events.append(span(self.pid, self.replica * 100, "update_weights", start, self.clock.now(), self.origin,
                                version=work.version, partial=partial))
        await self.coord.loaded_weights(self.node.name, self.replica, work.version)
        await self._report()  # now: an evaluation of this version may end the run (run.stop_when)

    async def _transform_loop(self) -> None:
        limit = self.op.knobs(self.op.config).concurrency
        while True:
            await self._wait_for_room(limit)
            work = await self._take()
            if work is None:
                return
            self._spawn(self._process_one(work))

    async def _process_one(self, work: Work) -> None:
        outputs = await self._timed(self.op.process(work.value), "process", work)
        if outputs is not None and not isinstance(outputs, dict):
            raise UserCodeFailed(f"{type(self.op).__name__}.process() returned {type(outputs).__name__} on sample "
                                 f"{work.id}; expected a dict of output port -> value")
        unknown = sorted(str(p) for p in (outputs or {}) if p not in self.node.outputs)
        if unknown:
            raise UserCodeFailed(f"{type(self.op).__name__}.process() returned port {', '.join(map(repr, unknown))} on "
                                 f"sample {work.id}, which node '{self.node.name}' does not have (its outputs: "
                                 f"{', '.join(self.node.outputs) or 'none'})")
        outputs = {port: (outputs or {}).get(port) for port in self.node.outputs}
        self._check_outputs("process", work, outputs)
        await self.coord.complete(self.node.name, self.replica, work.id, outputs, busy=self.busy,
                                  counters=self.op.metrics(), errors=self.op.errors())

    async def _train_loop(self) -> None:
        port = next(iter(self.node.outputs))
        while True:
            work = await self._take()
            if work is None:
                return
            if work.kind == "publish":  # resumed: send the restored policy again (runtime/durability/snapshot.py)
                result = await self.op.publish()
            else:
                groups = [next(iter(item.values())) for item in work.value]
                result = await self._timed(self.op.train(groups, step=work.step), "train", work, tid=0)
                faults.reached("train")
            if not isinstance(result, TrainResult):
                raise UserCodeFailed(f"{type(self.op).__name__}.train() returned {type(result).__name__}; "
                                     "expected flowrl.operator.TrainResult")
            if (wrong := ports.wrong_metrics(result.metrics)) is not None:
                raise UserCodeFailed(f"{type(self.op).__name__}.train() on step {work.step} returned {wrong}")
            await self.coord.complete(self.node.name, self.replica, work.id, {port: result.policy},
                                      metrics=dict(result.metrics), busy=self.busy)

    async def _sync_loop(self) -> None:
        port = next(iter(self.node.outputs))
        while True:
            work = await self._take()
            if work is None:
                return
            weights = await self._timed(self.op.sync(work.value, version=work.version), "sync", work, tid=0)
            faults.reached("sync")
            await self.coord.complete(self.node.name, self.replica, work.id, {port: weights}, busy=self.busy)

    # ---- helpers -----------------------------------------------------------------------------

    def _check_outputs(self, method: str, work: Work, outputs: dict[str, Any]) -> None:
        """Each output against its port's type: a wrong one is blamed here, on the node that returned
        it, not on the node downstream that would fail on it."""
        for port, value in outputs.items():
            if (wrong := ports.wrong_value(self.node.outputs[port], value)) is not None:
                raise UserCodeFailed(f"{type(self.op).__name__}.{method}() returned for port {port!r} on sample "
                                     f"{work.id} {wrong}")

    async def _take(self) -> Work | None:
        self._raise_failure()
        if self.clock.now() - self._reported > REPORT_EVERY_S:  # before waiting: counters are current
            await self._report()
        start = self.clock.now()
        work = await self.coord.take(self.node.name, self.replica)
        end = self.clock.now()
        if end - start > 1e-3:  # waits shorter than a millisecond only clutter the trace
            self.events.append(span(self.pid, self.replica * 100, "wait", start, end, self.origin))
        self._raise_failure()
        return work

    async def _wait_for_room(self, limit: int) -> None:
        while len(self.tasks) >= limit:
            await asyncio.wait(set(self.tasks), return_when=asyncio.FIRST_COMPLETED)
            self._raise_failure()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = failure_text(task.exception())
            # Wake the loop, which may be waiting in take(): the coordinator stops everyone.
            asyncio.get_running_loop().create_task(self.coord.fail(self.node.name, self.replica, self._failure))

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise _Failed(self._failure)

    async def _timed(self, coro: Any, name: str, work: Work, tid: int | None = None) -> Any:
        slot = 0 if tid == 0 else min(set(range(1, len(self.slots) + 2)) - self.slots)
        self.slots.add(slot)
        if self._in_flight == 0:
            self._busy_since = self.clock.now()
        self._in_flight += 1
        opened = self.probe.open() if self.probe is not None else None  # a train stage's: its one span kind
        start = self.clock.now()
        try:
            return await coro
        except UserCodeFailed:
            raise
        except Exception as exc:  # user code's own failure: its frames, the sample, not the library's frames
            if not user_frames(exc):
                raise
            raise UserCodeFailed(f"{type(self.op).__name__}.{name}() on sample {work.id}: {describe(exc)}") from None
        finally:
            end = self.clock.now()
            self._in_flight -= 1
            if self._in_flight == 0:
                self.busy += end - self._busy_since
            self.slots.discard(slot)
            lock = self.probe.close(opened) if opened is not None else None
            held = {"lock": round(lock, 3)} if lock is not None else {}
            self.events.append(span(self.pid, self.replica * 100 + slot, name, start, end, self.origin,
                                    id=work.id, step=work.step, version=work.version, **held))
            if end - self._reported > REPORT_EVERY_S:
                await self._report()

    async def _heartbeat(self) -> None:
        """Report although no work ends: when every piece of work hangs (an environment that never
        answers), the operator's waits still reach the run record and the live view."""
        while True:
            # Wake when the silence reaches HEARTBEAT_S, not a fixed period later (that could be twice it).
            await self.clock.sleep(max(0.05, self._reported + HEARTBEAT_S - self.clock.now()))
            if self.clock.now() - self._reported >= HEARTBEAT_S:
                try:
                    await self._report()
                except Exception:  # noqa: BLE001 - a lost report; the next one, or the loop, says more
                    continue

    async def _report(self) -> None:
        events, self.events = self.events, []
        self._reported = self.clock.now()
        busy = self.busy + (self.clock.now() - self._busy_since if self._in_flight else 0.0)
        op = getattr(self, "op", None)
        metrics = op.metrics() if op is not None else {}
        errors = op.errors() if op is not None else []
        waits = op.waits() if op is not None else []
        await self.coord.report(self.node.name, self.replica, events, busy, metrics, errors, waits)


def run_steps(plan: Plan) -> int | None:
    """The run's (phase's) length in train steps; None for a phase bounded only by `seconds`."""
    steps = int(plan.run.get("steps", 10))
    return None if steps >= UNBOUNDED_STEPS else steps


def failure_text(exc: BaseException) -> str:
    """What a stage's failure says: a UserCodeFailed's own complete message, else the traceback."""
    if isinstance(exc, UserCodeFailed):
        return str(exc)
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


class _Failed(Exception):
    """An operator call failed in a task; its traceback is already recorded."""
