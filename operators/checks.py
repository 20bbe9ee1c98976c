"""Checks of config keys that name code (`flowrl.spec.refs.check_with`), run by `flowrl validate`
before any stage starts: the same resolution `load_reward` and `load_workflow` do, without calling."""

from __future__ import annotations

import ipaddress
from typing import Any

from flowrl.spec.refs import callable_path

WORKFLOW_NAMES = ("single_turn", "supervised", "agent", "environment")


def _task(value: str, what: str) -> str | None:
    from flowrl.data.source import builtin_tasks

    registered = builtin_tasks()
    if value.removeprefix("builtin:") in registered:
        return None
    return f"unknown built-in {what} '{value}'; known: {', '.join('builtin:' + t for t in registered)}"


def _task_workflow_args(value: str, args: dict[str, Any]) -> str | None:
    """A built-in task's workflow built from `workflow_args` (cheap: no model), so a wrong or
    out-of-range argument is reported by `flowrl validate`, not after the weights load."""
    from flowrl.data.source import builtin_tasks

    registered = builtin_tasks()
    factory = getattr(registered[value.removeprefix("builtin:")], "workflow", None)
    if factory is None:
        return "workflow_args: this task's workflow takes none" if args else None
    try:
        factory(**args)
    except (TypeError, ValueError) as e:
        return f"workflow_args: {e}"
    return None


def reward_fn(value: str, section: Any = None) -> str | None:
    """A reward's `fn`: `builtin:<task>` or a `module:attr` callable with one argument (a trajectory,
    or with `batched` the group's list)."""
    del section
    return _task(value, "reward") if value.startswith("builtin:") else callable_path(value, arguments=1)


def workflow(value: str, section: Any) -> str | None:
    """A generate node's `workflow` (and the `module:attr` its `workflow_args` name for it)."""
    args = section.workflow_args
    if value.startswith("builtin:"):
        return _task(value, "workflow") or _task_workflow_args(value, args)
    if value in ("agent", "environment"):
        key = "agent" if value == "agent" else "env"
        if not isinstance(args.get(key), str):
            return f"workflow '{value}' needs workflow_args.{key}: module:attr"
        problem = callable_path(args[key])
        return f"workflow_args.{key}: {problem}" if problem else None
    if value in ("single_turn", "supervised") and args:  # they read none: an argument would be ignored
        return f"workflow_args: workflow '{value}' takes none (it got {', '.join(map(str, args))})"
    if value in WORKFLOW_NAMES:
        return None
    if ":" not in value:
        return f"unknown workflow '{value}': use {', '.join(WORKFLOW_NAMES)}, builtin:<task> or module:attr"
    return callable_path(value)


def proxy_host(value: str, section: Any) -> str | None:
    """A generate node's `proxy_host`: loopback unless `proxy_allow_remote` says otherwise."""
    if section.proxy_allow_remote or is_loopback(value):
        return None
    return (f"the OpenAI proxy has no authentication and binds loopback addresses only; '{value}' is not one: "
            "use 127.0.0.1, or set proxy_allow_remote: true to serve agents on other machines")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`); other names count as remote."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def judge_template(value: str, section: Any = None) -> str | None:
    """A judge's `template`: only the fields the judge fills, in `str.format` syntax."""
    del section
    try:
        value.format(prompt="", response="", reference="", max_score=10)
    except (KeyError, IndexError) as e:
        return f"the template names field {e} that the judge does not fill (it fills prompt, response, reference, max_score)"
    except ValueError as e:
        return f"the template is not str.format text: {e} (write a literal brace as {{{{ or }}}})"
    return None
