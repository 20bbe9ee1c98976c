"""The PPO-with-critic graph (pipelines/ppo_critic.yaml: generate -> reward -> reference -> critic
-> train -> sync) improves the reward of a toy task end to end, through the runtime."""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.graph.compile import compile_file
from flowrl.runtime import run

ROOT = Path(__file__).resolve().parents[1]
TOY = ["data.source=toy_tasks:AnswerWithDigits", "nodes.score.fn=toy_tasks:digit_fraction",
       "data.batch_size=32", "nodes.rollout.sampling.max_new_tokens=3", "nodes.learner.optim.lr=3e-3",
       "nodes.value.optim.lr=3e-3", "run.steps=14"]


def test_ppo_with_critic_graph_improves_reward(tmp_path: Path, monkeypatch) -> None:
    from flowrl.runtime import stage

    monkeypatch.setattr(stage, "REPORT_EVERY_S", 0.0)  # counters reported after every operator call
    plan = compile_file(str(ROOT / "pipelines/ppo_critic.yaml"), TOY).plan
    assert [plan.nodes[n].kind for n in plan.order] == ["generate", "reward", "reference", "transform", "train", "sync"]
    result = run(plan, run_dir=tmp_path, progress=False)
    assert result.status == "done" and result.steps == 14
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, rewards
    # The critic took one update per step, each before the train step that used its values.
    assert rows[-1]["operators"]["value"]["critic_updates"] == 14
    assert all(r["train"]["kl"] >= 0 for r in rows if "kl" in r["train"])
