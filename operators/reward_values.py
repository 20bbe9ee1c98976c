"""What a reward may be: a finite real number. Python ints and floats, numpy scalars (np.float32,
np.int64, ...) and 0-d numpy arrays or torch tensors are read as floats. Everything else is refused
with `InvalidReward`, a reward error like a raising function's: NaN and +/-inf (one NaN makes its
group's advantages NaN), None, text, containers, and bools (True is an int in Python: scoring it
1.0 silently hides a predicate returned by mistake; write `float(ok)`).

The reward node, environments' step rewards and agents' returned rewards all go through here.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

from flowrl.data.trajectory import Trajectory

KEYS = ("reward", "turn_rewards", "token_rewards")
SHAPES = "return a float, a list of turn rewards, or a dict with reward / turn_rewards / token_rewards"


class InvalidReward(ValueError):
    """A reward that is not a finite real number (or a list of them of the right length)."""


def as_reward(value: Any, what: str = "reward") -> float:
    """`value` as a finite float, or InvalidReward naming `what` and why."""
    if type(value) is float or type(value) is int:  # the common case, checked cheaply
        number = float(value)
    else:
        value = _scalar(value, what)
        if isinstance(value, bool):
            raise InvalidReward(f"{what} is a bool ({value}); return a number (float({value}) if you mean "
                                f"{float(value)})")
        if not isinstance(value, numbers.Real):
            raise InvalidReward(f"{what} is {_shown(value)}; it must be a finite number")
        number = float(value)
    if not math.isfinite(number):
        raise InvalidReward(f"{what} is {number}; it must be a finite number")
    return number


def as_rewards(values: Any, what: str, length: int, per: str) -> list[float]:
    """A list (or tuple) of `length` rewards, one per `per`."""
    if not isinstance(values, list | tuple):
        raise InvalidReward(f"{what} is {_shown(values)}; give a list of numbers, one per {per}")
    if len(values) != length:
        raise InvalidReward(f"{what} has {len(values)} values for {length} {per}s")
    if all(type(v) is float or type(v) is int for v in values):  # the common case, without messages
        floats = [float(v) for v in values]
        if all(map(math.isfinite, floats)):
            return floats
    return [as_reward(v, f"{what}[{i}]") for i, v in enumerate(values)]


def apply_score(trajectory: Trajectory, score: Any) -> None:
    """Write a reward function's return value into the trajectory: a number sets `reward`; a list
    sets `turn_rewards` and `reward` (their sum); a dict sets the keys it gives (None: unset).
    Checked whole before anything is written: an invalid score leaves the trajectory as it was."""
    if isinstance(score, dict):
        if not score or not set(score) <= set(KEYS):
            raise InvalidReward(f"reward returned a dict with keys {sorted(map(str, score))}; {SHAPES}")
        if all(v is None for v in score.values()):
            raise InvalidReward(f"reward returned a dict whose values are all None; {SHAPES}")
        given = dict(score)
    elif isinstance(score, list | tuple):
        given = {"turn_rewards": score}
    elif isinstance(_scalar(score, "reward"), numbers.Real):
        given = {"reward": score}
    else:
        raise InvalidReward(f"reward returned {_shown(score)}; {SHAPES}")
    checked: dict[str, Any] = {}
    for key, value in given.items():
        if value is None:
            checked[key] = None
        elif key == "reward":
            checked[key] = as_reward(value)
        elif key == "turn_rewards":
            checked[key] = as_rewards(value, key, len(trajectory.turns), "turn")
        else:
            checked[key] = as_rewards(value, key, len(trajectory.response_ids), "response token")
    if isinstance(score, list | tuple):
        checked["reward"] = sum(checked["turn_rewards"])
    for key, value in checked.items():
        setattr(trajectory, key, value)


def _scalar(value: Any, what: str) -> Any:
    """numpy scalars and 0-d arrays or tensors as Python numbers (`.item()`); other values as they
    are. numpy and torch are only looked at when already imported: a value cannot be theirs otherwise."""
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if numpy is not None and isinstance(value, numpy.generic | numpy.ndarray) \
            or torch is not None and isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise InvalidReward(f"{what} is an array of shape {tuple(value.shape)}; it must be one number")
        return value.item()
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
