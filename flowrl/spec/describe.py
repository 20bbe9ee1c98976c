"""Describe config schemas for `flowrl operators`: each field's dotted key, type, default and doc.

A field's doc is the comment written after it in the Struct's source (`lr: float = 1e-5  # ...`),
so the schema stays the single place where a key is defined and explained.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass
class Field:
    key: str
    type: str
    default: str
    doc: str


def _comments(cls: type) -> dict[str, str]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    above: list[str] = []  # a comment block written just above a field documents it too
    for line in source.splitlines():
        comment = re.match(r"\s+#\s*(.+)$", line)
        if comment:
            above.append(comment.group(1).strip())
            continue
        match = re.match(r"\s+(\w+)\s*:[^#]*?(?:#\s*(.+))?$", line)
        if match and not line.lstrip().startswith(("def ", "class ")):
            doc = match.group(2) or " ".join(above)
            if doc:
                docs[match.group(1)] = doc.strip()
        above = []
    return docs


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is typing.Annotated:
        base, *metas = typing.get_args(t)
        bounds = [f"{k}{v}" for m in metas if isinstance(m, msgspec.Meta)
                  for k, v in ((">=", m.ge), (">", m.gt), ("<=", m.le), ("<", m.lt)) if v is not None]
        return _type_name(base) + (f" ({', '.join(bounds)})" if bounds else "")
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(t))
    if origin in (typing.Union, type(int | None)):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(t))}]"
    return "null" if t is type(None) else getattr(t, "__name__", str(t))


def _struct_in(t: Any) -> type | None:
    for arg in [t, *typing.get_args(t)]:
        arg = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
        if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
            return arg
    return None


def fields(cls: type, prefix: str = "") -> list[Field]:
    """Fields of a Struct, nested Structs expanded with dotted keys."""
    out: list[Field] = []
    hints = typing.get_type_hints(cls, include_extras=True)
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # an inherited key keeps the doc of the class that defines it
        if isinstance(base, type) and issubclass(base, msgspec.Struct) and base is not msgspec.Struct:
            docs |= _comments(base)
    for info in msgspec.structs.fields(cls):
        t = hints[info.name]
        if info.default is not msgspec.NODEFAULT:
            default = repr(info.default)
        elif info.default_factory is not msgspec.NODEFAULT:
            default = "{...}" if _struct_in(t) else repr(info.default_factory())
        else:
            default = "required"
        key = prefix + info.name
        out.append(Field(key, _type_name(t), default, docs.get(info.name, "")))
        nested = _struct_in(t)
        if nested is not None:
            out.extend(fields(nested, key + "."))
    return out
