"""What may travel on a port, checked where an operator hands it over.

A plugin that returns the wrong thing (`{"trajectories": "garbage"}`) would otherwise fail in the
node that receives it, with a traceback that blames the receiver. The stage checks each output
against its port's type (`flowrl.operator.PORT_TYPES`) and a train step's metrics, and names the
node that returned it, the method, the sample and the type expected. Policy and weights records
are opaque to the runtime (a transport's handles): any value passes.
"""

from __future__ import annotations

from typing import Any

from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import PROMPTS, TRAJECTORIES


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def wrong_value(port_type: str, value: Any) -> str | None:
    """Why `value` cannot travel on a port of `port_type` (None filters a record out: allowed), or None."""
    if value is None:
        return None
    if port_type == TRAJECTORIES:
        if not isinstance(value, Group):
            return f"{_short(value)}; a trajectories port carries a flowrl.data.trajectory.Group (or None)"
        if not isinstance(value.trajectories, list):
            return f"a Group whose trajectories is {_short(value.trajectories)}; it must be a list of Trajectory"
        for i, item in enumerate(value.trajectories):
            if not isinstance(item, Trajectory):
                return (f"a Group whose trajectories[{i}] is {_short(item)}; it must be a "
                        "flowrl.data.trajectory.Trajectory")
    if port_type == PROMPTS and not isinstance(value, dict):
        return f"{_short(value)}; a prompts port carries a sample dict"
    return None


def wrong_metrics(metrics: Any) -> str | None:
    """Why a train step's metrics cannot go into metrics.jsonl (a dict of name -> number), or None."""
    if not isinstance(metrics, dict):
        return f"metrics {_short(metrics)}; they must be a dict of name -> number"
    for name, value in metrics.items():
        if not isinstance(name, str):
            return f"a metric named {_short(name)}; names are strings"
        if not isinstance(value, int | float):  # numpy's float32 and torch's tensors are not JSON
            return f"metric {name!r} = {_short(value)}; a metric is a Python number (int or float: call float())"
    return None
