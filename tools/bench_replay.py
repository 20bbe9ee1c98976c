"""The rollout store's cost, and `flowrl replay` of the quickstart's GRPO phase, sync and async.

    python tools/bench_replay.py [--steps 40] [--repeats 2] [--specs quickstart quickstart_async]

For each spec: its GRPO phase as a single-phase run of `--steps` steps (the top-level graph, which
the GRPO phase runs unchanged, from the untrained tiny model instead of the warm-up's export: the
same shapes, so the same step cost), `--repeats` times with `run.record_rollouts` true and false,
alternately, through the real CLI. Printed side by side: the mean step time (metrics.jsonl
`step_seconds`, step 0 left out) with the store on and off, the store's bytes per trajectory, and
the direct cost of recording (encoding and appending each recorded step again, timed here, over
the mean step time). Then the first recorded run is replayed: `max_abs_diff_vs_recorded` must be
0.0. Run-to-run noise on a shared machine is a few percent, larger than the store's cost; the
direct cost is the figure to trust. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file
import yaml

from flowrl.records import RunDir
from flowrl.runtime.durability import rollouts

ROOT = Path(__file__).resolve().parents[1]


def grpo_phase(spec: str, steps: int, where: Path) -> Path:
    """The spec's top-level graph (what its GRPO phase runs) as a single-phase spec of `steps` steps."""
    data = yaml.safe_load((ROOT / "pipelines" / f"{spec}.yaml").read_text())
    data.pop("phases", None)
    data.setdefault("run", {})["steps"] = steps
    path = where / f"{spec}-grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"flowrl {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def step_seconds(run_dir: Path) -> list[float]:
    return [r.step_seconds for r in RunDir(run_dir).metrics()][1:]


def direct_cost(run_dir: Path, where: Path) -> float:
    """Seconds per step to encode and append the recorded batches, as the coordinator does."""
    steps = list(rollouts.read(rollouts.path(run_dir, "learner")))
    began = time.perf_counter()
    for s in steps:
        rollouts.append(where, "learner", s.step, s.at, s.groups)
    return (time.perf_counter() - began) / len(steps)


def bench(spec: str, steps: int, repeats: int, where: Path) -> dict:
    path = grpo_phase(spec, steps, where)
    times: dict[bool, list[float]] = {True: [], False: []}
    first = None
    for i in range(repeats):
        for on in (True, False):
            run_dir = where / f"{spec}-{i}-{'on' if on else 'off'}"
            cli("run", str(path), f"run.record_rollouts={str(on).lower()}", "--run-dir", str(run_dir), "--quiet")
            times[on] += step_seconds(run_dir)
            assert (run_dir / "rollouts").exists() == on
            first = first or (run_dir if on else None)
    store = rollouts.path(first, "learner")  # type: ignore[arg-type]
    recorded = list(rollouts.read(store))
    trajectories = sum(len(g.trajectories) for s in recorded for g in s.groups)
    on, off = statistics.mean(times[True]), statistics.mean(times[False])
    cost = direct_cost(first, where / f"{spec}-again")  # type: ignore[arg-type]
    began = time.time()
    replay = json.loads(cli("replay", str(first), "--quiet").stdout.strip().splitlines()[-1])
    return {"spec": spec, "steps": steps, "repeats": repeats, "step_s_store_on": round(on, 4),
            "step_s_store_off": round(off, 4), "measured_overhead_pct": round(100 * (on - off) / off, 2),
            "direct_cost_ms_per_step": round(1000 * cost, 3), "direct_overhead_pct": round(100 * cost / off, 3),
            "store_bytes": store.stat().st_size, "trajectories": trajectories,
            "bytes_per_trajectory": round(store.stat().st_size / trajectories, 1),
            "replay_s": round(time.time() - began, 2), "replay_steps": replay["steps"],
            "max_abs_diff_vs_recorded": replay["max_abs_diff_vs_recorded"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--specs", nargs="+", default=["quickstart", "quickstart_async"])
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.specs:
            result = bench(spec, args.steps, args.repeats, Path(tmp))
            results.append(result)
            print(f"{spec}: step {result['step_s_store_on']:.4f}s with the store, {result['step_s_store_off']:.4f}s "
                  f"without ({result['measured_overhead_pct']:+.2f}%, noise included); recording itself "
                  f"{result['direct_cost_ms_per_step']:.3f} ms/step ({result['direct_overhead_pct']:.3f}%); "
                  f"{result['bytes_per_trajectory']:.0f} B/trajectory; replay of {result['replay_steps']} steps "
                  f"in {result['replay_s']:.1f}s, max |diff| {result['max_abs_diff_vs_recorded']}", flush=True)
    results_file.emit(args.record, "bench_replay", {"bench": "replay", "results": results})


if __name__ == "__main__":
    main()
