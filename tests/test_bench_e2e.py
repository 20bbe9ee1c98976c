"""tools/bench_e2e.py's `--warmups` override: both quickstart pipelines reduced to their GRPO phase."""

from pathlib import Path

import pytest
from tool_module import tool

from flowrl.spec.load import load

ROOT = Path(__file__).resolve().parents[1]


def bench():
    return tool("bench_e2e")


@pytest.mark.parametrize("name", ["sync", "async"])
def test_grpo_phase_alone(name):
    """The override leaves one phase, the pipeline's GRPO phase with its seconds replaced: a run
    from the warm-up's export then trains GRPO only, as long as both contenders are allowed."""
    b = bench()
    pipeline = b.PIPELINES[name]
    loaded = load(ROOT / pipeline, [f"phases={b.grpo_phase(pipeline, 42.0)}", "model.path=builtin:tiny-qwen2"])
    [phase] = loaded.spec.phases
    assert (phase.name, phase.seconds, phase.steps) == ("grpo", 42.0, None)
    assert len(load(ROOT / pipeline).spec.phases) == 2  # the file itself keeps its warm-up


def test_grpo_phase_of_fixed_steps():
    """`--grpo-steps N`: the GRPO phase runs N steps, with no seconds budget left over from the file."""
    b = bench()
    pipeline = b.PIPELINES["async"]
    loaded = load(ROOT / pipeline, [f"phases={b.grpo_phase(pipeline, 42.0, steps=30)}", "model.path=builtin:tiny-qwen2"])
    [phase] = loaded.spec.phases
    assert (phase.name, phase.seconds, phase.steps) == ("grpo", None, 30)


def test_mean_eval_is_the_learning_curve_area():
    b = bench()
    args = type("Args", (), {"also": [0.7], "target": 0.9})()
    evals = [{"eval_reward": r, "time": t, "version": 5 * t} for t, r in enumerate([0.2, 0.6, 0.95, 0.85])]
    out = b.summary(evals, 0.0, 10.0, args)
    assert out["mean_eval"] == 0.65 and out["best_eval"] == 0.95 and out["s_to_target"] == 2.0
    assert b.summary([], 0.0, 1.0, args)["mean_eval"] is None


def test_reached_counts_seeds_and_keeps_misses():
    """The done-when figures: seeds at the target, median and worst over those that got there (a miss
    counting as slower than every hit in the median), and each miss's best eval."""
    b = bench()
    runs = [{"name": "sync", "s_to_target": s, "steps_to_target": n, "best_eval": e}
            for s, n, e in [(30.0, 200, 0.95), (None, None, 0.86), (50.0, 400, 0.92), (20.0, 100, 0.97)]]
    out = b.reached(runs, [0, 1, 2, 3])
    assert out["sync_reached"] == 3 and out["sync_missed"] == {"1": 0.86}
    assert out["sync_steps_to_target_median"] == 300.0 and out["sync_steps_to_target_worst"] == 400
    assert out["sync_s_to_target_median"] == 40.0 and out["sync_s_to_target_worst"] == 50.0


def test_budget_overrides_follow_the_command_line():
    b = bench()
    args = type("Args", (), {"grpo_steps": None, "grpo_seconds": None})()
    assert b.budget_overrides(args) == []  # the pipeline's own budget
    args.grpo_steps = 30
    loaded = load(ROOT / b.PIPELINES["sync"], b.budget_overrides(args))
    assert (loaded.spec.phases[1].steps, loaded.spec.phases[1].seconds) == (30, None)


def test_mean_eval_ratio_is_async_over_sync_averaged_over_seeds():
    """The digit-task figure of issue #32: the mean of each run's mean eval over seeds, async over
    sync; a run that recorded no eval counts 0; no ratio without both contenders."""
    b = bench()
    runs = {"sync": [{"mean_eval": 0.8}, {"mean_eval": 0.6}], "async": [{"mean_eval": 0.63}, {"mean_eval": None}]}
    assert b.mean_eval_summary(runs) == {"sync_mean_eval": 0.7, "async_mean_eval": 0.315, "mean_eval_ratio": 0.45}
    assert "mean_eval_ratio" not in b.mean_eval_summary({"sync": runs["sync"]})
