"""A run that trains nothing fails, saying why; user code that fails is reported with its own frames.

Through the real CLI, tiny model, embedded engine and trainer. Every run here sets up a model
(~10 s on 2 CPU cores), hence `slow`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"
TINY = ["data.batch_size=4", "nodes.rollout.group_size=2", "nodes.rollout.sampling.max_new_tokens=4"]


def flowrl(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "FLOWRL_FAULT": fault, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args, "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300)


def failed(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-3000:])
    assert "done after" not in proc.stdout
    assert "Traceback (most recent call last)" not in proc.stderr and "flowrl bug" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


@pytest.mark.slow
def test_workflows_that_return_no_trajectory_fail_the_run_with_their_errors(tmp_path):
    run_dir = tmp_path / "run"
    proc = flowrl("run", str(BASE), *TINY, "run.steps=4", "nodes.rollout.workflow=user_code:wrong_returns",
                  "--run-dir", str(run_dir))
    failed(proc, "nothing was trained: node 'learner' got no valid sample in steps 0-2 (run.max_empty_steps 3)",
           "12 rejected", "The first errors", "- node 'rollout': sample 0:0, episode 0: TypeError: workflow "
           "'user_code:wrong_returns' returned str 'an answer'")
    assert (run_dir / "error.txt").read_text().startswith("nothing was trained")
    errors = [json.loads(line) for line in (run_dir / "errors.jsonl").read_text().splitlines()]
    texts = "\n".join(e["error"] for e in errors)
    assert {e["node"] for e in errors} == {"rollout"}
    assert "returned str" in texts and "returned int 42" in texts and "returned None" in texts
    assert "behaviour_logprobs has 3 entries" not in texts and "loss_mask has 2 entries, response has 3" in texts
    assert not (run_dir / "export").exists()
    shown = subprocess.run([sys.executable, "-m", "flowrl.cli", "inspect", str(run_dir)], capture_output=True,
                           text=True, timeout=120)
    assert "failed: nothing was trained" in shown.stdout, shown.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("op", "words"), [
    ("WrongPort", ["WrongPort.process() returned port 'trajectory' on sample 0:",
                   "which node 'tag' does not have (its outputs: trajectories)"]),
    ("RaisingOp", ["RaisingOp.process() on sample 0:", "user_code.py", "in process", "in lookup",
                   "KeyError: 'weights'"]),
])
def test_an_operators_own_mistake_is_named_where_it_happens(tmp_path, op, words):
    spec = BASE.read_text().replace("  learner:\n", f"  tag:\n    op: user_code:{op}\n  learner:\n").replace(
        "  - score -> learner\n", "  - score -> tag\n  - tag -> learner\n")
    (tmp_path / "user_op.yaml").write_text(spec)
    proc = flowrl("run", str(tmp_path / "user_op.yaml"), *TINY, "run.steps=2", "--run-dir", str(tmp_path / "run"))
    failed(proc, "node 'tag' (replica 0) failed", *words)
    assert "stage.py" not in proc.stderr


@pytest.mark.slow
def test_token_ids_outside_the_vocabulary_are_named_at_the_train_node(tmp_path):
    proc = flowrl("run", str(BASE), *TINY, "run.steps=2", "nodes.rollout.workflow=user_code:foreign_ids",
                  "--run-dir", str(tmp_path / "run"))
    failed(proc, "node 'learner': trajectory ", "has token id 1000000 at prompt_ids[2], outside the model's vocabulary")
    assert "IndexError" not in proc.stderr


@pytest.mark.slow
def test_a_stop_when_metric_the_train_node_does_not_report_is_refused_before_the_run(tmp_path):
    # The built-in train node declares its metrics (Operator.reported_metrics): refused by the
    # spec's checks; a plugin's that declares none fails at its first step (test_reported_metrics.py).
    proc = flowrl("run", str(BASE), *TINY, "run.steps=3", "run.stop_when={train.bogus: 1.0}",
                  "--run-dir", str(tmp_path / "run"))
    failed(proc, 'run.stop_when["train.bogus"]: train.bogus is not a metric the train node reports', "train.entropy")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_an_operators_setup_that_raises_is_named_with_its_node(tmp_path):
    spec = BASE.read_text().replace("  learner:\n", "  tag:\n    op: user_code:SetupRaises\n  learner:\n").replace(
        "  - score -> learner\n", "  - score -> tag\n  - tag -> learner\n")
    (tmp_path / "user_op.yaml").write_text(spec)
    proc = flowrl("run", str(tmp_path / "user_op.yaml"), *TINY, "run.steps=2", "--run-dir", str(tmp_path / "run"))
    failed(proc, "node 'tag' (replica 0): SetupRaises.setup() failed", "user_code.py", "in setup", "in lookup",
           "KeyError: 'tokenizer'")
    assert "stage.py" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("fn", "words"), [
    ("user_code:nan_reward", ["invalid reward: reward is nan"]),
    ("user_code:raising_reward", ["user_code.py", "in raising_reward", "in parse_answer",
                                  "ValueError: cannot parse"]),
])
def test_a_failing_reward_is_reported_once_with_the_users_frames(tmp_path, fn, words):
    proc = flowrl("run", str(BASE), *TINY, "run.steps=3", f"nodes.score.fn={fn}", "nodes.score.max_errors=3",
                  "--run-dir", str(tmp_path / "run"))
    failed(proc, "node 'score' (replica 0) failed", "3 reward errors", f"in {fn}", "the last, score on", *words)
    assert "reward.py" not in proc.stderr and "stage.py" not in proc.stderr  # flowrl's frames say nothing here
    assert proc.stderr.count("reward errors") == 1


@pytest.mark.slow
def test_rewards_that_fail_on_every_sample_train_nothing(tmp_path):
    # on_error: zero keeps the run going with stand-in rewards: three such steps are a failure.
    proc = flowrl("run", str(BASE), *TINY, "run.steps=5", "nodes.score.fn=user_code:raising_reward",
                  "run.max_empty_steps=2", "--run-dir", str(tmp_path / "run"))
    failed(proc, "nothing was trained: node 'learner' got no valid sample in steps 0-1 (run.max_empty_steps 2)",
           "8 invalid", "- node 'score': score on 0:0/", "in parse_answer")


@pytest.mark.slow
def test_records_are_on_disk_from_the_first_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = flowrl("run", str(BASE), *TINY, "run.steps=4", "--run-dir", str(run_dir), fault="train:2")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    events = [json.loads(line)["event"] for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert "issue" in events and "consume" in events


class _Group:
    def __init__(self, invalid: bool) -> None:
        from flowrl.data.trajectory import INVALID
        self.trajectories = [type("T", (), {"metadata": {INVALID: True} if invalid else {}})()]


def test_trailing_steps_emptied_by_staleness_drops_do_not_fail_an_async_run():
    from flowrl.runtime.untrained import Untrained
    untrained = Untrained(None, 2, 100, 0.0)
    counters = {"rejected": 2}  # rejections early in the run, then healthy steps
    assert untrained.step("learner", 0, [{"x": _Group(False)}], counters) is None
    for step in range(1, 6):  # the last steps: every sample dropped as too stale, none went bad
        assert untrained.step("learner", step, [], dict(counters, dropped=step)) is None
    # Restored from a checkpoint, the count of bad samples is the saved one: no spurious "went bad".
    restored = Untrained(None, 2, 100, 0.0)
    restored.restore(untrained.state())
    for step in range(6, 9):
        assert restored.step("learner", step, [], counters) is None


def test_empty_steps_with_samples_going_bad_fail_the_run_after_the_limit():
    from flowrl.runtime.untrained import Untrained
    untrained = Untrained(None, 3, 100, 0.0)
    reasons = [untrained.step("learner", step, [], {"rejected": 4 * (step + 1)}) for step in range(3)]
    assert reasons[:2] == [None, None] and "nothing was trained" in reasons[2] and "steps 0-2" in reasons[2]
    invalid = Untrained(None, 2, 100, 0.0)
    assert invalid.step("learner", 0, [{"x": _Group(True)}], {}) is None
    assert "(2 invalid)" in invalid.step("learner", 1, [{"x": _Group(True)}], {})
