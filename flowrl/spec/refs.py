"""Config keys whose value names code or files, checked when a spec is validated.

A key such as a reward's `fn` (`module:attr`) or `model.path` (a folder) is declared with
`Annotated[str, check_with(fn)]`; the compiler calls `fn(value, section)` for each such key
(the section is the Struct holding it) and reports the problem it returns at the key. Checking
`module:attr` imports the module: `flowrl validate` runs the module's top-level code.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Meta

from flowrl.registry import OperatorError, import_path

Check = Callable[[str, Any], "str | None"]

# A Hugging Face model folder holds its config and one of these tokenizer files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_with(fn: Check) -> Meta:
    """Metadata for a config key checked by `fn(value, section) -> problem | None`."""
    return Meta(extra={"check": fn})


def callable_path(value: str, arguments: int | None = None) -> str | None:
    """`module:attr` imports and names something callable (with `arguments` positional arguments,
    when given: a reward that takes none would fail on every call, counted but never reported)."""
    try:
        target = import_path(value)
    except OperatorError as e:
        return str(e)
    if not callable(target):
        return f"'{value}' is a {type(target).__name__}, not something callable"
    return None if arguments is None else _binds(value, target, arguments)


def _binds(value: str, target: Any, arguments: int) -> str | None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: cannot tell
        return None
    try:
        signature.bind(*[None] * arguments)
    except TypeError as e:
        return f"'{value}' cannot be called with {arguments} argument{'s' if arguments > 1 else ''}: {e}"
    return None


def model_folder(value: str, section: Any = None) -> str | None:
    """A local Hugging Face folder (config.json and a tokenizer), `builtin:<name>` or `phase:<name>`."""
    del section
    if value.startswith("phase:"):  # an earlier phase's export: flowrl/spec/phases.py checks the name
        return None
    if value.startswith("builtin:"):
        from flowrl.data import models

        return None if value.removeprefix("builtin:") in models.builtin_names() else models.unknown(value)
    folder = Path(value).expanduser()
    if not folder.is_dir():
        return f"no model folder '{value}' ({'not a folder' if folder.exists() else 'it does not exist'})"
    if not (folder / "config.json").is_file():
        return f"'{value}' is not a Hugging Face model folder: it has no config.json"
    if (problem := _config_problem(folder / "config.json")) is not None:
        return f"the model folder '{value}': {problem}"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"the model folder '{value}' has no tokenizer (one of {', '.join(TOKENIZER_FILES)})"
    return None


def _config_problem(config: Path) -> str | None:
    """A config.json that would fail only once the weights load: not JSON, or no model type that
    transformers knows."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"config.json cannot be read as JSON: {e}"
    kind = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        return "config.json names no model_type"
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return None if kind in CONFIG_MAPPING_NAMES else f"config.json's model_type '{kind}' is unknown to transformers"


def problems(section: msgspec.Struct, path: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], str]]:
    """(key path, problem) of every checked key in `section` and the Structs nested in it."""
    import typing

    out: list[tuple[tuple[str | int, ...], str]] = []
    hints = typing.get_type_hints(type(section), include_extras=True)
    for name in section.__struct_fields__:
        value = getattr(section, name)
        if isinstance(value, msgspec.Struct):
            out += problems(value, (*path, name))
            continue
        # A checked key, or a list of them (`run.trackers`): each item is reported at its index.
        items = [((*path, name), value)] if isinstance(value, str) else \
            [((*path, name, i), v) for i, v in enumerate(value) if isinstance(v, str)] if isinstance(value, list) else []
        for check in _checks(hints[name]):
            for where, item in items:
                try:
                    problem = check(item, section)
                except Exception as e:  # noqa: BLE001 - a checker's own failure is reported, not raised
                    problem = f"cannot check '{item}': {type(e).__name__}: {e}"
                if problem:
                    out.append(_at_sibling(section, path, where, problem))
    return out


def _at_sibling(section: msgspec.Struct, path: tuple[str | int, ...], where: tuple[str | int, ...],
                problem: str) -> tuple[tuple[str | int, ...], str]:
    """A problem a check words as `other_key: what` (a workflow's `workflow_args`) is located at that key."""
    named = re.match(r"([\w.]+): (.+)", problem, re.S)
    if named and named.group(1).split(".")[0] in section.__struct_fields__:
        return (*path, *named.group(1).split(".")), named.group(2)
    return where, problem


def _checks(hint: Any) -> list[Check]:
    import typing

    found: list[Check] = []
    for arg in [hint, *typing.get_args(hint)]:  # also finds list[Annotated[str, check_with(...)]]
        if typing.get_origin(arg) is typing.Annotated:
            found += [m.extra["check"] for m in arg.__metadata__
                      if isinstance(m, Meta) and m.extra and "check" in m.extra]
    return found
