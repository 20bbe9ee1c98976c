"""tools/bench_code_async.py: the async pipeline is the sync one with the changes plan simulates,
the figures read from a run's real records, and the triple's arithmetic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from tool_module import tool

from flowrl.data.trajectory import Group, Trajectory
from flowrl.runtime.durability import rollouts
from flowrl.spec.load import load

ROOT = Path(__file__).resolve().parents[1]
bench = tool("bench_code_async")


def leaves(data, prefix=""):
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in leaves(value, f"{prefix}{key}.").items()}
    if isinstance(data, list):
        return {k: v for i, value in enumerate(data) for k, v in leaves(value, f"{prefix}{i}.").items()}
    return {prefix[:-1]: data}


def test_the_async_pipeline_differs_from_the_sync_one_by_plan_s_changes_alone():
    import yaml

    sync, other = (leaves(load(ROOT / p).data) for p in bench.PIPELINES.values())
    changed = {k for k in sync.keys() | other.keys() if sync.get(k) != other.get(k)}
    plan_keys = {"nodes.rollout.engine.threads": 1, "nodes.rollout.partial_rollout": True,
                 "nodes.learner.own_process.threads": 1}
    assert {k: other[k] for k in plan_keys} == plan_keys
    staleness = {k for k in changed if k.startswith("edges.")}  # the train node's input edge: max_staleness=1
    assert {other[k] for k in staleness if k.endswith("max_staleness")} == {1}
    loss = {k for k in changed if k.startswith("nodes.learner.loss.")}
    assert loss == {"nodes.learner.loss.decoupled", "nodes.learner.loss.correction.kind",
                    "nodes.learner.loss.correction.threshold"}
    assert changed == {"name", "description"} | plan_keys.keys() | staleness | loss
    assert bench.PLAN_CHANGES[:4] == ["max_staleness=1", "nodes.rollout.engine.threads=1",
                                      "nodes.rollout.partial_rollout=true", "nodes.learner.own_process={threads: 1}"]
    key, value = bench.PLAN_CHANGES[4].split("=", 1)  # plan's loss is the async pipeline's, whole
    assert key == "nodes.learner.loss"
    assert leaves(yaml.safe_load(value), "nodes.learner.loss.") == {k: v for k, v in other.items() if
                                                                    k.startswith("nodes.learner.loss.")}


def episode(tid: str, calls: int, timing: list[dict]) -> Trajectory:
    return Trajectory(id=tid, group_id="g", sample_id="s", prompt_ids=[1], response_ids=[2], loss_mask=[1],
                      behaviour_logprobs=[-0.1], versions=[0], reward=1.0,
                      metadata={"calls": calls, "tool_calls": len(timing), "tool_timing": timing})


def call(queue: float, start: float, run: float) -> dict:
    return {"seconds": round(queue + start + run + 0.01, 4), "queue_s": queue, "start_s": start, "run_s": run}


def test_the_figures_come_from_the_run_s_records(tmp_path):
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"version": 0, "eval_reward": 0.1, "samples": 32, "time": 50.0},
        {"version": 1, "eval_reward": 0.5, "samples": 32, "time": 120.0},
        {"version": 2, "eval_reward": 0.95, "samples": 32, "time": 200.0}]))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [
        {"step": 0, "version": 1, "time": 100.0, "step_seconds": 100.0, "groups": 4, "staleness": {"0": 4}},
        {"step": 1, "version": 2, "time": 180.0, "step_seconds": 80.0, "groups": 4, "staleness": {"0": 2, "1": 2}},
        {"step": 2, "version": 3, "time": 250.0, "step_seconds": 70.0, "groups": 4, "staleness": {"1": 4}}]))
    first = [episode("0:0/0", 2, [call(0.5, 0.05, 0.01), call(0.0, 0.04, 0.02)]),
             episode("0:0/1.0", 3, [call(1.5, 0.06, 0.9)]),
             episode("0:0/1.1", 3, [call(1.5, 0.06, 0.9)])]  # the same episode's second chain: its calls again
    rollouts.append(tmp_path, "learner", 0, 0, [Group(id="0:0", step=0, trajectories=first)])
    rollouts.append(tmp_path, "learner", 1, 1, [Group(id="1:0", step=1, trajectories=[episode("1:0/0", 1, [])])])
    figures = bench.arm_figures(tmp_path, 0.9)
    assert figures["s_to_target"] == 200.0 and figures["steps_to_target"] == 2
    assert figures["samples_to_target"] == 8  # steps 0 and 1 trained version 2
    assert figures["groups_per_s"] == round(8 / 150, 4) and figures["steps"] == 3  # the steps after the first
    assert figures["mean_lag"] == round(6 / 12, 3)
    assert figures["tool"]["queue_s"] == [0.5, 0.0, 1.5] and figures["tool"]["run_s"] == [0.01, 0.02, 0.9]
    assert figures["turns_per_episode"] == 2.0  # episodes of 2, 3 and 1 calls
    missed = bench.arm_figures(tmp_path, 0.99)
    assert missed["s_to_target"] is None and missed["samples_to_target"] is None


def arm(s: float | None, samples: int | None, gps: float, queue: list[float], plan: float | None = None) -> dict:
    figures = {"s_to_target": s, "samples_to_target": samples, "groups_per_s": gps,
               "tool": {k: queue if k == "queue_s" else [0.1] * len(queue) for k in bench.TIMING}}
    return figures | ({"plan": {"wall_speedup": plan}} if plan else {})


def test_the_triple_its_misses_and_the_pooled_latency():
    args = argparse.Namespace(target=0.9, steps=6, eval_every=1, eval_samples=32, seeds=[0, 1, 2])
    runs = {"sync": [arm(300, 12, 0.04, [2.0, 0.0], 1.2), arm(400, 16, 0.04, [3.0], 1.4), arm(None, None, 0.03, [4.0])],
            "async": [arm(200, 16, 0.08, [0.0]), arm(250, 20, 0.06, [0.0, 0.5]), arm(260, 24, 0.07, [])]}
    result = bench.summarise(runs, args)
    assert result["wall_speedup"] == round(400 / 250, 3)  # sync's median is its second run: a miss is slowest
    assert result["sample_ratio"] == round(20 / 16, 3) and result["throughput_ratio"] == round(0.07 / 0.04, 3)
    assert result["reached"]["sync"]["successes"] == 2 and result["reached"]["async"]["successes"] == 3
    assert result["plan_wall_speedup"] == 1.3 and result["plan_wall_speedup_by_seed"] == [1.2, 1.4, None]
    assert result["latency"]["sync"]["queue_s"] == {"median": 2.0, "p90": 4.0, "p99": 4.0, "n": 4}
    assert result["latency"]["async"]["queue_s"]["n"] == 3
    lo, hi = result["wall_speedup_ci95"]
    assert lo <= result["wall_speedup"] and hi is None  # resampled, the miss can be sync's median: no upper bound


def test_held_out_runs_take_the_committed_schedule():
    with pytest.raises(SystemExit) as refused:
        bench.parse(["--heldout", "--steps", "4"])
    assert refused.value.code == 2
    assert bench.heldout.HELDOUT[bench.BENCH] == list(range(1010, 1015))  # not the learning claim's 1000-1004
    with pytest.raises(SystemExit):
        bench.parse(["--seeds", "1010"])  # a screening run may not touch a held-out seed


def test_replan_asks_this_tree_s_plan_again_of_runs_already_made(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        bench.parse(["--replan"])  # nothing to re-plan without the saved runs
    assert refused.value.code == 2
    saved = {"exit": 0, "s_to_target": 300.0, "samples_to_target": 12, "steps_to_target": 3, "groups_per_s": 0.04,
             "turns_per_episode": 1.5, "mean_lag": 0, "peak_rss_gb": 3.0, "curve": [[0, 0.1]],
             "tool": {k: [0.1] for k in bench.TIMING}}
    for name in ("sync", "async"):
        (tmp_path / f"{name}-0.json").write_text(json.dumps(saved | {"plan": {"wall_speedup": 9.0}}))
    (tmp_path / "sync-0").mkdir()  # no records in it: the real `flowrl plan` says so
    bench.main(["--report-only", "--replan", "--seeds", "0", "--out", str(tmp_path)])
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["plan_wall_speedup"] is None and "error" in last["by_seed"]["0"]["sync"]["plan"]
    assert last["by_seed"]["0"]["async"]["plan"] == {"wall_speedup": 9.0}  # only sync runs are planned
