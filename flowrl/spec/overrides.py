"""`key=value` overrides of a spec's plain data, then omegaconf interpolation (`${...}`).

A key is dotted (`nodes.learner.optim.lr`), a list item by its index (`phases.0.seconds`), and a
phase's `set` takes the rest of the key as one dotted key (`phases.1.set.nodes.a.b=v`). The value is
YAML (its text itself where it is not), read within the guard's limits.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flowrl.spec import guard
from flowrl.spec.errors import Diagnostic, SpecError, format_path
from flowrl.spec.guard import Loader

if TYPE_CHECKING:
    from flowrl.spec.load import Locator


def _override_value(text: str, where: str) -> Any:
    """The YAML value of a `key=value` override (the text itself if it is not YAML)."""
    if not text:
        return ""
    loader = Loader(text)
    try:
        guard.check_events(loader, where)
        loader.dispose()
        loader = Loader(text)
        node = loader.get_single_node()
        twice = _duplicate_key(node)
        if twice is not None:  # YAML would keep the last silently
            raise SpecError([Diagnostic(where, 0, 0, "", f"duplicate key '{twice}' (each name may appear once)")])
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError:
        return text
    finally:
        loader.dispose()


def _duplicate_key(node: yaml.Node | None) -> str | None:
    if isinstance(node, yaml.MappingNode):
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        return twice or next((d for _, v in node.value if (d := _duplicate_key(v)) is not None), None)
    if isinstance(node, yaml.SequenceNode):
        return next((d for v in node.value if (d := _duplicate_key(v)) is not None), None)
    return None


def _interpolates(raw: Any) -> bool:
    if isinstance(raw, dict):
        return any(_interpolates(k) or _interpolates(v) for k, v in raw.items())
    if isinstance(raw, list):
        return any(_interpolates(v) for v in raw)
    return isinstance(raw, str) and "${" in raw


def apply_overrides(raw: dict[str, Any], overrides: list[str], loc: Locator) -> dict[str, Any]:
    """Set each `dotted.key=value` (list items by index: `phases.0.seconds=10`), then interpolate."""
    for item in overrides:
        key, eq, text = item.partition("=")
        shown = item if len(item) <= 80 else item[:77] + "..."
        where = f"command-line override '{shown}'"
        if not eq or not key:
            raise SpecError([Diagnostic(where, 0, 0, "", "expected key=value")])
        if "" in key.split("."):
            raise SpecError([Diagnostic(where, 0, 0, "", f"'{key}' is not a dotted key (an empty part)")])
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        if len(path) > 3 and path[0] == "phases" and path[2] == "set":
            # A phase's `set` takes dotted keys: `phases.1.set.nodes.a.b=v` sets its key `nodes.a.b`.
            path = (*path[:3], ".".join(map(str, path[3:])))
        path, created = _assign(raw, path, _override_value(text, where), where)
        for prefix in created:  # a problem inside what the override added is the override's
            loc.overrides[prefix] = shown
        loc.overrides[path] = shown
    if not _interpolates(raw):  # omegaconf takes seconds on a large spec; skip it when it has nothing to do
        return raw
    guard.check_interpolation(raw, lambda path, message: SpecError([loc.diagnostic(path, message)]))
    try:
        # Interpolation only: omegaconf's built-in resolvers read config and environment values;
        # we register none that evaluates code.
        return OmegaConf.to_container(OmegaConf.create(raw), resolve=True)  # type: ignore[return-value]
    except (OmegaConfBaseException, RecursionError) as e:
        key = getattr(e, "full_key", "") or ""
        path = tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]", str(key)) if p)
        message = str(e).splitlines()[0]
        raise SpecError([loc.diagnostic(path, f"interpolation failed: {message}")]) from None


def _assign(raw: dict[str, Any], path: tuple[str | int, ...], value: Any, where: str
            ) -> tuple[tuple[str | int, ...], list[tuple[str | int, ...]]]:
    """Set `path` in `raw` (a digit is a list index, or a mapping's key); returns the path as set
    and the mappings it had to create on the way."""
    node: Any = raw
    done: tuple[str | int, ...] = ()
    created = []
    try:
        for i, part in enumerate(path):
            if isinstance(node, dict):
                part = str(part)
            elif not isinstance(node, list) or not isinstance(part, int):
                raise TypeError("not a mapping or list")
            done = (*done, part)
            if i == len(path) - 1:
                node[part] = value
            elif isinstance(node, dict) and part not in node:
                node = node.setdefault(part, {})
                created.append(done)
            else:
                node = node[part]
    except (IndexError, KeyError, TypeError):
        raise SpecError([Diagnostic(where, 0, 0, format_path(path), "no such key or list item to set")]) from None
    return done, created
