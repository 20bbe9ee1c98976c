"""Ray executor: the same stage code as in-process, on actors; restarts of a killed generate actor."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import runtime_ops as ops

from flowrl.runtime.durability import ledger
from flowrl.runtime.run import StageFailed, latest_checkpoint, run

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    # Ray workers import the test operators by module name.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def train_log(run_dir, rank=0):
    rows = [json.loads(line) for line in (run_dir / "train-learner.jsonl").read_text().splitlines()]
    return [r for r in rows if r["rank"] == rank]


def test_ray_and_inprocess_produce_the_same_records(tmp_path):
    plan = ops.grpo("sync", steps=3, batch_size=3, gen={"delay": 0.01}, reward={"delay": 0.01})
    results = {}
    for executor in ("inprocess", "ray"):
        run_dir = tmp_path / executor
        result = run(plan, run_dir, executor=executor, progress=False)
        assert result.status == "done" and result.steps == 3
        report = ledger.check(run_dir)
        assert report.ended and report.clean, report.problems
        results[executor] = [(r["step"], sorted(r["ids"]), r["checksum"]) for r in train_log(run_dir)]
    assert results["ray"] == results["inprocess"]
    pids = {r["pid"] for r in train_log(tmp_path / "ray")}
    assert os.getpid() not in pids  # the trainer really ran in an actor


def test_killed_generate_actor_is_restarted_and_its_samples_reissued(tmp_path):
    # The trainer is a group of two ranks here too: each is an actor with the rendezvous env.
    plan = ops.grpo("async", 1, steps=4, batch_size=4, gen={"delay": 0.05, "die_on": "1:2"}, train_ranks=2)
    result = run(plan, tmp_path, executor="ray", progress=False)
    assert result.status == "done" and result.steps == 4
    assert (tmp_path / "died-1:2").exists()
    events = ledger.read(tmp_path)
    reissued = {e["id"] for e in events if e["event"] == "reissue"}
    assert "1:2" in reissued
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
    seen = [i for r in train_log(tmp_path) for i in r["ids"]]
    assert sorted(seen) == sorted(f"{s}:{i}" for s in range(4) for i in range(4))  # none lost, none twice
    ranks = [train_log(tmp_path, rank=r) for r in (0, 1)]
    assert [r["ids"] for r in ranks[0]] == [r["ids"] for r in ranks[1]]
    assert {r["world_size"] for r in ranks[0] + ranks[1]} == {"2"}
    assert {r["pid"] for r in ranks[0]}.isdisjoint({r["pid"] for r in ranks[1]})


def test_ray_operator_exception_names_the_node_and_leaves_no_process(tmp_path):
    plan = ops.grpo("sync", steps=20, batch_size=2, reward={"fail_on": "2:0"})
    start = time.time()
    with pytest.raises(StageFailed, match=r"(?s)node 'score'.*ZeroDivisionError: toy reward failed on 2:0"):
        run(plan, tmp_path, executor="ray", progress=False)
    assert time.time() - start < 60
    pid = train_log(tmp_path)[0]["pid"]  # the train actor's process
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"train actor process {pid} still alive after the run failed")


def test_ray_setup_that_raises_names_the_node_not_a_flowrl_bug(tmp_path):
    plan = ops.grpo("sync", steps=2, train={"fail_setup": True})
    with pytest.raises(StageFailed, match=r"(?s)node 'learner' \(replica 0\): \w+\.setup\(\) failed: "
                                          ".*toy train cannot set up") as info:
        run(plan, tmp_path, executor="ray", progress=False)
    assert "stage.py" not in str(info.value) and "ray::" not in str(info.value), str(info.value)  # the user's frames only


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_weights_reach_sync_by_reference_not_through_the_coordinator(tmp_path, capfd):
    # 1 MiB of weights per version; ToySync checks each arrives whole and of the right version.
    plan = ops.grpo("sync", steps=2, batch_size=2, train={"weights_kb": 1024})
    crossed = {}
    for executor in ("inprocess", "ray"):
        result = run(plan, tmp_path / executor, executor=executor, progress=False)
        assert result.status == "done" and result.steps == 2
        crossed[executor] = [row["coordinator_weight_bytes"] for row in metrics(tmp_path / executor)]
    assert crossed["inprocess"] == [2**20] * 2  # handed over by reference there: the policy's size
    assert crossed["ray"] == [0] * 2  # only object refs crossed the coordinator actor
    # The generate actor is restartable: none of its constructor arguments may sit in the object store.
    assert "constructor arguments in the object store" not in capfd.readouterr().err


@pytest.mark.slow
def test_checkpoint_under_ray_keeps_no_weights_ref_and_resumes(tmp_path):
    plan = ops.grpo("async", 1, steps=4, batch_size=2, train={"weights_kb": 64, "delay": 0.05})
    first = run(plan, tmp_path, executor="ray", progress=False, max_steps=2)
    assert first.status == "interrupted" and first.steps == 2
    state = pickle.loads((latest_checkpoint(tmp_path) / "coordinator.pkl").read_bytes())
    policy = [records for label, (records, _) in state["channels"].items() if label.startswith("learner.policy")]
    assert policy and all(r.value is None for records in policy for r in records)
    result = run(plan, tmp_path, executor="ray", resume=True, progress=False)
    assert result.status == "done" and result.steps == 4
    assert [row["coordinator_weight_bytes"] for row in metrics(tmp_path)] == [0] * 4
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
