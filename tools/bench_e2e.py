"""End to end: the quickstart, synchronous and asynchronous, and the same recipe as a hand-written loop.

    python tools/bench_e2e.py [--seed 0] [--warmup-steps 650] [--grpo-seconds 250] [--target 0.9]
                              [--also 0.7,0.8] [--only hand,sync,async]

Runs `tools/hand_grpo.py`, `pipelines/quickstart.yaml` and `pipelines/quickstart_async.yaml` one
after the other (never together: they would share the two cores) with the same seed and budget,
then reads each one's greedy evaluations and prints, per contender: wall time from launch to the
first eval reward >= target (warm-up included), samples trained on until then, the GRPO seconds per
step and the best eval reward. The last line is one JSON object with sync_s_to_target,
async_s_to_target, async_over_sync, hand_s_to_target and sync_over_hand (null where a run did not
reach the target within its budget), and each contender's seconds to the lower `--also` targets
(`<name>_s_to_<target>`), which compare runs that stop short of the main one.
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
    evals = read_jsonl(grpo / "eval.jsonl")
    rows = read_jsonl(grpo / "metrics.jsonl")
    out, hit = summary(evals, wall, args.target)
    out["s_to"] = {t: round(warmup + e["time"], 1) if e else None for t, e in first_hits(evals, args.also).items()}
    out |= {"steps": len(rows), "s_per_step": round(json.loads((grpo / "phase.json").read_text())["seconds"] / max(len(rows), 1), 4)}
    if hit is not None:
        # Version v was trained on the groups of steps 0 .. v-1.
        out["s_to_target"] = round(warmup + hit["time"], 1)
        out["samples_to_target"] = sum(r["groups"] for r in rows if r["step"] < hit["version"])
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def first_hits(evals: list[dict], targets: list[float]) -> dict[float, dict | None]:
    return {t: next((e for e in evals if e["eval_reward"] >= t), None) for t in targets}


def summary(evals: list[dict], wall: float, target: float) -> tuple[dict, dict | None]:
    """What every contender reports from its greedy evaluations, and the first one at the target."""
    hit = first_hits(evals, [target])[target]
    return {"wall_s": round(wall, 1), "best_eval": max(e["eval_reward"] for e in evals),
            "last_eval": evals[-1]["eval_reward"], "s_to_target": None, "samples_to_target": None}, hit


def run_hand(run_dir: Path, args: argparse.Namespace) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    evals_file = run_dir / "eval.jsonl"
    started = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "tools/hand_grpo.py"), f"--seed={args.seed}",
                           f"--warmup-steps={args.warmup_steps}", f"--grpo-seconds={args.grpo_seconds}",
                           f"--eval-every={args.eval_every}", f"--out={evals_file}"],
                          check=True, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - started
    last = json.loads(done.stdout.strip().splitlines()[-1])
    evals = read_jsonl(evals_file)
    out, hit = summary(evals, wall, args.target)
    out["s_to"] = {t: e["time"] if e else None for t, e in first_hits(evals, args.also).items()}
    out |= {"steps": last["grpo_steps"], "s_per_step": last["grpo_s_per_step"]}
    if hit is not None:
        out["s_to_target"], out["samples_to_target"] = hit["time"], hit["samples"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=650)
    parser.add_argument("--grpo-seconds", type=float, default=250)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--also", type=lambda v: [float(x) for x in v.split(",") if x], default=[0.7, 0.8],
                        help="lower eval targets to report seconds to, comma-separated")
    parser.add_argument("--only", default="hand,sync,async", help="comma-separated subset to run")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            if name == "hand":
                results[name] = run_hand(Path(tmp) / name, args)
            else:
                results[name] = run(PIPELINES[name], Path(tmp) / name, args)
            r = results[name]
            print(f"{name:>5}: {r['steps']} GRPO steps ({r['s_per_step']} s each), best eval {r['best_eval']:.3f}, "
                  f"last {r['last_eval']:.3f}; to eval >= {args.target}: {r['s_to_target']} s, "
                  f"{r['samples_to_target']} samples (wall {r['wall_s']} s); "
                  + ", ".join(f"to {t}: {v} s" for t, v in r["s_to"].items()), flush=True)

    def to_target(name: str) -> float | None:
        return results.get(name, {}).get("s_to_target")

    def ratio(a: str, b: str) -> float | None:
        return round(to_target(a) / to_target(b), 3) if to_target(a) and to_target(b) else None

    print(f"time to target: async / sync {ratio('async', 'sync')}, sync / hand {ratio('sync', 'hand')}")
    print(json.dumps({"sync_s_to_target": to_target("sync"), "async_s_to_target": to_target("async"),
                      "async_over_sync": ratio("async", "sync"), "hand_s_to_target": to_target("hand"),
                      "sync_over_hand": ratio("sync", "hand"),
                      **{f"{n}_best_eval": round(r["best_eval"], 4) for n, r in results.items()},
                      **{f"{n}_s_per_step": r["s_per_step"] for n, r in results.items()},
                      **{f"{n}_samples_to_target": r["samples_to_target"] for n, r in results.items()},
                      **{f"{n}_s_to_{t}": v for n, r in results.items() for t, v in r["s_to"].items()},
                      "seed": args.seed, "target": args.target}))


if __name__ == "__main__":
    main()
