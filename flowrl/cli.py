"""`flowrl` command line: validate, inspect, operators, algorithms, run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowrl.spec.errors import SpecError


def _compile(file: str, overrides: list[str]):
    from flowrl.graph.compile import compile_file

    return compile_file(file, overrides)


def cmd_validate(args: argparse.Namespace) -> int:
    _compile(args.file, args.overrides)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    target = Path(args.target)
    if target.is_dir():
        from flowrl.report import render_run

        text = render_run(target, args.format)
    else:
        from flowrl.graph.render import render

        plan = _compile(args.target, args.overrides).plan
        text = render(plan, args.format, color=args.output is None and sys.stdout.isatty())
    if isinstance(text, bytes):  # png
        if not args.output:
            raise SystemExit("flowrl inspect --format png writes a file: add -o OUT.png")
        Path(args.output).write_bytes(text)
    elif args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_operators(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flowrl import registry
    from flowrl.operator import summary
    from flowrl.spec.describe import fields

    console = Console(width=140)
    for name in registry.names():
        try:
            op = registry.resolve(name)
        except registry.OperatorError as e:
            console.print(f"[red]{name}: {e}[/red]")
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
    return 0


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

    from flowrl.spec.describe import fields
    from flowrl_operators.training.registry import REGISTRIES

    console = Console(width=140)
    for registry in REGISTRIES:
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
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from flowrl import launch

    progress = not args.quiet
    if args.resume:
        results = launch.resume(Path(args.resume), progress=progress)
    elif args.file:
        results = launch.start(args.file, args.overrides, Path(args.run_dir) if args.run_dir else None,
                               args.executor, progress)
    else:
        raise SystemExit("flowrl run: give a pipeline file, or --resume RUN_DIR")
    for result in results:
        print(f"{result.run_dir}: {result.status} after {result.steps} steps in {result.seconds:.1f}s")
    return 0 if results and results[-1].status == "done" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrl", description="Declarative RL pipelines for language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a pipeline spec; silent on success")
    p.add_argument("file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("inspect", help="draw a pipeline (FILE) or what a run did (RUN_DIR)")
    p.add_argument("target", help="a pipeline YAML file or a run directory")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--format", default="text", choices=("text", "mermaid", "dot", "html", "json", "png"))
    p.add_argument("-o", "--output", help="write to this file instead of standard output")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("operators", help="list registered operators, their ports and config keys")
    p.set_defaults(fn=cmd_operators)

    p = sub.add_parser("algorithms", help="list registered losses, estimators, KL estimators, corrections, aggregations")
    p.set_defaults(fn=cmd_algorithms)

    p = sub.add_parser("run", help="run a pipeline")
    p.add_argument("file", nargs="?")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its directory")
    p.add_argument("--run-dir", help="where to write the run (default runs/<name>-<time>)")
    p.add_argument("--executor", choices=("inprocess", "ray"), help="overrides run.executor")
    p.add_argument("--quiet", action="store_true", help="no live progress view")
    p.set_defaults(fn=cmd_run)

    args = parser.parse_args(argv)
    if args.command == "inspect" and args.format == "png" and not Path(args.target).is_dir():
        parser.error("--format png is for run directories")
    try:
        return args.fn(args)
    except SpecError as e:
        for diagnostic in e.diagnostics:
            print(diagnostic, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
