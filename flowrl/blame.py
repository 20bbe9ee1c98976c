"""An exception raised in user code, described with the user's own frames only.

A reward function, a workflow or an operator plugin that fails is reported without the frames of
flowrl, flowrl_operators, asyncio or the thread pool that called it: those say nothing the user
can act on. `describe(exc)` gives the user's frames (innermost last) and `Type: message`.
"""

from __future__ import annotations

import sysconfig
import traceback
from importlib.metadata import packages_distributions
from importlib.util import find_spec
from pathlib import Path

import flowrl

_OURS = [str(Path(flowrl.__file__).resolve().parent)]
# The other packages this distribution installs (its operator library), found without importing them.
for _name, _dists in packages_distributions().items():
    if "flowrl" in _dists and _name != "flowrl" and (_spec := find_spec(_name)) is not None and _spec.origin:
        _OURS.append(str(Path(_spec.origin).resolve().parent))
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve())
MAX_FRAMES = 8


def internal(filename: str) -> bool:
    """Whether a frame's file is not the user's: flowrl's, flowrl_operators', the standard library's
    or an installed library's (torch, ray, ...). A plugin installed into site-packages counts as a
    library: its failures keep their whole traceback."""
    if filename.startswith("<"):  # <frozen ...>, <string>
        return not filename.startswith("<string")
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    if "site-packages" in path or "dist-packages" in path or path.startswith(_STDLIB):
        return True
    return any(path.startswith(root) for root in _OURS)


def describe(exc: BaseException) -> str:
    """The frames of `exc`'s traceback that are the user's (at most MAX_FRAMES, innermost last),
    then `Type: message`; only the latter when no frame is the user's."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not internal(f.filename)]
    lines = traceback.format_list(frames[-MAX_FRAMES:])
    head = "Traceback (the user's frames):\n" if lines else ""
    return head + "".join(lines) + "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")


class UserCodeFailed(Exception):
    """An operator's report that user code failed past what it isolates (a reward's `max_errors`,
    say): the message is complete (node, sample, the user's frames) and is shown alone, without
    the library's traceback (flowrl/runtime/stage.py)."""


def user_frames(exc: BaseException) -> bool:
    """Whether any frame of `exc`'s traceback is the user's."""
    return any(not internal(f.filename) for f in traceback.extract_tb(exc.__traceback__))
