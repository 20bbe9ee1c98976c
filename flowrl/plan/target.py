"""`flowrl plan RUN_DIR --target METRIC=VALUE`: the wall time, samples, device-hours and cost to
reach a metric's value, for the run as it ran, the overrides and the search's configurations.

samples to target  where the run reached the target: its own measured crossing (between the last
                   evaluation below it and the first at or above it), else the run's own learning
                   curve against samples (curve.py, the fit); times the staleness cost of the
                   configuration's mean lag against the run's (lag.py), and read off at that
                   configuration's next evaluation (a run tells its crossing only there)
wall time          the run's own overhead (its first WARMUP steps as measured, less those steps'
                   samples at its simulated samples/s: loading, the first batch) plus every sample
                   at the configuration's simulated samples/s: a faster configuration is faster
                   from its first step
device-hours       the devices the configuration holds (its cluster's GPUs, or CPU cores on a CPU
                   pipeline; more where it asks for more) times the wall time; cost: times --price

Every interval comes from the same draws: the crossing anywhere between its two evaluations (or the
curve refitted on resampled residuals), the staleness cost's draws, the run-to-run spread (reruns.py:
every configuration but the run as it ran is another run) and the throughput within the simulator's
error on the run as it ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowrl.plan import curve, lag, reruns
from flowrl.plan.changes import apply
from flowrl.plan.records import WARMUP
from flowrl.plan.search import budget_kind, spend
from flowrl.records import RunDir
from flowrl.spec.errors import UserError
from flowrl.spec.stop_when import EVAL, check_names

LEARNING = (EVAL, "reward", "train.<key>")  # metrics with a learning curve: the others measure the system
UNITS = {"gpus": "GPU-hours", "cpus": "core-hours"}


def parse(text: str) -> tuple[str, float]:
    """METRIC=VALUE, or a UserError naming what is wrong."""
    metric, eq, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not eq or not metric or not math.isfinite(number):
        raise UserError(f"--target {text!r}: expected METRIC=VALUE with a finite number, e.g. {EVAL}=0.9")
    try:
        check_names({metric: number})
    except ValueError as e:
        raise UserError(f"--target {text!r}: {str(e).removeprefix('stop_when: ')}") from None
    if metric != EVAL and metric != "reward" and not metric.startswith("train."):
        raise UserError(f"--target {text!r}: '{metric}' measures the system, not learning; plan predicts the time "
                        f"to a value of {', '.join(LEARNING)}")
    return metric, number


def check_price(price: float | None) -> None:
    if price is not None and not price > 0:
        raise UserError(f"--price {price:g}: expected a price per device-hour > 0")


def train_rows(run: RunDir) -> list[Any]:
    plan = run.plan()
    trains = plan.facts.trains
    return sorted((r for r in run.metrics() if r.node in trains[:1]), key=lambda r: r.step)


def points(run_dir: Path, metric: str, what: str = "the run") -> list[tuple[float, float]]:
    """(samples trained before it, value) of each record of `metric` in the run's last phase; a
    UserError where the run records none."""
    run = RunDir(run_dir).last()
    rows = train_rows(run)
    before = np.concatenate([[0], np.cumsum([r.groups for r in rows])]).tolist()  # samples before step i
    if metric == EVAL:
        found = {e.version: e.eval_reward for e in run.evals() if e.eval_reward is not None
                 and math.isfinite(e.eval_reward) and e.version < len(before)}
        out = [(float(before[v]), float(value)) for v, value in sorted(found.items())]
        why = f"{what} has no eval records ({run.path / 'eval.jsonl'}; data.eval)"
    else:
        values = [r.reward if metric == "reward" else r.train.get(metric.removeprefix("train.")) for r in rows]
        out = [(float(before[i]), float(v)) for i, v in enumerate(values) if isinstance(v, int | float)]
        reported = sorted({f"train.{k}" for r in rows for k in r.train})
        why = f"{what} records no {metric} (its train node reports {', '.join(reported) or 'nothing'})"
    if not out:
        raise UserError(f"--target {metric}: {why}")
    return out


def left_plateau(fit: curve.Fit) -> bool:
    """Whether the run has risen beyond its noise: twice the residual's spread."""
    return fit.rise > 2 * fit.residual


def curve_notes(fit: curve.Fit | None, metric: str, target: float, data: list[tuple[float, float]]) -> list[str]:
    """What the curve cannot tell, in words: an empty list where it predicts."""
    if fit is None:
        return [f"too short to fit: {len(data)} {metric} points at {len({c for c, _ in data})} sample counts; the "
                f"curve needs {curve.MIN_POINTS} (run longer, or evaluate more often: data.eval.every)"]
    if not left_plateau(fit):
        return [f"the run has not left its plateau: {metric} moved {fit.rise:+.3f} over its {fit.last_samples:g} "
                f"samples against a noise of {fit.residual:.3f}; where it levels off cannot be told yet"]
    notes = []
    best = max(data, key=lambda p: p[1])
    if best[1] >= target:
        notes.append(f"the run reached {metric} {best[1]:g} at {best[0]:g} samples (measured)")
    lo, hi = curve.percentiles([d.a for d in fit.draws])
    if fit.curve.a <= target:
        share = np.mean([math.isfinite(d.samples_to(target)) for d in fit.draws])
        notes.append(f"the target lies above the fitted asymptote {fit.curve.a:.3f} [{lo:.3f}..{hi:.3f}]: not reached "
                     f"on this curve ({share:.0%} of its resampled fits reach it)")
    elif fit.curve.a < target + 2 * fit.residual:
        notes.append(f"the target lies within the run's noise (2 x {fit.residual:.3f}) of its fitted asymptote "
                     f"{fit.curve.a:.3f}: when an evaluation first reaches it is noise as much as learning, and another "
                     "run's time to it may differ several-fold (docs/plan.md: the quickstart at 0.9)")
    if target < fit.curve.a and fit.curve.samples_to(target) > fit.last_samples:
        notes.append(f"extrapolated beyond the run's last point ({fit.last_samples:g} samples): the asymptote "
                     f"{fit.curve.a:.3f} [{lo:.3f}..{hi:.3f}] is the curve form's reading of the run so far")
    return notes


@dataclass
class ToTarget:
    """Samples to the target for the run as it ran: `point` and DRAWS draws; `grid` the samples
    between the run's evaluations where it was measured (a crossing is seen at an evaluation), 0 on
    the curve."""
    source: str  # "measured": the run's own crossing; "curve": the fitted learning curve
    point: float
    draws: list[float]
    grid: float = 0.0

    def at(self, samples: float) -> float:
        """`samples` read off at the next evaluation (on the curve: as they are)."""
        if self.grid <= 0 or not math.isfinite(samples):
            return samples
        return math.ceil(samples / self.grid - 1e-9) * self.grid


def crossing(data: list[tuple[float, float]], target: float) -> tuple[float, float] | None:
    """(samples at the last record below `target` before the first at or above it, samples at that
    first one): the run crossed in between; None where it never reached it."""
    before = 0.0
    for samples, value in data:
        if value >= target:
            return before, samples
        before = samples
    return None


def to_target(data: list[tuple[float, float]], fit: curve.Fit | None, target: float, seed: int) -> ToTarget | None:
    """The measured crossing where the run reached `target`, else the curve's (None where the curve
    cannot predict: too short, or still on its plateau)."""
    found = crossing(data, target)
    if found is not None:
        low, high = found
        gaps = np.diff(sorted({c for c, _ in data}))
        grid = float(np.median(gaps)) if len(gaps) else 0.0
        draws = np.random.default_rng(seed + 11).uniform(low, high, curve.DRAWS) if high > low else [high] * curve.DRAWS
        return ToTarget("measured", (low + high) / 2, [float(x) for x in draws], grid)
    if fit is None or not left_plateau(fit):
        return None
    return ToTarget("curve", fit.curve.samples_to(target), [d.samples_to(target) for d in fit.draws])


def time_to_target(run_dir: Path, text: str, result: dict[str, Any], price: float | None = None,
                   paired_dir: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """The `target` section of plan's result: `result` is plan_run's for the same run."""
    metric, value = parse(text)
    check_price(price)
    run = RunDir(run_dir).last()
    data = points(run_dir, metric)
    fit = curve.fit(data, seed=seed)
    notes = curve_notes(fit, metric, value, data)
    told = len(notes)  # what the curve cannot tell comes first: inspect's one line where plan cannot predict
    rows = train_rows(run)
    base_lag = lag.mean_lag(result["simulated"]["staleness"])
    cost = staleness(data, rows, metric, paired_dir, seed)
    error = abs(result["simulated"]["samples_per_s"] / max(result["measured"]["samples_per_s"], 1e-9) - 1)
    # What the run spent beyond its samples at its own rate (loading, the first batch): every
    # configuration pays it; its samples, the first steps' too, go at the configuration's rate.
    first = float(sum(r.groups for r in rows[:WARMUP]))
    overhead = max(0.0, rows[WARMUP - 1].time - first / max(result["simulated"]["samples_per_s"], 1e-9))
    notes += cost.notes + [reruns.note(),
        f"throughput within +-{error:.0%} (the simulator's error on the run as it ran; other configurations "
        "err more, docs/plan.md)",
        f"wall time: the run's own overhead ({overhead:.1f} s: its first {WARMUP} steps, {rows[WARMUP - 1].time:.1f} s "
        "measured, less their samples at its simulated samples/s) plus every sample at the configuration's "
        "simulated samples/s; evaluations and checkpoints cost what they did in the run"]
    base = to_target(data, fit, value, seed)
    if base is not None and base.source == "measured":
        low, high = crossing(data, value) or (0.0, 0.0)
        notes.insert(0, f"samples to target: the run's own crossing, measured between its records at {low:g} and "
                     f"{high:g} samples (the curve fit is not used); other configurations scale it by the staleness "
                     "cost and read it off at their next evaluation")
    elif base is not None:
        notes.insert(told, "samples to target: the fitted learning curve (the run did not reach the target)")
    plan = run.plan()
    kind = budget_kind(plan)
    rng = np.random.default_rng(seed + 7)
    spread = rng.uniform(-error, error, curve.DRAWS)
    rerun = reruns.factors(curve.DRAWS, seed)
    out = []
    for name, changes, figures in candidates(result):
        devices = max(float(plan.cluster.get(kind) or 0), spend(apply(plan, changes, len(rows)).plan, kind))
        devices = float(math.ceil(devices - 1e-9)) if kind == "gpus" else devices
        row = {"configuration": name, "changes": changes, "samples_per_s": figures["samples_per_s"],
               "mean_lag": round(lag.mean_lag(figures["staleness"]), 3), "devices": devices}
        if base is not None:
            row.update(reach(base, cost, base_lag, row["mean_lag"], figures["samples_per_s"], overhead, spread,
                             devices, price, rerun if changes else None))
        out.append(row)
    out.sort(key=lambda r: (_finite(r.get("seconds", [None, None])[1]), r["configuration"]))
    return {"metric": metric, "value": value, "unit": UNITS[kind], "price": price, "notes": notes,
            "overhead_s": round(overhead, 3),
            "samples_from": None if base is None else base.source, "curve": describe(fit, data),
            "staleness": {"source": cost.source, "per_lag": round(cost.slope, 4),
                          "interval": list(curve.percentiles(cost.slopes))},
            "configurations": out}


def staleness(data: list[tuple[float, float]], rows: list[Any], metric: str, paired_dir: Path | None,
              seed: int) -> lag.StalenessCost:
    measured = trained_lag(rows)
    if paired_dir is None:
        return lag.prior(curve.DRAWS, "one run trains at one lag; --paired RUN_DIR of the same task at another "
                         "lag measures it", seed)
    other = RunDir(paired_dir).last()
    return lag.paired(data, measured, points(paired_dir, metric, "the paired run"),
                      trained_lag(train_rows(other)), curve.DRAWS, seed)


def trained_lag(rows: list[Any]) -> float:
    """The mean lag of the samples a run trained on (its train rows' staleness histograms)."""
    return lag.mean_lag(_histogram(rows))


def _histogram(rows: list[Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in rows:
        for k, v in r.staleness.items():
            out[int(k)] = out.get(int(k), 0) + int(v)
    return out


def candidates(result: dict[str, Any]) -> list[tuple[str, list[str], dict[str, Any]]]:
    """(name, changes, simulated figures) of the run as it ran, the overrides and the search's."""
    out = [("as run", [], result["simulated"])]
    if "predicted" in result:
        out.append((" ".join(result["changes"]), list(result["changes"]), result["predicted"]))
    for r in result.get("search", {}).get("configurations", []):
        out.append((f"replicas {r['replicas']}, max_staleness {r['max_staleness']}", r["changes"], r))
    return out


def reach(base: ToTarget, cost: lag.StalenessCost, base_lag: float, mean_lag: float, rate: float,
          overhead: float, spread: np.ndarray, devices: float, price: float | None,
          rerun: np.ndarray | None = None) -> dict[str, Any]:
    """[low, point, high] samples, seconds, device-hours (and cost) of one configuration; `rerun` the
    run-to-run spread's draws for another configuration than the run's own (None: the run itself)."""
    def seconds(samples: float, speed: float) -> float:
        return overhead + samples / max(speed, 1e-9) if math.isfinite(samples) else math.inf

    point = base.at(base.point * cost.multiplier(base_lag, mean_lag))
    rerun = np.ones(len(base.draws)) if rerun is None else rerun
    samples = [base.at(n * cost.multiplier(base_lag, mean_lag, s) * f)
               for n, s, f in zip(base.draws, cost.slopes, rerun, strict=True)]
    walls = [seconds(n, rate * (1 + e)) for n, e in zip(samples, spread, strict=True)]
    out = {"samples": _three(samples, point), "seconds": _three(walls, seconds(point, rate))}
    out["device_hours"] = [None if x is None else x * devices / 3600 for x in out["seconds"]]
    if price is not None:
        out["cost"] = [None if x is None else x * price for x in out["device_hours"]]
    return out


def _three(draws: list[float], point: float) -> list[float | None]:
    """[low, point, high]; None for never (JSON has no infinity)."""
    lo, hi = curve.percentiles(draws)
    return [x if math.isfinite(x) else None for x in (min(lo, point), point, max(hi, point))]


def _finite(x: float | None) -> float:
    return math.inf if x is None else x


def describe(fit: curve.Fit | None, data: list[tuple[float, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"form": "R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), C samples", "points": len(data)}
    if fit is not None:
        c = fit.curve
        out.update(r0=round(c.r0, 4), a=round(c.a, 4), b=round(c.b, 3), c_mid=round(c.c_mid, 1),
                   a_interval=[round(x, 4) for x in curve.percentiles([d.a for d in fit.draws])],
                   residual=round(fit.residual, 4), last_samples=fit.last_samples)
    return out
