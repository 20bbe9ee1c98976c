"""Entry-point registries: what a plugin package (or flowrl itself, in pyproject.toml) registers.

Every registry of named things users pick in YAML (weight transports, losses, advantage
estimators, ...) is one entry-point group whose entries load to one value each. `load(group,
check)` loads a group once, checking each value; `unknown(...)` words the error for a name that
is not registered, with the closest registered name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from functools import cache
from importlib.metadata import entry_points
from typing import Any


@cache
def targets(group: str) -> dict[str, str]:
    """name -> `module:attr` of every entry point of `group`, without importing anything."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


@cache
def load(group: str, check: Callable[[str, str, Any], None] | None = None) -> dict[str, Any]:
    """name -> loaded value for every entry point of `group`; `check(name, target, value)` raises
    on a value that breaks the group's contract."""
    found = {}
    for ep in entry_points(group=group):
        value = ep.load()
        if check is not None:
            check(ep.name, ep.value, value)
        found[ep.name] = value
    return found


def suggestion(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def unknown(what: str, name: str, choices: Iterable[str]) -> str:
    """`unknown loss 'cispoo' (registered: ...); did you mean 'cispo'?`"""
    choices = sorted(choices)
    return f"unknown {what} '{name}' (registered: {', '.join(choices)}){suggestion(name, choices)}"
