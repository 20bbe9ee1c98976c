"""Sync against async where the tail is a real tool: pipelines/smollm2_code.yaml and its one-step-off
twin pipelines/smollm2_code_async.yaml, one after the other on each seed (never together: they
would share the cores), on SmolLM2-135M-Instruct writing Python that the sandbox service runs.

    python tools/bench_code_async.py [--seeds 0] [--target 0.9] [--steps 6] [--eval-every 1]
                                     [--eval-samples 32] [--out DIR] [--report-only]
    python tools/bench_code_async.py --heldout --record NAME   # the claim, on its held-out seeds

Both arms run `--steps` steps (the recipe's 6) with the same evaluation schedule (greedy,
`--eval-samples` problems every `--eval-every` versions); they do not stop at the target, so that
plan has the steps it fits on (4 at least) and throughput more than one. Per arm: wall seconds to the
target (the first evaluation at or above it, from the run's start: setup and evaluations included),
samples (groups) trained on before it, throughput (trained groups per second of the steps after the
first, which also pays for setup and the first evaluation), the
tool service's latency per call (`queue_s` waiting for a worker under the burst of a step's
episodes, `start_s` the sandboxed process's start, `run_s` the code's own time, `seconds` the round
trip through the proxy: median, p90, p99, from the calls of the trained episodes' `tool_timing`),
turns per episode, staleness, and `flowrl plan`'s prediction from the sync run of the async
configuration (PLAN_CHANGES: the async pipeline's differences that plan simulates).

The last line is one JSON object: the triple `wall_speedup` (sync's median seconds to the target
over async's), `sample_ratio` (async's median samples over sync's) and `throughput_ratio` (async's
median groups/s over sync's), each with a paired bootstrap 95% interval over the seeds
(tools/heldout.py); the pooled latency quantiles per arm; plan's predicted wall speedup beside the
measured one; the per-seed figures. A run that missed the target counts as slower than any that
reached it. Each arm's figures are written to OUT/ARM-SEED.json when it ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heldout  # noqa: E402
import results_file  # noqa: E402
from bench_smollm2 import measured_run  # noqa: E402

from flowrl.records import RunDir  # noqa: E402
from flowrl_operators.tools.pool import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = "bench_code_async"
PIPELINES = {"sync": "pipelines/smollm2_code.yaml", "async": "pipelines/smollm2_code_async.yaml"}
# The async pipeline's differences from the sync one that `flowrl plan` simulates (its loss, decoupled
# PPO, changes no cost); tests/test_bench_code_async.py checks they are the pipeline's differences.
PLAN_CHANGES = ["max_staleness=1", "nodes.rollout.engine.threads=1", "nodes.rollout.partial_rollout=true",
                "nodes.learner.own_process={threads: 1}",
                # the decoupled loss's proximal forward: one more pass over each step's tokens (CostShape.passes)
                "nodes.learner.loss={kind: ppo_clip, clip_low: 0.2, clip_high: 0.28, aggregation: token_mean, "
                "decoupled: true, correction: {kind: tis, threshold: 2.0}}"]
TIMING = ("queue_s", "start_s", "run_s", "seconds")


def schedule(args: argparse.Namespace) -> list[str]:
    """The overrides both arms run with: the same steps and evaluations."""
    return [f"run.steps={args.steps}", f"data.eval.every={args.eval_every}", f"data.eval.samples={args.eval_samples}"]


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict:
    run_dir = args.out / f"{arm}-{seed}"
    command = [sys.executable, "-m", "flowrl.cli", "run", PIPELINES[arm], f"run.seed={seed}", *schedule(args),
               "--run-dir", str(run_dir), "--quiet"]
    figures = {"arm": arm, "seed": seed, **measured_run(command, args.out / f"{arm}-{seed}.log"),
               **arm_figures(run_dir, args.target)}
    if arm == "sync" and figures["exit"] == 0:
        figures["plan"] = plan_prediction(run_dir, args.target)
    (args.out / f"{arm}-{seed}.json").write_text(json.dumps(figures) + "\n")
    return figures


def arm_figures(run_dir: Path, target: float) -> dict:
    """What one run's records say: to the target, throughput, the tool's latency, turns, staleness."""
    records = RunDir(run_dir)
    evals = list(records.evals()) if records.has("eval.jsonl") else []
    rows = list(records.metrics()) if records.has("metrics.jsonl") else []
    hit = next((e for e in evals if e.eval_reward is not None and e.eval_reward >= target), None)
    calls, turns = tool_calls(records)
    steady = rows[1:]
    lags = [int(lag) for r in rows for lag, n in r.staleness.items() for _ in range(n)]
    return {"s_to_target": round(hit.time, 1) if hit else None,
            "steps_to_target": hit.version if hit else None,
            # version v trained on steps 0 .. v-1
            "samples_to_target": sum(r.groups for r in rows if r.step < hit.version) if hit else None,
            "groups_per_s": round(sum(r.groups for r in steady) / sum(r.step_seconds for r in steady), 4)
            if steady and sum(r.step_seconds for r in steady) > 0 else None,
            "steps": len(rows), "curve": [[e.version, e.eval_reward] for e in evals],
            "mean_lag": round(statistics.mean(lags), 3) if lags else None,
            "turns_per_episode": round(statistics.mean(turns), 3) if turns else None,
            "tool": {k: [c[k] for c in calls] for k in TIMING}}


def tool_calls(records: RunDir) -> tuple[list[dict], list[int]]:
    """Each tool call of the trained episodes (`tool_timing`, operators/workflows/proxy.py) and each
    episode's model calls, read once per episode: its first trajectory."""
    calls, turns = [], []
    if not records.has("rollouts/learner.bin"):
        return calls, turns
    for step in records.rollouts("learner"):
        for group in step.groups:
            for t in group.trajectories:
                if "." in t.id.rsplit("/", 1)[-1] and not t.id.endswith(".0"):
                    continue  # a later chain of the same episode carries the same calls
                calls += t.metadata.get("tool_timing", [])
                turns.append(t.metadata.get("calls", 1))
    return calls, turns


def plan_prediction(sync_run: Path, target: float) -> dict | None:
    """`flowrl plan` on the sync run: its predicted seconds to the target, as run and as the async
    pipeline (medians of its intervals), and their ratio."""
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "plan", str(sync_run), *PLAN_CHANGES, "--target", f"eval_reward={target}",
                           "--format", "json"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-500:]}
    configurations = {c["configuration"]: c for c in json.loads(proc.stdout)["target"]["configurations"]}
    as_run, changed = configurations["as run"], configurations[" ".join(PLAN_CHANGES)]
    if "seconds" not in as_run or "seconds" not in changed:
        return {"error": "plan predicted no time to the target"}
    return {"sync_s": round(as_run["seconds"][1], 1), "async_s": round(changed["seconds"][1], 1),
            "wall_speedup": round(as_run["seconds"][1] / changed["seconds"][1], 3),
            "throughput_ratio": round(changed["samples_per_s"] / as_run["samples_per_s"], 3)
            if as_run["samples_per_s"] else None}


def quantiles(values: list[float]) -> dict:
    return {"median": round(percentile(values, 0.5), 4), "p90": round(percentile(values, 0.9), 4),
            "p99": round(percentile(values, 0.99), 4), "n": len(values)}


def summarise(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The triple with its intervals, the latency quantiles pooled over seeds, plan beside the measure."""
    by = {a: {k: [r[k] for r in rs] for k in ("s_to_target", "samples_to_target", "groups_per_s")}
          for a, rs in runs.items()}
    speed = heldout.median_ratio(by["sync"]["s_to_target"], by["async"]["s_to_target"])
    samples = heldout.median_ratio(by["async"]["samples_to_target"], by["sync"]["samples_to_target"])
    # Throughput is higher-is-better: the ratio of the inverses' medians, async over sync, is sync's
    # seconds per group over async's (a run with no steps is a miss).
    spg = {a: [1 / g if g else None for g in by[a]["groups_per_s"]] for a in by}
    throughput = heldout.median_ratio(spg["sync"], spg["async"])
    predicted = [(r.get("plan") or {}).get("wall_speedup") for r in runs["sync"]]
    plan_speedup = round(statistics.median(p for p in predicted if p), 3) if any(predicted) else None
    latency = {a: {k: quantiles([v for r in rs for v in r["tool"][k]]) for k in TIMING} for a, rs in runs.items()}
    return {"headline": f"to eval_reward {args.target}: async {speed['ratio']}x sync's speed (95% {speed['ci95']}), "
                        f"{samples['ratio']}x its samples (95% {samples['ci95']}), {throughput['ratio']}x its "
                        f"throughput (95% {throughput['ci95']}); plan predicted "
                        f"{plan_speedup}x",
            "wall_speedup": speed["ratio"], "wall_speedup_ci95": speed["ci95"],
            "sample_ratio": samples["ratio"], "sample_ratio_ci95": samples["ci95"],
            "throughput_ratio": throughput["ratio"], "throughput_ratio_ci95": throughput["ci95"],
            "plan_wall_speedup": plan_speedup,
            "plan_wall_speedup_by_seed": predicted,
            "reached": {a: heldout.rate(sum(v is not None for v in by[a]["s_to_target"]), len(rs))
                        for a, rs in runs.items()},
            "latency": latency, "target": args.target,
            "schedule": schedule(args), "seeds": args.seeds,
            "by_seed": {str(s): {a: {k: v for k, v in runs[a][i].items() if k != "tool"} for a in runs}
                        for i, s in enumerate(args.seeds)}}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",") if x],
                        help="comma-separated (default 0; with --heldout the held-out seeds)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=6, help="each arm's steps: one that has not reached the target by then missed it")
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench_code_async")
    parser.add_argument("--report-only", action="store_true", help="reprint OUT/ARM-SEED.json, run nothing")
    parser.add_argument("--replan", action="store_true", help="with --report-only: plan's prediction from each "
                        "sync run made anew by this tree's plan (the saved one is the measuring commit's)")
    parser.add_argument("--heldout", action="store_true", help="the held-out seeds (tools/heldout.py), defaults as committed")
    results_file.add_record_flag(parser)
    args = parser.parse_args(argv)
    defaults = parser.parse_args([])
    changed = [k for k in ("target", "steps", "eval_every", "eval_samples") if getattr(args, k) != getattr(defaults, k)]
    if args.heldout and changed:
        raise heldout.ProtocolError(f"--heldout measures the pair as committed: no --{changed[0].replace('_', '-')}")
    args.seeds = heldout.seeds_for(BENCH, args.heldout, args.seeds) or [0]
    if args.replan and not args.report_only:
        parser.error("--replan re-plans runs already made: use it with --report-only")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    taken = [f"{a}-{s}" for s in args.seeds for a in PIPELINES if (args.out / f"{a}-{s}").exists()]
    if taken and not args.report_only:
        raise SystemExit(f"bench_code_async: {args.out} already holds {', '.join(taken)}: give a new --out, or --report-only")
    args.out.mkdir(parents=True, exist_ok=True)
    protocol = heldout.stamp(BENCH, args.heldout, args.seeds)
    runs: dict[str, list[dict]] = {a: [] for a in PIPELINES}
    for seed in args.seeds:
        for arm in PIPELINES:
            saved = args.out / f"{arm}-{seed}.json"
            r = json.loads(saved.read_text()) if args.report_only else run_arm(arm, seed, args)
            if args.replan and arm == "sync":
                r["plan"] = plan_prediction(args.out / f"{arm}-{seed}", args.target)
            runs[arm].append(r)
            print(f"seed {seed} {arm:>5}: exit {r['exit']}, to eval >= {args.target}: {r['s_to_target']} s, "
                  f"{r['samples_to_target']} samples ({r['steps_to_target']} steps); {r['groups_per_s']} groups/s, "
                  f"{r['turns_per_episode']} turns, lag {r['mean_lag']}, peak {r['peak_rss_gb']} GB; curve {r['curve']}"
                  + (f"; plan {r['plan']}" if "plan" in r else ""), flush=True)
    result = {**summarise(runs, args), "protocol": protocol}
    for arm, latency in result["latency"].items():
        print(f"{arm:>5} tool latency: " + "; ".join(f"{k} {q['median']}/{q['p90']}/{q['p99']}" for k, q in latency.items())
              + " (median/p90/p99 s)")
    if not args.report_only:  # a reprint is not another measurement
        heldout.record(result)
    results_file.emit(args.record, BENCH, result)


if __name__ == "__main__":
    main()
