"""The held-out protocol every learning benchmark follows (docs/benchmarks.md, "Held-out seeds").

A recipe is screened on screening seeds (below 1000), frozen by a commit, and its claim is then
measured once on held-out seeds (1000 and up) that no screening touched. A benchmark's `--heldout`
run takes its held-out seeds from `HELDOUT`, refuses a tree with uncommitted changes (the figure
must belong to a commit) and puts the commit, the command and the machine in its last JSON line; a
screening run refuses held-out seeds, so they cannot be screened on by accident. Each run appends
its last line to `runs/bench-ledger.jsonl`, and a held-out run prints the screening figure recorded
at the same commit beside its own: the gap between the two is what screening bought.

The figures carry their uncertainty: a success rate its Wilson 95% interval; a median over seeds its
spread (quartiles) and a bootstrap 95% interval; a ratio of two medians a bootstrap interval from
resampling the seeds (paired where both arms ran the same seeds). A run that missed its target
counts as slower than every run that reached it (`inf`), so a median or bound that is a miss prints
as None.
"""

from __future__ import annotations

import json
import math
import platform
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "runs/bench-ledger.jsonl"
FIRST_HELDOUT = 1000
# Each benchmark's held-out seeds: fixed here, so "measured once on held-out seeds" names the same seeds.
HELDOUT = {
    "bench_e2e": list(range(1000, 1020)),
    "bench_longtail": list(range(1000, 1005)),
    "bench_smollm2": list(range(1000, 1005)),
    "bench_smollm2:smollm2_code": list(range(1000, 1005)),
    "bench_code_async": list(range(1010, 1015)),  # not the learning claim's seeds: its own runs
    # flowrl plan's time to target on the quickstart pair (issue #46): pairs no earlier figure used,
    # whose runs did not inform the staleness cost's prior (flowrl/plan/lag.py MEASURED); 1020-1027
    # the first check, 1028-1033 the second (after the thread-gain probe, plan/threads.py), 1034-1039
    # the third (after the prefill, handoff and multi-turn engine costs), 1040-1045 the fourth (after the
    # run-to-run spread, plan/reruns.py); 1046-1051 and 1052-1057 the fifth and sixth, fixed before they ran:
    # at eval 0.9 read pooled with the third and fourth (24 pairs, plan's points unchanged since the third:
    # the median over six pairs wanders more than the bar), and at eval 0.8 alone (12 pairs; 0.8 was
    # screened on the third and fourth sets only: results/plan-target-quickstart-0.8-screen-*.json)
    "bench_e2e:plan_target": list(range(1020, 1058)),
    # and on the long-tail pair: its first check re-ran bench_longtail's own seeds (1000-1004); its third
    # (1034-1038) and fourth (1040-1044) checks start from the quickstart's warm-ups of the same seeds
    "bench_longtail:plan_target": [*range(1020, 1025), *range(1034, 1039), *range(1040, 1045)],
}
Z95 = 1.959964


class ProtocolError(SystemExit):
    """A benchmark asked for something the protocol forbids: one message, exit 2 (argparse's code)."""

    def __init__(self, message: str) -> None:
        print(f"held-out protocol: {message}", file=sys.stderr)
        super().__init__(2)


def wilson(successes: int, trials: int) -> tuple[float, float] | None:
    """The Wilson score 95% interval of a success rate (sound at 0 and n of n, unlike p +- 1.96 se)."""
    if trials <= 0:
        return None
    p = successes / trials
    centre = (p + Z95**2 / (2 * trials)) / (1 + Z95**2 / trials)
    half = Z95 * math.sqrt(p * (1 - p) / trials + Z95**2 / (4 * trials**2)) / (1 + Z95**2 / trials)
    return round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)


def _value(v: float | None) -> float:
    return math.inf if v is None else float(v)


def _finite(v: float) -> float | None:
    return None if math.isinf(v) or math.isnan(v) else round(v, 3)


def _quantile(ranked: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, interpolating between neighbours (inf-safe: no inf * 0)."""
    pos = q * (len(ranked) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi or ranked[lo] == ranked[hi]:
        return ranked[lo]
    return ranked[lo] + (ranked[hi] - ranked[lo]) * (pos - lo)


def median_spread(values: Sequence[float | None], *, resamples: int = 2000, seed: int = 0) -> dict:
    """Median over seeds (None = a miss = slower than every hit), its quartiles and a bootstrap 95% interval."""
    xs = sorted(_value(v) for v in values)
    if not xs:
        return {"median": None, "q25": None, "q75": None, "ci95": None}
    rng = random.Random(seed)
    boots = sorted(_quantile(sorted(rng.choices(xs, k=len(xs))), 0.5) for _ in range(resamples))
    return {"median": _finite(_quantile(xs, 0.5)), "q25": _finite(_quantile(xs, 0.25)),
            "q75": _finite(_quantile(xs, 0.75)),
            "ci95": [_finite(_quantile(boots, 0.025)), _finite(_quantile(boots, 0.975))]}


def median_ratio(numerator: Sequence[float | None], denominator: Sequence[float | None], *, paired: bool = True,
                 resamples: int = 2000, seed: int = 0) -> dict:
    """median(numerator) / median(denominator) and its bootstrap 95% interval.

    Paired (the same seeds in both arms, in the same order): seeds are resampled together, so what a
    seed shares between the arms (its warm-up, its prompts) cancels as it does in the point figure."""
    a, b = [_value(v) for v in numerator], [_value(v) for v in denominator]
    if not a or not b:
        return {"ratio": None, "ci95": None}
    if paired and len(a) != len(b):
        raise ValueError("a paired ratio needs the same seeds in both arms")

    def ratio(xs: list[float], ys: list[float]) -> float:
        top, bottom = _quantile(sorted(xs), 0.5), _quantile(sorted(ys), 0.5)
        if math.isinf(bottom):
            return math.nan if math.isinf(top) else 0.0
        if not bottom:
            return math.nan if not top else math.inf
        return top / bottom

    rng = random.Random(seed)
    boots = []
    for _ in range(resamples):
        if paired:
            idx = rng.choices(range(len(a)), k=len(a))
            boots.append(ratio([a[i] for i in idx], [b[i] for i in idx]))
        else:
            boots.append(ratio(rng.choices(a, k=len(a)), rng.choices(b, k=len(b))))
    undefined = sum(math.isnan(x) for x in boots)  # resamples where both medians are misses (or 0)
    boots = sorted(x for x in boots if not math.isnan(x))
    ci = [_finite(_quantile(boots, 0.025)), _finite(_quantile(boots, 0.975))] if boots else None
    return {"ratio": _finite(ratio(a, b)), "ci95": ci, "undefined_resamples": undefined}


def rate(successes: int, trials: int) -> dict:
    return {"successes": successes, "trials": trials, "ci95": wilson(successes, trials)}


def commit() -> tuple[str, bool]:
    """HEAD's commit and whether the tree has changes (tracked or untracked, not ignored) against it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return head or "unknown", bool(status.strip())


def seeds_for(bench: str, heldout: bool, seeds: list[int] | None) -> list[int]:
    """The seeds a run may use: its benchmark's held-out seeds (all, or the subset asked for) under
    `--heldout`, and otherwise the seeds asked for, none of them held out."""
    if heldout:
        allowed = HELDOUT.get(bench)
        if allowed is None:
            raise ProtocolError(f"{bench} has no held-out seeds fixed: name them in tools/heldout.py's HELDOUT "
                                "(in the same commit as the recipe they measure)")
        chosen = seeds or allowed
        if any(s not in allowed for s in chosen):
            raise ProtocolError(f"--heldout runs {bench}'s held-out seeds {allowed[0]}-{allowed[-1]}; "
                                f"{[s for s in chosen if s not in allowed]} are not among them")
        head, dirty = commit()
        if dirty:
            raise ProtocolError("--heldout measures a frozen recipe: commit or stash the changes first "
                                "(`git status` lists them)")
        return chosen
    if seeds and any(s >= FIRST_HELDOUT for s in seeds):
        raise ProtocolError(f"seeds from {FIRST_HELDOUT} up are held out: screen on seeds below it, "
                            "or measure a frozen recipe with --heldout")
    return seeds or []


def add_set_flag(parser: Any, bench: str) -> None:
    """`--heldout-set NAME`: with --heldout, the held-out seeds of another claim made on `bench`'s
    runs (`HELDOUT[f"{bench}:NAME"]`), e.g. plan's time to target on bench_e2e's pairs."""
    names = sorted(key.partition(":")[2] for key in HELDOUT if key.startswith(f"{bench}:"))
    parser.add_argument("--heldout-set", choices=names,
                        help=f"with --heldout: the held-out seeds of another claim made on these runs "
                             f"(tools/heldout.py's HELDOUT['{bench}:NAME'])")


def bench_of(parser: Any, args: Any, bench: str) -> str:
    """The HELDOUT key the run's seeds come from: `bench`, or `bench:NAME` with --heldout-set."""
    if args.heldout_set and not args.heldout:
        parser.error("--heldout-set names held-out seeds: give --heldout too")
    return bench + (f":{args.heldout_set}" if args.heldout_set else "")


def stamp(bench: str, heldout: bool, seeds: list[int]) -> dict:
    """What a result carries to say where it came from."""
    head, dirty = commit()
    return {"bench": bench, "heldout": heldout, "commit": head, "dirty": dirty, "seeds": seeds,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}"}


def record(result: dict, ledger: Path = LEDGER) -> None:
    """Append a run's result to the ledger and, for a held-out run, print the screening figure of the
    same commit beside it (what screening bought; the held-out one is the figure to quote)."""
    protocol = result["protocol"]
    ledger.parent.mkdir(parents=True, exist_ok=True)
    earlier = []
    for line in ledger.read_text().splitlines() if ledger.exists() else []:
        try:
            earlier.append(json.loads(line))
        except ValueError:  # a line cut by a crash: the rest of the ledger still counts
            print(f"held-out protocol: skipped an unreadable line of {ledger}", file=sys.stderr)
    with ledger.open("a") as f:
        f.write(json.dumps(result) + "\n")
    if not protocol["heldout"]:
        return
    screens = [r for r in earlier if r.get("protocol", {}).get("bench") == protocol["bench"]
               and r["protocol"]["commit"] == protocol["commit"] and not r["protocol"]["heldout"]]
    if screens:
        print(f"screening at this commit (seeds {screens[-1]['protocol']['seeds']}): {screens[-1].get('headline')}")
    else:
        print("screening at this commit: none in the ledger")
    print(f"held-out (seeds {protocol['seeds']}): {result.get('headline')}")
