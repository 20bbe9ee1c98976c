"""Hung user code cannot stall or outlive a run: sync environment and reward code runs on daemon
threads off the event loop, a hung episode is timed out (episode_timeout_s, on by default), and a
finished `flowrl run` exits within seconds although a reward call or an environment step still
hangs. Reward errors (NaN, bools) reach metrics.jsonl with each step."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flowrl_operators.config import GenerateConfig

TESTS = Path(__file__).parent
SPEC = """
flowrl: 1
name: hangs
model: {path: builtin:tiny-qwen2}
data: {source: builtin:reverse_digits, batch_size: 2}
cluster: {cpus: 2}
run: {steps: 3, executor: inprocess, seed: 0}
nodes:
  rollout: {op: generate, group_size: 2, sampling: {temperature: 1.0, max_new_tokens: 4}}
  score: {op: reward, fn: test_hangs:hangs_once, timeout_s: 0.5}
  learner: {op: train, optim: {lr: 1.0e-3}}
  publish: {op: sync}
edges:
  - rollout -> score
  - score -> learner
  - learner -> publish
  - publish -> rollout: {kind: weights}
"""
FOREVER = threading.Event()  # never set: what a hung call waits on
RELEASE = threading.Event()  # set by a test to let its hung calls finish
_calls = itertools.count()


def hangs_once(trajectory: Any) -> float:
    """The run's first reward call hangs forever; the others score 1."""
    if next(_calls) == 0:
        FOREVER.wait()
    return 1.0


def nan_true_or_float32(trajectory: Any) -> Any:
    """NaN for one trajectory of step 0, True for one of step 1, numpy floats for the rest."""
    import numpy as np

    return {"0:0/0": float("nan"), "1:1/1": True}.get(trajectory.id, np.float32(0.5 * (len(trajectory.id) % 2)))


class SyncEnv:
    """An environment written with plain functions; the second one built hangs in its first step
    (until RELEASE: in-process tests set it, under `flowrl run` nothing does). Records where each
    of its methods ran: (method, environment index, thread name)."""

    built = itertools.count()
    calls: list[tuple[str, int, str]] = []
    hang_s: float | None = None  # None: forever (bounded in-process, where old code froze the test)

    def __init__(self) -> None:
        self.index = next(SyncEnv.built)
        self._note("init")

    def _note(self, method: str) -> None:
        self.calls.append((method, self.index, threading.current_thread().name))

    def reset(self, sample: dict[str, Any]) -> str:
        self._note("reset")
        return sample["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        self._note("step")
        if self.index == 1:
            RELEASE.wait(self.hang_s)
        return "try again", 0.25, False

    def close(self) -> None:
        self._note("close")


def test_episode_timeout_is_on_by_default():
    assert GenerateConfig().episode_timeout_s == 1800.0
    assert GenerateConfig(episode_timeout_s=None).episode_timeout_s is None  # explicitly unlimited


def test_a_hung_sync_environment_step_neither_blocks_the_loop_nor_outlives_its_timeout():
    from test_generate_node import make

    loop = asyncio.new_event_loop()
    op = make(loop, group_size=3, workflow="test_hangs:SyncEnv", episode_timeout_s=1.0,
              workflow_args={"max_turns": 2}, sampling={"max_new_tokens": 3})
    SyncEnv.built, SyncEnv.calls[:], SyncEnv.hang_s = itertools.count(), [], 20.0
    RELEASE.clear()

    async def main() -> tuple[Any, int, float]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.get_running_loop().create_task(heartbeat())
        start = time.monotonic()
        group = await op.generate({"prompt": "guess"}, step=0, sample_id="0:0")
        elapsed = time.monotonic() - start
        beat.cancel()
        return group, ticks, elapsed

    try:
        group, ticks, elapsed = loop.run_until_complete(main())
        m = op.metrics()
        assert len(group.trajectories) == 2 and m["generate/episode_timeouts"] == 1  # the hung one is dropped
        assert all(t.turn_rewards == [0.25, 0.25] for t in group.trajectories)
        assert elapsed < 3.0 and ticks > 50  # the loop kept running while the step hung
        assert ("close", 1) not in [c[:2] for c in SyncEnv.calls]  # queued behind the hung step
        RELEASE.set()
        deadline = time.monotonic() + 5
        while ("close", 1) not in [c[:2] for c in SyncEnv.calls] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        RELEASE.set()
        SyncEnv.hang_s = None
        loop.run_until_complete(op.close())
        loop.close()
    # Each environment lived on one thread of its own, built there too, never the loop's; the hung
    # one's close ran there once its step returned.
    threads = {index: {name for _, i, name in SyncEnv.calls if i == index} for index in range(3)}
    assert all(len(names) == 1 for names in threads.values()) and len(set.union(*threads.values())) == 3
    assert threading.current_thread().name not in set.union(*threads.values())
    for index in range(3):
        assert {c[0] for c in SyncEnv.calls if c[1] == index} == {"init", "reset", "step", "close"}


@pytest.mark.parametrize("reward, error", [(float("nan"), "step() reward is nan"), (True, "is a bool"),
                                           (None, "NoneType")])
def test_environment_step_rewards_must_be_finite_numbers(reward, error):
    import numpy as np

    from flowrl_operators.chat.template import EpisodeError
    from flowrl_operators.workflows.environment import as_step

    assert as_step(("ok", np.float32(0.5), False)).reward == 0.5
    with pytest.raises(EpisodeError, match=error.replace("(", r"\(").replace(")", r"\)")):
        as_step(("ok", reward, False))


def test_daemon_executor_reuses_threads_runs_queued_calls_and_exits_with_a_hung_one():
    from flowrl_operators.threads import DaemonExecutor

    pool = DaemonExecutor(2, "t")
    gate = threading.Event()
    busy = [pool.submit(gate.wait) for _ in range(2)]
    queued = pool.submit(lambda: threading.current_thread().name)  # both workers are busy: it waits
    time.sleep(0.1)
    assert not queued.done()
    gate.set()
    assert all(f.result(5) for f in busy)
    names = {queued.result(5)} | {pool.submit(lambda: threading.current_thread().name).result(5) for _ in range(20)}
    assert len(names) <= 2 and all(name.startswith("t-") for name in names)  # reused, never a third
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)
    # A process whose call hangs forever still exits at once (a ThreadPoolExecutor joins it at exit).
    code = ("import threading; from flowrl_operators.threads import DaemonExecutor; "
            "DaemonExecutor(1).submit(threading.Event().wait); print('bye')")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "bye" and time.monotonic() - start < 10


def test_reward_errors_reach_metrics_with_each_step(tmp_path):
    """Each step's row counts every reward call before it (the steps here take milliseconds, far
    less than the stages' REPORT_EVERY_S: the counters come with each completed piece of work)."""
    from flowrl.graph.compile import compile_file
    from flowrl.runtime.run import run

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("fn: test_hangs:hangs_once, timeout_s: 0.5", "fn: test_hangs:nan_true_or_float32"))
    result = run(compile_file(str(spec)).plan, run_dir=tmp_path / "run", progress=False)
    assert result.status == "done"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    score = [r["operators"]["score"] for r in rows]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [s["reward/invalid"] for s in score] == [1, 2, 2] == [s["reward/errors"] for s in score]
    assert [s["reward/calls"] for s in score] == [4, 8, 12] and score[-1]["reward/zeroed"] == 2
    assert all(r["reward"] is not None for r in rows)  # the numpy floats were scored


def _flowrl_run(tmp_path: Path, spec: str, *overrides: str) -> tuple[str, float, float]:
    """`flowrl run` in a child; its output, when it printed "done", and when it exited."""
    path = tmp_path / "spec.yaml"
    path.write_text(spec)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", str(path), *overrides, "--run-dir",
                             str(tmp_path / "run"), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines, done = [], None
    killer = threading.Timer(120, proc.kill)  # on the old code the child never exits
    killer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if "done after" in line:
                done = time.monotonic()
        proc.wait()
    finally:
        killer.cancel()
    return "".join(lines), done or float("inf"), time.monotonic()


def test_a_run_with_a_hung_reward_call_exits_after_done(tmp_path):
    out, done, exited = _flowrl_run(tmp_path, SPEC)
    assert "done after 3 steps" in out, out
    assert exited - done < 30, out  # was: never (the reward pool's thread was joined at exit)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_a_run_with_a_hung_sync_environment_step_finishes_and_exits(tmp_path):
    spec = SPEC.replace("source: builtin:reverse_digits", "source: builtin:guess_number").replace(
        "sampling:", "workflow: test_hangs:SyncEnv, workflow_args: {max_turns: 2}, episode_timeout_s: 2, "
        "sampling:").replace("fn: test_hangs:hangs_once, timeout_s: 0.5", "fn: builtin:guess_number")
    out, done, exited = _flowrl_run(tmp_path, spec)
    assert "done after 3 steps" in out, out
    assert exited - done < 30, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["operators"]["rollout"]["generate/episode_timeouts"] == 1


class SyncBroken(SyncEnv):
    """A sync environment whose second instance raises in its first step."""

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.index == 1:
            raise ConnectionError("simulator went away")
        return super().step(action)


def test_a_raising_sync_environment_is_isolated_counted_and_closed():
    from test_generate_node import make

    loop = asyncio.new_event_loop()
    op = make(loop, group_size=3, workflow="test_hangs:SyncBroken", workflow_args={"max_turns": 2},
              sampling={"max_new_tokens": 3})
    SyncEnv.built, SyncEnv.calls[:] = itertools.count(), []
    try:
        group = loop.run_until_complete(op.generate({"prompt": "guess"}, step=0, sample_id="0:0"))
    finally:
        loop.run_until_complete(op.close())
        loop.close()
    m = op.metrics()
    assert len(group.trajectories) == 2 and m["generate/episode_errors"] == 1 and m["generate/episode_timeouts"] == 0
    assert "simulator went away" in op.last_error
    assert sorted(i for name, i, _ in SyncEnv.calls if name == "close") == [0, 1, 2]


BEATS = [0]  # the heartbeat's ticks on the event loop
HUNG_AT: list[int] = []  # the ticks when eval_hangs began


def eval_hangs(trajectory: Any) -> float:
    HUNG_AT.append(BEATS[0])
    RELEASE.wait(20)  # bounded: the old code ran it on the loop, freezing the test
    return 1.0


def eval_nan(trajectory: Any) -> float:
    return float("nan")


@pytest.mark.parametrize("reward, error", [("test_hangs:eval_hangs", "took over 0.5 s"),
                                           ("test_hangs:eval_nan", "the eval reward of eval0:0/0 is nan")])
def test_a_hung_or_invalid_eval_reward_fails_the_evaluation_off_the_loop(reward, error, monkeypatch):
    import msgspec

    from flowrl.operator import OperatorContext
    from flowrl_operators import evaluate
    from flowrl_operators.generate import Generate

    monkeypatch.setattr(evaluate, "REWARD_TIMEOUT_S", 0.5)
    RELEASE.clear()
    data = {"source": "builtin:reverse_digits", "eval": {"every": 1, "samples": 2, "options": {"reward": reward}}}
    op = Generate(msgspec.convert({"sampling": {"max_new_tokens": 3}}, GenerateConfig),
                  OperatorContext(node="rollout", model={"path": "builtin:tiny-qwen2"}, data=data))

    async def main() -> BaseException | None:
        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(0.01)
                BEATS[0] += 1

        beat = asyncio.get_running_loop().create_task(heartbeat())
        try:
            await op.setup()  # evaluates version 0
        except Exception as exc:
            return exc
        finally:
            beat.cancel()
            await op.close()
        return None

    HUNG_AT.clear()
    try:
        failure = asyncio.run(main())
    finally:
        RELEASE.set()
    assert failure is not None and error in str(failure)
    if reward.endswith("hangs"):
        assert BEATS[0] - HUNG_AT[0] > 20  # the loop kept running while the reward hung (0.5 s)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


@pytest.mark.parametrize("how", ["key", "env", "auto"])
def test_a_ray_address_where_no_cluster_is_a_message_within_seconds(tmp_path, how):
    """A real address with nothing behind it (a closed loopback port; "auto" with no cluster on this
    machine). Before: no flowrl message, SIGTERM unheard, Ray retried for minutes (killed at 320 s);
    "auto" was reported as a flowrl bug."""
    spec = SPEC.replace("executor: inprocess", "executor: ray").replace(
        "fn: test_hangs:hangs_once, timeout_s: 0.5", "fn: builtin:reverse_digits")
    address = "auto" if how == "auto" else f"127.0.0.1:{_closed_port()}"
    overrides = [] if how == "env" else [f"run.ray_address={address}"]
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}  # "auto" finds no other test's cluster
    if how == "env":
        env["RAY_ADDRESS"] = address
    path = tmp_path / "spec.yaml"
    path.write_text(spec)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(path), *overrides, "--run-dir",
                           str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    where = "RAY_ADDRESS" if how == "env" else "run.ray_address"
    assert done.stderr.startswith(f"flowrl run: {where}: "), done.stderr
    assert ("no Ray cluster answers at" if how != "auto" else "cannot attach") in done.stderr
    assert "ray start --head" in done.stderr and "Traceback" not in done.stderr and "flowrl bug" not in done.stderr
    assert time.monotonic() - started < 60


def test_an_unreachable_weight_update_rendezvous_fails_in_its_connect_timeout_not_the_transfers():
    """Before: joining a broadcast group at an address where nothing answers waited the whole transfer
    timeout (600 s). Now the connection has its own, short one; a real closed port, both joins."""
    from flowrl_operators.transport.broadcast import BroadcastGroup, connect
    from flowrl_operators.transport.engine_wire import weight_update_group

    port = _closed_port()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"rendezvous at 127.0.0.1:{port} did not answer within 1 s"):
        weight_update_group("127.0.0.1", port, 1, 2, "g", timeout_s=600, connect_timeout_s=1)
    assert time.monotonic() - started < 10
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"rendezvous at 127.0.0.1:{port} did not answer within 1 s"):
        connect(BroadcastGroup("127.0.0.1", port, 2, "g", "gloo", timeout_s=1), 1)
    assert time.monotonic() - started < 10
