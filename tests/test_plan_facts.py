"""Graph facts in the Plan (flowrl/graph/facts.py): what the runtime reads instead of walking the graph."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import runtime_ops as ops

from flowrl.graph.compile import compile_file
from flowrl.graph.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def diamond(left_k: int, right_k: int, last: str = "async", last_k: int = 1) -> Plan:
    """rollout -> merge.left (async left_k); rollout -> score (async right_k) -> merge.right; merge -> learner."""
    return ops.plan([ops.node("rollout", "gen"), ops.node("score", "reward"), ops.node("merge", "join"),
                     ops.node("learner", "train"), ops.node("publish", "sync")],
                    [ops.edge("rollout", "merge", "async", left_k, dst_port="left"),
                     ops.edge("rollout", "score", "async", right_k), ops.edge("score", "merge", dst_port="right"),
                     ops.edge("merge", "learner", last, last_k if last == "async" else 0),
                     ops.edge("learner", "publish", dst_port="policy"), ops.edge("publish", "rollout", dst_port="weights")])


def test_budget_is_the_smallest_path_sum_and_a_limit_the_longest():
    facts = diamond(2, 1).facts
    assert facts.generate["rollout"].budget == 1 + 1  # via score: 1, then merge -> learner: 1
    assert facts.limits["merge.trajectories -> learner.trajectories"] == 2 + 1  # via the left edge: 2
    assert facts.limits["rollout.trajectories -> merge.left"] == 2
    assert facts.limits["score.trajectories -> merge.right"] is None  # a sync edge has no check
    assert facts.generate["rollout"].credited and facts.generate["rollout"].feeds == ["learner"]


def test_no_credit_over_a_sync_train_input_or_a_zero_budget():
    assert not diamond(2, 1, last="sync").facts.generate["rollout"].credited
    assert diamond(2, 1, last="sync").facts.generate["rollout"].budget == 1
    assert not diamond(0, 0, last="async", last_k=0).facts.generate["rollout"].credited


def test_per_node_the_generate_nodes_upstream_and_the_train_nodes_downstream():
    facts = diamond(1, 1).facts
    assert facts.nodes["merge"].generators == ["rollout"] and facts.nodes["merge"].trains == ["learner"]
    assert facts.nodes["learner"].input == "merge.trajectories -> learner.trajectories"
    assert facts.nodes["rollout"].trains == ["learner"] and facts.nodes["rollout"].input is None
    assert facts.nodes["publish"].trains == []  # the weights edge back is not a data path


def test_a_generate_node_that_reaches_no_train_node_has_no_budget():
    plan = ops.plan([ops.node("rollout", "gen"), ops.node("score", "reward")], [ops.edge("rollout", "score")])
    assert plan.facts.generate["rollout"].budget is None and plan.facts.generate["rollout"].feeds == []


def test_a_train_node_needs_exactly_one_data_input():
    with pytest.raises(ValueError, match="train node 'learner' needs exactly one data input edge, has 2"):
        ops.plan([ops.node("rollout", "gen"), ops.node("score", "reward"), ops.node("learner", "train")],
                 [ops.edge("rollout", "score"), ops.edge("rollout", "learner"), ops.edge("score", "learner")])


def test_the_compiler_puts_them_in_the_plan_and_an_older_plan_json_gets_them_on_load():
    plan = compile_file(str(ROOT / "pipelines/grpo_async.yaml")).plan
    assert plan.facts.generate["rollout"].budget == 2
    assert plan.facts.limits["score.trajectories -> learner.trajectories"] == 2
    record = msgspec.json.decode(plan.record())
    assert record["facts"]["generate"]["rollout"]["budget"] == 2  # plan.json shows them
    del record["facts"]
    assert msgspec.json.decode(msgspec.json.encode(record), type=Plan).facts == plan.facts
