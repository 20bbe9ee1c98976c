"""The last line of `flowrl inspect RUN_DIR`: plan's suggestion where a configuration of a small
search is predicted to reach the run's `stop_when` target at least SOONER times sooner than the
run as it ran. Silent where none is, or the run has no target plan can read; one line saying why
where plan cannot predict; never an error (inspect shows what a run did, whatever plan makes of it).
"""

from __future__ import annotations

from pathlib import Path

from flowrl.plan import plan_run
from flowrl.plan.report import duration
from flowrl.plan.target import time_to_target
from flowrl.records import RunDir
from flowrl.spec.errors import UserError
from flowrl.spec.stop_when import EVAL

SOONER = 1.3
SPACE = {"max_replicas": 2, "max_staleness": 2}  # six configurations: inspect stays within seconds


def suggestion(run_dir: Path, sooner: float | None = None) -> str | None:
    sooner = SOONER if sooner is None else sooner  # read at the call: a test may move the bar
    try:
        stop_when = RunDir(run_dir).last().plan().run.get("stop_when") or {}
    except (UserError, OSError, ValueError):
        return None  # inspect says what is wrong with the run itself
    wanted = [(m, float(v)) for m, v in stop_when.items() if m in (EVAL, "reward") or m.startswith("train.")]
    if not wanted:
        return None
    metric, value = wanted[0]
    why = f"plan: no suggestion for stop_when {metric} {value:g}"
    try:
        found = time_to_target(run_dir, f"{metric}={value!r}", plan_run(run_dir, [], search=True, **SPACE))
    except UserError as e:
        return f"{why}: {e}"
    except Exception as e:  # noqa: BLE001 - plan's fault: inspect still shows the run
        return f"{why}: internal error {type(e).__name__}: {e} (flowrl plan {run_dir} --target {metric}={value:g} " \
               "--debug shows it)"
    rows = found["configurations"]
    base = next(r for r in rows if r["configuration"] == "as run")
    if "seconds" not in base or base["seconds"][1] is None:
        return f"{why}: {found['notes'][0]}"
    best = min((r for r in rows if r is not base and r["seconds"][1] is not None), key=lambda r: r["seconds"][1],
               default=None)
    if best is None or best["seconds"][1] * sooner > base["seconds"][1]:
        return None
    return (f"plan: {best['configuration']} is predicted to reach {metric} {value:g} "
            f"{base['seconds'][1] / best['seconds'][1]:.1f}x sooner ({duration(best['seconds'][1])} "
            f"[{duration(best['seconds'][0])}..{duration(best['seconds'][2] or float('inf'))}] against "
            f"{duration(base['seconds'][1])} as run; flowrl plan {run_dir} --target {metric}={value:g} --search)")
