"""The metric names `run.stop_when` may use, checked as the spec loads (flowrl/spec/schema.py); the
runtime reads the same names when it watches them (flowrl/runtime/targets.py)."""

from __future__ import annotations

ROW_KEYS = ("reward", "samples_per_s", "trajectories_per_s", "step_seconds", "groups", "dropped",
            "dropped_total", "stale_kept_total", "rejected_total", "filtered_total")
EVAL = "eval_reward"


def check_names(stop_when: dict[str, float]) -> None:
    """Raise ValueError naming the first metric that stop_when cannot read."""
    for name in stop_when:
        if name == EVAL or name in ROW_KEYS or (name.startswith("train.") and len(name) > len("train.")):
            continue
        raise ValueError(f"stop_when: unknown metric {name!r}; use {EVAL}, one of "
                         f"{', '.join(ROW_KEYS)}, or train.<key> (a train node metric)")
