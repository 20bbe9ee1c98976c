"""What each experiment tracker costs the coordinator, whose event loop calls it at every flush.

A toy run (tests/runtime_ops.py, text-carrying trajectories) writes 10 metrics rows and 4 sample
rows per step; each tracker is then opened in a fresh folder and handed them as two flushes of 5
steps, as the runtime would. Per tracker: seconds to import and open, for the first flush (a
first table imports pandas under wandb), for the next one, and to close.

    python tools/bench_trackers.py [--trackers tensorboard wandb mlflow] [--repeats 3]

The last line of output is one JSON object: per tracker, the median of each figure in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file

from flowrl.records import RunDir, as_dicts

ROOT = Path(__file__).resolve().parents[1]


def measure(name: str, rows: list[dict], samples: list[dict]) -> dict[str, float]:
    """One tracker, once (call in a fresh process: imports count)."""
    from flowrl.trackers import TrackerContext, resolve

    folder = Path(tempfile.mkdtemp()) / name
    folder.mkdir()
    first = [s for s in samples if s["step"] < 5]
    t0 = time.perf_counter()
    tracker = resolve(name)()
    tracker.open(TrackerContext(folder, "bench", name, None, time.time(), {"bench": True}))
    t1 = time.perf_counter()
    tracker.log(rows[:5], first)
    t2 = time.perf_counter()
    tracker.log(rows[5:], [s for s in samples if s["step"] >= 5])
    t3 = time.perf_counter()
    tracker.close()
    t4 = time.perf_counter()
    return {"open_s": t1 - t0, "first_flush_s": t2 - t1, "next_flush_s": t3 - t2, "close_s": t4 - t3}


def records() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import runtime_ops as ops

    from flowrl.runtime.run import run

    run_dir = Path(tempfile.mkdtemp()) / "run"
    run(ops.grpo("sync", 0, steps=10, batch_size=4, gen={"text": True}), run_dir, progress=False)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trackers", nargs="+", default=["tensorboard", "wandb", "mlflow"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: RUN_DIR TRACKER
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    if args.one:
        run_dir = Path(args.one[0])
        rows, samples = as_dicts(RunDir(run_dir).metrics()), as_dicts(RunDir(run_dir).samples())
        print(json.dumps(measure(args.one[1], rows, samples)))
        return
    run_dir = records()
    result = {}
    for name in args.trackers:
        runs = [json.loads(subprocess.run([sys.executable, __file__, "--one", str(run_dir), name], check=True,
                                          capture_output=True, text=True).stdout.splitlines()[-1])
                for _ in range(args.repeats)]
        result[name] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        print(f"{name:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in result[name].items()))
    results_file.emit(args.record, "bench_trackers", result)


if __name__ == "__main__":
    main()
