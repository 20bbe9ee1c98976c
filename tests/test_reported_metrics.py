"""`run.stop_when: {train.<key>: ...}` checked against the metrics the train nodes declare
(`Operator.reported_metrics`): an unknown key is refused by `flowrl validate`, located, naming the
known ones; a plugin train node that declares nothing is not refused (its first step says it); and
the built-in train node's declaration holds every metric its steps report (a contract, on real
short runs of the tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl_operators.training.reported import TRAIN_METRICS

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"
TINY = ["run.steps=2", "data.batch_size=2", "nodes.rollout.group_size=2", "nodes.rollout.sampling.max_new_tokens=4"]
TOY = """flowrl: 1
name: toy
model: {path: builtin:tiny-qwen2}
data: {source: "runtime_ops:Numbers", batch_size: 2}
run: {steps: 3, stop_when: {train.no_such_metric: 0.5}}
nodes:
  rollout: {op: "runtime_ops:ToyGenerate"}
  score: {op: "runtime_ops:ToyReward"}
  learner: {op: "runtime_ops:ToyTrain"}
  publish: {op: "runtime_ops:ToySync"}
edges:
  - rollout -> score
  - score -> learner
  - learner.policy -> publish.policy
  - publish -> rollout.weights: {kind: weights}
"""


def flowrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


def test_validate_refuses_a_train_metric_no_train_node_reports(tmp_path, capsys):
    spec = tmp_path / "p.yaml"
    spec.write_text(BASE.read_text().replace("nodes:\n", "run: {stop_when: {train.no_such_metric: 0.5}}\nnodes:\n", 1))
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert 'p.yaml:8:19 run.stop_when["train.no_such_metric"]: train.no_such_metric is not a metric the train ' \
           "node reports, so the run would never stop on it; known: " in err, err
    assert "train.entropy" in err and "train.reward_mean" in err and "Traceback" not in err
    assert main(["validate", str(BASE), "run.stop_when={train.entropy: 0.5, reward: 1.0}"]) == 0


def test_a_plugin_train_node_that_declares_nothing_is_not_refused_and_its_first_step_says(tmp_path):
    (tmp_path / "toy.yaml").write_text(TOY)
    assert flowrl("validate", str(tmp_path / "toy.yaml")).returncode == 0
    proc = flowrl("run", str(tmp_path / "toy.yaml"), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "run.stop_when: train.no_such_metric is not a metric the train node reports" in proc.stderr
    assert "train.batch, train.loss, train.reward_seen" in proc.stderr  # what ToyTrain does report


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ppo_clip", "reinforce"])
def test_every_metric_the_built_in_train_node_reports_is_declared(tmp_path, loss):
    proc = flowrl("run", str(BASE), *TINY, f"nodes.learner.loss={loss}", "--run-dir", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    reported = set().union(*(row["train"] for row in rows))
    assert reported - TRAIN_METRICS == set(), f"reported but not declared: {reported - TRAIN_METRICS}"
    assert {"loss", "entropy", "grad_norm", "reward_mean", "trajectories", "tokens"} <= reported
