"""SIGINT stops a run cleanly with a checkpoint; resume finishes it with a clean ledger."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import runtime_ops as ops

from flowrl.runtime.durability import ledger
from flowrl.runtime.run import run

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import runtime_ops as ops
from flowrl.runtime.run import run
result = run(ops.grpo("async", 2, steps=12, batch_size=4, gen={{"delay": 0.05}}, train={{"delay": 0.15}}),
             {run_dir!r}, progress=True)
print("STATUS", result.status, result.steps, flush=True)
"""


def test_sigint_saves_a_checkpoint_and_resume_finishes_the_run(tmp_path):
    run_dir = tmp_path / "run"
    script = SCRIPT.format(tests=str(Path(__file__).parent), run_dir=str(run_dir))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "TERM": "dumb"})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        # metrics.jsonl is written at checkpoints only; the train log is written every step.
        log = run_dir / "train-learner.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    state, steps = re.search(r"STATUS (\w+) (\d+)", out).groups()
    assert state == "interrupted" and 3 <= int(steps) < 12, out
    assert "policy v" in out and "samples/s" in out  # the live progress view was drawn
    assert (run_dir / "checkpoints" / "latest").exists() and metrics.exists()
    assert not ledger.check(run_dir).problems

    plan = ops.grpo("async", 2, steps=12, batch_size=4, gen={"delay": 0.05}, train={"delay": 0.15})
    result = run(plan, run_dir, resume=True, progress=False)
    assert result.status == "done" and result.steps == 12
    report = ledger.check(run_dir)
    assert report.ended and report.clean, report.problems
    rows = [json.loads(line) for line in (run_dir / "train-learner.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    seen = [i for r in rows for i in r["ids"]]
    assert len(seen) == len(set(seen)) == 48


HUNG_TRACKER = """
import sys
sys.path.insert(0, {tests!r})
import runtime_ops as ops
from flowrl.runtime.run import run
plan = ops.grpo("async", 2, steps=40, batch_size=4, gen={{"delay": 0.05}}, train={{"delay": 0.15}})
plan.run.update(trackers=["test_trackers:Hangs"], tracker_timeout_s=2.0)
result = run(plan, {run_dir!r}, progress=False)
print("STATUS", result.status, result.steps, flush=True)
"""


def test_sigterm_is_honoured_with_a_hung_tracker_checkpoint_then_exit(tmp_path):
    """Before: the tracker's log() hung the flush on the event loop, so SIGTERM's handler never ran
    (and the run never moved on). Now the tracker is dropped after run.tracker_timeout_s and SIGTERM
    stops the run resumably: a checkpoint, then exit 0."""
    run_dir = tmp_path / "run"
    script = HUNG_TRACKER.format(tests=str(Path(__file__).parent), run_dir=str(run_dir))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "TERM": "dumb"})
    log = run_dir / "train-learner.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert time.monotonic() - signalled < 30, out
    state, steps = re.search(r"STATUS (\w+) (\d+)", out).groups()
    assert state == "interrupted" and 3 <= int(steps) < 40, out
    assert "tracker 'test_trackers:Hangs' failed and is dropped" in out
    assert (run_dir / "checkpoints" / "latest").exists()
    assert not ledger.check(run_dir).problems
