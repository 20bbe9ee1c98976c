"""A real checkpoint that learns: pipelines/smollm2_sums.yaml on several seeds, against a random-reward control.

    python tools/bench_smollm2.py [--pipeline P] [--seeds 0,1,2] [--control] [--out DIR] [--report-only] [key=value ...]
    python tools/bench_smollm2.py [--pipeline P] --heldout --control [--seeds 1000,...]   # the claim, on held-out seeds

`--pipeline` (default pipelines/smollm2_sums.yaml; also pipelines/smollm2_code.yaml, the agentic
task) names the recipe: any pipeline whose `data.eval` scores greedy answers into eval.jsonl.
Runs `flowrl run PIPELINE run.seed=S` for each seed (never two at once: they would
share the cores), measuring each run's wall time (process start to exit, model load included) and
peak resident memory (the run's process tree, from wait4), and reads its greedy evaluations of the
held-out sums (RUN_DIR/eval.jsonl): `eval_reward` (the pipeline's `last_integer`: the reply's last
integer is the sum) and each `scores` entry (`anywhere`: the sum written anywhere, which does not
reward the format alone). Per seed: the curve, the gain from the first evaluation to the last and
the gain in standard errors (Agresti-Coull's of each evaluation, combined: sqrt(se0^2 + se1^2)).

`--control` runs each seed a second time with `nodes.score.control=random` (the reward node trains
on rewards drawn from the run's own scores, independent of the answer; its evaluations still score
the truth: flowrl_operators/reward_control.py). Per seed it reports the control's gain and the gain
over the control: `over_control` (real gain minus control gain) and `last_over_control` (real last
evaluation minus control last evaluation; the same figure when both arms start from the same first
evaluation, as greedy answers of the same checkpoint do). A seed passes when its figure (the gain
over the control under `--control`, else the gain) is >= 0.15 and > 3 standard errors (the last
evaluations' SEs combined) within 30 minutes, peak RSS under 4 GB.

Over seeds, every figure is a mean with a 95% t-interval (mean +- t(0.975, n-1) s / sqrt(n)): with
3-5 seeds a bootstrap over seeds has too few distinct resamples and is too narrow. The interval is
over training seeds; all seeds evaluate the same 256 sums, so it does not cover the choice of sums
(the per-seed standard errors do). The held-out protocol (tools/heldout.py): `--heldout` runs the
benchmark's held-out seeds (1000-1004) on a committed tree with no key=value overrides, and needs
`--control` (the claim's bar is the gain over the control); a screening run refuses those seeds.

Each arm's figures are written to OUT/seed-S.json (real) and OUT/control-S.json as soon as it ends,
and `--report-only` reprints them from there (adding nothing to the ledger). key=value overrides go
to every run. The last line is one JSON object: `headline`, `pipeline`, `passed` (seeds passing /
seeds run), `bar`, `interval`, `gain`, `control_gain`, `over_control`, `last_over_control` (per
score: `mean`, `ci95`, `n`, `by_seed`; the control's figures null without `--control`), `protocol`,
`seeds` and `by_seed` (per seed: `real`, `control`, `over_control`, `passes`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heldout  # noqa: E402
import results_file  # noqa: E402

from flowrl.records import RunDir, as_dicts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = "pipelines/smollm2_sums.yaml"
BENCH = "bench_smollm2"
MIN_GAIN, MIN_SE, MAX_SECONDS, MAX_RSS_GB = 0.15, 3.0, 1800.0, 4.0
CONTROL = "nodes.score.control=random"
MAIN = "eval_reward"  # the pipeline's own eval reward; the `also` scores sit beside it
# t(0.975, df) for df = 1..30; past 30 a Cornish-Fisher expansion around the normal quantile.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
INTERVAL = "95% t-interval of the mean over seeds (n-1 degrees of freedom)"


def arm_name(arm: str, seed: int) -> str:
    """The real arm keeps the name earlier runs of this tool wrote (seed-S), so --report-only reads them."""
    return f"seed-{seed}" if arm == "real" else f"control-{seed}"


def bench_name(pipeline: str) -> str:
    """The protocol's name of this benchmark on `pipeline`: the default pipeline keeps the plain name
    its earlier ledger lines carry; another is `bench_smollm2:STEM` (its own screening history)."""
    return BENCH if pipeline == PIPELINE else f"{BENCH}:{Path(pipeline).stem}"


def run_arm(seed: int, arm: str, out: Path, overrides: list[str], pipeline: str = PIPELINE) -> dict:
    """One run of the pipeline (`arm`: real or control); its wall seconds, peak RSS (GB) of the
    whole process tree and its evaluations' figures."""
    name = arm_name(arm, seed)
    run_dir = out / name
    command = ["flowrl", "run", pipeline, f"run.seed={seed}", *overrides, *([CONTROL] if arm == "control" else []),
               "--run-dir", str(run_dir), "--quiet"]
    figures = {"seed": seed, "arm": arm, **measured_run(command, out / f"{name}.log"), "run_dir": str(run_dir)}
    figures.update(summary(run_dir))
    (out / f"{name}.json").write_text(json.dumps(figures) + "\n")
    return figures


def measured_run(command: list[str], log: Path) -> dict:
    """Run `command` (output to `log`): its `exit` code, `wall_s` and `peak_rss_gb`, the ru_maxrss
    (KiB on Linux) of the largest process it waited for: the run and its children."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"exit": os.waitstatus_to_exitcode(status), "wall_s": round(time.time() - started, 1),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2)}


def se(p: float, n: int) -> float:
    """The standard error of a mean of n 0/1 scores at rate p, Agresti-Coull's (two successes and two
    failures added): a plain sqrt(p(1-p)/n) is 0 at 0 and 1, so an evaluation that went from 0.09 to
    1.0 against a control at 0.0 would have no standard error and fail the bar it clears the most."""
    if not n:
        return 0.0
    adjusted = (p * n + 2) / (n + 4)
    return math.sqrt(adjusted * (1 - adjusted) / (n + 4))


def summary(run_dir: Path) -> dict:
    """The greedy-eval curve, the first-to-last gain in absolute terms and in standard errors, and
    each score's first, last and gain (`scores`: eval_reward and the `also` scores)."""
    evals = as_dicts(RunDir(run_dir).evals())
    if len(evals) < 2:
        return {"curve": [[e["version"], e["eval_reward"]] for e in evals], "gain": None, "gain_se": None, "scores": {}}
    first, last = evals[0], evals[-1]
    spread = math.hypot(se(first[MAIN], first["samples"]), se(last[MAIN], last["samples"]))
    gain = last[MAIN] - first[MAIN]
    steps = sum(1 for _ in RunDir(run_dir).metrics())

    def value(row: dict, name: str) -> float | None:
        return row[MAIN] if name == MAIN else (row.get("scores") or {}).get(name)

    scores = {}
    for name in [MAIN, *(last.get("scores") or {})]:
        a, b = value(first, name), value(last, name)
        if a is not None and b is not None:
            scores[name] = {"first": round(a, 4), "last": round(b, 4), "gain": round(b - a, 4)}
    return {"curve": [[e["version"], round(e[MAIN], 4)] for e in evals], "samples": last["samples"],
            "steps": steps, "gain": round(gain, 4), "se": round(spread, 4),
            "gain_se": round(gain / spread, 2) if spread > 0 else None, "scores": scores}


def compare(real: dict, control: dict | None) -> dict | None:
    """Per score, the real arm against the control of the same seed: `over_control` (gain minus the
    control's gain) and `last_over_control` (last evaluation minus the control's last); for
    eval_reward also that in standard errors (the two last evaluations' SEs combined)."""
    if control is None:
        return None
    out = {}
    for name, r in (real.get("scores") or {}).items():
        c = (control.get("scores") or {}).get(name)
        if c is None:
            continue
        out[name] = {"over_control": round(r["gain"] - c["gain"], 4),
                     "last_over_control": round(r["last"] - c["last"], 4)}
    if MAIN in out and real.get("samples") and control.get("samples"):
        spread = math.hypot(se(real["scores"][MAIN]["last"], real["samples"]),
                            se(control["scores"][MAIN]["last"], control["samples"]))
        out[MAIN]["se"] = round(spread, 4)
        out[MAIN]["over_control_se"] = round(out[MAIN]["over_control"] / spread, 2) if spread > 0 else None
    return out


def passes(real: dict, over: dict | None) -> bool:
    """The bar (module docs): on the gain over the control where there is one, else on the gain;
    either way the real run within its time and memory."""
    if real.get("exit") != 0 or real.get("wall_s", math.inf) > MAX_SECONDS or real.get("peak_rss_gb", math.inf) >= MAX_RSS_GB:
        return False
    if over is not None:
        figure = over.get(MAIN) or {}
        return (figure.get("over_control") is not None and figure["over_control"] >= MIN_GAIN
                and figure.get("over_control_se") is not None and figure["over_control_se"] > MIN_SE)
    return real.get("gain") is not None and real["gain"] >= MIN_GAIN and real.get("gain_se") is not None \
        and real["gain_se"] > MIN_SE


def t975(df: int) -> float:
    if df <= len(T975):
        return T975[df - 1]
    z = heldout.Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: list[float | None]) -> dict:
    """Mean over seeds and its 95% t-interval; seeds without the figure (a failed run) are left out
    and `n` says how many counted; one seed has no interval."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": round(mean, 4), "ci95": None, "n": 1}
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": round(mean, 4), "ci95": [round(mean - half, 4), round(mean + half, 4)], "n": len(xs)}


def over_seeds(rows: list[dict], names: list[str]) -> dict:
    """Each figure per score over seeds: the mean, its interval and the per-seed values."""

    def figure(values: list[float | None]) -> dict:
        return {**t_interval(values), "by_seed": values}

    def real(name: str, key: str) -> list[float | None]:
        return [(r["real"].get("scores") or {}).get(name, {}).get(key) for r in rows]

    def control(name: str, key: str) -> list[float | None]:
        return [((r["control"] or {}).get("scores") or {}).get(name, {}).get(key) for r in rows]

    def over(name: str, key: str) -> list[float | None]:
        return [(r["over_control"] or {}).get(name, {}).get(key) for r in rows]

    with_control = bool(rows) and all(r["control"] is not None for r in rows)
    return {"gain": {n: figure(real(n, "gain")) for n in names},
            "control_gain": {n: figure(control(n, "gain")) for n in names} if with_control else None,
            "over_control": {n: figure(over(n, "over_control")) for n in names} if with_control else None,
            "last_over_control": {n: figure(over(n, "last_over_control")) for n in names} if with_control else None}


def seed_row(seed: int, real: dict, control: dict | None) -> dict:
    over = compare(real, control)
    return {"seed": seed, "real": real, "control": control, "over_control": over, "passes": passes(real, over)}


def score_names(rows: list[dict]) -> list[str]:
    """eval_reward first, then the `also` scores every real run reported."""
    names = [MAIN]
    for r in rows:
        names += [n for n in (r["real"].get("scores") or {}) if n not in names]
    return names


def fmt(figure: dict) -> str:
    ci, n = figure["ci95"], figure["n"]
    interval = f"95% [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "no interval"
    return "none" if figure["mean"] is None else f"{figure['mean']:+.3f} ({interval}, {n} seed{'s' * (n != 1)})"


def headline(figures: dict, passed: str) -> str:
    names = list(figures["gain"])
    if figures["over_control"] is None:
        return "; ".join(f"{n} gain {fmt(figures['gain'][n])}" for n in names) + f"; passed {passed}"
    parts = [f"{MAIN} gain over the random-reward control {fmt(figures['over_control'][MAIN])}",
             f"real {fmt(figures['gain'][MAIN])}", f"control {fmt(figures['control_gain'][MAIN])}"]
    parts += [f"{n} over the control {fmt(figures['over_control'][n])} (real {fmt(figures['gain'][n])}, "
              f"control {fmt(figures['control_gain'][n])})" for n in names if n != MAIN]
    return "; ".join(parts) + f"; passed {passed}"


def result(rows: list[dict], protocol: dict, pipeline: str = PIPELINE) -> dict:
    """The last line's JSON object (module docs)."""
    figures = over_seeds(rows, score_names(rows))
    passed = f"{sum(r['passes'] for r in rows)}/{len(rows)}"
    bar = {"figure": "over_control" if figures["over_control"] is not None else "gain", "min_gain": MIN_GAIN,
           "min_se": MIN_SE, "max_wall_s": MAX_SECONDS, "max_rss_gb": MAX_RSS_GB}
    keep = ("curve", "gain", "gain_se", "scores", "wall_s", "steps", "peak_rss_gb", "exit")
    return {"headline": headline(figures, passed), "pipeline": pipeline, "passed": passed, "bar": bar,
            "interval": INTERVAL, **figures, "protocol": protocol, "seeds": [r["seed"] for r in rows],
            "by_seed": {str(r["seed"]): {"real": {k: r["real"].get(k) for k in keep},
                                         "control": {k: r["control"].get(k) for k in keep} if r["control"] else None,
                                         "over_control": r["over_control"], "passes": r["passes"]} for r in rows}}


def print_seed(row: dict) -> None:
    def arm(figures: dict) -> str:
        curve = "  ".join(f"v{v}:{r:.3f}" for v, r in figures["curve"])
        extra = "".join(f", {n} {s['gain']:+.3f}" for n, s in (figures.get("scores") or {}).items() if n != MAIN)
        return (f"{curve}  gain {figures['gain']} ({figures['gain_se']} SE){extra}  {figures['wall_s']:.0f} s  "
                f"{figures.get('steps', '?')} steps  peak {figures['peak_rss_gb']} GB  exit {figures['exit']}")

    print(f"seed {row['seed']} real:    {arm(row['real'])}")
    if row["control"] is not None:
        print(f"seed {row['seed']} control: {arm(row['control'])}")
        over = ", ".join(f"{n} {o['over_control']:+.3f} (last {o['last_over_control']:+.3f})"
                         for n, o in (row["over_control"] or {}).items())
        print(f"seed {row['seed']} over the control: {over}")
    print(f"seed {row['seed']}: {'PASS' if row['passes'] else 'FAIL'}")


def check_protocol(args: argparse.Namespace) -> list[int]:
    """The seeds to run, after the held-out protocol's refusals (tools/heldout.py; module docs)."""
    if args.heldout and args.overrides:
        raise heldout.ProtocolError(f"--heldout measures {args.pipeline} as committed: no key=value overrides "
                                    f"({' '.join(args.overrides)})")
    if args.heldout and not args.control:
        raise heldout.ProtocolError("--heldout measures the claim against its control: add --control "
                                    "(the bar is the gain over the random-reward arm)")
    if any(o.split("=", 1)[0] == CONTROL.split("=", 1)[0] for o in args.overrides):
        raise heldout.ProtocolError(f"{CONTROL} is the control arm's: use --control")
    return heldout.seeds_for(bench_name(args.pipeline), args.heldout, args.seeds) or [0, 1, 2]


def existing_runs(out: Path, seeds: list[int], arms: list[str]) -> list[str]:
    """Run folders a new run would write into: `flowrl run` refuses them, and the figures read
    afterwards would be the old run's."""
    return [arm_name(a, s) for s in seeds for a in arms if (out / arm_name(a, s)).exists()]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default=PIPELINE, help=f"the recipe (default {PIPELINE})")
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",") if x],
                        help="comma-separated (default 0,1,2; with --heldout all of the held-out seeds)")
    parser.add_argument("--control", action="store_true", help="also run each seed with random rewards (the control arm)")
    parser.add_argument("--heldout", action="store_true",
                        help="measure the committed recipe on the held-out seeds (tools/heldout.py); needs --control")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_smollm2"))
    parser.add_argument("--report-only", action="store_true", help="reprint OUT/seed-S.json (and control-S.json), run nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    results_file.add_record_flag(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    seeds = check_protocol(args)
    out = args.out if args.out.is_absolute() else ROOT / args.out
    arms = ["real", "control"] if args.control else ["real"]
    if not args.report_only and (taken := existing_runs(out, seeds, arms)):
        raise SystemExit(f"bench_smollm2: {out} already holds {', '.join(taken)}: give a new --out, or --report-only")
    out.mkdir(parents=True, exist_ok=True)
    protocol = heldout.stamp(bench_name(args.pipeline), args.heldout, seeds)
    rows = []
    for seed in seeds:
        figures = {}
        for arm in arms:
            path = out / f"{arm_name(arm, seed)}.json"
            if args.report_only:
                figures[arm] = json.loads(path.read_text()) if path.exists() else None
            else:
                figures[arm] = run_arm(seed, arm, out, args.overrides, args.pipeline)
                print(f"seed {seed} {arm} done: {figures[arm]['curve']}", flush=True)
        if figures["real"] is None:
            continue
        rows.append(seed_row(seed, figures["real"], figures.get("control")))
        print_seed(rows[-1])
    final = result(rows, protocol, args.pipeline)
    if not args.report_only:  # a reprint is not another measurement
        heldout.record(final)
    results_file.emit(args.record, "bench_smollm2", final)


if __name__ == "__main__":
    main()
