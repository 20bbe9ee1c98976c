"""Workflows: what a generate node runs per episode (see `base`), environments and their adapter,
the OpenAI-compatible proxy for agents, and `load_workflow`, which resolves the node's
`workflow:` key.
"""

from __future__ import annotations

from typing import Any

from flowrl.registry import import_path
from flowrl_operators.chat.template import EpisodeError, chat_ids, continuation_ids
from flowrl_operators.workflows.agent import AgentWorkflow
from flowrl_operators.workflows.base import TrajectoryBuilder, Workflow, WorkflowContext
from flowrl_operators.workflows.environment import Environment, EnvironmentWorkflow, StepResult
from flowrl_operators.workflows.single_turn import single_turn, supervised

__all__ = ["AgentWorkflow", "Environment", "EnvironmentWorkflow", "EpisodeError", "StepResult",
           "TrajectoryBuilder", "Workflow", "WorkflowContext", "chat_ids", "continuation_ids",
           "load_workflow", "single_turn", "supervised"]


def load_workflow(name: str, args: dict[str, Any] | None = None) -> Workflow:
    """The workflow a generate node's `workflow:` (and `workflow_args:`) name.

    - `single_turn` (default), `supervised` (the sample's known target, no engine call),
      `agent` (args: `agent: module:attr` plus its keyword arguments), `environment`
      (args: `env: module:attr` of an Environment class, `max_turns`, `system`);
    - `builtin:<task>`: a built-in task's workflow (e.g. `builtin:guess_number`);
    - `module:attr`: an Environment class (adapted), a workflow class (instantiated with the
      args), or an `async def workflow(ctx, sample)` (args reach it as `ctx.args`).
    """
    args = dict(args or {})
    if name == "single_turn":
        return single_turn
    if name == "supervised":
        return supervised
    if name == "agent":
        if "agent" not in args:
            raise ValueError("workflow 'agent' needs workflow_args.agent: module:attr of an agent function")
        return AgentWorkflow(args.pop("agent"), **args)
    if name == "environment":
        if "env" not in args:
            raise ValueError("workflow 'environment' needs workflow_args.env: module:attr of an environment class")
        return EnvironmentWorkflow(import_path(args.pop("env")), **args)
    if name.startswith("builtin:"):
        from flowrl.data.source import builtin_tasks

        registered = builtin_tasks()
        task = registered.get(name.removeprefix("builtin:"))
        if task is None:
            raise ValueError(f"unknown built-in task {name!r}; known: {', '.join('builtin:' + t for t in registered)}")
        if not hasattr(task, "workflow"):
            return single_turn
        return task.workflow(**args)
    if ":" not in name:
        raise ValueError(f"unknown workflow {name!r}: use single_turn, supervised, agent, environment, "
                         "builtin:<task> or module:attr")
    target = import_path(name)
    if isinstance(target, type):
        if callable(getattr(target, "reset", None)) and callable(getattr(target, "step", None)):
            return EnvironmentWorkflow(target, **args)
        return target(**args)
    if not callable(target):
        raise ValueError(f"workflow {name!r} is not callable")
    return target
