"""`wandb`: Weights & Biases, offline by default, its files under RUN_DIR/wandb.

Mode: `WANDB_MODE` if you set it (`online` with `wandb login` streams to the server), else
`offline`: the run is written to RUN_DIR/wandb/offline-run-<time>-<id>/ as it goes, the sample
tables staged in RUN_DIR/wandb/data unless you set `WANDB_DATA_DIR`, and
`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later. The project is `WANDB_PROJECT` if set,
else the pipeline's name; the run is named after the run directory, and the phases of a phased run
are grouped under its name; the run's config is the plan (plan.json's content).

Each metrics row is one `log` at `step` = the train step, with `flowrl.trackers.scalars`' names;
the step's sample rows are a `wandb.Table` under `samples` in the same call. Durability: wandb's
service writes the .wandb file every FILE_FLUSH_S and writes nothing more when this process is
killed, so a kill within FILE_FLUSH_S of a flush loses that flush's steps in wandb (the run's
files keep them; trackers.json counts them as sent, so a resume does not send them again). A resume continues
the same run id (kept in trackers.json, flowrl/runtime/tracking.py); offline, that writes a second
offline-run folder with the same id, which `wandb sync` appends to the same run.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from flowrl.trackers import SAMPLE_COLUMNS, TrackerContext, sample_cells, scalars

FILE_FLUSH_S = 0.5


class WandB:
    requires: ClassVar[tuple[str, ...]] = ("wandb",)

    def __init__(self) -> None:
        self.run: Any = None
        self.data_dir_set = False

    def open(self, context: TrackerContext) -> dict[str, Any]:
        import wandb

        # console="off": wandb would otherwise wrap stdout, under the live view; no system
        # metrics sampler either, the trace and metrics.jsonl are the run's own measurements.
        # The .wandb file is written every FILE_FLUSH_S (wandb's default, 15 s, would lose that
        # much to a kill: its service does not write what it holds when this process dies).
        # init_timeout: a server that does not answer fails init within the run's tracker timeout
        # (wandb's own, 90 s, kept a dropped tracker's thread, and the process's exit, waiting).
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True,
                                  x_transaction_log_flush_interval=FILE_FLUSH_S, init_timeout=context.timeout_s)
        if "WANDB_DATA_DIR" not in os.environ:
            # Where wandb stages a table's files until `wandb sync` uploads them (default: the
            # user's data folder): in the run directory, so that it syncs from anywhere. wandb
            # reads the variable whenever it stages, so it stays set until close().
            os.environ["WANDB_DATA_DIR"] = str(context.run_dir / "wandb" / "data")
            self.data_dir_set = True
        resumed = context.state.get("id")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or context.name, name=context.label, group=context.group,
            dir=str(context.run_dir), mode=os.environ.get("WANDB_MODE") or "offline",
            config=context.config, id=resumed, resume="allow" if resumed else None,
            settings=settings, reinit="create_new")
        return {"id": self.run.id}

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        import wandb

        for row in rows:
            values: dict[str, Any] = dict(scalars(row))
            mine = [sample_cells(s) for s in samples if (s["node"], s["step"]) == (row["node"], row["step"])]
            if mine:
                values["samples"] = wandb.Table(columns=list(SAMPLE_COLUMNS), data=mine)
            # commit: the step is whole; without it wandb holds a step's row open until a later
            # step arrives, and a kill would lose the last step sent.
            self.run.log(values, step=row["step"], commit=True)

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            # finish() returns before wandb's service has written the end of the .wandb file, and
            # the service writes nothing more once this process is killed (a Ray actor is, when
            # the run ends): teardown waits for it. A later open starts the service again.
            wandb.teardown()
        if self.data_dir_set:
            os.environ.pop("WANDB_DATA_DIR", None)
            self.data_dir_set = False
