"""Operator registry: entry points of the group `flowrl.operators`, or a `module:attr` path.

The built-in operators in `operators/` register through the same entry-point group a third-party
package uses, so a plugin is never a second-class citizen.
"""

from __future__ import annotations

import importlib

from flowrl import plugins
from flowrl.operator import KINDS, PORT_TYPES, Operator

GROUP = "flowrl.operators"


class OperatorError(Exception):
    """An operator name that cannot be resolved, or a class that breaks the protocol."""


def names() -> list[str]:
    return sorted(plugins.targets(GROUP))


def import_path(path: str) -> object:
    """Import `module:attr` (attr may be dotted). Only imports; never evaluates code."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise OperatorError(f"'{path}' is not of the form module:attr")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise OperatorError(f"cannot import module '{module_name}' for '{path}': {e}") from e
    except (Exception, SystemExit) as e:  # the module itself fails as it is imported (a syntax error, a raise, exit)
        raise OperatorError(f"importing module '{module_name}' for '{path}' failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise OperatorError(f"module '{module_name}' has no attribute '{attr}'") from None
    return obj


def resolve(op: str) -> type[Operator]:
    """The operator class for a registered name or a `module:attr` path."""
    if ":" in op:
        cls = import_path(op)
    else:
        target = plugins.targets(GROUP).get(op)
        if target is None:
            raise OperatorError(f"unknown operator '{op}'")
        cls = import_path(target)
    check(cls, op)
    return cls  # type: ignore[return-value]


def check(cls: object, name: str) -> None:
    """The protocol every operator class must satisfy (the contract test runs this on all)."""
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise OperatorError(f"'{name}' is not a subclass of flowrl.operator.Operator")
    if cls.kind not in KINDS:
        raise OperatorError(f"operator '{name}' has kind '{cls.kind}', expected one of {', '.join(KINDS)}")
    for direction in ("inputs", "outputs"):
        ports = getattr(cls, direction)
        if not isinstance(ports, dict):  # e.g. inputs = "trajectories": a plugin author's slip, not a flowrl bug
            raise OperatorError(f"operator '{name}' {direction} is a {type(ports).__name__}; it must be a dict "
                                f"of port name to port type, e.g. {{'trajectories': 'trajectories'}}")
        for port, port_type in ports.items():
            if port_type not in PORT_TYPES:
                raise OperatorError(
                    f"operator '{name}' {direction[:-1]} port '{port}' has unknown type '{port_type}'"
                )
    if not (isinstance(cls.provides, set | frozenset) and all(isinstance(f, str) for f in cls.provides)):
        raise OperatorError(f"operator '{name}' provides is {cls.provides!r}; it must be a frozenset of field names")
