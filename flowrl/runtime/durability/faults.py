"""Fault injection for durability tests: `FLOWRL_FAULT=<point>:<n>` kills this process with
SIGKILL (as `kill -9` would) the n-th time it reaches `point`. Points: `generate` (a sample's
generation returned), `train` (a train step returned, before the coordinator heard of it), `sync`
(weights sent, not yet delivered) and `checkpoint` (a checkpoint's files written, not yet renamed
into place). Unset, `reached` is one dictionary lookup."""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("FLOWRL_FAULT", "")
_POINT, _, _COUNT = _SPEC.partition(":")
_seen = 0


def reached(point: str) -> None:
    global _seen
    if point != _POINT:
        return
    _seen += 1
    if _seen >= int(_COUNT or 1):
        os.kill(os.getpid(), signal.SIGKILL)
