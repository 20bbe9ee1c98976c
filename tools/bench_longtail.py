"""Async where it pays: sync and async GRPO on the long-tail agentic task, at several tail settings.

    python tools/bench_longtail.py --warmups DIR [--runs DIR] [--seeds 0,1,2,3,4] [--tails 0,0.5,1] [--target 0.4]
                                   [--grpo-seconds 240] [--eval-every 5] [--async-set KEY=VALUE ...]
                                   [--sync-set KEY=VALUE ...] [--heldout [--heldout-set plan_target]]

For each seed and tail setting (`data.options.tail` of builtin:longtail_digits, 0 uniform .. 1 heavy:
operators/tasks/longtail.py), runs the GRPO phase of `pipelines/longtail_sync.yaml` and
`pipelines/longtail_async.yaml` one after the other (never together: they would share the cores),
both from the same per-seed warm-up (DIR/seed-N: the quickstart's copy warm-up, made once by
tools/bench_e2e.py's `warmup_policy` and shared with `bench_e2e.py --warmups DIR`). Each run stops
once its greedy eval reaches `--target` (or after `--grpo-seconds`) and reports wall seconds to the
target (from the phase's start, setup included, as eval.jsonl's `time`), samples (groups) trained
on until then, samples dropped as stale on the way, the median step time and
`episode_p99_over_median`: the p99 / median of its samples' generate spans in trace.json (one span
per sample: its group of episodes, the engine's queueing included).

The last line is one JSON object: per tail setting (`by_tail`), `wall_speedup` (sync's median
seconds to the target over async's), `sample_ratio` (async's median samples to the target over
sync's), `async_wins` (seeds where async got there first) and the per-seed figures; and at the top
level the heaviest setting's `wall_speedup`, `sample_ratio` and `async_wins`. A run that missed the
target counts as slower (and hungrier) than any that reached it; a median that is a miss is null.
`--heldout --heldout-set plan_target` runs the held-out seeds of plan's time-to-target check on the
long-tail pair (tools/heldout.py's `HELDOUT["bench_longtail:plan_target"]`; `--runs DIR` keeps the
runs for tools/bench_plan_target.py).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heldout  # noqa: E402
import results_file  # noqa: E402
from bench_e2e import first_hit, grpo_phase, median_time, read_jsonl, run_root, supervise, warmup_policy  # noqa: E402

from flowrl.records import RecordError, RunDir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = {"sync": "pipelines/longtail_sync.yaml", "async": "pipelines/longtail_async.yaml"}


def episode_tail(trace: Path) -> float | None:
    """p99 / median of the generate spans (one per sample: its group's episodes) in a Chrome trace."""
    if not trace.exists():
        return None
    try:
        events = RunDir(trace.parent).trace()  # a trace cut off by the stop reads up to the cut
    except RecordError:  # damaged: no figure rather than a wrong one
        return None
    spans = sorted(e.dur_us for e in events if e.name == "generate" and e.dur_us)
    if len(spans) < 20:
        return None
    return round(spans[min(len(spans) - 1, int(0.99 * len(spans)))] / statistics.median(spans), 2)


def run_one(name: str, run_dir: Path, seed: int, tail: float, args: argparse.Namespace) -> dict:
    pipeline = PIPELINES[name]
    overrides = [f"run.seed={seed}", f"data.eval.every={args.eval_every}", f"data.options.tail={tail}",
                 f"model.path={warmup_policy(seed, args)}", f"phases={grpo_phase(pipeline, args.grpo_seconds)}",
                 *{"async": args.async_set, "sync": args.sync_set}[name]]
    grpo = run_dir / "phases/0-grpo"
    wall = supervise([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / pipeline), *overrides,
                      "--run-dir", str(run_dir), "--quiet"], grpo / "eval.jsonl", args, signal.SIGINT)
    evals, rows = read_jsonl(grpo / "eval.jsonl"), read_jsonl(grpo / "metrics.jsonl")
    hit = first_hit(evals, args.target)
    before = [r for r in rows if hit and r["step"] < hit["version"]]  # version v: trained on steps 0 .. v-1
    return {"wall_s": round(wall, 1), "steps": len(rows),
            "s_to_target": round(hit["time"], 1) if hit else None,
            "samples_to_target": sum(r["groups"] for r in before) if hit else None,
            "dropped_to_target": before[-1]["dropped_total"] if before else (0 if hit else None),
            "steps_to_target": hit["version"] if hit else None,
            "s_per_step": round(statistics.median(r["step_seconds"] for r in rows[1:]), 3) if len(rows) > 1 else None,
            "best_eval": round(max((e["eval_reward"] for e in evals), default=0.0), 4),
            "episode_p99_over_median": episode_tail(grpo / "trace.json")}


def failed_run() -> dict:
    """A run that failed (its message printed): a miss in every figure."""
    return {"wall_s": None, "steps": 0, "s_to_target": None, "samples_to_target": None, "dropped_to_target": None,
            "steps_to_target": None, "s_per_step": None, "best_eval": 0.0, "episode_p99_over_median": None,
            "failed": True}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarise(runs: dict[str, list[dict]]) -> dict:
    """One tail setting's figures over seeds (module docs)."""
    med = {n: {k: median_time([r[k] for r in rs]) for k in ("s_to_target", "samples_to_target")}
           for n, rs in runs.items()}
    sync_s, async_s = [r["s_to_target"] for r in runs["sync"]], [r["s_to_target"] for r in runs["async"]]
    wins = sum(a is not None and (s is None or a < s) for a, s in zip(async_s, sync_s, strict=True))
    sync_n, async_n = [r["samples_to_target"] for r in runs["sync"]], [r["samples_to_target"] for r in runs["async"]]
    return {"wall_speedup": ratio(med["sync"]["s_to_target"], med["async"]["s_to_target"]),
            "sample_ratio": ratio(med["async"]["samples_to_target"], med["sync"]["samples_to_target"]),
            # Paired bootstrap intervals (tools/heldout.py): one eval interval is not the uncertainty.
            "wall_speedup_ci95": heldout.median_ratio(sync_s, async_s)["ci95"],
            "sample_ratio_ci95": heldout.median_ratio(async_n, sync_n)["ci95"],
            "reached": {n: heldout.rate(sum(r["s_to_target"] is not None for r in rs), len(rs)) for n, rs in runs.items()},
            "async_wins": wins, "seeds": len(sync_s),
            **{f"{n}_median_{k}": v for n, m in med.items() for k, v in m.items()},
            "failed_runs": sum(r.get("failed", False) for rs in runs.values() for r in rs),
            **{f"{n}_{k}_by_seed": [r[k] for r in rs] for n, rs in runs.items() for k in rs[0] if k != "failed"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmups", required=True, help="folder of per-seed warm-ups (made once, shared with bench_e2e)")
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",") if x],
                        help="comma-separated (default 0-4; with --heldout the held-out seeds)")
    parser.add_argument("--tails", type=lambda v: [float(x) for x in v.split(",") if x], default=[0.0, 0.5, 1.0])
    parser.add_argument("--target", type=float, default=0.4)
    parser.add_argument("--grpo-seconds", type=float, default=240)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--runs", help="keep the run folders here (<name>-<tail>-<seed>; default: removed at the end)")
    parser.add_argument("--warmup-steps", type=int, default=650, help="steps of a warm-up made here (bench_e2e's)")
    parser.add_argument("--async-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sync-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--heldout", action="store_true",
                        help="measure the committed pipelines on the held-out seeds (tools/heldout.py)")
    heldout.add_set_flag(parser, "bench_longtail")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    if args.heldout and (args.async_set or args.sync_set):
        parser.error("--heldout measures the pipelines as committed: no --sync-set / --async-set")
    args.bench = heldout.bench_of(parser, args, "bench_longtail")
    args.seeds = heldout.seeds_for(args.bench, args.heldout, args.seeds) or [0, 1, 2, 3, 4]
    args.full = False  # bench_e2e.supervise: stop at the target
    results: dict[float, dict[str, list[dict]]] = {t: {"sync": [], "async": []} for t in args.tails}
    with run_root(args.runs) as tmp:
        for seed in args.seeds:
            for tail in args.tails:
                for name in ("sync", "async"):
                    try:
                        r = run_one(name, Path(tmp) / f"{name}-{tail}-{seed}", seed, tail, args)
                    except RuntimeError as e:  # reported, and counted as a miss rather than ending the benchmark
                        print(f"seed {seed} tail {tail} {name}: FAILED: {str(e)[-1500:]}", flush=True)
                        r = failed_run()
                    results[tail][name].append(r)
                    print(f"seed {seed} tail {tail} {name:>5}: to eval >= {args.target}: {r['s_to_target']} s, "
                          f"{r['steps_to_target']} steps, {r['samples_to_target']} samples "
                          f"({r['dropped_to_target']} dropped); {r['steps']} steps ({r['s_per_step']} s each), "
                          f"best eval {r['best_eval']}, episode p99/median {r['episode_p99_over_median']}", flush=True)
    by_tail = {str(t): summarise(runs) for t, runs in results.items()}
    for t, s in by_tail.items():
        print(f"tail {t}: sync {s['sync_median_s_to_target']} s / async {s['async_median_s_to_target']} s -> "
              f"wall_speedup {s['wall_speedup']} (async first on {s['async_wins']} of {s['seeds']}); samples "
              f"sync {s['sync_median_samples_to_target']} / async {s['async_median_samples_to_target']} -> "
              f"sample_ratio {s['sample_ratio']}")
    heaviest = by_tail[str(max(args.tails))]
    result = {"headline": f"tail {max(args.tails)}: wall_speedup {heaviest['wall_speedup']} (95% "
                          f"{heaviest['wall_speedup_ci95']}), sample_ratio {heaviest['sample_ratio']} (95% "
                          f"{heaviest['sample_ratio_ci95']}), async first on {heaviest['async_wins']} of {len(args.seeds)}",
              "wall_speedup": heaviest["wall_speedup"], "wall_speedup_ci95": heaviest["wall_speedup_ci95"],
              "sample_ratio": heaviest["sample_ratio"], "sample_ratio_ci95": heaviest["sample_ratio_ci95"],
              "async_wins": heaviest["async_wins"], "heaviest_tail": max(args.tails), "target": args.target,
              "protocol": heldout.stamp(args.bench, args.heldout, args.seeds), "seeds": args.seeds,
              "by_tail": by_tail}
    heldout.record(result)
    results_file.emit(args.record, "bench_longtail", result)


if __name__ == "__main__":
    main()
