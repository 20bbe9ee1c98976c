"""`flowrl plan --target` against measured pairs it did not fit: from one arm of a sync/async pair
alone, predict the other arm's wall time to a target, and compare with what the other arm took.

    python tools/bench_plan_target.py RUNS [RUNS ...] --target eval_reward=0.9
                                      [--direction both|sync-to-async|async-to-sync] [--seeds 1000,1001] [--record NAME]

RUNS holds paired run folders `sync-<key>/` and `async-<key>/` as tools/bench_e2e.py (`<seed>`) and
tools/bench_longtail.py (`<tail>-<seed>`) write them. Several RUNS folders are read as one pool of
pairs (a key in two of them is an error): a median over more pairs wanders less. For each pair and direction, the changes
from one arm to the other are read off the two runs' own compiled plans (plan.json: what ran) and
expressed as `flowrl plan` overrides (`derive`): the train input edge's mode and max_staleness
(`max_staleness=N`) and on_stale (`on_stale=keep`), a node's replicas, a node config key where plan
accepts it (partial rollout, a trainer's own process, an engine's threads, a loss, ...; a config key
differing in several leaves is set whole), data.batch_size. A difference plan refuses (another
edge, a node's CPUs, the model) is listed with plan's own reason: the prediction is made without it.
Then `flowrl.plan.plan_run` and `time_to_target` on the one arm alone (no `--paired`: the other
arm is what is predicted) give the other configuration's wall time to the target with its stated
interval (5th-95th percentile), and the parallel fractions plan timed where the pair's arms differ
in threads (flowrl/plan/threads.py).

Measured: the time of the other arm's first record reaching the target in its last phase, from
that phase's start (eval.jsonl's `time` for eval_reward, metrics.jsonl's for reward / train.KEY):
bench_e2e's and bench_longtail's `s_to_target` where their GRPO phase ran alone (`--warmups`), as
in their held-out runs. A run that never reached it counts as slower than every run that did.

Per direction: each pair's prediction, interval, measurement and relative error; the median over
pairs of the predictions against the median of the measurements (bar: within 25 %), whether the
median's interval (the medians of the pairs' interval ends) covers the measured median, how many
pairs' own intervals cover their measurement, and the pairs where plan could not predict, with its
reason. A folder still being written or cut off (no record at the target, no phase.json) is skipped and
named. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heldout  # noqa: E402
import results_file  # noqa: E402

from flowrl.graph.plan import Plan  # noqa: E402
from flowrl.plan import plan_run  # noqa: E402
from flowrl.plan.changes import apply  # noqa: E402
from flowrl.plan.target import parse, time_to_target, train_rows, trained_lag  # noqa: E402
from flowrl.records import RunDir  # noqa: E402
from flowrl.spec.errors import UserError  # noqa: E402
from flowrl.spec.stop_when import EVAL  # noqa: E402

BAR = 0.25  # the median prediction within 25 % of the measured median (issue #46)
ARMS = ("sync", "async")
DIRECTIONS = {"sync-to-async": ("sync", "async"), "async-to-sync": ("async", "sync")}
IGNORED = ("name", "run", "phases", "seed", "environment", "metric_roles", "facts", "order")


# ---- the changes from one plan to the other, as plan's overrides ------------------------------------

def derive(base: Plan, other: Plan) -> tuple[list[str], list[str]]:
    """(overrides that turn `base` into `other` as far as plan can simulate, the differences it
    cannot, each with plan's reason). Each override is tried on `base` (changes.apply): what plan
    refuses is listed, not dropped silently. The run's length, seed, phases and name are not a change."""
    found = _edges(base, other) + _data(base, other)
    found += [c for name in sorted(set(base.nodes) | set(other.nodes)) for c in _node(base, other, name)]
    found += [(s, "differs", f"plan simulates the run's own {s}") for s in ("model", "cluster")
              if _plain(getattr(base, s)) != _plain(getattr(other, s))]
    accepted: list[str] = []
    refused: list[str] = []
    for key, value, why in found:
        text = f"{key}={json.dumps(value)}"
        if why is None:
            try:
                apply(base, [*accepted, text], 10)
            except UserError as e:  # plan's own words, without its list of what it does simulate
                why = str(e).split(": ", 2)[-1].split("; it simulates")[0]
        if why is None:
            accepted.append(text)
        else:
            refused.append(f"{key} {json.dumps(value)}: {why}")
    return accepted, refused


Found = tuple[str, Any, "str | None"]  # (key, the other plan's value, why plan cannot simulate it; None: try)


def _plain(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def _edges(base: Plan, other: Plan) -> list[Found]:
    """The train input edge's mode and max_staleness as `max_staleness`, its on_stale as `on_stale`;
    its other fields, and any other edge that differs, refused."""
    trains = set(base.facts.trains if base.facts else ())
    mine = {(e.src, e.dst, e.kind): _plain(e) for e in base.edges}
    theirs = {(e.src, e.dst, e.kind): _plain(e) for e in other.edges}
    out: list[Found] = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        label = f"edges.{key[0]} -> {key[1]}"
        if a is None or b is None:
            out.append((label, "only in one plan", "plan simulates the run's own graph"))
            continue
        if key[1] in trains and key[2] == "data":
            if (a["mode"], a["max_staleness"]) != (b["mode"], b["max_staleness"]):
                out.append(("max_staleness", b["max_staleness"] if b["mode"] == "async" else 0, None))
            if a["on_stale"] != b["on_stale"]:
                out.append(("on_stale", b["on_stale"], None))
            a = {**a, "mode": b["mode"], "max_staleness": b["max_staleness"], "on_stale": b["on_stale"]}
        out += [(f"{label}.{field}", b[field], "plan sets only the train input edge's mode, max_staleness and on_stale")
                for field in sorted(a) if a[field] != b[field]]
    return out


def _data(base: Plan, other: Plan) -> list[Found]:
    return [(f"data.{k}", v, None if k == "batch_size" else "plan simulates data.batch_size only")
            for k, v in _leaves(_plain(base.data), _plain(other.data))]


def _node(base: Plan, other: Plan, name: str) -> list[Found]:
    a, b = base.nodes.get(name), other.nodes.get(name)
    if a is None or b is None or (a.kind, a.op) != (b.kind, b.op):
        return [(f"nodes.{name}", b.op if b else None, "plan simulates the run's own nodes and operators")]
    out: list[Found] = []
    mine, theirs = _plain(a.config), _plain(b.config)
    for key in sorted(set(mine) | set(theirs)):
        # One leaf that differs is set alone (engine.threads); several, the whole key at once: a loss's
        # decoupled and correction are valid only together, each alone refused by the config.
        leaves = _leaves(mine.get(key), theirs.get(key), f"{key}.")
        whole = len(leaves) > 1 and isinstance(theirs.get(key), dict)
        out += [(f"nodes.{name}.{k}", v, None) for k, v in ([(key, theirs.get(key))] if whole else leaves)]
    out += [(f"nodes.{name}.resources.{k}", v, None if k == "replicas" else "plan simulates replicas only")
            for k, v in _leaves(_plain(a.resources), _plain(b.resources))]
    return out


def _leaves(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, b's value) where b differs from a; mappings on both sides are compared key by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [item for k in sorted(set(a) | set(b)) for item in _leaves(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [(prefix.rstrip("."), b)] if a != b else []


# ---- measured and predicted time to the target ---------------------------------------------------

def measured(run_dir: Path, metric: str, value: float) -> float | None:
    """Seconds from the last phase's start to its first record of `metric` >= `value`; None: never."""
    run = RunDir(run_dir).last()
    if metric == EVAL:
        hits = (e.time for e in run.evals() if e.eval_reward is not None and e.eval_reward >= value)
    else:
        key = metric.removeprefix("train.")
        hits = (r.time for r in train_rows(run)
                if _at_least(r.reward if metric == "reward" else r.train.get(key), value))
    return next(hits, None)


def samples_to(run_dir: Path, metric: str, value: float) -> float | None:
    """Samples (groups) trained before the first record of `metric` >= `value` (bench_e2e's
    `samples_to_target`: version v was trained on steps 0 .. v-1); None: never."""
    run = RunDir(run_dir).last()
    rows = train_rows(run)
    if metric == EVAL:
        version = next((e.version for e in run.evals() if e.eval_reward is not None and e.eval_reward >= value), None)
        return None if version is None else float(sum(r.groups for r in rows if r.step < version))
    key = metric.removeprefix("train.")
    hit = next((i for i, r in enumerate(rows) if _at_least(r.reward if metric == "reward" else r.train.get(key), value)),
               None)
    return None if hit is None else float(sum(r.groups for r in rows[:hit]))


def _at_least(x: Any, value: float) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x >= value


def finished(run_dir: Path, metric: str, value: float) -> bool:
    """Whether a run is done being written: it reached the target (a run stopped there) or its
    phase ended (phase.json). One still going is neither."""
    try:
        run = RunDir(run_dir).last()
        return run.phase_done() is not None or measured(run_dir, metric, value) is not None
    except (UserError, OSError, ValueError):
        return False


def predict(run_dir: Path, overrides: list[str], target: str) -> dict[str, Any]:
    """plan's wall time to `target` of the run under `overrides`, from that run alone: `seconds`
    [low, point, high] (None: never reached on its curve), or `impossible` with plan's reason."""
    try:
        result = plan_run(run_dir, overrides)
        found = time_to_target(run_dir, target, result)
    except UserError as e:
        return {"impossible": str(e)}
    name = " ".join(overrides) if overrides else "as run"
    row = next(r for r in found["configurations"] if r["configuration"] == name)
    if "seconds" not in row:
        return {"impossible": found["notes"][0]}
    as_run = next(r for r in found["configurations"] if r["configuration"] == "as run")
    cost = found["staleness"]
    return {"seconds": row["seconds"], "samples": row["samples"], "samples_per_s": row["samples_per_s"],
            "as_run_seconds": as_run["seconds"][1], "as_run_samples_per_s": as_run["samples_per_s"],
            "lag": row["mean_lag"], "staleness": f"{cost['source']} {cost['per_lag']:+.0%} samples per unit of lag",
            "threads": [f"{node} parallel fraction {p:.2f}" for node, p in sorted(result["model"]["parallel"].items())]}


def pairs(folder: Path, keys: list[str] | None) -> dict[str, dict[str, Path]]:
    """key -> {"sync": path, "async": path} of the folder's complete pairs (`keys` only, if given),
    in the order of their keys' numbers."""
    found: dict[str, dict[str, Path]] = {}
    for path in folder.iterdir():
        arm, _, key = path.name.partition("-")
        if arm in ARMS and key and path.is_dir() and (keys is None or key in keys):
            found.setdefault(key, {})[arm] = path
    return {k: v for k, v in sorted(found.items(), key=lambda kv: _numbers(kv[0])) if len(v) == 2}


def _numbers(key: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", key)]


def one_pair(runs: dict[str, Path], source: str, goal: str, target: str) -> dict[str, Any]:
    """One pair, one direction: the derived overrides, plan's prediction from `source` alone, the
    measured time of `goal`, the error and whether the interval covers it."""
    metric, value = parse(target)
    overrides, refused = derive(RunDir(runs[source]).last().plan(), RunDir(runs[goal]).last().plan())
    out: dict[str, Any] = {"overrides": overrides, "not_simulated": refused,
                           "measured_s": measured(runs[goal], metric, value),
                           "source_measured_s": measured(runs[source], metric, value),
                           "measured_samples": samples_to(runs[goal], metric, value),
                           "measured_lag": round(trained_lag(train_rows(RunDir(runs[goal]).last())), 3)}
    out.update(predict(runs[source], overrides, target))
    if "seconds" in out:
        out["error"] = relative_error(out["seconds"][1], out["measured_s"])
        out["covered"] = covers(out["seconds"], out["measured_s"])
        out["samples_error"] = relative_error(out["samples"][1], out["measured_samples"])
        out["as_run_error"] = relative_error(out["as_run_seconds"], out["source_measured_s"])
    return out


# ---- the arithmetic: None is never (slower than any time) --------------------------------------------

def _inf(x: float | None) -> float:
    return math.inf if x is None else float(x)


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 4)


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1; 0 where both never reach, None (unbounded) where only one does."""
    if predicted is None and measured is None:
        return 0.0
    if predicted is None or measured is None or measured <= 0:
        return None
    return round(predicted / measured - 1.0, 4)


def covers(interval: list[float | None], measured: float | None) -> bool:
    """Whether [low, point, high] (None: never) holds the measurement (None: never reached)."""
    return _inf(interval[0]) <= _inf(measured) <= _inf(interval[2])


def median(values: list[float | None]) -> float | None:
    """The median, never counting as slower than any time; None where the median is never."""
    return _finite(statistics.median(_inf(v) for v in values)) if values else None


def summarise(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One direction over its pairs: the median prediction and interval against the measured median
    (over the pairs plan could predict), the bars, the pairs' own coverage, the impossible ones."""
    done = {k: r for k, r in rows.items() if "seconds" in r}
    interval = [median([r["seconds"][i] for r in done.values()]) for i in range(3)]
    measured_median = median([r["measured_s"] for r in done.values()])
    error = relative_error(interval[1], measured_median) if done else None
    return {"pairs": len(rows), "predicted": len(done),
            "median_predicted_s": interval[1], "median_interval_s": [interval[0], interval[2]],
            "median_measured_s": measured_median,
            "median_measured_s_all_pairs": median([r["measured_s"] for r in rows.values()]),
            "median_error": error, "within_bar": error is not None and abs(error) <= BAR,
            # the parts: the learning side (samples to the target, the other arm's measured) and the curve's
            # error on the run it was fitted on (plan's time for the source as it ran against its own)
            "median_samples_error": relative_error(median([r["samples"][1] for r in done.values()]),
                                                   median([r["measured_samples"] for r in done.values()])),
            "median_as_run_error": relative_error(median([r["as_run_seconds"] for r in done.values()]),
                                                  median([r["source_measured_s"] for r in done.values()])),
            "interval_covers_median": bool(done) and covers(interval, measured_median),
            "pairs_covered": sum(r["covered"] for r in done.values()),
            "pair_errors": [r["error"] for r in done.values()],
            "impossible": {k: r["impossible"] for k, r in rows.items() if "impossible" in r}}


# ---- the report ----------------------------------------------------------------------------------------

def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f}"


def print_direction(name: str, rows: dict[str, dict[str, Any]], s: dict[str, Any]) -> None:
    source, goal = DIRECTIONS[name]
    print(f"\n{source} -> {goal}: {goal}'s time to target predicted from the {source} run alone")
    labels = {"overrides": "plan overrides", "not_simulated": "not simulated (plan cannot express it)",
              "staleness": "staleness cost", "threads": "threads timed (flowrl/plan/threads.py)"}
    for what, label in labels.items():
        seen: dict[str, int] = {}
        for r in rows.values():
            text = _listed(r, what) or "none"
            seen[text] = seen.get(text, 0) + 1
        for text, n in seen.items():
            print(f"  {label} ({n} of {len(rows)} pairs): {text}")
    print(f"  {'pair':<12} {'predicted s [interval]':>30} {'measured s':>11} {'error':>8}  covered  ({source}'s own s: measured / plan as run)")
    for key, r in rows.items():
        if "seconds" in r:
            lo, pt, hi = r["seconds"]
            err = "inf" if r["error"] is None else f"{r['error']:+.0%}"
            print(f"  {key:<12} {_s(pt):>12} [{_s(lo)}..{_s(hi)}]{'':>4} {_s(r['measured_s']):>11} {err:>8}  "
                  f"{'yes' if r['covered'] else 'no':<7}  ({_s(r['source_measured_s'])} / {_s(r['as_run_seconds'])})")
        else:
            print(f"  {key:<12} cannot predict: {r['impossible']}")
    err = _pct(s["median_error"])
    lo, hi = s["median_interval_s"]
    print(f"  median over {s['predicted']} of {s['pairs']} pairs: predicted {_s(s['median_predicted_s'])} s "
          f"[{_s(lo)}..{_s(hi)}] against measured {_s(s['median_measured_s'])} s: error {err} "
          f"(bar {BAR:.0%}: {'pass' if s['within_bar'] else 'FAIL'}); the interval covers it: "
          f"{'yes' if s['interval_covers_median'] else 'NO'}; pairs' own intervals cover {s['pairs_covered']} of "
          f"{s['predicted']}")
    print(f"  its parts: samples to the target {_pct(s['median_samples_error'])} (median predicted against the "
          f"{goal} runs' measured); the {source} run's own time as it ran {_pct(s['median_as_run_error'])} (the "
          f"curve's error where it was fitted)")


def _listed(row: dict[str, Any], what: str) -> str:
    """A pair's overrides, what plan could not express, the parallel fractions plan timed (lists) or
    its staleness cost (a line) as one line; empty where the pair has none."""
    value = row.get(what) or []
    return value if isinstance(value, str) else "; ".join(value)


def _pct(x: float | None) -> str:
    return "undefined" if x is None else f"{x:+.1%}"


PER_PAIR = ("seconds", "measured_s", "source_measured_s", "error", "covered", "samples", "measured_samples",
            "samples_error", "as_run_seconds", "as_run_error", "lag", "measured_lag")


def _rounded(x: Any) -> Any:
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return round(x, 4) if isinstance(x, float) else x


def per_pair(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The pairs' figures as lists in the order of `pair_keys` (None where plan could not predict),
    and the distinct override sets and what plan could not express, each with its count of pairs."""
    out: dict[str, Any] = {"pair_keys": list(rows)}
    out.update({f"{f}_by_pair": [_rounded(r.get(f)) for r in rows.values()] for f in PER_PAIR})
    for what in ("overrides", "not_simulated", "staleness", "threads"):
        texts = [_listed(r, what) for r in rows.values()]
        out[what] = [[t, texts.count(t)] for t in dict.fromkeys(texts)]
    return out


def pooled(folders: list[Path], keys: list[str] | None) -> dict[str, dict[str, Path]]:
    """The pairs of every folder, as one: a key two folders hold is a SystemExit naming both."""
    out: dict[str, dict[str, Path]] = {}
    for folder in folders:
        for key, arms in pairs(folder, keys).items():
            if key in out:
                raise SystemExit(f"pair {key} is in {out[key]['sync'].parent} and in {folder}: read one of them")
            out[key] = arms
    return dict(sorted(out.items(), key=lambda kv: _numbers(kv[0])))


def run(folders: list[Path], target: str, directions: list[str], keys: list[str] | None) -> dict[str, Any]:
    metric, value = parse(target)
    every = pooled(folders, keys)
    runs = " ".join(str(f) for f in folders)
    done = {k: v for k, v in every.items() if all(finished(p, metric, value) for p in v.values())}
    skipped = sorted(set(every) - set(done), key=_numbers)
    print(f"bench_plan_target {runs}: {metric} >= {value:g}; {len(done)} complete pairs"
          + (f", skipped (incomplete: no record at the target and no phase.json; still being written, or cut off): {', '.join(skipped)}" if skipped else ""))
    out: dict[str, Any] = {"target": target, "runs": runs, "bar": BAR, "skipped": skipped, "directions": {}}
    for name in directions:
        rows = {k: one_pair(v, *DIRECTIONS[name], target) for k, v in done.items()}
        s = summarise(rows)
        print_direction(name, rows, s)
        out["directions"][name] = s | per_pair(rows)
    out["bars"] = {f"{n}/{b}": d[b] for n, d in out["directions"].items() for b in ("within_bar", "interval_covers_median")}
    seeds = sorted({int(_numbers(k)[-1]) for k in done})
    out["protocol"] = heldout.stamp("bench_plan_target", bool(seeds) and min(seeds) >= heldout.FIRST_HELDOUT, seeds)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="folders of sync-<key>/ and async-<key>/ run folders (several: one pool)")
    parser.add_argument("--target", required=True, help="METRIC=VALUE, e.g. eval_reward=0.9")
    parser.add_argument("--direction", choices=("both", *DIRECTIONS), default="both")
    parser.add_argument("--seeds", type=lambda v: [x for x in v.split(",") if x],
                        help="comma-separated pair keys (the folder names' part after sync-/async-); default all")
    results_file.add_record_flag(parser)
    args = parser.parse_args(argv)
    for folder in args.runs:
        if not folder.is_dir():
            parser.error(f"{folder} is not a folder")
    try:
        parse(args.target)
    except UserError as e:
        parser.error(str(e))
    directions = list(DIRECTIONS) if args.direction == "both" else [args.direction]
    result = run(args.runs, args.target, directions, args.seeds)
    results_file.emit(args.record, "bench_plan_target", result)


if __name__ == "__main__":
    main()
