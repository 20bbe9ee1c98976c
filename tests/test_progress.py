"""The live progress view of `flowrl run`: what one frame shows for a status of the coordinator."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from flowrl.graph.compile import compile_file
from flowrl.runtime.progress import ProgressView

ROOT = Path(__file__).resolve().parents[1]


def frame(view: ProgressView, status: dict | None) -> str:
    console = Console(width=140, record=True, color_system=None)
    console.print(view.render(status))
    return console.export_text()


def test_frame_shows_phase_step_version_rates_reward_eval_and_queues() -> None:
    plan = compile_file(str(ROOT / "pipelines/quickstart.yaml")).plan
    plan.run["phase"], plan.run["steps"] = "grpo", 60
    view = ProgressView(plan, executor=None)
    assert "starting..." in frame(view, None)
    status = {"versions": {"learner": 7, "rollout": 7}, "counters": {"dropped": 3},
              "queues": {"score.trajectories -> learner.trajectories": 5},
              "last": {"samples_per_s": 12.5, "reward": 0.4567,
                       "operators": {"rollout": {"eval/reward": 0.625, "generate/episodes": 90.0}}}}
    text = frame(view, status)
    for part in ("quickstart · grpo", "step 7/60", "policy v7", "12.50 samples/s", "reward 0.457",
                 "eval 0.625", "dropped 3", "score.trajectories -> learner.trajectories", "5"):
        assert part in text, (part, text)


def test_frame_warns_of_each_health_condition_on_now() -> None:
    plan = compile_file(str(ROOT / "pipelines/grpo_sync.yaml")).plan
    view = ProgressView(plan, executor=None)
    events = [
        {"node": "learner", "condition": "tied_groups", "event": "began", "step": 3, "at": 12,
         "message": "tied groups from step 3: 60% of groups tied"},
        {"node": "learner", "condition": "entropy_collapse", "event": "began", "step": 20, "at": 29,
         "message": "entropy collapse from step 20: entropy 0.001"},
        {"node": "learner", "condition": "tied_groups", "event": "ended", "step": 31, "at": 40,
         "message": "tied groups ended at step 31"},
    ]
    status = {"versions": {"learner": 41}, "counters": {"dropped": 0}, "queues": {}, "last": {}, "health": events}
    text = frame(view, status)
    assert "! learner: entropy collapse from step 20: entropy 0.001" in text
    assert "tied groups" not in text  # it ended
    assert "!" not in frame(view, status | {"health": []})


def test_frame_warns_of_each_node_whose_episodes_wait_naming_the_longest(tmp_path) -> None:
    from flowrl.runtime.waits import Waits

    plan = compile_file(str(ROOT / "pipelines/grpo_sync.yaml")).plan
    view = ProgressView(plan, executor=None)
    waits = Waits(tmp_path, origin=0.0)  # what the coordinator's status() hands the view
    step = {"sample_id": "3:1", "episode": 2, "turn": 4, "awaits": "environment.step", "waited_s": 75.2}
    engine = {"sample_id": "3:0", "episode": 0, "turn": 1, "awaits": "engine", "waited_s": 61.0}
    waits.report("rollout", 0, [engine])
    waits.report("rollout", 1, [step])
    status = {"versions": {"learner": 3}, "counters": {"dropped": 0}, "queues": {}, "last": {},
              "waits": waits.status()}
    text = frame(view, status)
    assert "! rollout: 2 episodes waiting; the longest 75 s on environment.step (sample 3:1, episode 2, turn 4)" in text
    waits.report("rollout", 0, [])
    waits.report("rollout", 1, [])
    assert "!" not in frame(view, status | {"waits": waits.status()})
    rows = [json.loads(line) for line in (tmp_path / "waits.jsonl").read_text().splitlines()]
    assert [(r["event"], r["replica"], r["awaits"]) for r in rows] == [
        ("began", 0, "engine"), ("began", 1, "environment.step"), ("ended", 0, "engine"), ("ended", 1, "environment.step")]
