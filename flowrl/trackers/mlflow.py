"""`mlflow`: an MLflow run, in a local file store under RUN_DIR/mlruns by default.

Store: `MLFLOW_TRACKING_URI` if you set it (a server, a database), else `file:RUN_DIR/mlruns`
(`mlflow ui --backend-store-uri RUN_DIR/mlruns` shows it). MLflow 3 refuses a file store unless
`MLFLOW_ALLOW_FILE_STORE=true`; with the default store this tracker sets it in the process when
you have not set it (a database store costs ~6 s of migrations at the first flush). The
experiment is `MLFLOW_EXPERIMENT_NAME` if set, else the pipeline's name; the plan is logged as the
artifact `plan.json`.

Metrics are `flowrl.trackers.scalars` at `step` = the train step; MLflow's metric names allow
letters, digits and `_-. /` only, so an edge label's `->` reads `to` and other characters `_`.
Sample rows go to table artifacts (`log_table`), `samples/steps-<first>.json` per 1,000 steps
(each call rewrites its file, so the files stay bounded). A resume continues the same run id
(kept in trackers.json, flowrl/runtime/tracking.py).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, ClassVar

from flowrl.trackers import SAMPLE_COLUMNS, TrackerContext, sample_cells, scalars

STEPS_PER_TABLE = 1000


def metric_name(name: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", name.replace("->", "to"))


class MLflow:
    requires: ClassVar[tuple[str, ...]] = ("mlflow",)

    def __init__(self) -> None:
        self.client: Any = None
        self.run_id = ""
        self.origin = 0.0

    def open(self, context: TrackerContext) -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (context.run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.origin = context.origin
        self.run_id = context.state.get("run_id", "")
        if self.run_id:  # a resume: the same run, running again
            self.client.update_run(self.run_id, status="RUNNING")
            return {"run_id": self.run_id}
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or context.name
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=context.label).info.run_id
        self.client.log_dict(self.run_id, context.config, "plan.json")
        return {"run_id": self.run_id}

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(metric_name(key), value, int((self.origin + row["time"]) * 1000), row["step"])
                   for row in rows for key, value in scalars(row).items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1,000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        tables: dict[int, list[list[Any]]] = {}
        for sample in samples:
            tables.setdefault(sample["step"] // STEPS_PER_TABLE, []).append(sample_cells(sample))
        for first, cells in tables.items():
            columns = {c: [row[i] for row in cells] for i, c in enumerate(SAMPLE_COLUMNS)}
            with warnings.catch_warnings():  # pandas' deprecation notices about MLflow's own code
                warnings.simplefilter("ignore")
                self.client.log_table(self.run_id, columns, f"samples/steps-{first * STEPS_PER_TABLE:06d}.json")

    def close(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id)
            self.client = None
