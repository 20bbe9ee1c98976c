"""`run.stop_when`: end a run cleanly once a metric reaches a value.

    run: {steps: 500, stop_when: {eval_reward: 0.9}}

Each entry is `metric: threshold` and is reached when the metric's latest value is >= the
threshold; with several entries the run stops when any one is reached. The run then ends like
`run.max_seconds` does: the train step in progress finishes, a final checkpoint and the export are
written, status "done", stopped_by "stop_when", `flowrl run` exits 0. Metric names:

- `eval_reward`: the greedy evaluation's mean reward (`data.eval`; the row of `eval.jsonl`), seen
  as soon as the generate node has evaluated a policy version;
- a number of the `metrics.jsonl` row (`reward`, `samples_per_s`, ...: ROW_KEYS), seen after each
  train step;
- `train.<key>`: a key of the row's `train` object (the train node's own metrics, e.g.
  `train.entropy`).

A metric that should fall (a loss) is not a stop_when target: thresholds are lower bounds.
A `train.<key>` that no train node declares (`Operator.reported_metrics`) is refused by `flowrl
validate`, naming the keys they report (flowrl/graph/rules.py); the names it knows are checked as the spec loads
(flowrl/spec/stop_when.py). One a node that declares nothing
(a plugin) does not report at its first trained step fails the run there, naming those it does.
"""

from __future__ import annotations

from typing import Any

from flowrl.spec.stop_when import EVAL, ROW_KEYS

EVAL_METRIC = "eval/reward"  # what the generate operator reports (flowrl_operators/generate.py)


class Targets:
    def __init__(self, stop_when: dict[str, float]) -> None:
        self.wanted = {name: float(value) for name, value in stop_when.items()}
        self.reached: str | None = None  # e.g. "eval_reward 0.94 >= 0.9"
        # A train.<key> target that the train node's first trained step did not report: it never
        # would be reached (no node declares its metrics beforehand, so this is found at step 0).
        self.unread: str | None = None

    def row(self, row: dict[str, Any] | None) -> bool:
        """A metrics row (after a train step): has any row or train.* target been reached?"""
        if not row:
            return False
        values = {name: row.get(name) for name in ROW_KEYS}
        train = row.get("train") or {}
        values.update({f"train.{k}": v for k, v in train.items()})
        missing = [n for n in self.wanted if n.startswith("train.") and n not in values]
        if missing and train and train.get("trajectories", 1) > 0 and self.unread is None:
            self.unread = (f"run.stop_when: {missing[0]} is not a metric the train node reports, so the run "
                           f"would never stop on it; it reports {', '.join(f'train.{k}' for k in sorted(train))}")
        return self._check(values)

    def operators(self, metrics: dict[str, Any]) -> bool:
        """An operator's reported metrics: has eval_reward been reached?"""
        return self._check({EVAL: metrics.get(EVAL_METRIC)})

    def _check(self, values: dict[str, Any]) -> bool:
        for name, threshold in self.wanted.items():
            value = values.get(name)
            if isinstance(value, int | float) and value >= threshold:
                self.reached = self.reached or f"{name} {value:g} >= {threshold:g}"
                return True
        return False
