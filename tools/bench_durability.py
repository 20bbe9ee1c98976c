"""What durability costs: the quickstart's GRPO phase with periodic checkpoints and records
streamed every 2 s, against the same run that only writes them at its end, side by side.

- `durable`: `run.checkpoint_every: 50` (weights, optimizer state, coordinator state and the
  record streams' offsets, while the trainer waits) and ledger, metrics, TensorBoard and trace
  appended every 2 s (the default);
- `at_end`: no periodic checkpoint and the record streams flushed only at the end (what flowrl
  did before runs were durable).

The pairs alternate their order (durable first, then at_end first, ...) so drift on a shared
machine and whatever the first run of a pair pays (a cold page cache) hit both alike. Each
run is the quickstart with a 1-step warm-up and `--steps` GRPO steps; the figure is the seconds
from the first GRPO step's end to the last's (set-up excluded), read from metrics.jsonl.

    OMP_NUM_THREADS=1 python tools/bench_durability.py --steps 150 --pairs 4

The last line is one JSON object; `overhead_ratio` is durable / at_end (median over pairs), and
`direct_share` the share of a durable run's wall time its trace spends in checkpoints and flushes
(the `runtime` row): the same cost measured inside one run, free of the drift between runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import results_file

from flowrl.records import RunDir, as_dicts

ROOT = Path(__file__).resolve().parents[1]
DRIVER = """
import importlib
run = importlib.import_module("flowrl.runtime.run")  # the module: flowrl.runtime.run is also its function's name
if {at_end}:
    run.FLUSH_EVERY_S = 1e9  # records reach the disk only at the end (the keeper still runs, idle)
from flowrl import launch
launch.start({file!r}, {overrides!r}, {run_dir!r}, None, progress=False)
"""


def one(steps: int, durable: bool, every: int, workdir: Path, index: int) -> dict[str, float]:
    run_dir = workdir / f"{'durable' if durable else 'at_end'}-{index}"
    overrides = ["phases.0.steps=1", "phases.0.seconds=null", f"phases.1.steps={steps}", "phases.1.seconds=null",
                 "data.eval=null"]
    overrides.append(f"run.checkpoint_every={every}" if durable else "run.checkpoint_seconds=1000000")
    code = DRIVER.format(at_end=not durable, file=str(ROOT / "pipelines/quickstart.yaml"), overrides=overrides,
                         run_dir=str(run_dir))
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TERM": "dumb"})
    phase = run_dir / "phases" / "1-grpo"
    rows = as_dicts(RunDir(phase).metrics())
    kept = sorted(p.name for p in (phase / "checkpoints").iterdir() if p.is_dir())
    seconds = rows[-1]["time"] - rows[0]["time"]
    # The run's own work inside the same window, from the trace's runtime row (observe.py):
    # checkpoints (train nodes wait) and flushes (the event loop is busy appending).
    events = as_dicts(RunDir(phase).trace())
    lo, hi = rows[0]["time"] * 1e6, rows[-1]["time"] * 1e6
    spent = {name: sum(e["dur"] for e in events if e["pid"] == 0 and e.get("name") == name
                       and e.get("ph") == "X" and lo <= e["ts"] <= hi) / 1e6 for name in ("checkpoint", "flush")}
    return {"seconds": seconds, "steps": len(rows), "checkpoints": kept, **spent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--every", type=int, default=50)
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    durable, at_end, direct = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = ((True, durable), (False, at_end))
            for flag, out in order if i % 2 == 0 else order[::-1]:
                result = one(args.steps, flag, args.every, Path(tmp), i)
                out.append(result["seconds"])
                if flag:
                    direct.append((result["checkpoint"] + result["flush"]) / result["seconds"])
                print(f"pair {i} {'durable' if flag else 'at_end '}: {result['seconds']:.2f} s for "
                      f"{result['steps'] - 1} steps, checkpoints {result['checkpoints']} (in the window: "
                      f"checkpoints {result['checkpoint']:.3f} s, flushes {result['flush']:.3f} s)", flush=True)
    ratios = [d / a for d, a in zip(durable, at_end, strict=True)]
    summary = {"steps": args.steps, "checkpoint_every": args.every, "durable_s": durable, "at_end_s": at_end,
               "ratios": [round(r, 4) for r in ratios], "overhead_ratio": round(statistics.median(ratios), 4),
               "direct_share": round(statistics.median(direct), 4)}
    print(f"durable / at_end per pair: {', '.join(f'{r:.3f}' for r in ratios)}; the durable runs' own "
          f"checkpoint and flush time: {statistics.median(direct):.2%} of their wall time (median)")
    results_file.emit(args.record, "bench_durability", summary)


if __name__ == "__main__":
    main()
