"""End to end: the quickstart, synchronous and asynchronous, and the same recipe as a hand-written loop.

    python tools/bench_e2e.py [--seeds 0,1,2] [--warmup-steps 650] [--grpo-seconds S | --grpo-steps N] [--target 0.9]
                              [--also 0.7,0.8] [--only hand,sync,async] [--full] [--threads N]
                              [--warmups DIR [--grpo-steps N]] [--async-set KEY=VALUE ...] [--sync-set ...]
                              [--runs DIR] [--heldout [--heldout-set plan_target]]

For each seed, runs `tools/hand_grpo.py`, `pipelines/quickstart.yaml` and
`pipelines/quickstart_async.yaml` one after the other (never together: they would share the two
cores) with the same seed and budget, and reads each one's greedy evaluations: wall time from the
warm-up's start to the first eval reward >= target, samples trained on until then, the median
seconds of a GRPO step and the best eval reward. A run is stopped once it reaches the target
(SIGINT: flowrl checkpoints and exits; `--full` runs every budget out). One seed cannot tell
10% apart here (steps to 0.9 varied 205-480 between runs of one setting), so the summary is per
seed plus the median over seeds, a run that missed the target counting as slower than any that
reached it. `--threads N` gives the plain loop and the
pipelines' engines N torch threads each (default: each one's own setting, 2), e.g. 1 on a machine
other work keeps busy, where two threads per process spend their time waiting for each other.
`--warmups DIR` starts both pipelines' GRPO phase from the same per-seed warm-up (DIR/seed-N, made
once by the sync pipeline's warm-up phase and reused by later runs): the pipelines' own warm-ups
differ in length and, async, in which samples they train on, so this compares the GRPO phases alone
(times then count from the GRPO phase's start; the plain loop is not run). `--async-set KEY=VALUE`
(repeatable) overrides the async pipeline, to compare a variant against sync (`--sync-set` the sync
one). `--grpo-steps N` (with `--warmups`) runs each GRPO phase for N steps instead of seconds, run
out in full: the per-step view, `mean_eval` (the mean of a run's greedy evals, every `--eval-every`
steps: the area under its learning curve) compares variants with less noise than the first step at
the target. `--runs DIR` keeps the run folders (`<name>-<seed>`: tools/bench_plan_target.py reads
them); `--heldout --heldout-set plan_target` runs the held-out seeds of plan's time-to-target
claim (tools/heldout.py), not the quickstart's. The last line is one JSON object: `<name>_mean_eval` (over seeds) and, with both sync
and async, `mean_eval_ratio` (async's over sync's), sync_s_to_target, async_s_to_target (medians; null
where the median run missed), async_over_sync (their ratio), async_wins (seeds where async
reached the target first), hand_s_to_target, sync_over_hand, and per contender the per-seed figures
(`<name>_<figure>_by_seed`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heldout  # noqa: E402
import results_file  # noqa: E402

from flowrl.records import RunDir, as_dicts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = {"sync": "pipelines/quickstart.yaml", "async": "pipelines/quickstart_async.yaml"}


def read_jsonl(path: Path) -> list[dict]:
    """eval.jsonl's or metrics.jsonl's rows (RunDir; none while the file is not written yet)."""
    reader = {"eval.jsonl": RunDir.evals, "metrics.jsonl": RunDir.metrics}[path.name]
    return as_dicts(reader(RunDir(path.parent)))


def first_hit(evals: list[dict], target: float) -> dict | None:
    return next((e for e in evals if e["eval_reward"] >= target), None)


def supervise(command: list[str], evals_file: Path, args: argparse.Namespace, interrupt: int) -> float:
    """Run `command`; stop it with `interrupt` once `evals_file` shows the target. Returns wall seconds."""
    started = time.time()
    stopped = False
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: a full pipe would block the run
        # stdout too: a run that fails says why there (`--quiet` leaves nothing else on it)
        process = subprocess.Popen(command, cwd=ROOT, stdout=stderr, stderr=stderr, text=True)
        while process.poll() is None:
            time.sleep(1.0)
            if not args.full and first_hit(read_jsonl(evals_file), args.target):
                process.send_signal(interrupt)
                stopped = True
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                break
        # Stopped at the target, `flowrl run` exits 1 (resumable), the plain loop dies of the signal,
        # and a run that outlived its 120 s to stop was killed: all fine, the target was reached.
        if process.wait() != 0 and not (stopped and process.returncode in (1, -interrupt, -signal.SIGKILL)):
            stderr.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{stderr.read()[-3000:]}")
    return time.time() - started


def summary(evals: list[dict], warmup: float, wall: float, args: argparse.Namespace) -> dict:
    """What every contender reports from its greedy evaluations (times from the warm-up's start)."""
    hits = {t: first_hit(evals, t) for t in [*args.also, args.target]}
    hit = hits[args.target]
    return {"wall_s": round(wall, 1), "best_eval": round(max((e["eval_reward"] for e in evals), default=0.0), 4),
            "s_to_target": round(warmup + hit["time"], 1) if hit else None,
            "mean_eval": round(statistics.mean(e["eval_reward"] for e in evals), 4) if evals else None,
            "s_to": {t: round(warmup + e["time"], 1) if e else None for t, e in hits.items() if t != args.target}}


def run_root(folder: str | None) -> contextlib.AbstractContextManager[str]:
    """Where the runs go: `--runs DIR`, kept for `flowrl plan` and tools/bench_plan_target.py to read
    (refused unless empty: a run folder already there would be resumed, not run afresh), else a
    temporary folder removed at the end."""
    if folder is None:
        return tempfile.TemporaryDirectory()
    path = Path(folder)
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"--runs {folder}: not empty; name an empty or new folder")
    path.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(path))


def warmup_policy(seed: int, args: argparse.Namespace) -> Path:
    """The seed's warm-up policy under `--warmups` (an HF folder), made by the sync pipeline's warm-up
    phase (and one GRPO step) the first time."""
    run_dir = Path(args.warmups) / f"seed-{seed}"
    export = run_dir / "phases/0-warmup/export/learner"
    if not (export / "config.json").exists():
        subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / PIPELINES["sync"]), f"run.seed={seed}",
                        f"phases.0.steps={args.warmup_steps}", "phases.1.steps=1", "--run-dir", str(run_dir),
                        "--quiet"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return export


def grpo_phase(pipeline: str, seconds: float | None, steps: int | None = None) -> str:
    """The pipeline's last (GRPO) phase alone, its length set to `steps` if given, else `seconds` if
    given, else the pipeline's own, as a `phases=` value."""
    import yaml

    phase = yaml.safe_load((ROOT / pipeline).read_text())["phases"][-1]
    if steps or seconds:
        phase.pop("steps", None)
        phase.pop("seconds", None)
    return json.dumps([phase | ({"steps": steps} if steps else {"seconds": seconds} if seconds else {})])


def budget_overrides(args: argparse.Namespace) -> list[str]:
    """The GRPO phase's (`phases.1`) length from the command line; none: the pipeline's own."""
    if args.grpo_steps:
        return ["phases.1.seconds=null", f"phases.1.steps={args.grpo_steps}"]
    return ["phases.1.steps=null", f"phases.1.seconds={args.grpo_seconds}"] if args.grpo_seconds else []


def mean_eval_summary(results: dict[str, list[dict]]) -> dict[str, float]:
    """`<name>_mean_eval` (a run's mean greedy eval, averaged over seeds; a run without evals
    counts 0) per contender, and `mean_eval_ratio`, async's over sync's, where both ran."""
    out = {f"{n}_mean_eval": round(statistics.mean(r["mean_eval"] or 0.0 for r in rs), 4)
           for n, rs in results.items() if rs}
    if out.get("sync_mean_eval") and "async_mean_eval" in out:
        out["mean_eval_ratio"] = round(out["async_mean_eval"] / out["sync_mean_eval"], 3)
    return out


def run_flowrl(pipeline: str, run_dir: Path, seed: int, args: argparse.Namespace, extra: list[str]) -> dict:
    overrides = [f"run.seed={seed}", f"data.eval.every={args.eval_every}", *extra]
    if args.warmups:
        overrides += [f"model.path={warmup_policy(seed, args)}", f"phases={grpo_phase(pipeline, args.grpo_seconds, args.grpo_steps)}"]
    else:
        overrides += [f"phases.0.steps={args.warmup_steps}", *budget_overrides(args)]
    if args.threads:
        overrides.append(f"nodes.rollout.engine.threads={args.threads}")
    grpo = run_dir / ("phases/0-grpo" if args.warmups else "phases/1-grpo")
    wall = supervise([sys.executable, "-m", "flowrl.cli", "run", str(ROOT / pipeline), *overrides,
                      "--run-dir", str(run_dir), "--quiet"], grpo / "eval.jsonl", args, signal.SIGINT)
    warmup = 0.0 if args.warmups else RunDir(run_dir / "phases/0-warmup").phase_done().seconds
    evals, rows = read_jsonl(grpo / "eval.jsonl"), read_jsonl(grpo / "metrics.jsonl")
    out = summary(evals, warmup, wall, args) | {"warmup_s": round(warmup, 1), "steps": len(rows)}
    # The median step: the first one also sets up the phase (engine, trainer, its process).
    out["s_per_step"] = round(statistics.median(r["step_seconds"] for r in rows[1:]), 4) if len(rows) > 1 else None
    hit = first_hit(evals, args.target)
    # Version v was trained on the groups of steps 0 .. v-1.
    out["samples_to_target"] = sum(r["groups"] for r in rows if r["step"] < hit["version"]) if hit else None
    out["steps_to_target"] = hit["version"] if hit else None  # version v: v GRPO steps taken
    return out


def run_hand(run_dir: Path, seed: int, args: argparse.Namespace) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    evals_file = run_dir / "eval.jsonl"
    wall = supervise([sys.executable, str(ROOT / "tools/hand_grpo.py"), f"--seed={seed}",
                      f"--warmup-steps={args.warmup_steps}", f"--grpo-seconds={args.grpo_seconds or 250}",
                      f"--eval-every={args.eval_every}", f"--out={evals_file}"]
                     + ([f"--threads={args.threads}"] if args.threads else []), evals_file, args, signal.SIGTERM)
    evals = read_jsonl(evals_file)  # the loop's times already count from the warm-up's start
    out = summary(evals, 0.0, wall, args) | {"steps": evals[-1]["step"] if evals else 0}
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(evals[1:], evals[2:], strict=False)]
    out["s_per_step"] = round(statistics.median(gaps), 4) if gaps else None  # eval time included
    hit = first_hit(evals, args.target)
    out["samples_to_target"] = hit["samples"] if hit else None
    return out


def median_time(values: list[float | None]) -> float | None:
    """Median seconds over seeds, a miss counting as slower than every hit; None if that median is a miss."""
    ranked = sorted(values, key=lambda v: (v is None, v or 0.0))
    middle = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
    return None if not middle or None in middle else round(sum(middle) / len(middle), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",") if x],
                        help="comma-separated (default 0,1,2; with --heldout all of the held-out seeds)")
    parser.add_argument("--warmup-steps", type=int, default=650)
    parser.add_argument("--grpo-seconds", type=float, help="GRPO phases of this many seconds (default: the pipeline's own)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--also", type=lambda v: [float(x) for x in v.split(",") if x], default=[0.7, 0.8],
                        help="lower eval targets to report seconds to, comma-separated")
    parser.add_argument("--only", default="hand,sync,async", help="comma-separated subset to run")
    parser.add_argument("--full", action="store_true", help="run every budget out instead of stopping at the target")
    parser.add_argument("--threads", type=int, help="torch threads of the plain loop and of the pipelines' engines")
    parser.add_argument("--warmups", help="folder of per-seed warm-ups (made once): run the GRPO phases alone from them")
    parser.add_argument("--runs", help="keep the run folders here (<name>-<seed>; default: removed at the end)")
    parser.add_argument("--grpo-steps", type=int, help="GRPO phases of this many steps, run out in full")
    parser.add_argument("--async-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the async pipeline (repeatable)")
    parser.add_argument("--sync-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the sync pipeline (repeatable)")
    parser.add_argument("--heldout", action="store_true",
                        help="measure the committed recipe on the held-out seeds (tools/heldout.py)")
    heldout.add_set_flag(parser, "bench_e2e")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    names = args.only.split(",")
    args.bench = heldout.bench_of(parser, args, "bench_e2e")
    args.seeds = heldout.seeds_for(args.bench, args.heldout, args.seeds) or [0, 1, 2]
    if args.heldout and (args.async_set or args.sync_set):
        parser.error("--heldout measures the pipelines as committed: no --sync-set / --async-set")
    if args.warmups and "hand" in names:
        parser.error("--warmups compares the pipelines' GRPO phases: use --only sync,async")
    if args.grpo_steps and "hand" in names:
        parser.error("--grpo-steps: the plain loop runs for seconds; use --only sync,async")
    if args.grpo_steps and args.grpo_seconds:
        parser.error("give --grpo-steps or --grpo-seconds, not both")
    args.full = args.full or bool(args.grpo_steps)  # a fixed number of steps is run out
    results: dict[str, list[dict]] = {n: [] for n in names}
    with run_root(args.runs) as tmp:
        for seed in args.seeds:
            for name in names:
                run_dir = Path(tmp) / f"{name}-{seed}"
                extra = {"async": args.async_set, "sync": args.sync_set}.get(name, [])
                r = run_hand(run_dir, seed, args) if name == "hand" else run_flowrl(PIPELINES[name], run_dir, seed, args, extra)
                results[name].append(r | {"name": name})
                print(f"seed {seed} {name:>5}: to eval >= {args.target}: {r['s_to_target']} s, "
                      f"{r.get('steps_to_target')} steps, {r['samples_to_target']} samples; {r['steps']} GRPO steps ({r['s_per_step']} s each), "
                      f"best eval {r['best_eval']:.3f}, mean eval {r['mean_eval']}" + (f", warm-up {r['warmup_s']} s" if r.get("warmup_s") else "")
                      + "; " + ", ".join(f"to {t}: {v} s" for t, v in r["s_to"].items()), flush=True)
    report(results, names, args)


def reached(runs: list[dict], seeds: list[int]) -> dict:
    """How many seeds reached the target, the median and worst steps and seconds to it over those
    that did (the median counting a miss as slower than every hit), and each miss's best eval."""
    name = runs[0]["name"]
    hits = [r for r in runs if r["s_to_target"] is not None]
    steps = [r.get("steps_to_target") for r in runs]

    def worst(key: str) -> float | None:
        return max(r[key] for r in hits) if hits and all(r.get(key) is not None for r in hits) else None

    return {f"{name}_reached": len(hits), f"{name}_steps_to_target_median": median_time(steps),
            f"{name}_steps_to_target_worst": worst("steps_to_target"),
            f"{name}_s_to_target_median": median_time([r["s_to_target"] for r in runs]),
            f"{name}_s_to_target_worst": worst("s_to_target"),
            f"{name}_missed": {str(s): r["best_eval"] for s, r in zip(seeds, runs, strict=True) if r["s_to_target"] is None}}


def report(results: dict[str, list[dict]], names: list[str], args: argparse.Namespace) -> None:
    """The summary over seeds, and the last line's JSON object (module docs)."""

    def times(name: str) -> list[float | None]:
        return [r["s_to_target"] for r in results.get(name, [])]

    medians = {n: median_time(times(n)) for n in names}

    def ratio(a: str, b: str) -> float | None:
        return round(medians[a] / medians[b], 3) if medians.get(a) and medians.get(b) else None

    wins = None
    if "sync" in results and "async" in results:
        wins = sum(a is not None and (s is None or a < s) for a, s in zip(times("async"), times("sync"), strict=True))
    print(f"median over seeds {args.seeds}: " + ", ".join(f"{n} {medians[n]} s" for n in names)
          + f"; async / sync {ratio('async', 'sync')} (async first on {wins} of {len(args.seeds)} seeds), "
          f"sync / hand {ratio('sync', 'hand')}")
    mean_evals = mean_eval_summary(results)
    print("mean eval over seeds (learning-curve area): " + ", ".join(
        f"{k[:-10]} {v}" for k, v in mean_evals.items() if k.endswith("_mean_eval"))
        + (f"; async / sync {mean_evals['mean_eval_ratio']}" if "mean_eval_ratio" in mean_evals else ""))
    reach = {n: reached(rs, args.seeds) for n, rs in results.items() if rs}
    for n, r in reach.items():
        print(f"{n}: reached {args.target} on {r[n + '_reached']} of {len(args.seeds)} seeds; steps to it median "
              f"{r[n + '_steps_to_target_median']}, worst {r[n + '_steps_to_target_worst']}; seconds median "
              f"{r[n + '_s_to_target_median']}, worst {r[n + '_s_to_target_worst']}; missed {r[n + '_missed']}")
    spread = intervals(results)
    headline = "; ".join(f"{n} reached {args.target} on {r[n + '_reached']} of {len(args.seeds)} "
                         f"(95% {spread[n + '_reached_rate']['ci95']}), median {spread[n + '_steps_to_target_spread']['median']} "
                         f"steps (95% {spread[n + '_steps_to_target_spread']['ci95']})" for n, r in reach.items())
    result = {"headline": headline, **mean_evals, **{k: v for r in reach.values() for k, v in r.items()}, **spread,
              "protocol": heldout.stamp(args.bench, args.heldout, args.seeds),
              "sync_s_to_target": medians.get("sync"), "async_s_to_target": medians.get("async"),
              "async_over_sync": ratio("async", "sync"), "async_wins": wins,
              "hand_s_to_target": medians.get("hand"), "sync_over_hand": ratio("sync", "hand"),
              **{f"{n}_{k}_by_seed": [r[k] for r in rs] for n, rs in results.items()
                 for k in ("s_to_target", "steps_to_target", "samples_to_target", "s_per_step", "best_eval",
                           "mean_eval", "warmup_s")
                 if all(k in r for r in rs)},
              **{f"{n}_s_to_{t}_by_seed": [r["s_to"][t] for r in rs] for n, rs in results.items()
                 for t in args.also},
              "seeds": args.seeds, "target": args.target}
    heldout.record(result)
    results_file.emit(args.record, "bench_e2e", result)


def intervals(results: dict[str, list[dict]]) -> dict:
    """Each contender's success rate with its Wilson interval and its medians with quartiles and a bootstrap
    interval; with both pipelines, async's time and steps to the target over sync's, with a paired one."""
    out: dict = {}
    for n, rs in results.items():
        if rs:
            out[f"{n}_reached_rate"] = heldout.rate(sum(r["s_to_target"] is not None for r in rs), len(rs))
            out[f"{n}_steps_to_target_spread"] = heldout.median_spread([r.get("steps_to_target") for r in rs])
            out[f"{n}_s_to_target_spread"] = heldout.median_spread([r["s_to_target"] for r in rs])
    if results.get("sync") and results.get("async"):
        for key in ("s_to_target", "steps_to_target"):
            out[f"async_over_sync_{key}"] = heldout.median_ratio([r.get(key) for r in results["async"]],
                                                                 [r.get(key) for r in results["sync"]])
    return out


if __name__ == "__main__":
    main()
