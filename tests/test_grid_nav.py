"""builtin:grid_nav without a model: what the agent sees, how it moves and is rewarded, and the
source's splits."""

from __future__ import annotations

import pytest

from flowrl_operators.tasks import TASKS
from flowrl_operators.tasks.grid_nav import GOAL, WALL, GridNavEnv, best_moves, grid_nav, parse_move, render


def cell(image, col: int, row: int, cell_px: int) -> tuple[int, int, int]:
    return image.getpixel((col * cell_px + cell_px // 2, row * cell_px + cell_px // 2))


def test_the_view_is_centred_on_the_agent_with_walls_off_the_grid():
    image = render(size=3, agent=(0, 0), target=(2, 1), radius=2, cell_px=4)
    assert image.size == (20, 20)
    assert cell(image, 2, 2, 4) == (255, 255, 255)  # the agent, always in the middle
    assert cell(image, 4, 3, 4) == GOAL  # two right, one down
    assert cell(image, 1, 2, 4) == WALL and cell(image, 2, 1, 4) == WALL  # left of and above the grid
    assert cell(image, 3, 2, 4) == (0, 0, 0)  # floor


def test_a_target_beyond_the_view_is_marked_on_its_edge():
    image = render(size=4, agent=(1, 1), target=(3, 1), radius=1, cell_px=28)
    assert image.size == (84, 84)
    assert cell(image, 2, 1, 28) == GOAL  # right of the agent, on the edge
    far = render(size=4, agent=(0, 3), target=(3, 0), radius=1, cell_px=28)
    assert cell(far, 2, 0, 28) == GOAL and cell(far, 0, 1, 28) == WALL  # up and right; left is off the grid
    assert sum(far.getpixel((x, y)) == GOAL for x in range(84) for y in range(84)) == 28 * 28  # one marker


def test_moves_rewards_and_the_end_of_an_episode():
    env = GridNavEnv()
    first = env.reset({"size": 3, "agent": [0, 0], "target": [1, 1]})
    assert first["content"][0]["type"] == "image" and first["content"][1]["type"] == "text"
    assert first["content"][0]["image"].size == (57, 57)  # 3x3 cells of 19 pixels
    step = env.step("left")  # into the wall: no closer
    assert (step.reward, step.done, env.agent) == (-0.1, False, (0, 0))
    assert env.step("hello").reward == -0.3
    step = env.step("Right")
    assert (step.reward, step.done, env.agent) == (0.2, False, (1, 0))
    assert step.observation["content"][0]["type"] == "image"
    step = env.step("down please")
    assert (step.reward, step.done, step.info) == (1.0, True, {"solved": True})


def test_parse_and_best_moves():
    assert parse_move(" up") == "up" and parse_move("LEFT!") == "left" and parse_move("go up") is None
    assert best_moves((0, 0), (2, 1)) == ["right", "down"] and best_moves((2, 2), (2, 0)) == ["up"]


def test_source_is_pure_and_splits_never_overlap():
    source = grid_nav(seed=3)
    assert source.sample(4, 2) == grid_nav(seed=3).sample(4, 2)
    sample = source.sample(0, 0)
    assert sample["target_move"] in best_moves(tuple(sample["agent"]), tuple(sample["target"]))
    assert 1 <= abs(sample["agent"][0] - sample["target"][0]) + abs(sample["agent"][1] - sample["target"][1]) <= 2
    assert source.eval_sample(5) == grid_nav(seed=9).eval_sample(5)
    assert TASKS["grid_nav"] is grid_nav
    with pytest.raises(ValueError, match="size >= 2"):
        grid_nav(size=1)


def test_workflow_args_are_checked_before_anything_loads():
    from types import SimpleNamespace

    from flowrl_operators.checks import workflow
    from flowrl_operators.workflows.environment import EnvironmentWorkflow
    from flowrl_operators.workflows.vision_supervised import FirstObservationSupervised

    def check(**args):
        return workflow("builtin:grid_nav", SimpleNamespace(workflow_args=args))

    assert check(max_turns=2, supervised=True, answer="any") is None
    assert check(answer="some") == "workflow_args: grid_nav's answer must be best or any, got 'some'"
    assert check(cell_px=0) == "workflow_args: grid_nav's cell_px must be an integer >= 1, got 0"
    assert "unexpected keyword argument 'radiu'" in check(radiu=2)
    assert workflow("builtin:guess_number", SimpleNamespace(workflow_args={"max_turns": 0.5, "x": 1})).startswith(
        "workflow_args:")
    built = grid_nav.workflow(max_turns=2, radius=2, cell_px=5, system="s", max_context=99)
    assert isinstance(built, EnvironmentWorkflow) and (built.max_turns, built.system, built.max_context) == (2, "s", 99)
    env = built.make_env()
    assert (env.radius, env.cell_px) == (2, 5)
    warm = grid_nav.workflow(supervised=True, answer="any")
    assert isinstance(warm, FirstObservationSupervised) and warm.target_key == "any_move"
    assert grid_nav.workflow(supervised=True).target_key == "target_move"
