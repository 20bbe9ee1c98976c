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


_BROKEN: dict[str, dict[str, str]] = {}  # group -> name -> why its entry point did not load


@cache
def load(group: str, check: Callable[[str, str, Any], None] | None = None) -> dict[str, Any]:
    """name -> loaded value for every entry point of `group` that loads and passes
    `check(name, target, value)` (which raises on a value that breaks the group's contract). One
    that does not is left out and kept in `broken(group)`: a broken plugin costs only its own names."""
    found = {}
    for ep in entry_points(group=group):
        try:
            value = ep.load()
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a plugin may fail in any way as it imports
            _BROKEN.setdefault(group, {})[ep.name] = f"entry point {ep.name} = {ep.value} ({group}): {type(e).__name__}: {e}"
            continue
        try:
            if check is not None:
                check(ep.name, ep.value, value)
        except Exception as e:  # noqa: BLE001 - the check says what is wrong
            _BROKEN.setdefault(group, {})[ep.name] = str(e)
            continue
        found[ep.name] = value
    return found


def broken(group: str) -> dict[str, str]:
    """name -> why it did not load, of the entry points of `group` that `load` left out."""
    return dict(_BROKEN.get(group, {}))


def missing(what: str, name: str, group: str, choices: Iterable[str]) -> str:
    """Why `name` is not among `choices`: its plugin did not load, or it is not registered."""
    why = broken(group).get(name)
    return f"{what} '{name}' cannot be loaded: {why}" if why else unknown(what, name, choices)


def suggestion(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def unknown(what: str, name: str, choices: Iterable[str]) -> str:
    """`unknown loss 'cispoo' (registered: ...); did you mean 'cispo'?`"""
    choices = sorted(choices)
    return f"unknown {what} '{name}' (registered: {', '.join(choices)}){suggestion(name, choices)}"
