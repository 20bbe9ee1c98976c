"""`flowrl` command line: validate, inspect, operators, algorithms, run, replay, plan.

A user's mistake never ends in a traceback: spec problems print as located diagnostics, other
mistakes (a missing run directory, a broken plugin) as one explained line, each with exit 1.
Anything else is flowrl's own fault and says so; `--debug` shows the traceback of either.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

from flowrl.spec.errors import SpecError, UserError

MAX_SHOWN = 50  # problems printed of one spec; a generated spec can have thousands


def _compile(file: str, overrides: list[str], probe: bool = False):
    from flowrl.graph.compile import compile_file

    return compile_file(file, overrides, probe)


def cmd_validate(args: argparse.Namespace) -> int:
    _compile(args.file, args.overrides, args.probe)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    target = Path(args.target)
    if target.is_dir() and args.overrides and all(Path(o).is_dir() for o in args.overrides):
        from flowrl.replay import compare  # runs or replays side by side (docs/runs.md#replay)

        if args.format != "text":
            raise UserError("comparing runs or replays renders as text only")
        text = compare([target, *map(Path, args.overrides)])
    elif target.is_dir():
        from flowrl.report import render_run

        try:
            text = render_run(target, args.format)
        except (OSError, ValueError) as e:  # not a run directory, or a record that does not parse
            raise UserError(f"cannot inspect {target}: {e}") from e
        if args.format == "text":
            from flowrl.plan.suggest import suggestion

            line = suggestion(target)
            text += f"{line}\n" if line else ""
    else:
        from flowrl.graph.render import render

        plan = _compile(args.target, args.overrides).plan
        text = render(plan, args.format, color=args.output is None and sys.stdout.isatty())
    if isinstance(text, bytes) and not args.output:  # png
        raise UserError("--format png writes a file: add -o OUT.png")
    if not args.output:
        sys.stdout.write(text)  # type: ignore[arg-type]
        return 0
    try:
        out = Path(args.output)
        out.write_bytes(text) if isinstance(text, bytes) else out.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write {args.output}: {e.strerror or e}") from e
    return 0


def cmd_operators(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flowrl import registry
    from flowrl.operator import summary
    from flowrl.spec.describe import fields

    console = Console(width=140)
    broken = []
    for name in registry.names():
        try:
            op = registry.resolve(name)
        except registry.OperatorError as e:  # a plugin that fails to load: list the others, then say so
            broken.append(f"flowrl operators: operator '{name}' cannot be loaded: {e}")
            continue
        console.print(f"[bold]{name}[/bold]  kind {op.kind}  ({op.__module__}:{op.__qualname__})")
        console.print(f"  {summary(op)}")
        ins = ", ".join(f"{p}: {t}" for p, t in op.inputs.items()) or "-"
        outs = ", ".join(f"{p}: {t}" for p, t in op.outputs.items()) or "-"
        r = op.resources
        console.print(f"  inputs: {ins}   outputs: {outs}   resources: {r.cpus:g} CPU, {r.gpus:g} GPU")
        table = _fields_table(fields(op.Config))
        if table.row_count:
            console.print(table)
        console.print()
    for line in broken:
        print(line, file=sys.stderr)
    return 1 if broken else 0


def _fields_table(rows):
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 2))
    for col in ("key", "type", "default", "doc"):
        table.add_column(col, overflow="fold")
    for f in rows:
        table.add_row(f.key, f.type, f.default, f.doc)
    return table


def cmd_algorithms(args: argparse.Namespace) -> int:
    """Every registered loss, estimator, KL estimator, correction and aggregation with its keys."""
    from rich.console import Console

    from flowrl import plugins
    from flowrl.spec.describe import fields

    console = Console(width=140)
    # The registries themselves are registered (entry-point group flowrl.registries), as their entries are.
    registries = [registry for _, registry in sorted(plugins.load("flowrl.registries").items())]
    for registry in registries:
        shared = fields(registry.base)
        console.print(f"[bold underline]{registry.concept}[/]  (entry points {registry.group}; YAML key "
                      f"'{registry.key}', default {registry.default}; keys of every {registry.concept}:)")
        console.print(_fields_table(shared))
        console.print()
        own = {f.key for f in shared}
        for name, entry in sorted(registry.entries().items()):
            console.print(f"[bold]{name}[/bold]  ({entry.config.__module__}:{entry.config.__qualname__})")
            console.print(f"  {entry.doc}")
            rows = [f for f in fields(entry.config) if f.key.split(".")[0] not in own]
            if rows:
                console.print(_fields_table(rows))
            console.print()
    broken = [why for registry in registries for why in plugins.broken(registry.group).values()]
    for why in broken:  # a plugin that fails to load: the others are listed above
        print(f"flowrl algorithms: cannot be loaded: {why}", file=sys.stderr)
    return 1 if broken else 0


def cmd_run(args: argparse.Namespace) -> int:
    from flowrl import launch
    from flowrl.runtime import StageFailed
    from flowrl.runtime.durability.checkpoints import DiskSpaceError
    from flowrl.runtime.executors.ray_local import ClusterError
    from flowrl.runtime.executors.ray_placement import PlacementError

    progress = not args.quiet
    if args.resume and (args.file or args.overrides):
        given = [a for a in (args.file, *args.overrides) if a]
        if any("=" in a and not Path(a).exists() for a in given):
            raise UserError(f"--resume takes no key=value overrides (got {' '.join(given)}): a run continues with "
                            f"the spec and overrides it started with ({Path(args.resume) / 'launch.json'}). To "
                            f"change a setting, start a new run: flowrl run {Path(args.resume) / 'spec.yaml'} "
                            "key=value --run-dir NEW_DIR")
        raise UserError("--resume continues the run in RUN_DIR with its own spec; give no pipeline file")
    try:
        if args.resume:
            results = launch.resume(Path(args.resume), progress=progress)
        elif args.file:
            results = launch.start(args.file, args.overrides, Path(args.run_dir) if args.run_dir else None,
                                   args.executor, progress)
        else:
            raise UserError("give a pipeline file, or --resume RUN_DIR")
    except StageFailed as e:  # the message names the node and carries its own error
        raise UserError(f"the run failed: {e}") from e
    except (FileExistsError, FileNotFoundError, DiskSpaceError, PlacementError, ClusterError) as e:  # run dir; cluster
        raise UserError(str(e)) from e
    for result in results:
        lost = result.lost()
        print(f"{result.run_dir}: {result.status} after {result.steps} steps in {result.seconds:.1f}s"
              + (f"; {lost}" if lost else ""))
        for event in (e for e in result.health if e["event"] == "began"):
            print(f"  health: {event['message']}")
    return 0 if results and results[-1].status == "done" else 1


def cmd_replay(args: argparse.Namespace) -> int:
    """Train again on a run's recorded batches (flowrl/replay.py); the last line is JSON."""
    import json

    from flowrl.blame import UserCodeFailed
    from flowrl.replay import replay

    try:
        summary = replay(Path(args.run_dir_in), args.overrides, args.run_dir,
                         echo=(lambda _line: None) if args.quiet else print)
    except UserCodeFailed as e:
        raise UserError(str(e)) from e
    print(json.dumps(summary), flush=True)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Predict a run under changes from its own records (flowrl/plan/, docs/plan.md)."""
    import json

    from flowrl.plan import plan_run
    from flowrl.plan.report import text

    target = Path(args.run_dir)
    if not target.is_dir():
        raise UserError(f"{target} is not a directory: give a run directory (runs/<name>-<time>)")
    if args.target is None and (args.price is not None or args.paired is not None):
        raise UserError(f"{'--price' if args.price is not None else '--paired'} is for a time to target: add "
                        "--target METRIC=VALUE")
    if args.target is not None:
        from flowrl.plan.target import check_price, parse

        parse(args.target)  # a mistake in either is said before the run is fitted
        check_price(args.price)
    if args.paired is not None and not Path(args.paired).is_dir():
        raise UserError(f"--paired {args.paired}: not a directory; give the run directory of the same task at "
                        "another staleness")
    result = plan_run(target, args.overrides, args.search, args.budget, args.max_replicas, args.max_staleness)
    if args.target is not None:
        from flowrl.plan.target import time_to_target

        result["target"] = time_to_target(target, args.target, result, args.price,
                                          Path(args.paired) if args.paired else None)
    sys.stdout.write(json.dumps(result) + "\n" if args.format == "json" else text(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "inspect" and args.format == "png" and not Path(args.target).is_dir():
        parser.error("--format png is for run directories")
    try:
        return args.fn(args)
    except SpecError as e:
        _debug(args)
        for diagnostic in e.diagnostics[:MAX_SHOWN]:
            print(diagnostic, file=sys.stderr)
        if len(e.diagnostics) > MAX_SHOWN:
            print(f"... and {len(e.diagnostics) - MAX_SHOWN} more problems", file=sys.stderr)
    except UserError as e:
        _debug(args)
        print(f"flowrl {args.command}: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a bug in flowrl: say so, keep the traceback for --debug
        _debug(args)
        print(f"flowrl {args.command}: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        if not args.debug:
            print("  this is a flowrl bug, not a mistake in your input; run again with --debug for the "
                  "traceback", file=sys.stderr)
    return 1


def _debug(args: argparse.Namespace) -> None:
    if args.debug:
        traceback.print_exc()


class _Parser(argparse.ArgumentParser):
    """A command-line mistake exits 1, as every other user error does (argparse's own is 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flowrl", description="Declarative RL pipelines for language models.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = _Parser(add_help=False)  # --debug also after the command
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", parents=[common], help="check a pipeline spec; silent on success")
    p.add_argument("file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--probe", action="store_true", help="also score a few rows' reference and nonsense answers "
                   "with the reward (seconds; docs/pipeline.md)")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("inspect", parents=[common], help="draw a pipeline (FILE) or what a run did (RUN_DIR)")
    p.add_argument("target", help="a pipeline YAML file or a run directory")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides of a pipeline file; or more run / replay directories to compare with RUN_DIR")
    p.add_argument("--format", default="text", choices=("text", "mermaid", "dot", "html", "json", "png"))
    p.add_argument("-o", "--output", help="write to this file instead of standard output")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("operators", parents=[common], help="list registered operators, their ports and config keys")
    p.set_defaults(fn=cmd_operators)

    p = sub.add_parser("algorithms", parents=[common],
                       help="list registered losses, estimators, KL estimators, corrections, aggregations")
    p.set_defaults(fn=cmd_algorithms)

    p = sub.add_parser("run", parents=[common], help="run a pipeline")
    p.add_argument("file", nargs="?")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its directory")
    p.add_argument("--run-dir", help="where to write the run (default runs/<name>-<time>)")
    p.add_argument("--executor", choices=("inprocess", "ray"), help="overrides run.executor")
    p.add_argument("--quiet", action="store_true", help="no live progress view")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("replay", parents=[common], help="train again on the batches a run recorded (docs/runs.md)")
    p.add_argument("run_dir_in", metavar="RUN_DIR", help="a run directory (a multi-phase run: its last phase)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="changes to the train node's config, "
                   "e.g. nodes.learner.loss.kind=cispo")
    p.add_argument("--run-dir", help="where to write the replay (default RUN_DIR/replay-N)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines; only the JSON summary")
    p.set_defaults(fn=cmd_replay)

    _plan_parser(sub, common)
    return parser



def _plan_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plan", parents=[common], help="predict step time, idle and staleness of a run under changes "
                       "(docs/plan.md)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (a multi-phase run: its last phase)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="changes to simulate, e.g. data.batch_size=32 "
                   "max_staleness=1 nodes.rollout.resources.replicas=2 scale=4")
    p.add_argument("--search", action="store_true", help="try engine replicas x max_staleness under a budget")
    p.add_argument("--budget", type=float, help="devices the search may use (GPUs, or CPUs on a CPU pipeline; "
                   "default: the cluster's)")
    p.add_argument("--max-replicas", type=int, default=4, help="search engine replicas 1..N (default 4)")
    p.add_argument("--max-staleness", type=int, default=4, help="search max_staleness 0..N (default 4)")
    p.add_argument("--target", metavar="METRIC=VALUE", help="predict each configuration's wall time, samples and "
                   "device-hours to reach it, e.g. eval_reward=0.9 (docs/plan.md#time-to-target)")
    p.add_argument("--price", type=float, metavar="USD", help="price per device-hour (GPU, or CPU core on a CPU "
                   "pipeline): adds the cost to target")
    p.add_argument("--paired", metavar="RUN_DIR", help="a run of the same task at another staleness (sync for an "
                   "async run, or the reverse): measures the staleness cost")
    p.add_argument("--format", default="text", choices=("text", "json"))
    p.set_defaults(fn=cmd_plan)


if __name__ == "__main__":
    sys.exit(main())
