"""The agent workflow: a user's agent, written against the `openai` client, plays one episode
through the proxy; its recorded calls become the episode's trajectories.

    async def my_agent(base_url: str, sample: dict) -> float | None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="flowrl")
        ...                      # any number of chat.completions.create calls
        return reward            # or None to leave scoring to a reward node

An agent may instead return a dict: its `reward` (float or None) as above, and any other keys with
plain JSON values (text, numbers, booleans) into each trajectory's `metadata["info"]`, where reward
functions read them (e.g. the final answer's text, without parsing the whole conversation).

Sync agents (with `openai.OpenAI`) run in a thread. `agent_args` are passed as keyword arguments.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl.registry import import_path
from flowrl_operators.chat.template import EpisodeError
from flowrl_operators.reward_values import InvalidReward, as_reward
from flowrl_operators.workflows.base import WorkflowContext
from flowrl_operators.workflows.proxy import assemble, run_agent


class AgentWorkflow:
    needs_proxy = True

    def __init__(self, agent: str | Callable[..., Any], **agent_args: Any) -> None:
        self.agent = import_path(agent) if isinstance(agent, str) else agent
        if not callable(self.agent):
            raise ValueError(f"agent {agent!r} is not callable; give an async def agent(base_url, sample)")
        self.agent_args = agent_args

    async def __call__(self, ctx: WorkflowContext, sample: dict[str, Any]) -> list[Trajectory]:
        proxy = ctx.services.get("proxy")
        if proxy is None:
            raise EpisodeError("the agent workflow needs the generate node's proxy (ctx.services['proxy'])")
        session = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{ctx.sample_id}-{ctx.episode}") + "-" + uuid.uuid4().hex[:6]
        base_url = proxy.open_session(session, ctx.sampling, ctx.seed, wait=ctx.wait)
        try:
            with ctx.awaiting("agent"):  # the proxy marks its engine calls inside
                outcome = await run_agent(functools.partial(self.agent, **self.agent_args), base_url, sample)
        finally:
            ended = proxy.end_session(session)
        trajectories = assemble(ended.calls, ctx.version, ended.tool_calls)
        reward, info = (outcome.get("reward"), _plain(outcome)) if isinstance(outcome, dict) else (outcome, {})
        if reward is not None:  # None leaves scoring to a reward node
            try:
                reward = as_reward(reward, "the agent's reward")
            except InvalidReward as e:
                raise EpisodeError(f"{e}; return a float reward or None") from None
        for t in trajectories:
            t.reward = reward
            t.metadata["sample"] = sample
            if info:
                t.metadata["info"] = info
        return trajectories


def _plain(outcome: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able keys of an agent's dict outcome other than `reward`."""
    return {k: v for k, v in outcome.items() if k != "reward" and (isinstance(v, str | int | float | bool) or v is None)}
