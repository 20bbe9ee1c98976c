"""pipelines/dapo.yaml's DAPO phase, over a sync and an async edge to the learner: every train batch
holds data.batch_size groups whose rewards differ, replacements of the dropped groups are generated
(of the same step over the sync edge), and the metrics count both. A fast reward that ties often on
the untrained tiny model stands in for the exact-match reversal (which needs the warm-up phase)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import toy_tasks

from flowrl.graph.compile import compile_spec
from flowrl.runtime import check
from flowrl.runtime.durability.ledger import read
from flowrl.runtime.run import run
from flowrl.spec.load import load
from flowrl.spec.phases import expand

ROOT = Path(__file__).resolve().parents[1]
FAST = ["data.source=toy_tasks:AnswerWithDigits", "data.options={}", "data.eval=null", "data.batch_size=4",
        "nodes.rollout.group_size=4", "nodes.rollout.sampling.max_new_tokens=2",
        "nodes.rollout.engine.threads=1", "nodes.score.fn=toy_tasks:first_is_digit",
        "nodes.filter.max_oversample=8", "phases.1.seconds=null", "phases.1.steps=3"]
ASYNC = 'phases.1.set={"edges.filter -> learner": {mode: async, max_staleness: 1}}'


def dapo(tmp_path: Path, *overrides: str):
    toy_tasks.SCORED.clear()
    (_, loaded), = expand(load(str(ROOT / "pipelines/dapo.yaml"), [*FAST, *overrides]), index=1)
    return run(compile_spec(loaded).plan, tmp_path, progress=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_batch_is_full_of_groups_that_differ(tmp_path: Path, mode: str) -> None:
    result = dapo(tmp_path, *([ASYNC] if mode == "async" else []))
    assert result.status == "done" and result.steps == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = read(tmp_path)
    batches: dict[int, list[str]] = {}
    for e in events:
        if e["event"] == "consume" and e.get("consumer") == "learner":
            batches.setdefault(e["consumer_version"], []).append(e["id"])
    assert sorted(batches) == [0, 1, 2] and all(len(ids) == 4 for ids in batches.values()), batches
    for ids in batches.values():
        assert all(len(set(toy_tasks.SCORED[i])) > 1 for i in ids)  # no tied group was trained on
    assert [r["groups"] for r in rows] == [4, 4, 4]
    # Counted by the coordinator per step; the filter's own cumulative counter lags (reported each second).
    assert rows[-1]["filtered_total"] == sum(r["filtered"] for r in rows) > 0
    reported = rows[-1]["operators"].get("filter", {})
    assert reported.get("dynamic_sampling/dropped", 0) <= rows[-1]["filtered_total"]
    extra = [e["id"] for e in events if e["event"] == "issue" and int(e["id"].split(":")[1]) >= 4]
    assert rows[-1]["oversampled_total"] == sum(r["oversampled"] for r in rows) > 0
    if mode == "sync":  # replacements are samples of the step they replace, trained in that step
        assert rows[-1]["oversampled_total"] == len(extra) > 0
        for step, ids in batches.items():
            assert all(int(i.split(":")[0]) == step for i in ids)
    report = check(tmp_path)
    assert report.clean and report.ended, report.problems


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_whose_groups_all_tie_waits_for_more_and_never_publishes(tmp_path: Path, mode: str) -> None:
    # The untrained model never copies a number exactly: every group ties at 0. The step goes on
    # past the cap (8 samples) and no version is published until the phase's seconds run out.
    result = dapo(tmp_path, "nodes.score.fn=flowrl_operators.tasks.digits:exact_match",
                  "data.source=builtin:copy_digits", "nodes.filter.max_oversample=2", "phases.1.steps=null",
                  "phases.1.seconds=4", *([ASYNC] if mode == "async" else []))
    assert result.status == "done" and result.stopped_by == "max_seconds"
    metrics = tmp_path / "metrics.jsonl"
    assert result.steps == 0 and not (metrics.exists() and metrics.read_text().strip())
    issued = [e for e in read(tmp_path) if e["event"] == "issue"]
    assert 8 < result.counters["filtered"] <= len(issued)


def test_an_interrupted_dapo_run_resumes_with_its_replacements(tmp_path: Path) -> None:
    toy_tasks.SCORED.clear()
    (_, loaded), = expand(load(str(ROOT / "pipelines/dapo.yaml"), FAST), index=1)
    plan = compile_spec(loaded).plan
    first = run(plan, tmp_path, progress=False, max_steps=1)
    assert first.status == "interrupted" and first.steps == 1
    second = run(plan, tmp_path, progress=False, resume=True)
    assert second.status == "done" and second.steps == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups"] for r in rows] == [4, 4, 4]
    batches: dict[int, list[str]] = {}
    for e in read(tmp_path):
        if e["event"] == "consume" and e.get("consumer") == "learner":
            batches.setdefault(e["consumer_version"], []).append(e["id"])
    assert all(int(i.split(":")[0]) == step for step, ids in batches.items() for i in ids)
    assert all(len(set(toy_tasks.SCORED[i])) > 1 for ids in batches.values() for i in ids)
    report = check(tmp_path)
    assert report.clean and report.ended, report.problems
