"""Real runs judged by flowrl/health.py: one whose policy collapses (no entropy bonus, a learning rate
30x the quickstart's) is named so, with the step it began, in metrics.jsonl, the live view, the
run's closing lines and `flowrl inspect`; a healthy quickstart-shaped run (copy warm-up, then GRPO
with the quickstart's settings) is not flagged. The pipelines are written here, not read from
pipelines/, so that a change of the shipped recipe does not change what these tests judge."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from flowrl import health
from flowrl.cli import main

GRPO = {
    "flowrl": 1, "name": "health-grpo", "model": {"path": "builtin:tiny-qwen2"},
    "data": {"source": "builtin:reverse_digits", "batch_size": 8},
    "cluster": {"cpus": 2}, "run": {"seed": 0, "executor": "inprocess", "trackers": []},
    "nodes": {
        "rollout": {"op": "generate", "group_size": 8, "sampling": {"temperature": 1.0, "max_new_tokens": 8},
                    "engine": {"max_batch": 64, "threads": 2}},
        "score": {"op": "reward", "fn": "flowrl_operators.tasks.digits:position_rewards"},
        "learner": {"op": "train", "advantage": {"estimator": "grpo", "gamma": 0.0},
                    "loss": {"kind": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.01},
                    "optim": {"lr": 1.0e-3}},
        "publish": {"op": "sync"},
    },
    "edges": ["rollout -> score", "score -> learner", "learner -> publish", {"publish -> rollout": {"kind": "weights"}}],
}
WARMUP = {"name": "warmup", "steps": 60, "set": {
    "data.source": "builtin:copy_digits", "data.options": {"marker": ">"}, "data.batch_size": 64,
    "nodes.rollout.workflow": "supervised", "nodes.rollout.group_size": 1, "nodes.score.fn": "builtin:copy_digits",
    "nodes.learner.loss": {"kind": "sft"}}}


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def collapse_began(rows: list[dict]) -> int | None:
    """The first step of the first ENTROPY_STEPS-long streak at or under ENTROPY_RATIO of the start."""
    entropy = [r["train"]["entropy"] for r in rows]
    start = sum(entropy[: health.REFERENCE_STEPS]) / health.REFERENCE_STEPS
    low = [e <= health.ENTROPY_RATIO * start for e in entropy]
    for i in range(health.REFERENCE_STEPS - 1, len(low) - health.ENTROPY_STEPS + 1):
        if all(low[i: i + health.ENTROPY_STEPS]) and not low[i - 1]:
            return i
    return None


@pytest.mark.slow
def test_a_collapsing_run_is_named_with_the_step_it_began(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = copy.deepcopy(GRPO) | {"run": GRPO["run"] | {"steps": 20}}
    spec["nodes"]["learner"] |= {
        "loss": {"kind": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.0}, "optim": {"lr": 3.0e-2},
        "policy_kl_every": 0}
    (tmp_path / "collapse.yaml").write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    assert main(["run", str(tmp_path / "collapse.yaml"), "--run-dir", str(run_dir)]) == 0  # with the live view
    shown = capsys.readouterr().out
    rows = rows_of(run_dir)
    assert rows[-1]["train"]["entropy"] < 0.01 * rows[0]["train"]["entropy"]  # it did collapse
    assert not any("policy_kl" in r["train"] for r in rows)  # policy_kl_every: 0
    began = collapse_began(rows)
    assert began is not None
    events = [e for r in rows for e in r.get("health", []) if e["condition"] == "entropy_collapse"]
    assert [(e["event"], e["step"], e["at"]) for e in events] == [("began", began, began + health.ENTROPY_STEPS - 1)]
    # The row that found it carries it: on disk from that row's flush on.
    assert rows[began + health.ENTROPY_STEPS - 1]["health"][0]["condition"] == "entropy_collapse"
    phrase = f"entropy collapse from step {began}"
    assert f"! learner: {phrase}" in shown  # the live view's last frame
    assert f"health: {phrase}" in shown  # the run's closing lines
    assert main(["inspect", str(run_dir)]) == 0
    assert phrase in capsys.readouterr().out


@pytest.mark.slow
def test_a_healthy_quickstart_shaped_run_is_not_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = copy.deepcopy(GRPO) | {"phases": [WARMUP, {"name": "grpo", "steps": 30}]}
    (tmp_path / "healthy.yaml").write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    assert main(["run", str(tmp_path / "healthy.yaml"), "--run-dir", str(run_dir), "--quiet"]) == 0
    rows = rows_of(run_dir / "phases/1-grpo")
    assert len(rows) == 30 and all("health" not in r for r in rows)
    assert all("policy_kl" in r["train"] for r in rows if r["step"] % 10 == 0)
    assert all(0.0 <= r["train"]["tied_group_fraction"] <= 1.0 for r in rows)
    assert health.replay(rows) == []
    capsys.readouterr()
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("health: nothing found") == 2 and len(out.splitlines()) <= 60
