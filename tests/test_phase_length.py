"""A phase too short to train a step: refused by `flowrl validate` when its `seconds` are under a
second, and, when a longer one still ends before a train step finishes, the run says so at the
phase's `seconds` key instead of "finished without exporting its policy". Real CLI, toy operators."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = """flowrl: 1
name: short
model: {{path: builtin:tiny-qwen2}}
data: {{source: "runtime_ops:Numbers", batch_size: 2}}
cluster: {{cpus: 2}}
phases:
  - {{name: a, seconds: {seconds}}}
  - {{name: b, steps: 1}}
nodes:
  rollout: {{op: "runtime_ops:ToyGenerate", delay: {delay}}}
  score: {{op: "runtime_ops:ToyReward"}}
  learner: {{op: "runtime_ops:ToyTrain"}}
  publish: {{op: "runtime_ops:ToySync"}}
edges:
  - rollout -> score
  - score -> learner
  - learner.policy -> publish.policy
  - publish -> rollout.weights: {{kind: weights}}
"""


def flowrl(tmp_path: Path, *args: str, **spec: object) -> subprocess.CompletedProcess:
    (tmp_path / "short.yaml").write_text(SPEC.format(**spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", *args, str(tmp_path / "short.yaml")],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_validate_refuses_a_phase_of_less_than_a_second(tmp_path):
    proc = flowrl(tmp_path, "validate", seconds="1.0e-300", delay=0)
    assert "short.yaml:7:24 phases[0].seconds: phase 'a' lasts 1e-300 s, too short to train a step" in proc.stderr


def test_a_phase_whose_seconds_end_before_a_train_step_says_so_at_its_key(tmp_path):
    # Each sample takes up to 3 s to generate: the phase's 1 s runs out before any step is trained.
    proc = flowrl(tmp_path, "run", "--quiet", "--run-dir", str(tmp_path / "run"), seconds=1, delay=3)
    assert "short.yaml:7:24 phases[0].seconds: phase 'a' ran out of its 1 s before one train step finished" in proc.stderr
    assert "nothing was trained, so it exported no policy for the next phase" in proc.stderr
    assert "finished without exporting" not in proc.stderr
