"""A run's learning curve against samples: ScaleRL's saturating form, fitted with an interval.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)        (R(0) = R0)

C is samples (groups) trained, R the metric, A its asymptote, C_mid the samples at half the gain,
B how sharply it rises. Chosen over a saturating exponential because that one rises fastest at
C = 0 and cannot describe a run that sits on a plateau before it climbs (the quickstart's reversal
after its copy warm-up does), and because ScaleRL fitted and extrapolated RL runs in this form.

The fit is a grid over (B, C_mid) with R0 and A solved in closed form (least squares is linear in
them once B and C_mid are fixed): no optimiser to diverge, numpy only, every draw of the interval
fitted alike. The interval resamples the fit's residuals onto the fitted curve and fits again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

B_GRID = np.geomspace(0.3, 8.0, 32)
MID_POINTS = 64  # C_mid values over [the first sample count / 4, the last x 20]
MIN_POINTS = 5  # four parameters: fewer points leave no residual to draw an interval from
DRAWS = 200
INTERVAL = (5.0, 95.0)  # percentiles every stated interval spans


@dataclass(frozen=True)
class Curve:
    r0: float
    a: float
    b: float
    c_mid: float

    def value(self, c: float | np.ndarray) -> np.ndarray:
        c = np.asarray(c, dtype=float)
        with np.errstate(divide="ignore", over="ignore"):
            s = np.where(c > 0, 1.0 / (1.0 + (self.c_mid / np.maximum(c, 1e-300)) ** self.b), 0.0)
        return self.r0 + (self.a - self.r0) * s

    def samples_to(self, target: float) -> float:
        """Samples at which the curve reaches `target` (a lower bound: reached at >= target);
        0 where it starts there, inf where it never does."""
        if self.r0 >= target:
            return 0.0
        gain = (target - self.r0) / (self.a - self.r0) if self.a != self.r0 else np.inf
        if not 0.0 < gain < 1.0:
            return float("inf")
        return float(self.c_mid * (1.0 / gain - 1.0) ** (-1.0 / self.b))


@dataclass
class Fit:
    curve: Curve
    draws: list[Curve]  # refits on resampled residuals: the interval
    residual: float  # the residuals' standard deviation (degrees of freedom corrected)
    points: int
    last_samples: float
    rise: float  # the fitted gain so far: R(last samples) - R0


def _grid(c: np.ndarray, bs: np.ndarray, mids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (B, C_mid) of bs x mids with s_i = 1 / (1 + (C_mid / C_i)^B) at each point (0 at C = 0)."""
    b, mid = (g.ravel() for g in np.meshgrid(bs, mids, indexing="ij"))
    with np.errstate(over="ignore"):
        ratio = (mid[:, None] / np.where(c > 0, c, 1.0)[None, :]) ** b[:, None]
    s = np.where(c[None, :] > 0, 1.0 / (1.0 + ratio), 0.0)
    return b, mid, s


def _best(c: np.ndarray, ys: np.ndarray, bs: np.ndarray, mids: np.ndarray) -> list[tuple[Curve, float]]:
    """For each row of `ys` (values at `c`), the least-squares curve over the grid bs x mids (R0
    and A solved exactly) and its squared error."""
    b, mid, s = _grid(c, bs, mids)
    s_c = s - s.mean(axis=1, keepdims=True)
    y_c = ys - ys.mean(axis=1, keepdims=True)
    sss = np.maximum((s_c ** 2).sum(axis=1), 1e-300)[:, None]  # (grid, 1)
    ssy = s_c @ y_c.T  # (grid, rows)
    sse = (y_c ** 2).sum(axis=1)[None, :] - ssy ** 2 / sss
    out = []
    for row, g in enumerate(sse.argmin(axis=0)):
        gain = ssy[g, row] / sss[g, 0]
        r0 = ys[row].mean() - gain * s[g].mean()
        out.append((Curve(float(r0), float(r0 + gain), float(b[g]), float(mid[g])), float(max(sse[g, row], 0.0))))
    return out


def _solve(c: np.ndarray, ys: np.ndarray) -> list[tuple[Curve, float]]:
    """`_best` on the coarse grid, then on a fine one around each row's best (one coarse step
    either way): the interval's draws are not quantised to the coarse grid."""
    mids = _coarse_mids(c)
    step_b, step_mid = np.log(B_GRID[1] / B_GRID[0]), np.log(mids[1] / mids[0])
    fine = np.linspace(-1.0, 1.0, 9)
    return [_best(c, y[None, :], curve.b * np.exp(fine * step_b), curve.c_mid * np.exp(fine * step_mid))[0]
            for y, (curve, _) in zip(ys, _best(c, ys, B_GRID, mids), strict=True)]


def fit(points: list[tuple[float, float]], draws: int = DRAWS, seed: int = 0) -> Fit | None:
    """The curve through `points` (samples, value) and its resampled draws; None with fewer than
    MIN_POINTS distinct sample counts, or none above zero."""
    c = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(set(c.tolist())) < MIN_POINTS or not (c > 0).any():
        return None
    (curve, sse), = _solve(c, y[None, :])
    refits = [cv for cv, _ in _solve(c, resample(c, y, curve, draws, seed))]
    last = float(c.max())
    return Fit(curve, refits, float(np.sqrt(sse / max(len(c) - 4, 1))), len(c), last,
               float(curve.value(last) - curve.r0))


def resample(c: np.ndarray, y: np.ndarray, curve: Curve, draws: int, seed: int) -> np.ndarray:
    """`draws` rows of values at `c`: the fitted curve plus its residuals drawn with replacement
    (scaled up by n / (n - 4): a fit's residuals run smaller than the noise)."""
    fitted = curve.value(c)
    residuals = (y - fitted) * np.sqrt(len(c) / max(len(c) - 4, 1))
    return fitted[None, :] + np.random.default_rng(seed).choice(residuals, size=(draws, len(c)), replace=True)


def _coarse_mids(c: np.ndarray) -> np.ndarray:
    positive = c[c > 0]
    return np.geomspace(positive.min() / 4, positive.max() * 20, MID_POINTS)


def stretch(first: np.ndarray, second: np.ndarray, ys: np.ndarray, factors: np.ndarray, around: Curve) -> np.ndarray:
    """For each row of `ys` (values at the sample counts `first`, then `second`), the factor k
    under which the second run is the first's curve stretched along samples, R2(C) = R1(C / k):
    the k whose pooled fit has the least squared error, between the points of `factors`. The fits
    search a fine grid around `around` (the first run's own curve): a coarse one biases k to
    where its points fall."""
    bs = around.b * np.exp(np.linspace(-0.7, 0.7, 15))
    mids = around.c_mid * np.exp(np.linspace(-1.0, 1.0, 57))
    y_c = ys - ys.mean(axis=1, keepdims=True)
    errors = []
    for k in factors:
        _, _, s = _grid(np.concatenate([first, second / k]), bs, mids)
        s_c = s - s.mean(axis=1, keepdims=True)
        sss = np.maximum((s_c ** 2).sum(axis=1), 1e-300)[:, None]
        errors.append(((y_c ** 2).sum(axis=1)[None, :] - (s_c @ y_c.T) ** 2 / sss).min(axis=0))
    return _vertex(np.log(factors), np.array(errors))


def _vertex(x: np.ndarray, errors: np.ndarray) -> np.ndarray:
    """Per column of `errors` (one row per x, evenly spaced), exp of the x at the minimum of the
    parabola through the least error and its neighbours: between the grid's points, not on them."""
    i = np.clip(errors.argmin(axis=0), 1, len(x) - 2)
    cols = np.arange(errors.shape[1])
    left, mid, right = errors[i - 1, cols], errors[i, cols], errors[i + 1, cols]
    curvature = left - 2 * mid + right
    shift = np.where(curvature > 1e-300, 0.5 * (left - right) / np.maximum(curvature, 1e-300), 0.0)
    return np.exp(x[i] + np.clip(shift, -1.0, 1.0) * (x[1] - x[0]))


def percentiles(values: list[float] | np.ndarray) -> tuple[float, float]:
    """The stated interval of `values` (inf where the draws that never reach lie above it)."""
    values = np.asarray(values, dtype=float)  # no interpolation: it turns inf into nan
    return (float(np.percentile(values, INTERVAL[0], method="lower")),
            float(np.percentile(values, INTERVAL[1], method="higher")))
