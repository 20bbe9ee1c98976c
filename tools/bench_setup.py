"""Set-up of the quickstart's GRPO phase: from `flowrl` starting to the end of the first train step.

    OMP_NUM_THREADS=1 python tools/bench_setup.py [--repeats 3] [--pipeline pipelines/quickstart.yaml]

Runs the quickstart once with a 5-step warm-up (its export is the GRPO phase's model), then, in a
fresh process each time, only the GRPO phase (`flowrl run --resume` of that run directory with the
GRPO phase removed: a phase not yet started starts from scratch, as in a plain `flowrl run`). Each
repeat is split by phase:

- interpreter: from the parent's spawn to the child's first line (Python starting up);
- import: `flowrl.cli` and `flowrl.launch` imported;
- compile: the spec loaded, validated and compiled (every phase, as `flowrl run` does), the run
  directory readied, up to the run's origin (`meta.json`);
- setup: from the origin until the last stage finished setting up (`setup` spans in `trace.json`:
  engine and trainer built, weights loaded, the first greedy evaluation);
- first_step: from there to the end of the learner's first `step` span (rollout, reward, train);
- total: the four added up, the time a user waits for the first step.

Next to each repeat, `floor`: a fresh interpreter that only imports torch and transformers' Qwen2
model (what any trainer of a Hugging Face model in PyTorch pays before its first step), so that a
busy machine's slowness shows in both; `over_floor` = total - floor. On a shared machine wall time
stretches with the load, so each process's CPU seconds (user + system, whole process) are reported
too: `cpu` (the GRPO phase's process, its second step and close included) and `floor_cpu`.

The first run (both phases in one process) also gives `in_run`: the GRPO phase's set-up as the
quickstart's user meets it, torch and transformers already imported by the warm-up: from the
warm-up's last train step to the GRPO phase's first (`close_compile`: the warm-up closing, its export
and the GRPO phase compiled; `setup`; `first_step`).

Prints each repeat and the median of each part, then one JSON line (`total_s` median, target < 3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file

from flowrl.records import RunDir

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("interpreter", "import", "compile", "setup", "first_step")


def child(run_dir: str) -> None:
    """Run the GRPO phase; print when this process started and when its imports were done."""
    started = time.time()
    from flowrl import cli, launch  # noqa: F401 - what `flowrl run` imports before it reads the spec

    imported = time.time()
    print(json.dumps({"started": started, "imported": imported}), flush=True)
    code = cli.main(["run", "--resume", run_dir, "--quiet"])
    sys.exit(code)


FLOOR = "import time, torch, transformers.models.qwen2.modeling_qwen2; print(time.time())"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def floor(env: dict) -> tuple[float, float]:
    """(wall, CPU) seconds of a fresh interpreter importing torch and transformers' Qwen2 model."""
    started, cpu = time.time(), cpu_seconds()
    out = subprocess.run([sys.executable, "-c", FLOOR], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout) - started, cpu_seconds() - cpu  # wall until imported, not the exit


def spans(trace: Path) -> list[dict]:
    return [e.as_dict() for e in RunDir(trace.parent).trace() if e.ph == "X"]


def measure(run_dir: Path, phase: str, env: dict) -> dict:
    """One fresh process running the phase; its parts in seconds."""
    shutil.rmtree(run_dir / "phases" / phase, ignore_errors=True)
    launched, cpu = time.time(), cpu_seconds()
    out = subprocess.run([sys.executable, __file__, "--child", str(run_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the phase failed ({out.returncode}):\n{out.stderr[-3000:]}")
    cpu = cpu_seconds() - cpu
    marks = json.loads(out.stdout.splitlines()[0])
    directory = run_dir / "phases" / phase
    origin = RunDir(directory).meta().origin
    events = spans(directory / "trace.json")
    names = {e.pid: e.args["name"] for e in RunDir(directory).trace() if e.name == "process_name"}
    setups = {names[e["pid"]]: e["dur"] / 1e6 for e in events if e["name"] == "setup"}
    set_up = max((e["ts"] + e["dur"]) / 1e6 for e in events if e["name"] == "setup")
    first = min((e["ts"] + e["dur"]) / 1e6 for e in events if e["name"] == "step")
    parts = {"interpreter": marks["started"] - launched, "import": marks["imported"] - marks["started"],
             "compile": origin - marks["imported"], "setup": set_up, "first_step": first - set_up}
    return {k: round(v, 3) for k, v in parts.items()} | {"total": round(sum(parts.values()), 3), "cpu": round(cpu, 3),
                                                         "nodes": {n: round(s, 3) for n, s in setups.items()}}


def in_run(run_dir: Path, phases: list[str]) -> dict:
    """The GRPO phase's set-up inside the whole quickstart run (one process, torch and transformers
    already imported by the warm-up): from the warm-up's last train step to the GRPO phase's first,
    split into the warm-up's close (export included), compile and setup, and the first step."""
    marks = []
    for phase in phases:
        directory = run_dir / "phases" / phase
        origin = RunDir(directory).meta().origin
        events = spans(directory / "trace.json")
        steps = sorted(origin + (e["ts"] + e["dur"]) / 1e6 for e in events if e["name"] == "step")
        setup = max(origin + (e["ts"] + e["dur"]) / 1e6 for e in events if e["name"] == "setup")
        marks.append((origin, setup, steps))
    (_, _, warm_steps), (origin, setup, steps) = marks
    parts = {"close_compile": origin - warm_steps[-1], "setup": setup - origin, "first_step": steps[0] - setup}
    return {k: round(v, 3) for k, v in parts.items()} | {"total": round(steps[0] - warm_steps[-1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pipeline", default="pipelines/quickstart.yaml")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "flowrl.cli", "run", args.pipeline, "phases.0.steps=5",
                        "phases.1.steps=2", "--run-dir", str(run_dir), "--quiet"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        phases = sorted(p.name for p in (run_dir / "phases").iterdir())
        phase = phases[1]
        warm = in_run(run_dir, phases)
        print("in the whole run (imports warm): " + ", ".join(f"{k} {v:.2f} s" for k, v in warm.items()), flush=True)
        results = []
        for i in range(args.repeats):
            r = measure(run_dir, phase, env)
            r["floor"], r["floor_cpu"] = (round(v, 3) for v in floor(env))
            r["over_floor"] = round(r["total"] - r["floor"], 3)
            results.append(r)
            print(f"repeat {i}: " + ", ".join(f"{k} {r[k]:.2f} s" for k in (*PARTS, "total", "floor", "over_floor", "cpu", "floor_cpu"))
                  + "; setup per node: " + ", ".join(f"{n} {s:.2f}" for n, s in r["nodes"].items()), flush=True)
    medians = {f"{k}_s": round(statistics.median(r[k] for r in results), 3)
               for k in (*PARTS, "total", "floor", "over_floor", "cpu", "floor_cpu")}
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    results_file.emit(args.record, "bench_setup", medians | {"in_run": warm, "total_s_by_repeat": [r["total"] for r in results], "target_s": 3.0,
                                "pipeline": args.pipeline, "repeats": args.repeats})


if __name__ == "__main__":
    main()
