"""The run-to-run spread: another configuration is another run, and two runs of one task from one
start need different samples to the same target even where the staleness cost is known exactly.

On flowrl's own tasks this spread is larger than any other part of time to target: on the
quickstart, the two arms of one held-out pair (same warm-up, same seed) needed samples to the target
whose ratio ranged over 0.53x-2.48x (once 10.8x) across pairs (RERUNS). One run cannot tell its
task's spread, so it is the one flowrl measured: per task, the standard deviation of log(samples of
one arm / the other's) over the pairs where both reached the target; across tasks their
pair-weighted root mean square. The stated interval of every configuration but the run as it ran
multiplies its samples by exp(sigma z), z standard normal: the point (its median) is unchanged, the
interval says how far one run of it may land.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z90 = 1.645  # a standard normal's 95th percentile: the stated intervals span the 5th-95th


@dataclass(frozen=True)
class Spread:
    """One task's run-to-run spread as a held-out benchmark measured it: `sigma` over `pairs` pairs,
    from the per-seed samples (or steps) to the target of its two arms at `arms` in `results`
    ('/'-separated keys; '*' every value of a dict): tests/test_plan_target.py recomputes it there."""

    task: str
    results: str
    arms: tuple[str, str]
    sigma: float
    pairs: int


RERUNS = (
    Spread("the quickstart's digits", "results/quickstart-heldout.json",
           ("sync_steps_to_target_by_seed", "async_steps_to_target_by_seed"), 0.709, 19),
    Spread("code with a sandboxed tool", "results/code-async-heldout.json",
           ("by_seed/*/sync/samples_to_target", "by_seed/*/async/samples_to_target"), 0.465, 5),
    Spread("the long-tail agent", "results/longtail-heldout-runs.json",
           ("by_tail/1.0/sync_samples_to_target_by_seed", "by_tail/1.0/async_samples_to_target_by_seed"), 0.342, 5),
)


def sigma() -> float:
    """The tasks' pair-weighted root mean square spread (log samples)."""
    return math.sqrt(sum(s.sigma**2 * s.pairs for s in RERUNS) / sum(s.pairs for s in RERUNS))


def factors(draws: int, seed: int = 0) -> np.ndarray:
    """`draws` multipliers of one run's samples to the target, exp(sigma z)."""
    return np.exp(sigma() * np.random.default_rng(seed + 13).standard_normal(draws))


def note() -> str:
    low, high = math.exp(-Z90 * sigma()), math.exp(Z90 * sigma())
    tasks = ", ".join(f"{s.task} {s.sigma:.2f} ({s.pairs} pairs, {s.results})" for s in RERUNS)
    return (f"another configuration is another run: on flowrl's own tasks two runs from one start needed samples "
            f"to the target within {low:.2f}x-{high:.2f}x of each other (5th-95th percentile; log spread {sigma():.2f}: {tasks}); "
            "every interval but the run's own includes it, the points do not")
