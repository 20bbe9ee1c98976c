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

from flowrl.spec import guard
from flowrl.spec.errors import Diagnostic, Path, SpecError, did_you_mean, format_path
from flowrl.spec.guard import Loader as _Loader
from flowrl.spec.overrides import apply_overrides
from flowrl.spec.schema import PipelineSpec

_TEXT_KEYS = ("tag:yaml.org,2002:str", "tag:yaml.org,2002:merge")  # `<<: *base` merges a mapping


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


def _walk(node: yaml.Node, path: Path, loc: Locator, problems: list[Diagnostic]) -> None:
    loc.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            mark = key_node.start_mark
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag not in _TEXT_KEYS:
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else "a list or mapping"
                problems.append(Diagnostic(loc.file, mark.line + 1, mark.column + 1, format_path(path),
                                           f"a key must be plain text, got {shown}; quote it if it is a name"))
                continue
            key = key_node.value
            child = (*path, key)
            if key in seen:
                problems.append(Diagnostic(loc.file, mark.line + 1, mark.column + 1, format_path(child),
                                           f"duplicate key '{key}' (each name may appear once)"))
            seen.add(key)
            loc.keys[child] = (mark.line + 1, mark.column + 1)
            _walk(value_node, child, loc, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            loc.keys[(*path, i)] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _walk(item, (*path, i), loc, problems)


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
    where, in_mapping, _ = where.rstrip("`").partition("[...]")  # msgspec's mark: a value of this mapping
    path = parse_msgspec_path(where)
    if in_mapping and isinstance(value := _get(data, path), dict):
        path = (*path, *_mapping_key(value, message))
    own = re.match(r"([\w.]+): (.+)", message, re.S)  # a Struct's own check names its key: "key: what"
    if own and schema and own.group(1).split(".")[0] in _fields_at(schema, path):
        return (*path, *own.group(1).split(".")), own.group(2), False
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
            value = get_path(data, path)
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            return path, f"expected {wrong_type.group(1)}, got {shown}", False
        except (KeyError, IndexError, TypeError):
            pass
    return path, message[0].lower() + message[1:], False


def _get(data: Any, path: Path) -> Any:
    try:
        return get_path(data, path)
    except (KeyError, IndexError, TypeError):
        return None


_JSON_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "null": type(None), "array": list, "object": dict}


def _mapping_key(mapping: dict[str, Any], message: str) -> Path:
    """The key of `mapping` whose value a msgspec type error is about (the first of that type)."""
    got = re.search(r"got `(\w+)`", message)
    kind = _JSON_TYPES.get(got.group(1)) if got else None
    return next(((key,) for key, value in mapping.items() if kind is not None and type(value) is kind), ())


def _fields_at(schema: type, path: Path) -> list[str]:
    """Field names of the Struct type found by following `path` from `schema`."""
    import typing

    current: Any = schema
    for part in path:
        if isinstance(part, int):
            if _is_struct(current):  # a list's item type, already unwrapped from list[...]
                continue
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
    environment: list[str] = field(default_factory=list)  # variables read by ${oc.env:NAME}


def load(file: str | FsPath, overrides: list[str] | None = None) -> LoadedSpec:
    """Read, override, interpolate and check the top-level schema. Raises SpecError."""
    file = str(file)
    text = guard.read_text(file)
    loc = Locator(file)
    raw = _compose(text, file, loc)
    data = apply_overrides(raw, overrides or [], loc)
    bad = guard.bad_numbers(data)
    if bad:
        raise SpecError([loc.diagnostic(path, problem) for path, problem in bad])
    try:
        spec = msgspec.convert(data, PipelineSpec)
    except msgspec.ValidationError as e:
        raise SpecError([validation_diagnostic(e, data, (), loc, PipelineSpec)]) from None
    check_names(spec, loc)
    return LoadedSpec(spec, data, loc, file, _environment(raw))


_ENV = re.compile(r"\$\{oc\.env:\s*([^,}\s]+)")


def _environment(raw: Any) -> list[str]:
    """Names of the environment variables that `${oc.env:NAME}` interpolations in `raw` read."""
    if isinstance(raw, dict):
        return sorted({n for v in raw.values() for n in _environment(v)})
    if isinstance(raw, list):
        return sorted({n for v in raw for n in _environment(v)})
    return sorted(set(_ENV.findall(raw))) if isinstance(raw, str) else []


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_names(spec: PipelineSpec, loc: Locator) -> None:
    """The run's and phases' names become folder names (runs/<name>-<time>, phases/<i>-<name>):
    nothing that could leave the runs folder or name a special file."""
    named = [(("name",), spec.name)] + [(("phases", i, "name"), p.name) for i, p in enumerate(spec.phases)]
    problems = [loc.diagnostic(path, f"{name!r} cannot name a folder: use letters, digits, '_', '-' and '.' "
                                     "(starting with a letter or digit, at most 128)")
                for path, name in named if not _NAME.fullmatch(name)]
    if problems:
        raise SpecError(problems)


def _compose(text: str, file: str, loc: Locator) -> dict[str, Any]:
    """Parse `text` (within the guard's limits), recording every key's position in `loc`."""
    loader = None
    try:
        loader = _Loader(text)
        guard.check_events(loader, file)
        loader.dispose()
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None:
            raise SpecError([Diagnostic(file, 1, 1, "", "the spec is empty")])
        problems: list[Diagnostic] = []
        _walk(root, (), loc, problems)
        if problems:
            raise SpecError(problems)
        raw = loader.construct_document(root)
    except yaml.reader.ReaderError as e:
        raise guard.reader_error(file, text, e) from None
    except yaml.MarkedYAMLError as e:
        raise SpecError([_yaml_diagnostic(file, e)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(raw, dict):
        raise SpecError([Diagnostic(file, 1, 1, "", "the spec must be a mapping of keys (flowrl, name, nodes, ...)")])
    return raw


def _yaml_diagnostic(file: str, e: yaml.MarkedYAMLError) -> Diagnostic:
    # A quote or bracket left open is found only at the end of the file: point at where it opens.
    at_end = "end of stream" in (e.problem or "") or "end of stream" in (e.context or "")
    mark = (e.context_mark if at_end else None) or e.problem_mark or e.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    context = ""
    if e.context and e.context_mark:
        opened = e.context_mark
        context = f" ({e.context} here)" if at_end else f" ({e.context} at {opened.line + 1}:{opened.column + 1})"
    return Diagnostic(file, line, col, "", f"invalid YAML: {e.problem}{context}")
