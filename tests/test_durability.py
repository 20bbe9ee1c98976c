"""Durable runs: periodic checkpoints, streamed records, SIGTERM, kill -9 at any moment, resume.

The toy pipeline (tests/runtime_ops.py) is deterministic over a sync edge: its generate node writes
the policy version it holds into every response, and its train node folds every batch into a
checksum, so a resumed run equals an uninterrupted one only if every engine held the right
weights and no record was lost or repeated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import runtime_ops as ops

from flowrl.runtime.durability import checkpoints, ledger, rollouts
from flowrl.runtime.run import StageFailed, run

TESTS = str(Path(__file__).parent)
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import runtime_ops as ops
from flowrl.runtime.run import run
plan = ops.grpo({mode!r}, {k}, steps=12, batch_size=4, gen={{"delay": 0.02}}, train={{"delay": {delay}}})
plan.run.update({run!r})
result = run(plan, {run_dir!r}, progress=False)
print("STATUS", result.status, result.steps, flush=True)
"""


def toy(mode: str = "sync", k: int = 0, **run_keys):
    plan = ops.grpo(mode, k, steps=12, batch_size=4, gen={"delay": 0.02}, train={"delay": 0.05})
    plan.run.update(run_keys)
    return plan


def start(run_dir: Path, mode: str = "sync", k: int = 0, fault: str | None = None, delay: float = 0.05,
          **run_keys) -> subprocess.Popen:
    script = SCRIPT.format(tests=TESTS, run_dir=str(run_dir), mode=mode, k=k, run=run_keys, delay=delay)
    env = {**os.environ, "FLOWRL_FAULT": fault or ""}
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def train_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train-learner.jsonl").read_text().splitlines()]


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    """The final checksum of the toy sync run, never interrupted."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    result = run(toy(checkpoint_every=3), run_dir, progress=False)
    assert result.status == "done" and result.steps == 12
    return train_rows(run_dir)[-1]["checksum"]


@pytest.fixture(scope="module")
def uninterrupted_ids(tmp_path_factory) -> list[list[str]]:
    """The trajectory ids of each step the uninterrupted toy sync run recorded in its rollout store."""
    run_dir = tmp_path_factory.mktemp("whole-ids") / "run"
    assert run(toy(checkpoint_every=3), run_dir, progress=False).status == "done"
    return rollouts.sample_ids(list(rollouts.read(rollouts.path(run_dir, "learner"))))


def test_periodic_checkpoints_keep_the_newest(tmp_path):
    result = run(toy(checkpoint_every=3, keep_checkpoints=2), tmp_path, progress=False)
    assert result.status == "done"
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-12", "step-9"]  # 3 and 6 were written and rotated out
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-12"
    assert json.loads((tmp_path / "checkpoints" / "step-9" / "streams.json").read_text())["ledger.jsonl"] > 0


def test_the_trace_shows_what_checkpoints_and_flushes_cost(tmp_path):
    result = run(toy(checkpoint_every=4), tmp_path, progress=False)
    assert result.status == "done"
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "runtime"}} in events
    spans = [e for e in events if e["pid"] == 0 and e["ph"] == "X"]
    checkpoints = [e for e in spans if e["name"] == "checkpoint"]
    assert [e["args"]["version"] for e in checkpoints] == [4, 8]  # 12: the final one, written after the loop
    assert all(e["dur"] > 0 for e in checkpoints)
    # A checkpoint span covers the train node's wait: no train call overlaps it.
    steps = [e for e in events if e["name"] == "train" and e["ph"] == "X"]
    assert len(steps) == 12
    for c in checkpoints:
        assert not any(s["ts"] < c["ts"] + c["dur"] and c["ts"] < s["ts"] + s["dur"] for s in steps)
    assert any(e["name"] == "flush" for e in spans)


def test_records_reach_the_disk_while_the_run_goes_on(tmp_path):
    proc = start(tmp_path, delay=0.5, checkpoint_every=100)  # 6 s of steps; records flush every 2 s
    try:
        deadline, seen = time.time() + 60, []
        while time.time() < deadline and proc.poll() is None:
            metrics = tmp_path / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().strip():
                seen = metric_steps(tmp_path)
                trace = json.loads((tmp_path / "trace.json").read_text())  # valid while being written
                assert trace["traceEvents"]
                assert (tmp_path / "ledger.jsonl").stat().st_size > 0
                break
            time.sleep(0.1)
        assert seen and proc.poll() is None, "nothing was written before the run ended"
        assert 0 < len(seen) < 12
    finally:
        proc.kill()
        proc.communicate()


def test_sigterm_checkpoints_and_resume_finishes(tmp_path, uninterrupted):
    proc = start(tmp_path, checkpoint_every=100)
    deadline = time.time() + 60
    while time.time() < deadline and (not (tmp_path / "train-learner.jsonl").exists()
                                      or len(train_rows(tmp_path)) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "STATUS interrupted" in out, out
    result = run(toy(checkpoint_every=3), tmp_path, resume=True, progress=False)
    assert result.status == "done" and result.steps == 12
    assert train_rows(tmp_path)[-1]["checksum"] == uninterrupted
    assert ledger.check(tmp_path).clean


@pytest.mark.parametrize("fault", ["generate:9", "train:5", "sync:4", "checkpoint:2", "checkpoint:1", "train:2"])
def test_kill_9_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path, uninterrupted, uninterrupted_ids, fault):
    """kill -9 during generation, training, weight sync or a checkpoint write (the first one
    included: nothing to resume from, so the run starts again)."""
    proc = start(tmp_path, fault=fault, checkpoint_every=3)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, out
    result = run(toy(checkpoint_every=3), tmp_path, resume=True, progress=False)
    assert result.status == "done" and result.steps == 12
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
    assert train_rows(tmp_path)[-1]["checksum"] == uninterrupted
    # The streams were cut back to the checkpoint: each step's metrics row once, in order, and each
    # trained batch once in the rollout store, the same batches as the uninterrupted run's.
    assert metric_steps(tmp_path) == list(range(12))
    recorded = list(rollouts.read(rollouts.path(tmp_path, "learner")))
    assert [s.step for s in recorded] == list(range(12))
    assert rollouts.sample_ids(recorded) == uninterrupted_ids
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    json.loads((tmp_path / "trace.json").read_text())


def test_kill_9_async_run_resumes_with_nothing_lost_or_duplicated(tmp_path):
    proc = start(tmp_path, mode="async", k=2, fault="train:6", checkpoint_every=2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, out
    result = run(toy("async", 2, checkpoint_every=2), tmp_path, resume=True, progress=False)
    assert result.status == "done" and result.steps == 12
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
    issued = [e["id"] for e in ledger.read(tmp_path) if e["event"] == "issue"]
    assert len(issued) == len(set(issued))
    assert metric_steps(tmp_path) == list(range(12))


def test_resumed_engines_load_the_restored_policy_before_generating(tmp_path):
    """The toy engine, like the real one, starts from the initial weights after a restart: the
    coordinator has the train node publish its restored policy, and no sample is issued before
    the engine holds it."""
    run(toy(checkpoint_every=100), tmp_path, progress=False, max_steps=5)
    run(toy(checkpoint_every=100), tmp_path, resume=True, progress=False)
    events = ledger.read(tmp_path)
    resumed = next(i for i, e in enumerate(events) if e["event"] == "resume")
    after = events[resumed:]
    first_weights = next(i for i, e in enumerate(after) if e["event"] == "consume" and e.get("weights"))
    first_sample = next(i for i, e in enumerate(after) if e["event"] in ("issue", "reissue"))
    assert first_weights < first_sample
    assert after[first_weights]["version"] == 5
    versions = {e["version"] for e in after if e["event"] in ("issue", "reissue")}
    assert min(versions) == 5


def test_disk_space_is_checked_with_a_clear_message(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    checkpoints.check_space(tmp_path, 1)
    with pytest.raises(checkpoints.DiskSpaceError, match=str(tmp_path)):
        checkpoints.check_space(tmp_path, free + 2**40)


def test_a_failed_periodic_checkpoint_stops_the_run_and_leaves_no_partial_folder(tmp_path):
    plan = toy(checkpoint_every=3)
    plan.nodes["learner"].config["fail_save_at"] = 6
    with pytest.raises(StageFailed, match="checkpoint at version 6 failed.*No space left"):
        run(plan, tmp_path, progress=False)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-3"
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_a_failed_close_fails_the_run(tmp_path):
    plan = ops.grpo("sync", 0, steps=2, batch_size=2, train={"fail_close": True})
    with pytest.raises(StageFailed, match="learner.*while closing"):
        run(plan, tmp_path, progress=False)
