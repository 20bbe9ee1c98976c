"""A real checkpoint that learns: pipelines/smollm2_sums.yaml on several seeds, one after another.

    python tools/bench_smollm2.py [--seeds 0,1,2] [--out runs/bench_smollm2] [--report-only] [key=value ...]

Runs `flowrl run pipelines/smollm2_sums.yaml run.seed=S` for each seed (never two at once: they would
share the cores), measuring each run's wall time (process start to exit, model load included) and
peak resident memory (the run's process tree, from wait4), and reads its greedy evaluations of the
held-out sums (RUN_DIR/eval.jsonl). Per seed it prints the curve (eval reward by policy version),
the gain from the first evaluation to the last, the gain in standard errors (sqrt(p(1-p)/n) of each
evaluation, combined: sqrt(se0^2 + se1^2)) and whether the run passes: gain >= 0.15 and > 3 SE
within 30 minutes, peak RSS under 4 GB. Each seed's figures are also written to OUT/seed-S.json as
soon as it ends, and `--report-only` reprints them from there. key=value overrides go to every run.
The last line is one JSON object: per-seed figures and `passed` (seeds passing / seeds run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = "pipelines/smollm2_sums.yaml"
MIN_GAIN, MIN_SE, MAX_SECONDS, MAX_RSS_GB = 0.15, 3.0, 1800.0, 4.0


def run_seed(seed: int, out: Path, overrides: list[str]) -> dict:
    """One run of the pipeline; its wall seconds and peak RSS (GB) of the whole process tree."""
    run_dir = out / f"seed-{seed}"
    command = ["flowrl", "run", PIPELINE, f"run.seed={seed}", *overrides, "--run-dir", str(run_dir), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.time()
    with open(out / f"seed-{seed}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - started
    # ru_maxrss (KiB on Linux) of the largest process it waited for: the run and its children.
    figures = {"seed": seed, "exit": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 1),
               "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "run_dir": str(run_dir)}
    figures.update(summary(run_dir))
    (out / f"seed-{seed}.json").write_text(json.dumps(figures) + "\n")
    return figures


def summary(run_dir: Path) -> dict:
    """The greedy-eval curve and the first-to-last gain in absolute terms and in standard errors."""
    path = run_dir / "eval.jsonl"
    evals = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(evals) < 2:
        return {"curve": [[e["version"], e["eval_reward"]] for e in evals], "gain": None, "gain_se": None}
    first, last = evals[0], evals[-1]

    def se(row: dict) -> float:
        p = row["eval_reward"]
        return math.sqrt(p * (1 - p) / row["samples"])

    gain = last["eval_reward"] - first["eval_reward"]
    spread = math.hypot(se(first), se(last))
    metrics = run_dir / "metrics.jsonl"
    steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    return {"curve": [[e["version"], round(e["eval_reward"], 4)] for e in evals], "samples": last["samples"],
            "steps": steps, "gain": round(gain, 4), "se": round(spread, 4),
            "gain_se": round(gain / spread, 2) if spread > 0 else None}


def passes(row: dict) -> bool:
    return (row.get("exit") == 0 and row.get("gain") is not None and row["gain"] >= MIN_GAIN
            and row["gain_se"] is not None and row["gain_se"] > MIN_SE and row["wall_s"] <= MAX_SECONDS
            and row["peak_rss_gb"] < MAX_RSS_GB)


def report(rows: list[dict]) -> None:
    for row in rows:
        curve = "  ".join(f"v{v}:{r:.3f}" for v, r in row["curve"])
        print(f"seed {row['seed']}: {curve}  gain {row['gain']} ({row['gain_se']} SE)  "
              f"{row['wall_s']:.0f} s  {row.get('steps', '?')} steps  peak {row['peak_rss_gb']} GB  "
              f"{'PASS' if passes(row) else 'FAIL'}")
    print(json.dumps({"pipeline": PIPELINE, "passed": f"{sum(passes(r) for r in rows)}/{len(rows)}",
                      "seeds": {r["seed"]: {k: r.get(k) for k in ("curve", "gain", "gain_se", "wall_s", "steps",
                                                                   "peak_rss_gb", "exit")} for r in rows}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_smollm2"))
    parser.add_argument("--report-only", action="store_true", help="reprint OUT/seed-S.json, run nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    out = args.out if args.out.is_absolute() else ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        if args.report_only:
            path = out / f"seed-{seed}.json"
            if path.exists():
                rows.append(json.loads(path.read_text()))
            continue
        rows.append(run_seed(seed, out, args.overrides))
        print(f"seed {seed} done: {rows[-1]['curve']}", flush=True)
    report(rows)


if __name__ == "__main__":
    main()
