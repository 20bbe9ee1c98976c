"""Environments (simulator-style tasks) and their adapter to a multi-turn workflow.

An environment is created fresh for each episode, so its state belongs to one sample and dies with
the episode:

    class MyEnv:
        def reset(self, sample: dict) -> str | dict | list[dict]: ...          # first observation
        async def step(self, action: str) -> tuple[observation, reward, done, info]: ...

`reset` and `step` may be sync or async. An observation is text (a user message), one chat
message (`{"role": "tool", "content": ...}`), or a list of messages. For a vision-language policy
a message's content may be a list of `{"type": "text", "text": ...}` and `{"type": "image", "image":
<PIL image, bytes, path or data URL>}` parts: each image is stored in the run's image store, its
placeholder tokens expanded in the observation's ids, and the trajectory lists its images in
order. `step` receives the decoded text of the model's turn, or its token ids if the class sets
`action = "ids"`. `step` may return `(observation, reward, done)` or add an `info` dict; a
`StepResult` works too. Its reward must be a finite number (`flowrl_operators.reward_values`);
anything else fails the episode. An optional `close()` runs when the episode ends, however it ends.

Sync code never runs on the event loop, where it would stall every stage of the process and no
timeout could fire: an environment class with a sync `reset` or `step` is built, and its sync
methods are called, on a daemon thread of its own (always the same one, for libraries that tie
state to a thread). When the generate node's `episode_timeout_s` cancels an episode stuck in a
sync call, the call is abandoned in that thread (it cannot be killed; being a daemon, it does
not keep the process alive) and a sync `close()` is queued behind it; an async `close()` gets
`CLOSE_TIMEOUT_S` in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from flowrl.data.images import ImageRef
from flowrl.data.trajectory import Trajectory
from flowrl_operators.chat.images import ImageContentError, store_images
from flowrl_operators.chat.template import EpisodeError, chat_ids, continuation_ids
from flowrl_operators.reward_values import InvalidReward, as_reward
from flowrl_operators.threads import DaemonExecutor, call_in_thread
from flowrl_operators.workflows.base import TrajectoryBuilder, WorkflowContext, is_async_callable, maybe_await

CLOSE_TIMEOUT_S = 30.0  # an abandoned episode's async close() (its sync close() queues in its thread)
_CLOSING: set[asyncio.Task] = set()  # those closes, kept referenced until they finish


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


def with_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Image parts stored in the run's image store (`chat.images.store_images`)."""
    try:
        return store_images(messages)
    except ImageContentError as e:
        raise EpisodeError(f"an observation's image: {e}") from None


def as_step(value: Any) -> StepResult:
    if isinstance(value, tuple) and len(value) in (3, 4):
        observation, reward, done, *info = value
        value = StepResult(observation, reward, bool(done), dict(info[0] or {}) if info else {})
    elif not isinstance(value, StepResult):
        raise EpisodeError(f"step() must return (observation, reward, done[, info]) or a StepResult, got {value!r:.80}")
    try:
        return msgspec.structs.replace(value, reward=as_reward(value.reward, "step() reward"))
    except InvalidReward as e:
        raise EpisodeError(str(e)) from None


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
        host = _Host()
        try:
            with ctx.awaiting("environment.make"):
                env = await host.make(self.make_env)
            try:
                trajectory = await self._episode(ctx, host, env, sample)
            except asyncio.CancelledError:  # the episode timed out: do not wait on a hung call
                host.abandon(env)
                raise
            except BaseException:
                with ctx.awaiting("environment.close"):
                    await host.close(env)
                raise
            with ctx.awaiting("environment.close"):
                await host.close(env)
            return trajectory
        finally:
            host.thread.close()

    async def _episode(self, ctx: WorkflowContext, host: _Host, env: Any, sample: dict[str, Any]) -> Trajectory:
        with ctx.awaiting("environment.reset"):
            first = await host.call(env.reset, sample)
        history, images = with_images(([{"role": "system", "content": self.system}] if self.system else [])
                                      + as_messages(first))
        builder = TrajectoryBuilder(chat_ids(ctx.tokenizer, history, images=images), images)
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
            result = await ctx.generate(builder.context_ids, images=builder.images, max_new_tokens=max_new)
            builder.add_model(result)
            text = ctx.decode(result.output_ids)
            action = result.output_ids if getattr(env, "action", "text") == "ids" else text
            with ctx.awaiting("environment.step"):
                step = as_step(await host.call(env.step, action))
            builder.turn_rewards.append(step.reward)
            info.update(_plain_info(step.info))
            history.append({"role": "assistant", "content": text})
            if step.done:
                done = True
                break
            if turn == self.max_turns - 1:
                break  # out of turns: the last observation would never be answered
            observation, images = with_images(as_messages(step.observation))
            builder.add_environment(continuation_ids(ctx.tokenizer, history[:-1], observation, result.output_ids,
                                                     images), ctx.version, images)
            history += observation
        if not done and builder.finish_reason == "stop":
            builder.finish_reason = "length"  # out of turns
        metadata = {"sample": sample, "turns": len(builder.turns), "done": done, "info": info}
        return builder.build(reward=sum(builder.turn_rewards), metadata=metadata)


class _Host:
    """Where one episode's environment runs: sync code on a daemon thread of its own (started at
    the first sync call, one call at a time), async code on the event loop."""

    def __init__(self) -> None:
        self.thread = DaemonExecutor(1, "flowrl-env")

    async def make(self, make_env: Callable[[], Any]) -> Any:
        """A class with a sync `reset` or `step` is built on the thread its methods will run on."""
        if isinstance(make_env, type) and not all(
                is_async_callable(getattr(make_env, name, None)) for name in ("reset", "step")):
            return await call_in_thread(self.thread, make_env)
        return make_env()

    async def call(self, method: Callable[..., Any], *args: Any) -> Any:
        if is_async_callable(method):
            return await method(*args)
        return await maybe_await(await call_in_thread(self.thread, method, *args))

    async def close(self, env: Any) -> None:
        close = getattr(env, "close", None)  # optional in the protocol
        if callable(close):
            await self.call(close)

    def abandon(self, env: Any) -> None:
        """Close without waiting: a sync close queues behind whatever call the thread is stuck in;
        an async one runs in the background, for at most CLOSE_TIMEOUT_S."""
        close = getattr(env, "close", None)
        if not callable(close):
            return
        if not is_async_callable(close):
            self.thread.submit(close)
            return
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(close(), CLOSE_TIMEOUT_S))
        _CLOSING.add(task)
        task.add_done_callback(_closed)


def _closed(task: asyncio.Task) -> None:
    _CLOSING.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failed close of an abandoned episode is not reported again
