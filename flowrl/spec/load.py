"""YAML -> checked `PipelineSpec`, keeping every key's position for located errors.

Steps: compose the YAML (positions, duplicate keys), construct plain data, apply `key=value`
overrides and `${...}` interpolation with omegaconf, then convert to msgspec Structs. msgspec
errors carry a `$.a.b[2]` path but no position; `Locator` maps the path back to the YAML node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

import msgspec
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flowrl.spec.errors import Diagnostic, Path, SpecError, did_you_mean, format_path
from flowrl.spec.schema import PipelineSpec


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.1 wants `1.0e-3`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


@dataclass
class Locator:
    """Maps key paths to (line, col) of the YAML file, 1-based."""

    file: str
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)  # where the key is written
    values: dict[Path, tuple[int, int]] = field(default_factory=dict)  # where its value starts
    overrides: dict[Path, str] = field(default_factory=dict)  # paths set on the command line

    def diagnostic(self, path: Path, message: str, at_key: bool = False) -> Diagnostic:
        shown = format_path(path)
        for cut in range(len(path), -1, -1):
            prefix = path[:cut]
            if prefix in self.overrides:
                return Diagnostic(f"command-line override '{self.overrides[prefix]}'", 0, 0, shown, message)
            table = self.keys if at_key and cut == len(path) else self.values
            if prefix in table:
                line, col = table[prefix]
                return Diagnostic(self.file, line, col, shown, message)
        return Diagnostic(self.file, 1, 1, shown, message)


def _walk(node: yaml.Node, path: Path, loc: Locator, dups: list[Diagnostic]) -> None:
    loc.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            child = (*path, key)
            if key in seen:
                mark = key_node.start_mark
                dups.append(
                    Diagnostic(loc.file, mark.line + 1, mark.column + 1, format_path(child),
                               f"duplicate key '{key}' (each name may appear once)")
                )
            seen.add(key)
            loc.keys[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _walk(value_node, child, loc, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            loc.keys[(*path, i)] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _walk(item, (*path, i), loc, dups)


def parse_msgspec_path(text: str) -> Path:
    """`$.nodes.a[2].b` -> ('nodes', 'a', 2, 'b')."""
    out: list[str | int] = []
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", text.removeprefix("$")):
        out.append(int(index) if index else name)
    return tuple(out)


def get_path(data: Any, path: Path) -> Any:
    for part in path:
        data = data[part]
    return data


def validation_diagnostic(
    err: msgspec.ValidationError, data: Any, base: Path, loc: Locator, schema: type | None
) -> Diagnostic:
    """Turn a msgspec error into a located, plainly worded diagnostic."""
    path, message, at_key = validation_problem(err, data, schema)
    return loc.diagnostic((*base, *path), message, at_key=at_key)


def validation_problem(err: msgspec.ValidationError, data: Any, schema: type | None) -> tuple[Path, str, bool]:
    """A msgspec error converting `data` to `schema`, plainly worded: (key path inside `data`,
    message, whether the path names a key rather than a value)."""
    text = str(err)
    message, _, where = text.partition(" - at `")
    path = parse_msgspec_path(where.rstrip("`"))
    unknown = re.match(r"Object contains unknown field `(.+)`", message)
    if unknown:
        key = unknown.group(1)
        fields = _fields_at(schema, path) if schema else []
        return (*path, key), f"unknown key '{key}'" + did_you_mean(key, fields), True
    missing = re.match(r"Object missing required field `(.+)`", message)
    if missing:
        return path, f"missing required key '{missing.group(1)}'", False
    wrong_type = re.match(r"Expected `(.+?)`, got `(.+)`", message)
    if wrong_type:
        try:
            return path, f"expected {wrong_type.group(1)}, got {get_path(data, path)!r}", False
        except (KeyError, IndexError, TypeError):
            pass
    return path, message[0].lower() + message[1:], False


def _fields_at(schema: type, path: Path) -> list[str]:
    """Field names of the Struct type found by following `path` from `schema`."""
    import typing

    current: Any = schema
    for part in path:
        if isinstance(part, int):
            current = next((a for a in typing.get_args(current) if a is not type(None)), None)
        else:
            hints = typing.get_type_hints(current, include_extras=True) if _is_struct(current) else {}
            current = hints.get(part)
        current = _unwrap(current)
    return list(current.__struct_fields__) if _is_struct(current) else []


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


def _unwrap(t: Any) -> Any:
    import typing

    while typing.get_origin(t) in (typing.Annotated, typing.Union, list, type(int | None)):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        structs = [a for a in args if _is_struct(_strip_annotated(a))]
        t = structs[0] if structs else args[0]
        if typing.get_origin(t) is typing.Annotated:
            t = typing.get_args(t)[0]
    return t


def _strip_annotated(t: Any) -> Any:
    import typing

    return typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t


@dataclass
class LoadedSpec:
    spec: PipelineSpec
    data: dict[str, Any]  # resolved plain data (after overrides and interpolation)
    locator: Locator
    file: str


def load(file: str | FsPath, overrides: list[str] | None = None) -> LoadedSpec:
    """Read, override, interpolate and check the top-level schema. Raises SpecError."""
    file = str(file)
    try:
        text = FsPath(file).read_text()
    except OSError as e:
        raise SpecError([Diagnostic(file, 0, 0, "", f"cannot read spec: {e.strerror}")]) from None
    loc = Locator(file)
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise SpecError([Diagnostic(file, 1, 1, "", "the spec is empty")])
        dups: list[Diagnostic] = []
        _walk(root, (), loc, dups)
        if dups:
            raise SpecError(dups)
        raw = loader.construct_document(root)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise SpecError([Diagnostic(file, line, col, "", f"invalid YAML: {e.problem}")]) from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict):
        raise SpecError([Diagnostic(file, 1, 1, "", "the spec must be a mapping of keys (flowrl, name, nodes, ...)")])

    data = _apply_overrides(raw, overrides or [], loc)
    try:
        spec = msgspec.convert(data, PipelineSpec)
    except msgspec.ValidationError as e:
        raise SpecError([validation_diagnostic(e, data, (), loc, PipelineSpec)]) from None
    return LoadedSpec(spec, data, loc, file)


def _apply_overrides(raw: dict[str, Any], overrides: list[str], loc: Locator) -> dict[str, Any]:
    """Set each `dotted.key=value` (list items by index: `phases.0.seconds=10`), then interpolate."""
    for item in overrides:
        key, eq, text = item.partition("=")
        where = f"command-line override '{item}'"
        if not eq or not key:
            raise SpecError([Diagnostic(where, 0, 0, "", "expected key=value")])
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        try:
            value = yaml.load(text, Loader=_Loader) if text else ""
        except yaml.YAMLError:
            value = text
        node: Any = raw
        try:
            for part in path[:-1]:
                node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
            if isinstance(node, list) and not isinstance(path[-1], int):
                raise TypeError("a list")
            node[path[-1]] = value
        except (IndexError, KeyError, TypeError, AttributeError):
            raise SpecError([Diagnostic(where, 0, 0, format_path(path), "no such key or list item to set")]) from None
        loc.overrides[path] = item
    try:
        # Interpolation only: omegaconf's built-in resolvers read config and environment values;
        # we register none that evaluates code.
        return OmegaConf.to_container(OmegaConf.create(raw), resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        path = tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]", str(key)) if p)
        message = str(e).splitlines()[0]
        raise SpecError([loc.diagnostic(path, f"interpolation failed: {message}")]) from None
