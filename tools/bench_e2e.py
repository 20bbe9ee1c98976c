"""End to end: the quickstart, synchronous and asynchronous, with the same seed and budget.

    python tools/bench_e2e.py [--seed 0] [--warmup-steps 60] [--grpo-seconds 270] [--target 0.9]

Runs `pipelines/quickstart.yaml` and `pipelines/quickstart_async.yaml` one after the other (never
together: they would share the two cores) through `flowrl run`, then reads each GRPO phase's
greedy evaluations (eval.jsonl) and prints, per pipeline: wall time from launch to the first eval
reward >= target (warm-up included), samples trained on until then, and the best eval reward.
The last line is one JSON object with sync_s_to_target, async_s_to_target and async_over_sync
(null where a run did not reach the target within its budget).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = {"sync": "pipelines/quickstart.yaml", "async": "pipelines/quickstart_async.yaml"}


def run(pipeline: str, run_dir: Path, args: argparse.Namespace) -> dict:
    overrides = [f"run.seed={args.seed}", f"phases.0.steps={args.warmup_steps}",
                 f"phases.1.seconds={args.grpo_seconds}", f"data.eval.every={args.eval_every}"]
    started = time.time()
    subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / pipeline), *overrides,
                    "--run-dir", str(run_dir), "--quiet"], check=True, cwd=ROOT)
    wall = time.time() - started
    warmup = json.loads((run_dir / "phases/0-warmup/phase.json").read_text())["seconds"]
    grpo = run_dir / "phases/1-grpo"
    evals = [json.loads(line) for line in (grpo / "eval.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    hit = next((e for e in evals if e["eval_reward"] >= args.target), None)
    out = {"wall_s": round(wall, 1), "best_eval": max(e["eval_reward"] for e in evals),
           "last_eval": evals[-1]["eval_reward"], "steps": len(rows), "s_to_target": None, "samples_to_target": None}
    if hit is not None:
        # Version v was trained on the groups of steps 0 .. v-1.
        out["s_to_target"] = round(warmup + hit["time"], 1)
        out["samples_to_target"] = sum(r["groups"] for r in rows if r["step"] < hit["version"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--grpo-seconds", type=float, default=270)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.9)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, pipeline in PIPELINES.items():
            results[name] = run(pipeline, Path(tmp) / name, args)
            r = results[name]
            print(f"{name:>5}: {r['steps']} GRPO steps, best eval {r['best_eval']:.3f}, last {r['last_eval']:.3f}; "
                  f"to eval >= {args.target}: {r['s_to_target']} s, {r['samples_to_target']} samples (wall {r['wall_s']} s)")
    sync_s, async_s = results["sync"]["s_to_target"], results["async"]["s_to_target"]
    ratio = round(async_s / sync_s, 3) if sync_s and async_s else None
    print(f"async / sync time to target: {ratio}")
    print(json.dumps({"sync_s_to_target": sync_s, "async_s_to_target": async_s, "async_over_sync": ratio,
                      "sync_samples_to_target": results["sync"]["samples_to_target"],
                      "async_samples_to_target": results["async"]["samples_to_target"],
                      "sync_best_eval": results["sync"]["best_eval"], "async_best_eval": results["async"]["best_eval"],
                      "seed": args.seed, "target": args.target}))


if __name__ == "__main__":
    main()
