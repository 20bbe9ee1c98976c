"""Grid navigation from pictures: a multi-turn vision-language task.

An agent and a target sit on a small grid. Each turn the environment renders what the agent sees as
an image: the cells around it (the agent, white, in the middle; cells off the grid gray walls) and
the target in red, or, when the target lies beyond the view, a red marker on the view's edge in its
direction (the target clamped into the view, as a minimap shows what is off screen). The model
answers `up`, `down`, `left` or `right`; the agent moves one cell (into a wall: it stays). Where
the target is can only be read from the picture: the text never says.

Turn rewards: reaching the target 1 (the episode ends), a move closer 0.2, a move away or into a wall
-0.1, a reply that is no direction -0.3 (the agent stays). The episode reward is their sum, so
an episode that walks straight to a target d cells away earns 1 + 0.2 (d - 1). A reply that is no
direction costs more than a wrong move: otherwise a policy that moves badly learns to stop answering
(measured: GRPO drifted to misspelt words when both cost about the same).

Why this shape: a tiny vision-language model must learn it in minutes on a CPU. The view is centred
on the agent, so the answer depends only on where red appears in the picture, not on comparing two
positions. A 3x3 view of 19-pixel cells is 57 pixels, which the built-in VL models' processor takes
as 56x56: 4 image tokens (patch 14, merged 2x2), each holding a quarter of the view. Measured with
builtin:tiny-qwen2-vl, supervised on the best first move (batch 32, lr 1e-3): this view was answered
right 52% of the time after 50 steps and always after 100; with 28-pixel cells (one token per cell, 9
tokens) 31% and 44%: the model must then read where a token sits, rather than what it holds.

Samples hold only the state (`size`, `agent`, `target`), a best first move (`target_move`) and a
direction drawn at random (`any_move`): the answers a supervised warm-up may teach
(`workflow_args: {supervised: true, answer: best | any}`). `any` teaches the answer format and
nothing of the picture, so what the model then learns to see, it learns by RL (pipelines/vl_agent.yaml).
The environment renders images in the generate stage, where they are stored in the run's image
store (`flowrl.data.images`).
"""

from __future__ import annotations

import random
import re
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import Split, TaskSource, draw
from flowrl_operators.workflows.environment import EnvironmentWorkflow, StepResult

MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
_WORD = re.compile(r"[a-z]+")
PROMPT = "Go to red. up/down/left/right?"
WALL, FLOOR, AGENT, GOAL = (110, 110, 110), (0, 0, 0), (255, 255, 255), (255, 0, 0)


def render(size: int, agent: tuple[int, int], target: tuple[int, int], radius: int, cell_px: int) -> Any:
    """The agent's view: (2 radius + 1)^2 cells around it, `cell_px` pixels each (a PIL image)."""
    from PIL import Image, ImageDraw

    cells = 2 * radius + 1
    image = Image.new("RGB", (cells * cell_px, cells * cell_px), WALL)
    draw_ = ImageDraw.Draw(image)
    # The target, or its marker on the view's edge (between the agent and the target: on the grid).
    seen = tuple(a + max(-radius, min(radius, t - a)) for a, t in zip(agent, target, strict=True))
    for row in range(cells):
        for col in range(cells):
            x, y = agent[0] + col - radius, agent[1] + row - radius
            if not (0 <= x < size and 0 <= y < size):
                continue
            color = GOAL if (x, y) == seen else AGENT if (x, y) == tuple(agent) else FLOOR
            draw_.rectangle([col * cell_px, row * cell_px, (col + 1) * cell_px - 1, (row + 1) * cell_px - 1],
                            fill=color)
    return image


def parse_move(text: str) -> str | None:
    """The first word of a reply if it is a direction, else None."""
    match = _WORD.search(text.lower())
    return match.group() if match and match.group() in MOVES else None


def best_moves(agent: tuple[int, int], target: tuple[int, int]) -> list[str]:
    """The moves that bring the agent one cell closer (one or two of them)."""
    dx, dy = target[0] - agent[0], target[1] - agent[1]
    moves = []
    if dx:
        moves.append("right" if dx > 0 else "left")
    if dy:
        moves.append("down" if dy > 0 else "up")
    return moves


class GridNavEnv:
    """One episode: the agent's position moves with each valid answer until it reaches the target."""

    def __init__(self, radius: int = 1, cell_px: int = 19) -> None:
        self.radius, self.cell_px = radius, cell_px

    def reset(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.size = int(sample["size"])
        self.agent, self.target = tuple(sample["agent"]), tuple(sample["target"])
        return self.observation(PROMPT)

    def observation(self, text: str | None = None) -> dict[str, Any]:
        image = render(self.size, self.agent, self.target, self.radius, self.cell_px)
        parts: list[dict[str, Any]] = [{"type": "image", "image": image}]
        if text:
            parts.append({"type": "text", "text": text})
        return {"role": "user", "content": parts}

    def distance(self) -> int:
        return abs(self.target[0] - self.agent[0]) + abs(self.target[1] - self.agent[1])

    def step(self, action: str) -> StepResult:
        move = parse_move(action)
        if move is None:
            return StepResult(self.observation("up/down/left/right?"), -0.3, False, {"solved": False})
        before = self.distance()
        x, y = self.agent[0] + MOVES[move][0], self.agent[1] + MOVES[move][1]
        if 0 <= x < self.size and 0 <= y < self.size:
            self.agent = (x, y)
        if self.agent == self.target:
            return StepResult(None, 1.0, True, {"solved": True})
        reward = 0.2 if self.distance() < before else -0.1
        return StepResult(self.observation(), reward, False, {"solved": False})


class grid_nav(TaskSource):  # noqa: N801 - the name users write: builtin:grid_nav
    """Walk to a target seen only in pictures of the agent's surroundings (module docs)."""

    name = "grid_nav"
    images = True  # its episodes show the model pictures: `flowrl validate` asks for a VL model

    def __init__(self, seed: int = 0, split: Split = "train", size: int = 4, max_distance: int = 2) -> None:
        super().__init__(seed, split)
        if size < 2:
            raise ValueError(f"grid_nav needs size >= 2, got {size}")
        self.size, self.max_distance = size, max_distance
        if max_distance < 1:
            raise ValueError(f"grid_nav needs max_distance >= 1, got {max_distance}")

    def _state(self, rng: random.Random) -> tuple[tuple[int, int], tuple[int, int], int]:
        while True:
            agent = (rng.randrange(self.size), rng.randrange(self.size))
            target = (rng.randrange(self.size), rng.randrange(self.size))
            distance = abs(target[0] - agent[0]) + abs(target[1] - agent[1])
            if 1 <= distance <= self.max_distance:
                return agent, target, rng.getrandbits(32)

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        # Few distinct states, so the held-out key includes a per-draw nonce (as guess_number):
        # eval episodes are fresh draws, not unseen layouts.
        agent, target, _ = draw(self._state, rng, split, lambda s: f"{s[0]}/{s[1]}/{s[2]}")
        return {"size": self.size, "agent": list(agent), "target": list(target),
                "target_move": rng.choice(best_moves(agent, target)), "any_move": rng.choice(list(MOVES))}

    @staticmethod
    def workflow(max_turns: int = 3, radius: int = 1, cell_px: int = 19, supervised: bool = False,
                 answer: str = "best", system: str | None = None, max_context: int | None = None) -> Any:
        """The episode (`EnvironmentWorkflow`), or with `supervised: true` one first view answered
        with a best move (`answer: best`) or a random direction (`answer: any`, the format only)."""
        for name, value in (("max_turns", max_turns), ("radius", radius), ("cell_px", cell_px)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"grid_nav's {name} must be an integer >= 1, got {value!r}")
        if answer not in ("best", "any"):
            raise ValueError(f"grid_nav's answer must be best or any, got {answer!r}")

        def make_env() -> GridNavEnv:
            return GridNavEnv(radius, cell_px)
        if supervised:
            from flowrl_operators.workflows.vision_supervised import FirstObservationSupervised

            key = "target_move" if answer == "best" else "any_move"
            return FirstObservationSupervised(make_env, target_key=key, system=system)
        return EnvironmentWorkflow(make_env, max_turns=max_turns, system=system, max_context=max_context)

    @staticmethod
    def reference(sample: dict[str, Any]) -> str:
        """A best first move (`flowrl validate --probe`, flowrl_operators/probe.py)."""
        return sample["target_move"]

    @staticmethod
    def reward(trajectory: Trajectory) -> float:
        """The environment scored the episode; this reads it back (the sum of turn rewards). A
        supervised warm-up trajectory scores 1 (its answer is the best move)."""
        if trajectory.turn_rewards:
            return float(sum(trajectory.turn_rewards))
        return trajectory.reward if trajectory.reward is not None else 1.0
