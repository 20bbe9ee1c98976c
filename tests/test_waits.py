"""Waits made visible: a generate node's episodes awaiting one thing past `slow_episode_s` are
named (sample, episode, turn, what they await) in its metrics, in `waits.jsonl` as the run goes, and
in the live view, while they still wait."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import runtime_ops as ops

from flowrl_operators.config import GenerateConfig

TESTS = Path(__file__).parent
HANGING = "FLOWRL_TEST_HANG_DIR"  # where HangingEnv's first step waits for a file named `release`


class HangingEnv:
    """The first environment built in a process hangs in its first step until the file
    `$FLOWRL_TEST_HANG_DIR/release` exists (at most 60 s); the others answer at once."""

    built = 0

    def __init__(self) -> None:
        self.index, HangingEnv.built = HangingEnv.built, HangingEnv.built + 1

    def reset(self, sample: dict[str, Any]) -> str:
        return sample["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        release = Path(os.environ.get(HANGING, "/nonexistent")) / "release"
        deadline = time.monotonic() + 60
        while self.index == 0 and not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "", 1.0, True


async def slow_agent(base_url: str, sample: dict[str, Any]) -> float:
    """An agent that asks the model once, then runs its own code (a tool, say) for 1.5 s."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="flowrl", max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample["prompt"]}])
    await asyncio.sleep(1.5)
    return 1.0


def test_the_config_key_defaults_to_a_minute_and_zero_turns_it_off():
    assert GenerateConfig().slow_episode_s == 60.0
    assert msgspec.convert({"slow_episode_s": 0}, GenerateConfig).slow_episode_s == 0
    with pytest.raises(msgspec.ValidationError, match="slow_episode_s"):
        msgspec.convert({"slow_episode_s": -1}, GenerateConfig)


@pytest.mark.parametrize("workflow, args, awaits, threshold", [
    ("environment", {"env": "test_waits:HangingEnv", "max_turns": 2}, "environment.step", 0.5),
    ("agent", {"agent": "test_waits:slow_agent"}, "agent", 0.5),
    ("environment", {"env": "test_waits:HangingEnv", "max_turns": 2}, None, 0),  # off
])
def test_the_generate_node_names_its_slow_episodes_while_they_wait(tmp_path, monkeypatch, workflow, args, awaits,
                                                                   threshold):
    from test_generate_node import make

    monkeypatch.setenv(HANGING, str(tmp_path))
    HangingEnv.built = 0
    loop = asyncio.new_event_loop()
    op = make(loop, group_size=2, workflow=workflow, workflow_args=args, slow_episode_s=threshold,
              sampling={"max_new_tokens": 3})
    seen: list[tuple[list[dict], dict]] = []

    async def main() -> Any:
        episodes = asyncio.get_running_loop().create_task(op.generate({"prompt": "guess"}, step=0, sample_id="4:2"))
        while not episodes.done():
            await asyncio.sleep(0.1)
            seen.append((op.waits(), op.metrics()))
            if len(seen) == 15:  # 1.5 s: the hanging step may end now
                (tmp_path / "release").touch()
        return await episodes

    try:
        group = loop.run_until_complete(main())
    finally:
        (tmp_path / "release").touch()
        loop.run_until_complete(op.close())
        loop.close()
    assert len(group.trajectories) == 2  # the wait ended well: nothing was lost
    slow = [(w, m) for w, m in seen if w]
    if awaits is None:
        assert not slow and all(m["generate/slow_episodes"] == 0 for _, m in seen)
        return
    assert slow, seen
    waits, metrics = slow[-1]
    assert metrics["generate/slow_episodes"] == len(waits) >= 1
    wait = waits[0]
    assert wait["sample_id"] == "4:2" and wait["awaits"] == awaits and wait["episode"] in (0, 1)
    assert wait["waited_s"] >= threshold and wait["episode_s"] >= wait["waited_s"]
    assert wait["turn"] == 1  # after its first engine call (the proxy's, for the agent)
    if workflow == "environment":
        assert len(waits) == 1  # the other episode ran on
    assert op.waits() == [] and op.metrics()["generate/slow_episodes"] == 0  # all ended


SPEC = """
flowrl: 1
name: waits
model: {path: builtin:tiny-qwen2}
data: {source: builtin:guess_number, batch_size: 2}
cluster: {cpus: 2}
run: {steps: 2, executor: inprocess, seed: 0}
nodes:
  rollout: {op: generate, group_size: 2, workflow: environment, slow_episode_s: 1,
            workflow_args: {env: "test_waits:HangingEnv", max_turns: 2}, sampling: {max_new_tokens: 4}}
  score: {op: reward, fn: builtin:guess_number}
  learner: {op: train, optim: {lr: 1.0e-3}}
  publish: {op: sync}
edges:
  - rollout -> score
  - score -> learner
  - learner -> publish
  - publish -> rollout: {kind: weights}
"""


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("executor", ["inprocess", pytest.param("ray", marks=pytest.mark.slow)])
def test_flowrl_run_records_a_hanging_environment_call_while_it_hangs(tmp_path, executor):
    """Through `flowrl run`: the environment's step hangs until the test has read, in waits.jsonl,
    the row naming the waiting episode; only then does it answer, and the run finishes. Under Ray
    the generate stage is an actor: its reports reach the coordinator actor, which writes the file."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("executor: inprocess", f"executor: {executor}"))
    ray_tmp = tempfile.mkdtemp(prefix="flowrl-ray-")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", HANGING: str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", str(spec), "--run-dir", str(tmp_path / "run"),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    killer = threading.Timer(150, proc.kill)
    killer.start()
    waits = tmp_path / "run" / "waits.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not _rows(waits) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        during = _rows(waits)
        (tmp_path / "release").touch()
        out, _ = proc.communicate()
    finally:
        killer.cancel()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert during, out
    began = during[0]
    assert began["event"] == "began" and began["node"] == "rollout" and began["replica"] == 0
    assert began["awaits"] == "environment.step" and began["turn"] == 1
    assert began["sample_id"] == "0:0" and began["episode"] in (0, 1) and began["waited_s"] >= 1.0
    assert proc.returncode == 0 and "done after 2 steps" in out, out
    ended = [r for r in _rows(waits) if r["event"] == "ended"]
    assert [(r["sample_id"], r["episode"], r["awaits"]) for r in ended] == [
        (began["sample_id"], began["episode"], "environment.step")]
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["operators"]["rollout"]["generate/slow_episodes"] == 0


class WaitingGenerate(ops.ToyGenerate):
    """A plugin generate operator (runtime_ops.ToyGenerate, whose sample `slow_on` sleeps
    `slow_delay` s) that reports its own waits past 0.5 s, in the Operator.waits contract's least
    form: what it awaits, for how long, and what names the work."""

    async def generate(self, sample: dict[str, Any], *, step: int, sample_id: str) -> Any:
        self.started = getattr(self, "started", {})
        self.started[sample_id] = time.monotonic()
        try:
            return await super().generate(sample, step=step, sample_id=sample_id)
        finally:
            del self.started[sample_id]

    def waits(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"sample_id": s, "awaits": "simulator", "waited_s": round(now - t, 1)}
                for s, t in getattr(self, "started", {}).items() if now - t >= 0.5]


def test_a_plugin_operators_waits_reach_waits_jsonl_though_none_of_its_work_ends(tmp_path):
    """The runtime side of Operator.waits, for any operator: the stage's heartbeat reports while its
    only work in flight sleeps (no work ends meanwhile), and each wait is written when it begins
    and when it ends."""
    from flowrl.runtime.run import run

    plan = ops.grpo("sync", steps=2, batch_size=1, gen={"slow_on": "1:0", "slow_delay": 2.5})
    plan.nodes["rollout"].op = "test_waits:WaitingGenerate"
    assert run(plan, tmp_path, progress=False).status == "done"
    rows = _rows(tmp_path / "waits.jsonl")
    assert [(r["event"], r["node"], r["sample_id"], r["awaits"]) for r in rows] == [
        ("began", "rollout", "1:0", "simulator"), ("ended", "rollout", "1:0", "simulator")]
    assert 0.5 <= rows[0]["waited_s"] < 2.0 and rows[0]["time"] < rows[1]["time"]
