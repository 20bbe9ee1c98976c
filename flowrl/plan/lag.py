"""The staleness cost: how many more (or fewer) samples a configuration needs for the same progress
when it trains on samples its policy generated some versions ago.

Samples to any value scale with m(L) = 1 + s x L, L the mean lag (train version - the version that
generated the sample, over the samples trained), s the cost per unit of lag. A pair of runs of one
task at different lags tells s: the second run's curve is the first's stretched along samples by
k = m(L2) / m(L1), k fitted (curve.stretch) and resampled with both runs' residuals. One run alone
trains at one lag and cannot tell s; then s is neither assumed 0 nor guessed: it is the cost flowrl
measured on its own tasks' held-out sync/async pairs (MEASURED), their pair-weighted mean, the
interval spanning the tasks' own 95 % intervals, and the output says so. A pair on the user's task
replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowrl.plan import curve

SAME_LAG = 0.05  # mean lags closer than this train alike: a pair this close cannot tell s
FACTORS = np.geomspace(0.25, 4.0, 61)  # stretches tried between a pair (4.7 % apart)
LEAST = 0.1  # m(L) kept at least this: a fitted s must not make samples free


@dataclass(frozen=True)
class Measured:
    """One task's staleness cost as a benchmark measured it on held-out seeds: the async arm's
    median samples to the target over the sync arm's (`ratio`, at `ratio_key` in the results file,
    and its 95 % interval over seeds at `ratio_key`'s `_ci95` sibling or `ci95` child:
    tests/test_plan_target.py reads both there), the async arm's mean lag and the pairs measured."""

    task: str
    results: str
    ratio_key: str
    ratio: float
    ci95: tuple[float, float]
    lag: float
    pairs: int

    def slope(self, ratio: float | None = None) -> float:
        return ((self.ratio if ratio is None else ratio) - 1.0) / self.lag


# The quickstart's async arm is one-step-off for ~200 steps (mean lag 1.0 to two figures); the code
# task's trains 6 steps, the first at lag 0 (5/6).
MEASURED = (
    Measured("the quickstart's digits", "results/quickstart-heldout.json", "async_over_sync_steps_to_target/ratio",
             1.215, (0.743, 1.86), 1.0, 20),
    Measured("code with a sandboxed tool", "results/code-async-heldout.json", "sample_ratio", 1.667, (0.667, 2.0),
             0.833, 5),
)


@dataclass
class StalenessCost:
    source: str  # "paired": fitted on a pair of runs; "prior": MEASURED (no pair, or one that cannot tell)
    slope: float  # s, the point estimate
    slopes: list[float]  # s of each draw of the interval
    notes: list[str] = field(default_factory=list)

    def multiplier(self, base_lag: float, lag: float, slope: float | None = None) -> float:
        """Samples at mean lag `lag` per sample the run needed at `base_lag`: exactly 1 at the same lag."""
        if abs(lag - base_lag) < SAME_LAG:
            return 1.0
        s = self.slope if slope is None else slope
        return max(1.0 + s * lag, LEAST) / max(1.0 + s * base_lag, LEAST)


def mean_lag(histogram: dict[int, int] | dict[str, int]) -> float:
    """The mean lag of a staleness histogram (lag -> samples); 0 for an empty one."""
    total = sum(histogram.values())
    return sum(int(k) * v for k, v in histogram.items()) / total if total else 0.0


def prior(draws: int, why: str, seed: int = 0) -> StalenessCost:
    """The cost measured on flowrl's own tasks (MEASURED), for a run without a pair that can tell its
    own: the pair-weighted mean of their slopes, drawn across all their 95 % intervals (a task's
    own cost may lie anywhere the measured ones might)."""
    point = sum(m.slope() * m.pairs for m in MEASURED) / sum(m.pairs for m in MEASURED)
    low = min(m.slope(m.ci95[0]) for m in MEASURED)
    high = max(m.slope(m.ci95[1]) for m in MEASURED)
    drawn = np.random.default_rng(seed).uniform(low, high, draws).tolist()
    tasks = ", ".join(f"{m.task} {m.slope():+.0%} ({m.results})" for m in MEASURED)
    return StalenessCost("prior", point, drawn, [
        f"staleness cost not measured for this task ({why}): flowrl's own tasks' held-out pairs give "
        f"{point:+.0%} samples per unit of mean lag ({tasks}), drawn over their 95 % intervals "
        f"[{low:+.0%}..{high:+.0%}]; it applies where a configuration trains at another mean lag than the run"])


def slope_of(k: float, base_lag: float, other_lag: float) -> float:
    """s from the stretch k = m(other) / m(base): 1 + s x other = k (1 + s x base)."""
    denominator = other_lag - k * base_lag
    return (k - 1.0) / denominator if abs(denominator) > 1e-9 else 0.0


def paired(base: list[tuple[float, float]], base_lag: float, other: list[tuple[float, float]], other_lag: float,
           draws: int, seed: int = 0) -> StalenessCost:
    """s fitted on the run (`base`, its points and mean lag) and a paired run of the same task."""
    if abs(other_lag - base_lag) < SAME_LAG:
        return prior(draws, f"the paired run trained at the run's mean lag ({other_lag:.2f} against "
                     f"{base_lag:.2f}) and cannot tell it", seed)
    first, second = curve.fit(base, draws=1), curve.fit(other, draws=1)
    if first is None or second is None:
        return prior(draws, f"{'the run' if first is None else 'the paired run'} has fewer than "
                     f"{curve.MIN_POINTS} points to fit", seed)
    c1, y1 = (np.array(v, dtype=float) for v in zip(*base, strict=True))
    c2, y2 = (np.array(v, dtype=float) for v in zip(*other, strict=True))
    k = float(curve.stretch(c1, c2, np.concatenate([y1, y2])[None, :], FACTORS, first.curve)[0])
    ys = np.concatenate([curve.resample(c1, y1, first.curve, draws, seed),
                         curve.resample(c2, y2, second.curve, draws, seed + 1)], axis=1)
    ks = curve.stretch(c1, c2, ys, FACTORS, first.curve)
    lo, hi = curve.percentiles(ks)
    notes = [f"staleness cost from the paired run: at mean lag {other_lag:.2f} it needed {k:.2f}x "
             f"[{lo:.2f}..{hi:.2f}] the samples of this run (mean lag {base_lag:.2f}) for the same progress: "
             f"{slope_of(k, base_lag, other_lag):+.0%} samples per unit of mean lag"]
    if not FACTORS[1] < k < FACTORS[-2]:
        notes.append(f"the pair's stretch lies at the edge of the range tried ({FACTORS[0]:g}-{FACTORS[-1]:g}): "
                     "the two runs may not be the same task")
    return StalenessCost("paired", slope_of(k, base_lag, other_lag),
                         [slope_of(float(x), base_lag, other_lag) for x in ks], notes)
