"""The live progress view of `flowrl run`: what one frame shows for a status of the coordinator."""

from __future__ import annotations

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
