"""A run directory's records: the row types its files hold and `RunDir`, their one reader.

- rows.py    the rows, as msgspec Structs; the writers (flowrl/runtime/, operators/evaluate.py,
             flowrl/launch.py, flowrl/replay.py) encode these, so reader and writer share them
- lines.py   JSON lines and files: decoded into rows, a torn last line skipped, damage located
- rundir.py  RunDir(path): is it a run, its phases, and a typed reader for each file
- rollouts.py the rollout store's format (RolloutStep records) and its reader
"""

from flowrl.records.lines import RecordError, append, encode
from flowrl.records.rows import (
    ErrorRow,
    EvalRow,
    HealthEvent,
    Launch,
    LedgerEntry,
    Meta,
    MetricsRow,
    PhaseDone,
    ReplayInfo,
    SampleRow,
    Trace,
    TraceEvent,
    WaitRow,
)
from flowrl.records.rundir import NotARun, RunDir, as_dicts

__all__ = ["ErrorRow", "EvalRow", "HealthEvent", "Launch", "LedgerEntry", "Meta", "MetricsRow", "NotARun", "PhaseDone",
           "RecordError", "ReplayInfo", "RunDir", "SampleRow", "Trace", "TraceEvent", "WaitRow", "append",
           "as_dicts", "encode"]
