"""`run.stop_when`: a run ends cleanly (status done, a final checkpoint, a closed ledger) once a
metric reaches its threshold; any one of several entries is enough."""

from __future__ import annotations

import runtime_ops as ops
from test_runtime import assert_clean

from flowrl.runtime.run import run
from flowrl.runtime.targets import Targets
from flowrl.spec.stop_when import check_names


def test_a_train_metric_reaching_its_threshold_ends_the_run_after_that_step(tmp_path):
    plan = ops.grpo("sync", steps=10_000, batch_size=2)
    # train.loss is 1 / (step + 1) in the toy trainer: it never reaches 2; train.batch (2) does at once.
    plan.run["stop_when"] = {"train.loss": 2.0, "train.batch": 2.0}
    result = run(plan, tmp_path, progress=False)
    assert result.status == "done" and result.stopped_by == "stop_when"
    assert result.reached == "train.batch 2 >= 2" and result.steps == 1
    assert result.checkpoint is not None and result.checkpoint.name == "step-1"
    assert_clean(tmp_path)


def test_thresholds_are_lower_bounds_read_from_rows_and_evaluations():
    targets = Targets({"reward": 0.5, "eval_reward": 0.9})
    assert not targets.row({"reward": 0.49, "train": {}}) and not targets.row({"reward": None})
    assert not targets.operators({"eval/reward": 0.89, "generate/episodes": 5.0})
    assert targets.operators({"eval/reward": 0.9}) and targets.reached == "eval_reward 0.9 >= 0.9"
    assert Targets({"train.kl": 0.1}).row({"reward": 1.0, "train": {"kl": 0.2}})
    check_names({"eval_reward": 1, "reward": 1, "train.entropy": 1})
