"""The two simplest workflows: one model turn per episode, and a supervised one that calls no model."""

from __future__ import annotations

from typing import Any

from flowrl.data.trajectory import Trajectory, Turn
from flowrl_operators.chat.template import EpisodeError
from flowrl_operators.workflows.base import TrajectoryBuilder, WorkflowContext


async def single_turn(ctx: WorkflowContext, sample: dict[str, Any]) -> Trajectory:
    """Prompt (see `WorkflowContext.prompt`, images included) -> one generation -> one trajectory."""
    ids, images = ctx.prompt(sample)
    builder = TrajectoryBuilder(ids, images)
    builder.add_model(await ctx.generate(builder.context_ids, images=images))
    return builder.build(metadata={"sample": sample})


async def supervised(ctx: WorkflowContext, sample: dict[str, Any]) -> Trajectory:
    """The sample's known `target` text (or `target_ids`) as the response, ended by the EOS token.

    For supervised phases (e.g. a warm-up with `loss: {kind: sft}`): the engine is not called, the
    target is tokenised (it is data, not model output), its logprobs are 0, every token is stamped
    with the serving policy version, and its sampling span is temperature 1 (the loss is on the
    model's own distribution whatever the node's sampling).
    """
    if "target_ids" in sample:
        target = list(sample["target_ids"])
    elif "target" in sample:
        target = ctx.encode(sample["target"])
        if ctx.tokenizer.eos_token_id is not None:
            target.append(ctx.tokenizer.eos_token_id)
    else:
        raise EpisodeError(f"the supervised workflow needs a sample with 'target' or 'target_ids' (keys: {sorted(sample)})")
    return data_trajectory(TrajectoryBuilder(*ctx.prompt(sample)), target, ctx.version, sample)


def data_trajectory(builder: TrajectoryBuilder, target: list[int], version: int, sample: dict[str, Any]) -> Trajectory:
    """`target` as the response of `builder`'s prompt: data, not sampled (logprobs 0, every token at
    `version`, one turn), trained on the model's own distribution (a temperature-1 span)."""
    builder.response_ids, builder.loss_mask = target, [1] * len(target)
    builder.logprobs, builder.versions = [0.0] * len(target), [version] * len(target)
    builder.turns = [Turn(0, len(target))]
    builder.add_sampling(0, temperature=1.0)
    return builder.build(metadata={"sample": sample})
