"""Limits a spec must respect before it is composed: size, encoding, nesting depth, alias expansion.

PyYAML composes and constructs nodes recursively and expands aliases into shared objects that
every later walk visits again, so a deeply nested file ends in a RecursionError and a 1 KB alias
bomb ("billion laughs") in minutes of work and gigabytes. The checks here read the file's event
stream, which PyYAML produces without recursion, and refuse such a file at the offending place.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable
from typing import Any

import yaml

from flowrl.spec.errors import Diagnostic, Path, SpecError


class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where built: 5-10x faster
    """SafeLoader that also reads `1e-3` as a float (YAML 1.1 wants `1.0e-3`)."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


MAX_BYTES = 256 * 1024  # a spec is a few KB; this keeps even a hostile file's parse within a second or two
MAX_DEPTH = 64  # mappings and lists nested in each other
MAX_NODES = 100_000  # values in the spec with every alias expanded


def read_text(file: str) -> str:
    """The spec file's text: UTF-8 (a UTF-8 byte-order mark is allowed), at most MAX_BYTES."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):  # a folder, a pipe, /dev/zero: never read to the end
            raise SpecError([Diagnostic(file, 0, 0, "", "cannot read spec: not a regular file")])
        with open(file, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise SpecError([Diagnostic(file, 0, 0, "", f"cannot read spec: {e.strerror or e}")]) from None
    if len(raw) > MAX_BYTES:  # located where the limit is passed
        line = raw.count(b"\n", 0, MAX_BYTES) + 1
        col = MAX_BYTES - (raw.rfind(b"\n", 0, MAX_BYTES) + 1) + 1
        raise SpecError([Diagnostic(file, line, col, "", f"the spec is larger than the limit of {MAX_BYTES} bytes; "
                                                         "it passes it here")])
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise SpecError([Diagnostic(file, 1, 1, "", "the spec is UTF-16 text; save it as UTF-8")])
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError([Diagnostic(file, line, col, "", f"not UTF-8 text (byte 0x{raw[e.start]:02x}); a spec is a "
                                                         "YAML text file")]) from None


def check_events(loader: Any, file: str) -> None:
    """Walk the event stream once, refusing deep nesting and alias expansion beyond the limits."""
    depth = 0
    total = 0  # nodes so far, aliases expanded
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (expanded nodes, levels) of the anchored value
    opened: list[list[Any]] = []  # [anchor, total at start, depth at start, deepest inside] per open collection
    while loader.check_event():
        event = loader.get_event()
        reached = depth
        if isinstance(event, yaml.AliasEvent):
            nodes, levels = sizes.get(event.anchor, (1, 0))
            total, reached = total + nodes, depth + levels
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                sizes[event.anchor] = (1, 0)
        elif isinstance(event, yaml.CollectionStartEvent):
            opened.append([event.anchor, total, depth, depth + 1])
            depth += 1
            total += 1
            reached = depth
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start, base, deepest = opened.pop()
            depth = base
            if opened:
                opened[-1][3] = max(opened[-1][3], deepest)
            if anchor:
                sizes[anchor] = (total - start, deepest - base)
        if opened:
            opened[-1][3] = max(opened[-1][3], reached)
        if reached > MAX_DEPTH:
            _refuse(file, event, f"nested more than {MAX_DEPTH} levels deep (aliases expanded)")
        if total > MAX_NODES:
            _refuse(file, event, f"more than {MAX_NODES} values once aliases (*name) are expanded")


def _refuse(file: str, event: yaml.Event, what: str) -> None:
    mark = event.start_mark
    raise SpecError([Diagnostic(file, mark.line + 1, mark.column + 1, "", f"the spec is {what}; refusing it")])


def reader_error(file: str, text: str, e: yaml.reader.ReaderError) -> SpecError:
    """A character YAML does not allow (a control character, NUL), at its place."""
    line = text.count("\n", 0, e.position) + 1
    col = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
    char = e.character if isinstance(e.character, str) else chr(e.character)
    return SpecError([Diagnostic(file, line, col, "", f"character {char!r} (U+{ord(char):04X}) is not allowed in a "
                                                      "YAML file")])


def bad_numbers(data: Any, path: Path = ()) -> list[tuple[Path, str]]:
    """(path, problem) of every inf or NaN, and of every integer no 64-bit field can hold, in plain data."""
    if isinstance(data, float) and not math.isfinite(data):
        return [(path, f"{data} is not a finite number; write a finite value")]
    if isinstance(data, int) and not isinstance(data, bool) and not -(2**63) <= data < 2**63:
        return [(path, f"{data} is out of range (a 64-bit integer)")]
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in bad_numbers(v, (*path, k))]
    if isinstance(data, list | tuple):
        return [p for i, v in enumerate(data) for p in bad_numbers(v, (*path, i))]
    return []


MAX_NESTED_INTERPOLATION = 8  # `${a.${b}}` is 2
MAX_RESOLVED = 1_000_000  # characters a string may reach once its `${...}` references are resolved
# A reference `${a.b}`, `${.sibling}`, `${a[0]}`, or a resolver's key argument (`${oc.select:a.b,x}`).
_REF = re.compile(r"\$\{\s*(?:[\w.]+:\s*)?([.\w\[\]-]+)\s*[,}]")


def check_interpolation(raw: dict[str, Any], refuse: Callable[[Path, str], SpecError]) -> None:
    """Refuse strings whose references expand past MAX_RESOLVED characters: `${a}${a}...` nested a
    few levels (an "interpolation bomb") would take omegaconf minutes and gigabytes to resolve."""
    strings: dict[Path, str] = {}
    _strings(raw, (), strings)
    sizes: dict[Path, int] = {}

    def size(path: Path, depth: int) -> int:
        if path in sizes:
            return sizes[path]
        sizes[path] = 0  # a cycle counts as nothing here; omegaconf reports it
        text = strings[path]
        total = len(text)
        for ref in _REF.findall(text):
            target = _target(path, ref)  # a string, or a mapping or list: every string under it
            for inner in [target] if target in strings else [p for p in strings if p[: len(target)] == target]:
                if depth < 100:
                    total += size(inner, depth + 1)
            if total > MAX_RESOLVED:
                raise refuse(path, f"resolving its ${{...}} references would make it longer than {MAX_RESOLVED} "
                                   "characters; refusing it")
        sizes[path] = total
        return total

    for path in [p for p, text in strings.items() if "${" in text]:
        if _nesting(strings[path]) > MAX_NESTED_INTERPOLATION:  # omegaconf's parser recurses on each level
            raise refuse(path, f"its ${{...}} are nested more than {MAX_NESTED_INTERPOLATION} deep; refusing it")
        size(path, 0)


def _nesting(text: str) -> int:
    depth = deepest = 0
    for i, char in enumerate(text):
        if char == "$" and text[i + 1: i + 2] == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif char == "}" and depth:
            depth -= 1
    return deepest


def _strings(data: Any, path: Path, out: dict[Path, str]) -> None:
    if isinstance(data, dict):
        for key, value in data.items():
            _strings(value, (*path, key), out)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _strings(value, (*path, i), out)
    else:  # a number or other scalar counts with its printed length
        out[path] = data if isinstance(data, str) else str(data)


def _target(path: Path, ref: str) -> Path:
    """The path a reference written at `path` names: absolute `a.b[0]`, or relative `.x`, `..x`."""
    dots = len(ref) - len(ref.lstrip("."))
    base = path[: len(path) - dots] if dots else ()
    parts = re.findall(r"[^.\[\]]+", ref[dots:])
    return (*base, *(int(p) if p.isdigit() else p for p in parts))
