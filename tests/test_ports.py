"""A node's output of the wrong type is blamed on the node that returned it, naming the type its port
carries, not on the node downstream that would fail on it (with a traceback): a transform's result, a
generate node's group, a train step's result and metrics. Through the real runtime (toy operators),
and once through the real CLI with the tiny model (slow)."""

from __future__ import annotations

import pytest
import runtime_ops as ops
from test_untrained import BASE, TINY, failed, flowrl

from flowrl.data.trajectory import Group
from flowrl.operator import PROMPTS, TRAJECTORIES
from flowrl.runtime.ports import wrong_metrics, wrong_value
from flowrl.runtime.run import StageFailed, run


def test_what_each_port_type_carries():
    assert wrong_value(TRAJECTORIES, None) is None and wrong_value(TRAJECTORIES, Group(id="0", step=0, trajectories=[])) is None
    assert "str 'garbage'; a trajectories port carries a flowrl.data.trajectory.Group" in wrong_value(TRAJECTORIES, "garbage")
    group = Group(id="0", step=0, trajectories=[])
    group.trajectories = ["x"]
    assert "trajectories[0] is str 'x'; it must be a flowrl.data.trajectory.Trajectory" in wrong_value(TRAJECTORIES, group)
    assert "a prompts port carries a sample dict" in wrong_value(PROMPTS, [1])
    assert wrong_value("policy", object()) is None  # opaque to the runtime
    assert wrong_metrics({"loss": 0.5, "n": 3, "nan": float("nan")}) is None
    assert "metric 'loss' = float32" in wrong_metrics({"loss": __import__("numpy").float32(0.5)})


def test_a_transform_returning_the_wrong_type_is_blamed_not_its_consumer(tmp_path):
    base = ops.grpo("sync", steps=2, batch_size=2)
    nodes = [*base.nodes.values(), ops.node("tag", "user_code:GarbageOut")]
    edges = [e for e in base.edges if (e.src, e.dst) != ("score", "learner")]
    plan = ops.plan(nodes, [*edges, ops.edge("score", "tag"), ops.edge("tag", "learner")], steps=2, batch_size=2)
    with pytest.raises(StageFailed) as info:
        run(plan, tmp_path, progress=False)
    text = str(info.value)
    assert "node 'tag' (replica 0) failed" in text and "GarbageOut.process() returned for port 'trajectories'" in text
    assert "str 'garbage'; a trajectories port carries a flowrl.data.trajectory.Group" in text
    assert "Traceback" not in text and "learner" not in text


def test_a_train_steps_metrics_json_cannot_write_are_blamed_on_the_train_node(tmp_path):
    base = ops.grpo("sync", steps=2, batch_size=2)
    nodes = {**base.nodes, "learner": ops.node("learner", "user_code:BadMetricsTrain")}
    with pytest.raises(StageFailed) as info:
        run(ops.plan(list(nodes.values()), base.edges, steps=2, batch_size=2), tmp_path, progress=False)
    text = str(info.value)
    assert "node 'learner' (replica 0) failed" in text and "BadMetricsTrain.train() on step 0 returned metric 'loss'" in text
    assert "a metric is a Python number" in text and "Traceback" not in text


@pytest.mark.slow
def test_flowrl_run_blames_the_transform_that_returned_garbage(tmp_path):
    spec = BASE.read_text().replace("  learner:\n", "  tag:\n    op: user_code:GarbageOut\n  learner:\n").replace(
        "  - score -> learner\n", "  - score -> tag\n  - tag -> learner\n")
    (tmp_path / "garbage.yaml").write_text(spec)
    proc = flowrl("run", str(tmp_path / "garbage.yaml"), *TINY, "run.steps=2", "--run-dir", str(tmp_path / "run"))
    failed(proc, "node 'tag' (replica 0) failed", "GarbageOut.process() returned for port 'trajectories' on sample",
           "a trajectories port carries a flowrl.data.trajectory.Group")
    assert "node 'learner'" not in proc.stderr
