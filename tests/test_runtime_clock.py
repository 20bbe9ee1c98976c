"""The runtime on a virtual clock (flowrl/runtime/clock.py): the real coordinator, roles and stages
with the toy operators of runtime_ops, whose waits are timers, so that hours of virtual time pass
in milliseconds and every run takes the same course. Each test pins one rule of admission,
staleness or pacing to exact times and ids, where a wall-clock test can only bound them."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import runtime_ops as ops

from flowrl.runtime.clock import Stalled, VirtualClock
from flowrl.runtime.executors import inprocess
from flowrl.runtime.executors.inprocess import simulate


def op(ex, node, replica=0):
    return next(s.op for s in ex.stages if s.node.name == node and s.replica == replica)


def spans(ex, node, name):
    pid = ex.coord.observe.pids[node]
    return [e for e in ex.coord.observe.kept.events if e.ph == "X" and e.pid == pid and e.name == name]


def times(ex):
    return [row["time"] for row in ex.coord.observe.kept.rows]


def replicas(plan, node, n):
    plan.nodes[node].resources = msgspec.structs.replace(plan.nodes[node].resources, replicas=n)
    return plan


def test_the_virtual_clock_jumps_to_the_next_timer_and_says_when_nothing_can_wake():
    clock = VirtualClock()

    async def late(seconds):
        await clock.sleep(seconds)
        return clock.now()

    async def both():
        return await asyncio.gather(late(3600.0), late(1.5))

    assert clock.run(both()) == [3600.0, 1.5] and clock.now() == 3600.0
    with pytest.raises(Stalled, match="every task waits and no timer is set"):
        clock.run(asyncio.Event().wait())


def test_a_sync_step_takes_exactly_its_records_and_its_slowest_sample_plus_training():
    plan = ops.grpo("sync", steps=4, batch_size=3, gen={"replica_delay": [1.0]}, train={"delay": 0.5})
    ex = simulate(plan)
    assert times(ex) == [1.5, 3.0, 4.5, 6.0]  # generation (1 s, all at once) and training (0.5 s) take turns
    assert op(ex, "learner").batches == [[(f"{t}:{i}", t) for i in range(3)] for t in range(4)]
    assert simulate(plan).coord.observe.kept == ex.coord.observe.kept  # the same course, event for event


def test_a_slower_replica_is_handed_fewer_samples():
    plan = replicas(ops.grpo("async", 2, steps=6, batch_size=4, gen={"replica_delay": [1.0, 3.0]},
                             train={"delay": 0.5}), "rollout", 2)
    generated = spans(simulate(plan), "rollout", "generate")
    fast, slow = (sum(1 for e in generated if e.tid // 100 == r) for r in (0, 1))
    assert fast + slow == 24 and fast > slow
    # Over a sync edge a step's samples are all handed out at once: by load, half each.
    plan = replicas(ops.grpo("sync", steps=6, batch_size=4, gen={"replica_delay": [1.0, 3.0]},
                             train={"delay": 0.5}), "rollout", 2)
    ex = simulate(plan)
    assert [sum(1 for e in spans(ex, "rollout", "generate") if e.tid // 100 == r) for r in (0, 1)] == [12, 12]
    assert times(ex) == [3.5 * (t + 1) for t in range(6)]  # each step waits for the slow replica


@pytest.mark.parametrize("k", [1, 2])
def test_generation_runs_ahead_of_training_by_exactly_the_staleness_limit(k):
    plan = ops.grpo("async", k, steps=8, batch_size=4, gen={"replica_delay": [0.1]}, train={"delay": 1.0})
    ex = simulate(plan)
    ahead = [e.args["step"] - e.args["version"] for e in spans(ex, "rollout", "generate")]
    assert max(ahead) == k  # admitted at version v up to step v + k, never beyond
    lags = [t - v for t, batch in enumerate(op(ex, "learner").batches) for _, v in batch]
    assert max(lags) == k and ex.coord.counters["dropped"] == 0


@pytest.mark.parametrize("on_stale", ["drop", "keep"])
def test_a_sample_older_than_the_limit_never_trains_on_a_drop_edge(on_stale):
    """Partial rollout, max_staleness 1, sample 0:0 slow (0.6 s against steps of ~0.01 s): it
    arrives versions later and is dropped (credited to admission), or kept and counted."""
    plan = ops.grpo("async", 1, steps=6, batch_size=4, on_stale=on_stale,
                    gen={"delay": 0.01, "partial_rollout": True, "slow_on": "0:0", "slow_delay": 0.6})
    ex = simulate(plan)
    lags = {gid: t - v for t, batch in enumerate(op(ex, "learner").batches) for gid, v in batch}
    if on_stale == "drop":
        assert "0:0" not in lags and max(lags.values()) == 1 and ex.coord.counters["dropped"] == 2
    else:
        assert lags["0:0"] == 5 and ex.coord.counters["stale_kept"] == 3 and ex.coord.counters["dropped"] == 0
    assert all(during for _, during in op(ex, "rollout").updates)  # loaded while generations were in flight


def test_without_partial_rollout_a_weight_load_waits_for_the_slowest_generation():
    plan = ops.grpo("async", 1, steps=6, batch_size=4, gen={"delay": 0.01, "slow_on": "0:0", "slow_delay": 0.6})
    ex = simulate(plan)
    assert not any(during for _, during in op(ex, "rollout").updates)
    first = min(spans(ex, "rollout", "update_weights"), key=lambda e: e.ts)
    assert first.args["version"] == 1 and first.ts == 0.6e6  # the drain ended with sample 0:0, at 0.6 s
    lags = [t - v for t, batch in enumerate(op(ex, "learner").batches) for _, v in batch]
    assert max(lags) <= 1 and ex.coord.counters["dropped"] == 0


def test_an_async_step_takes_a_short_batch_once_no_more_may_come():
    """Sample 0 of every step rejected, max_staleness 1: lost samples are admitted again (credit), so
    six full batches form from 24 records; the last two steps find nothing more to come and train on
    empty batches rather than wait."""
    plan = ops.grpo("async", 1, steps=8, batch_size=4, gen={"reject_every": 4, "delay": 0.002},
                    train={"delay": 0.05})
    ex = simulate(plan)
    batches = op(ex, "learner").batches
    assert [len(b) for b in batches] == [4] * 6 + [0] * 2 and ex.coord.counters["rejected"] == 8
    assert {t - v for t, batch in enumerate(batches[1:], 1) for _, v in batch} == {1}  # never waits on lag 0


def test_a_run_that_would_hang_is_stopped_and_said(monkeypatch):
    """Sample 0:0 takes a year: the stages' heartbeats keep the clock going, the watch stops it."""
    monkeypatch.setattr(inprocess, "STALL_S", 100.0)
    plan = ops.grpo("sync", steps=2, batch_size=2, gen={"slow_on": "0:0", "slow_delay": 3e7})
    with pytest.raises(Stalled, match="no train step in 100 virtual seconds, at versions {'learner': 0}"):
        simulate(plan)
