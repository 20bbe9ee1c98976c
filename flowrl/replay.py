"""`flowrl replay RUN_DIR [key=value ...] [--run-dir NEW]`: train again on a run's recorded batches.

The recorded run's rollout store (flowrl/runtime/durability/rollouts.py) holds every batch its train node
trained on, in order. Replay builds that node's operator from the run's plan (plan.json: the
config, model and seed the run started with; a phase's model is the previous phase's export),
changes its config by the overrides (`nodes.<train node>.<key>=value`), and calls its `train()`
with the recorded groups step by step, writing metrics.jsonl and the final export into NEW
(default RUN_DIR/replay-N). Without overrides the trainer sees exactly what it saw in the run,
so on CPU the replayed policy equals the recorded export bit for bit (`max_abs_diff_vs_recorded`
0.0); with another loss or estimator it is an A/B on identical data.

Supported: one train node (replicas: 1); a multi-phase run's last phase (or a phase directory
given itself). The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml

from flowrl.records import MetricsRow, ReplayInfo, RunDir, encode
from flowrl.runtime.durability import rollouts
from flowrl.spec.errors import UserError


def phase_directory(run_dir: Path) -> Path:
    """The directory holding the plan to replay: RUN_DIR itself, or its last phase's (RunDir.last)."""
    return RunDir(run_dir).last().path


def train_node(plan: Any, directory: Path) -> str:
    trains = plan.facts.trains
    if len(trains) != 1:
        raise UserError(f"{directory / 'plan.json'}: replay supports a pipeline with one train node; this one has "
                        f"{len(trains)} ({', '.join(trains) or 'none'})")
    node = trains[0]
    if plan.nodes[node].resources.replicas > 1:
        raise UserError(f"{directory / 'plan.json'}: node '{node}' has replicas: "
                        f"{plan.nodes[node].resources.replicas}; replay trains on one rank only")
    return node


def apply_overrides(config: dict[str, Any], node: str, overrides: list[str]) -> dict[str, Any]:
    """The train node's config changed by `nodes.<node>.<key path>=<YAML value>` overrides."""
    config = copy.deepcopy(config)
    prefix = f"nodes.{node}."
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.startswith(prefix) or key == prefix:
            raise UserError(f"override {item!r}: replay changes the train node's config only: give "
                            f"{prefix}<key>=<value>")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UserError(f"override {item!r}: the value is not YAML: {e}") from None
        parts = key[len(prefix):].split(".")
        target = config
        for i, part in enumerate(parts[:-1]):
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                raise UserError(f"override {item!r}: {prefix}{'.'.join(parts[:i + 1])} is not a mapping")
            target = target[part]
        target[parts[-1]] = value
    return config


def load_steps(directory: Path, node: str) -> list[rollouts.RolloutStep]:
    """The recorded batches, checked: the store exists, reads back whole, and holds steps 0..n-1."""
    steps = rollouts.load(directory, node, "the run recorded no rollouts (run.record_rollouts: false, or a run "
                          "from before the rollout store); nothing to replay")
    file = rollouts.path(directory, node)
    for index, step in enumerate(steps):
        if step.step != index:
            raise UserError(f"{file}: record {index} is step {step.step}, expected {index}; the store is damaged")
    trained = _trained_steps(directory, node)
    if trained is not None and trained != len(steps):
        raise UserError(f"{file} holds {len(steps)} steps but {directory / 'metrics.jsonl'} records {trained} "
                        "trained steps of node '" + node + "': the store is truncated")
    return steps


def _train_rows(directory: Path, node: str) -> list[dict[str, Any]] | None:
    """The run's metrics.jsonl rows of `node`'s train steps (None without a metrics.jsonl)."""
    run = RunDir(directory)
    if not run.has("metrics.jsonl"):
        return None
    return [r.as_dict() for r in run.metrics() if r.node == node]  # a damaged row: RecordError, located


def _trained_steps(directory: Path, node: str) -> int | None:
    rows = _train_rows(directory, node)
    return None if rows is None else len(rows)


def recorded_threads(directory: Path, node: str) -> dict[int, int]:
    """The torch thread count each recorded step trained with (its metrics row's train.torch_threads)."""
    return {r["step"]: int(r["train"]["torch_threads"]) for r in _train_rows(directory, node) or []
            if isinstance(r["train"].get("torch_threads"), int | float)}


def new_directory(run_dir: Path, given: str | None) -> Path:
    if given:
        out = Path(given)
        if (out / "metrics.jsonl").exists():
            raise UserError(f"{out} already holds a replay; choose another --run-dir")
        return out
    n = 1
    while (run_dir / f"replay-{n}").exists():
        n += 1
    return run_dir / f"replay-{n}"


def replay(run_dir: Path, overrides: list[str], out: str | None = None, echo: Any = print) -> dict[str, Any]:
    """Replay the run in `run_dir` (see the module docstring); returns the summary printed last."""
    from flowrl.runtime.run import load_plan

    directory = phase_directory(run_dir)
    try:
        plan = load_plan(directory)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise UserError(f"cannot read {directory / 'plan.json'}: {e}") from None
    node = train_node(plan, directory)
    config = apply_overrides(plan.nodes[node].config, node, overrides)
    steps = load_steps(directory, node)
    target = new_directory(run_dir, out)
    target.mkdir(parents=True, exist_ok=True)
    ids = rollouts.sample_ids(steps)
    info = ReplayInfo(source=str(directory), node=node, overrides=overrides, steps=len(steps),
                      ids_sha256=rollouts.checksum(ids))
    (target / "replay.json").write_bytes(msgspec.json.format(encode(info), indent=1))
    _thread_environment(recorded_threads(directory, node))
    started = time.time()
    asyncio.run(_train(plan, node, config, steps, directory, target, echo))
    # Without overrides: the reproduction's error (0.0 on CPU). With them: how far the A/B moved the
    # policy from the recorded one, on identical data.
    diff = max_abs_diff(plan.nodes[node].op, directory / "export" / node, target / "export" / node)
    return {"steps": len(steps), "samples": sum(len(s.groups) for s in steps),
            "trajectories": sum(len(i) for i in ids), "ids_sha256": rollouts.checksum(ids),
            "max_abs_diff_vs_recorded": None if overrides else diff,
            "ab_max_abs_diff": diff if overrides else None, "seconds": round(time.time() - started, 3),
            "source": str(directory), "run_dir": str(target)}


async def _train(plan: Any, node: str, config: dict[str, Any], steps: list[rollouts.RolloutStep],
                 source: Path, target: Path, echo: Any) -> None:
    """The real train operator, set up as the run's stage set it up, fed the recorded batches."""
    from flowrl import registry
    from flowrl.data import images
    from flowrl.operator import ConfigError, OperatorContext
    from flowrl.runtime.stage import run_steps

    images.use_store(source / "images")  # the run's images, by reference
    spec = plan.nodes[node]
    cls = registry.resolve(spec.op)
    try:
        typed = msgspec.convert(config, cls.Config)
    except msgspec.ValidationError as e:
        raise UserError(f"nodes.{node}: {e}") from None
    context = OperatorContext(node=node, run_dir=target, seed=plan.seed, model=plan.model, data=plan.data, rank=0,
                              world_size=1, steps=run_steps(plan), phase=str(plan.run.get("phase", "main")),
                              executor="inprocess", threads=_threads(recorded_threads(source, node)))
    op = cls(typed, context)
    try:
        await op.setup()
    except (ConfigError, ValueError) as e:
        await op.close()
        raise UserError(f"nodes.{node}: {e}") from None
    try:
        started = time.time()
        with open(target / "metrics.jsonl", "ab") as rows:
            for record in steps:
                began = time.time()
                result = await op.train(record.groups, step=record.step)
                row = MetricsRow(step=record.step, version=record.step + 1, node=node, replay=True,
                                 time=round(time.time() - started, 4), step_seconds=round(time.time() - began, 4),
                                 groups=len(record.groups), reward=_mean_reward(record), train=dict(result.metrics))
                rows.write(encode(row) + b"\n")
                rows.flush()  # on disk while it runs
                echo(f"replay step {record.step}: {len(record.groups)} groups, loss "
                     f"{result.metrics.get('loss', float('nan')):.6g}, {row.step_seconds:.2f}s")
    finally:
        await op.close()  # the final export, into target/export/<node>


def _thread_environment(threads: dict[int, int]) -> None:
    """Before torch loads: every OS thread starts with the run's thread count (OpenMP and MKL read
    these once). Setting it after the load reaches only the threads that ask for it, and then the
    float sums of a 2-thread run were reproduced in about half of the tries, against all with it."""
    if threads and "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads[min(threads)])


def _threads(threads: dict[int, int]) -> int | None:
    """The torch thread count to train with: the run's, as a float sum's order depends on it (None:
    the run recorded none). It reaches the train operator as `OperatorContext.threads`, which sets it
    in the thread each step runs in (torch's count is per OS thread; flowrl/ imports no torch)."""
    if not threads:
        return None
    count = threads[min(threads)]
    if len(set(threads.values())) > 1:
        print(f"flowrl replay: the run trained with {sorted(set(threads.values()))} torch threads in different "
              f"steps; replaying with {count}: the policy may differ in the last bits", file=sys.stderr)
    return count


def _mean_reward(record: rollouts.RolloutStep) -> float | None:
    rewards = [t.reward for g in record.groups for t in g.trajectories if t.reward is not None]
    return sum(rewards) / len(rewards) if rewards else None


def max_abs_diff(op: str, recorded: Path, replayed: Path) -> float | None:
    """The largest |difference| of any parameter between the two exports, as the train node's
    operator `op` measures it (`Operator.export_difference`: flowrl/ reads no tensors); None where
    there is no recorded export to compare with."""
    from flowrl import registry

    try:
        diff = registry.resolve(op).export_difference(recorded, replayed)
    except ValueError as e:
        raise UserError(str(e)) from None
    if diff is None:
        print(f"flowrl replay: {recorded} holds no export to compare with (the run did not finish, or its train "
              "operator exports none)", file=sys.stderr)
    return diff


COMPARED = ("loss", "grad_norm", "entropy", "kl", "clip_fraction")  # train metrics shown side by side
COMPARE_ROWS = 10


def compare(dirs: list[Path]) -> str:
    """`flowrl inspect A B ...`: runs or replays side by side: whether they trained on the same samples
    (the ids checksum of each one's rollout store or replay.json), and their train metrics by step."""
    sides = [_side(d) for d in dirs]
    same = len({s["ids"] for s in sides}) == 1 and sides[0]["ids"] is not None
    lines = [f"{i}: {s['dir']}  {s['what']}  ids {str(s['ids'])[:12]}  {len(s['rows'])} steps"
             for i, s in enumerate(sides)]
    lines.append("same samples: " + ("yes (equal ids checksums)" if same else "no, or unknown"))
    keys = [k for k in COMPARED if any(k in r["train"] for s in sides for r in s["rows"])]
    steps = sorted({r["step"] for s in sides for r in s["rows"]})
    shown = steps if len(steps) <= COMPARE_ROWS else \
        sorted({steps[round(i * (len(steps) - 1) / (COMPARE_ROWS - 1))] for i in range(COMPARE_ROWS)})
    header = "step  " + "  ".join(f"{k}[{i}]".rjust(14) for k in keys for i in range(len(sides)))
    lines.append(header)
    for step in shown:
        cells = []
        for k in keys:
            for s in sides:
                value = next((r["train"].get(k) for r in s["rows"] if r["step"] == step), None)
                cells.append(("-" if value is None else f"{value:.6g}").rjust(14))
        lines.append(f"{step:<4}  " + "  ".join(cells))
    return "\n".join(lines) + "\n"


def _side(directory: Path) -> dict[str, Any]:
    """One run's or replay's train rows, what it is, and the checksum of the sample ids it trained on."""
    info = RunDir(directory).replay_info()
    if info is not None:
        rows = _train_rows(directory, info.node) or []
        what = "replay of " + info.source + (" with " + " ".join(info.overrides) if info.overrides else "")
        return {"dir": directory, "rows": rows, "ids": info.ids_sha256, "what": what}
    source = phase_directory(directory)
    from flowrl.runtime.run import load_plan

    node = train_node(load_plan(source), source)
    ids = None
    if rollouts.path(source, node).exists():
        try:
            ids = rollouts.checksum(rollouts.sample_ids(list(rollouts.read(rollouts.path(source, node)))))
        except rollouts.StoreError as e:
            raise UserError(str(e)) from None
    return {"dir": source, "rows": _train_rows(source, node) or [], "ids": ids, "what": "recorded run"}
