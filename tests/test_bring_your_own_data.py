"""The "Bring your own data" example of docs/data.md, as a user would write it: a parquet file of chat
messages and answers, a reward module of their own, a local checkpoint, and `flowrl run` in a
fresh process. Then `run.stop_when` ending such a run at the version whose evaluation reached it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine import make_checkpoint

from flowrl.cli import main

REWARDS = '''
def exact(trajectory) -> float:
    text = trajectory.metadata["text"]
    row = trajectory.metadata["sample"]
    return 1.0 if text.strip() == row["answer"] else 0.0


def digits_right(trajectory) -> float:
    """Partial credit, so that a few steps of GRPO see different rewards in a group."""
    text, answer = trajectory.metadata["text"], trajectory.metadata["sample"]["answer"]
    return sum(a == b for a, b in zip(text, answer)) / len(answer)


async def answer_once(ctx, sample):  # docs/data.md's workflow
    from flowrl_operators.workflows import TrajectoryBuilder

    builder = TrajectoryBuilder(ctx.prompt_ids(sample))
    builder.add_model(await ctx.generate(builder.context_ids))
    return builder.build(metadata={"sample": sample})


def from_version_two(trajectory) -> float:
    """1 for an answer of policy version 2 or later: evaluations reach 1.0 exactly at version 2."""
    return float(min(trajectory.versions) >= 2)
'''

PIPELINE = '''
flowrl: 1
name: my-math
model: {path: ./my-checkpoint}
data:
  source: {file: train.parquet, eval_rows: 4}
  batch_size: 4
  eval: {every: 1, samples: 4, options: {reward: my_rewards:exact}}
run: {steps: 3}
nodes:
  rollout: {op: generate, group_size: 4, sampling: {temperature: 1.0, max_new_tokens: 6}}
  score:   {op: reward, fn: my_rewards:digits_right, on_error: fail}
  learner: {op: train, advantage: {estimator: grpo}, loss: {kind: ppo_clip}, optim: {lr: 1.0e-3}}
  publish: {op: sync}
edges:
  - rollout -> score
  - score -> learner
  - learner -> publish
  - publish -> rollout: {kind: weights}
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("user")
    rows = [{"messages": [{"role": "user", "content": f"What is {a}+{b}? Answer with the number."}],
             "answer": str(a + b)} for a in range(4) for b in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    (root / "my_rewards.py").write_text(REWARDS)
    (root / "pipeline.yaml").write_text(PIPELINE)
    make_checkpoint("tiny-qwen2", root / "my-checkpoint", seed=0)
    return root


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_parquet_dataset_of_chat_messages_trains_a_checkpoint_through_flowrl_run(project):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", "pipeline.yaml", "--run-dir", "run", "--quiet"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = project / "run"
    rows = lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["groups"] == 4 and r["reward"] is not None for r in rows)
    evals = lines(run / "eval.jsonl")
    assert [e["version"] for e in evals] == [0, 1, 2, 3] and all(e["samples"] == 4 for e in evals)
    assert all(0 < e["seconds"] <= e["time"] for e in evals)
    assert (run / "export/learner/config.json").exists() and list((run / "export/learner").glob("*.safetensors"))
    assert (run / "checkpoints/latest").read_text().strip().endswith("step-3")


def test_stop_when_ends_the_run_at_the_version_whose_evaluation_reached_it(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    code = main(["run", "pipeline.yaml", "run.steps=50", "run.stop_when={eval_reward: 1.0}",
                 "data.eval.options.reward=my_rewards:from_version_two", "nodes.rollout.workflow=my_rewards:answer_once",
                 "--run-dir", "stopped", "--quiet"])
    assert code == 0
    assert "done after 2 steps" in capsys.readouterr().out
    evals = lines(project / "stopped/eval.jsonl")
    assert [(e["version"], e["eval_reward"]) for e in evals] == [(0, 0.0), (1, 0.0), (2, 1.0)]
    assert [r["step"] for r in lines(project / "stopped/metrics.jsonl")] == [0, 1]
    assert (project / "stopped/checkpoints/latest").read_text().strip().endswith("step-2")
    assert (project / "stopped/export/learner/config.json").exists()
