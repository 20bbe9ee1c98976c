"""A benchmark run side by side on an earlier commit and on this tree, in one command.

    python tools/bench_against.py REV tools/bench_weight_sync.py --layers 2 [--rounds 2] [--logs DIR]
    python tools/bench_against.py REV tools/bench_plan.py --from-logs DIR

The earlier commit is checked out into a temporary git worktree and imported in place of this tree
(its `flowrl/` and `operators/` put first on PYTHONPATH, for the benchmark and every process it
starts), so both run in this environment, one after the other, `--rounds` times alternately. Each
benchmark's last output line is its JSON summary; every number in both is printed with the ratio
this tree / REV. The last line is one JSON object: {"rev", "bench", "figures": {key: [rev, this]}}.
`--logs DIR` keeps each run's whole output (DIR/rev-1.log, DIR/this-1.log, ...), and `--from-logs DIR`
compares what such a folder kept without running anything. A summary's list of rows (bench_plan's
`configs`) is compared row by row, each keyed by its `config` (or `name`).
A refactor that should not change speed keeps the ratios of each summary where they were.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str, where: Path) -> Path:
    """REV's tree in a detached worktree, and a folder that imports it as flowrl / flowrl_operators."""
    tree = where / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
    shadow = where / "path"
    shadow.mkdir()
    (shadow / "flowrl").symlink_to(tree / "flowrl")
    (shadow / "flowrl_operators").symlink_to(tree / "operators")
    return tree


def run(tree: Path, bench: str, args: list[str], path: str | None, log: Path | None = None) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(tree / bench), *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + proc.stderr)
    summary = last_line(proc.stdout)
    if proc.returncode != 0 or summary is None:
        sys.exit(f"{bench} on {tree} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return summary


def numbers(summary: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a summary by its dotted key; a list of rows is keyed by each row's name (its
    `config` or `name` value, else its index), so per-configuration rows compare row by row."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out |= numbers(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, row in enumerate(value):
                out |= numbers(row, f"{prefix}{key}.{row.get('config', row.get('name', i))}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


def last_line(output: str) -> dict | None:
    """A benchmark's summary: the last line of its output that is a JSON object; None without one."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def kept(log: Path) -> dict[str, float]:
    summary = last_line(log.read_text())
    if summary is None:
        sys.exit(f"{log}: no JSON summary line")
    return numbers(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rev", help="the earlier commit")
    parser.add_argument("bench", help="the benchmark, a path relative to the repository root")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each, alternately (medians are shown)")
    parser.add_argument("--logs", type=Path, help="keep each run's whole output in this folder")
    parser.add_argument("--from-logs", type=Path, metavar="DIR",
                        help="run nothing: compare the summaries an earlier --logs DIR kept")
    parser.add_argument("--record", metavar="NAME", help="also keep the last line as results/NAME.json")
    args, rest = parser.parse_known_args()
    if args.from_logs is not None:
        runs = {side: [kept(log) for log in sorted(args.from_logs.glob(f"{side}-*.log"))]
                for side in ("rev", "this")}
        if not runs["rev"] or not runs["this"]:
            sys.exit(f"{args.from_logs}: needs rev-N.log and this-N.log files (written by --logs)")
    else:
        runs = measure(args, rest)
    compare(args, runs)


def measure(args: argparse.Namespace, rest: list[str]) -> dict[str, list[dict[str, float]]]:
    with tempfile.TemporaryDirectory(prefix="flowrl-against-") as scratch:
        tree = checkout(args.rev, Path(scratch))
        try:
            runs: dict[str, list[dict[str, float]]] = {"rev": [], "this": []}
            for n in range(1, args.rounds + 1):
                log = {side: args.logs / f"{side}-{n}.log" if args.logs else None for side in runs}
                runs["rev"].append(numbers(run(tree, args.bench, rest, str(Path(scratch) / "path"), log["rev"])))
                runs["this"].append(numbers(run(ROOT, args.bench, rest, None, log["this"])))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    return runs


def compare(args: argparse.Namespace, runs: dict[str, list[dict[str, float]]]) -> None:
    keys = [k for k in runs["this"][0] if k in runs["rev"][0]]
    figures = {k: [statistics.median(r[k] for r in runs["rev"]), statistics.median(r[k] for r in runs["this"])]
               for k in keys}
    print(f"{'figure':<44} {args.rev[:10]:>12} {'this tree':>12} {'this/rev':>9}")
    for key, (old, new) in figures.items():
        ratio = f"{new / old:9.3f}" if old else f"{'-':>9}"
        print(f"{key:<44} {old:12.4g} {new:12.4g} {ratio}")
    result = {"rev": args.rev, "bench": args.bench, "figures": figures}
    print(json.dumps(result))
    if args.record:
        sys.path.insert(0, str(ROOT / "tools"))
        import results_file  # only here: the tool also runs in a repository without it (its test)

        print(f"recorded {results_file.save(args.record, result, 'bench_against').relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
