"""A run directory's records: the row types its files hold and `RunDir`, their one reader.

- rows.py    the rows, as msgspec Structs; the writers (flowrl/runtime/, operators/evaluate.py,
             flowrl/launch.py, flowrl/replay.py) encode these, so reader and writer share them
- lines.py   JSON lines and files: decoded into rows, a torn last line skipped, damage located
- rundir.py  RunDir(path): is it a run, its phases, and a typed reader for each file
- rollouts.py the rollout store's format (RolloutStep records) and its reader
- checkpoint.py a checkpoint folder's streams.json and manifest.json
"""

from flowrl.records.checkpoint import Checkpoint
from flowrl.records.lines import RecordError, append, encode
from flowrl.records.rows import (
    ErrorRow,
    EvalRow,
    HealthEvent,
    Launch,
    LedgerEntry,
    Manifest,
    Meta,
    MetricsRow,
    PhaseDone,
    ReplayInfo,
    SampleRow,
    StreamSizes,
    Trace,
    TraceEvent,
    TrackerEntry,
    WaitRow,
)
from flowrl.records.rundir import NotARun, RunDir, as_dicts

__all__ = ["Checkpoint", "ErrorRow", "EvalRow", "HealthEvent", "Launch", "LedgerEntry", "Manifest", "Meta", "MetricsRow", "NotARun", "PhaseDone",
           "RecordError", "ReplayInfo", "RunDir", "SampleRow", "StreamSizes", "Trace", "TraceEvent", "TrackerEntry", "WaitRow", "append",
           "as_dicts", "encode"]
