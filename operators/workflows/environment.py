"""Environments (simulator-style tasks) and their adapter to a multi-turn workflow.

An environment is created fresh for each episode, so its state belongs to one sample and dies with
the episode:

    class MyEnv:
        def reset(self, sample: dict) -> str | dict | list[dict]: ...          # first observation
        async def step(self, action: str) -> tuple[observation, reward, done, info]: ...

`reset` and `step` may be sync or async. An observation is text (a user message), one chat
message (`{"role": "tool", "content": ...}`), or a list of messages. `step` receives the decoded
text of the model's turn, or its token ids if the class sets `action = "ids"`. `step` may return
`(observation, reward, done)` or add an `info` dict; a `StepResult` works too. An optional
`close()` runs when the episode ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from flowrl.data.trajectory import Trajectory
from flowrl_operators.workflows.base import (
    EpisodeError,
    TrajectoryBuilder,
    WorkflowContext,
    chat_ids,
    continuation_ids,
    maybe_await,
)


class StepResult(msgspec.Struct):
    observation: Any
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = {}


class Environment(Protocol):
    def reset(self, sample: dict[str, Any]) -> Any: ...

    async def step(self, action: Any) -> Any: ...


def as_messages(observation: Any) -> list[dict[str, Any]]:
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return list(observation)
    raise EpisodeError(f"an observation must be text, a chat message or a list of them, got {type(observation).__name__}")


def as_step(value: Any) -> StepResult:
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) in (3, 4):
        observation, reward, done, *info = value
        return StepResult(observation, float(reward), bool(done), dict(info[0] or {}) if info else {})
    raise EpisodeError(f"step() must return (observation, reward, done[, info]) or a StepResult, got {value!r:.80}")


def _plain_info(info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able part of an info dict (it travels in trajectory metadata)."""
    return {k: v for k, v in info.items() if isinstance(v, str | int | float | bool) or v is None}


class EnvironmentWorkflow:
    """Runs any environment as a multi-turn episode: the model answers each observation until the
    environment says done, `max_turns` is reached, or the context is full.

    The trajectory holds the first observation as its prompt; its response interleaves model turns
    (loss mask 1, one `Turn` span each, the engine's ids) with the template's continuation and the
    next observation (loss mask 0). Step rewards become `turn_rewards`; `reward` is their sum.
    """

    def __init__(self, make_env: Callable[[], Any], max_turns: int = 8, system: str | None = None,
                 max_context: int | None = None) -> None:
        self.make_env = make_env
        self.max_turns = max_turns
        self.system = system
        self.max_context = max_context

    async def __call__(self, ctx: WorkflowContext, sample: dict[str, Any]) -> Trajectory:
        env = self.make_env()
        try:
            return await self._episode(ctx, env, sample)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                await maybe_await(close())

    async def _episode(self, ctx: WorkflowContext, env: Any, sample: dict[str, Any]) -> Trajectory:
        history = ([{"role": "system", "content": self.system}] if self.system else []) + as_messages(
            await maybe_await(env.reset(sample)))
        builder = TrajectoryBuilder(chat_ids(ctx.tokenizer, history))
        limit = self.max_context or getattr(ctx.engine, "max_context", None)
        info: dict[str, Any] = {}
        done = False
        for turn in range(self.max_turns):
            if limit is not None and len(builder.context_ids) + 1 >= limit:
                builder.finish_reason = "length"
                break
            max_new = ctx.sampling.max_new_tokens
            if limit is not None:
                max_new = min(max_new, limit - len(builder.context_ids))
            result = await ctx.generate(builder.context_ids, max_new_tokens=max_new)
            builder.add_model(result)
            text = ctx.decode(result.output_ids)
            action = result.output_ids if getattr(env, "action", "text") == "ids" else text
            step = as_step(await maybe_await(env.step(action)))
            builder.turn_rewards.append(step.reward)
            info.update(_plain_info(step.info))
            history.append({"role": "assistant", "content": text})
            if step.done:
                done = True
                break
            if turn == self.max_turns - 1:
                break  # out of turns: the last observation would never be answered
            observation = as_messages(step.observation)
            builder.add_environment(continuation_ids(ctx.tokenizer, history[:-1], observation, result.output_ids),
                                    ctx.version)
            history += observation
        if not done and builder.finish_reason == "stop":
            builder.finish_reason = "length"  # out of turns
        metadata = {"sample": sample, "turns": len(builder.turns), "done": done, "info": info}
        return builder.build(reward=sum(builder.turn_rewards), metadata=metadata)
