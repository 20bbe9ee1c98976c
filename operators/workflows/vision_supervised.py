"""A supervised warm-up on an environment's first observation: the prompt is what the environment
shows at `reset` (its images included), the response the sample's known answer.

Used by tasks whose observations are rendered (e.g. images) rather than stored in the sample, so
that a warm-up phase sees exactly the prompts its RL phase will see (`builtin:grid_nav` with
`workflow_args: {supervised: true}`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.chat.template import EpisodeError, chat_ids
from flowrl_operators.workflows.base import TrajectoryBuilder, WorkflowContext
from flowrl_operators.workflows.environment import as_messages, with_images
from flowrl_operators.workflows.single_turn import data_trajectory


def _end_of_turn(tokenizer: Any) -> list[int]:
    """The chat template's end of an assistant turn (`<|im_end|>`), which the RL phase's turns end
    with too; else the EOS token."""
    if "<|im_end|>" in tokenizer.get_vocab():
        return [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


class FirstObservationSupervised:
    """`target_key`: the sample's field holding the answer text (tokenised, then the end of turn)."""

    def __init__(self, make_env: Callable[[], Any], target_key: str = "target", system: str | None = None) -> None:
        self.make_env, self.target_key, self.system = make_env, target_key, system

    async def __call__(self, ctx: WorkflowContext, sample: dict[str, Any]) -> Trajectory:
        if self.target_key not in sample:
            raise EpisodeError(f"the supervised warm-up needs the sample's {self.target_key!r} (keys: {sorted(sample)})")
        env = self.make_env()
        # reset renders; it is quick and pure, so it runs here rather than on a thread of its own.
        first = as_messages(env.reset(sample))
        history, images = with_images(([{"role": "system", "content": self.system}] if self.system else []) + first)
        builder = TrajectoryBuilder(chat_ids(ctx.tokenizer, history, images=images), images)
        target = ctx.encode(str(sample[self.target_key])) + _end_of_turn(ctx.tokenizer)
        return data_trajectory(builder, target, ctx.version, sample)
