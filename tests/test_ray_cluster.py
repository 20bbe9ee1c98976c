"""Scale-out under Ray: stages placed on named nodes of a multi-node cluster, and a run that attaches
to a cluster it did not start and leaves it running (the `ray_nodes` fixture, tests/conftest.py:
a head and worker nodes a and b started with `ray start` on this machine)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgspec
import pytest
import runtime_ops as ops
from adam_tolerance import assert_adam_close

from flowrl.cli import main
from flowrl.graph.compile import compile_file
from flowrl.graph.render import resources_label
from flowrl.runtime.durability import checkpoints, ledger
from flowrl.runtime.executors.ray_placement import PlacementError
from flowrl.runtime.run import StageFailed, run

ROOT = Path(__file__).resolve().parents[1]
ray = pytest.importorskip("ray")


def placed(plan, **resources):
    """`plan` with node name -> extra resources keys."""
    nodes = {name: msgspec.structs.replace(n, resources=msgspec.structs.replace(n.resources, **resources[name]))
             if name in resources else n for name, n in plan.nodes.items()}
    return msgspec.structs.replace(plan, nodes=nodes)


def test_placement_keys_reach_the_plan(tmp_path):
    spec = (ROOT / "tests/specs/good/base.yaml").read_text().replace(
        "    op: generate\n", "    op: generate\n    resources: {cpus: 0.5, custom: {flowrl_node_a: 0.01}, placement: spread}\n"
    ).replace("    op: train\n", "    op: train\n    resources: {cpus: 0.5, labels: {flowrl_node: b}}\n"
              ).replace("cluster: {cpus: 2}", "cluster: {cpus: 2}\nrun: {executor: ray, ray_address: '10.0.0.1:6379'}")
    (tmp_path / "p.yaml").write_text(spec)
    plan = compile_file(str(tmp_path / "p.yaml")).plan
    rollout, learner = plan.nodes["rollout"].resources, plan.nodes["learner"].resources
    assert (rollout.custom, rollout.labels, rollout.placement) == ({"flowrl_node_a": 0.01}, {}, "spread")
    assert (learner.custom, learner.labels, learner.placement) == ({}, {"flowrl_node": "b"}, "pack")
    assert plan.run["ray_address"] == "10.0.0.1:6379"
    assert resources_label(plan.nodes["rollout"]) == "0.5 CPU + 0.01 flowrl_node_a on spread"
    assert resources_label(plan.nodes["learner"]) == "0.5 CPU on flowrl_node=b"


@pytest.mark.slow
def test_stages_run_on_the_nodes_they_name_and_the_cluster_stays_up(ray_nodes, tmp_path, capsys):
    plan = placed(ops.grpo("sync", steps=3, batch_size=2, train={"weights_kb": 256}),
                  rollout={"custom": {"flowrl_node_a": 0.5}}, learner={"labels": {"flowrl_node": "b"}})
    plan.run["executor"], plan.run["ray_address"] = "ray", ray_nodes.address
    result = run(plan, tmp_path, progress=False)
    assert result.status == "done" and result.steps == 3
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
    record = json.loads((tmp_path / "placement.json").read_text())
    assert record["attached"] is True and record["ray_nodes"] == 3
    rollout, learner = record["nodes"]["rollout"][0], record["nodes"]["learner"][0]
    assert "flowrl_node_a" in rollout["custom"] and learner["labels"]["flowrl_node"] == "b"
    assert rollout["ray_node"] != learner["ray_node"]
    trained = [json.loads(line) for line in (tmp_path / "train-learner.jsonl").read_text().splitlines()]
    assert {r["pid"] for r in trained} == {learner["pid"]}  # the record names the process that trained
    # Across nodes too, the weights went by reference: none through the coordinator.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["coordinator_weight_bytes"] for r in rows] == [0, 0, 0]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ray placement (attached to a running cluster, 3 nodes)" in out
    assert "flowrl_node_a" in out and "flowrl_node=b" in out
    assert not ray.is_initialized()  # flowrl disconnected its driver ...
    assert ray_nodes.alive_nodes() == 3  # ... and left the cluster it attached to running


@pytest.mark.slow
def test_a_node_no_ray_node_can_host_fails_fast_and_names_it(ray_nodes, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_nodes.address)  # attach through the environment this time
    plan = placed(ops.grpo("sync", steps=2, batch_size=2), learner={"custom": {"flowrl_node_c": 1}})
    with pytest.raises(PlacementError, match=r"node 'learner': no Ray node can host it.*flowrl_node_c.*flowrl_node_a"):
        run(plan, tmp_path, executor="ray", progress=False)
    assert not ray.is_initialized()
    assert ray_nodes.alive_nodes() == 3


def test_coordinator_counts_weight_tensors_once_and_refs_as_nothing():
    import numpy as np
    import torch

    from flowrl.runtime.observe import tensor_bytes
    from flowrl_operators.transport.inprocess import InProcessRecord

    weights = torch.zeros(256)  # 1 KiB
    buckets = [[("w", weights)], [("b", torch.zeros(2, dtype=torch.bfloat16))]]
    assert tensor_bytes(buckets) == 1024 + 4
    # A weights record aliasing the policy's tensors is the same bytes, counted once.
    assert tensor_bytes([buckets, InProcessRecord(1, buckets, 1028)]) == 1028
    assert tensor_bytes({"arrays": [np.zeros(8, dtype=np.uint8)]}) == 8
    assert tensor_bytes(ray.ObjectRef(b"\x01" * 28)) == 0  # what Ray's stages hand over instead


@pytest.mark.slow
def test_a_two_rank_fsdp2_train_node_spreads_over_two_ray_nodes(ray_nodes, tmp_path):
    # The real pipeline (tiny model, FSDP2 trainer, object-store sync); the learner's two ranks
    # must land on distinct Ray nodes and meet over gloo across them.
    spec = (ROOT / "tests/specs/good/base.yaml").read_text().replace(
        "    op: train\n", "    op: train\n    resources: {cpus: 0.5, replicas: 2, placement: strict_spread}\n"
    ).replace("cluster: {cpus: 2}", f"cluster: {{cpus: 3}}\nrun: {{steps: 2, executor: ray, ray_address: '{ray_nodes.address}'}}")
    (tmp_path / "p.yaml").write_text(spec)
    result = run(compile_file(str(tmp_path / "p.yaml")).plan, tmp_path / "run", progress=False)
    assert result.status == "done" and result.steps == 2
    ranks = json.loads((tmp_path / "run" / "placement.json").read_text())["nodes"]["learner"]
    assert len({r["ray_node"] for r in ranks}) == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["coordinator_weight_bytes"] for r in rows] == [0, 0]
    assert all(abs(r["train"]["loss"]) < 10 for r in rows)


@pytest.mark.slow
def test_two_train_ranks_on_two_nodes_equal_one_rank_after_three_steps(ray_nodes, tmp_path):
    # Same seed, same samples: the two ranks split each batch, all-reduce their gradients, and
    # must land on the policy one rank computes alone (float summation order aside).
    from safetensors.torch import load_file

    def policy(replicas: int, placement: str) -> dict:
        spec = (ROOT / "tests/specs/good/base.yaml").read_text().replace(
            "    op: train\n", f"    op: train\n    resources: {{cpus: 0.5, replicas: {replicas}, placement: {placement}}}\n"
            "    loss: {entropy_coef: 0.01}\n    advantage: {estimator: grpo, gamma: 0.0}\n"
        ).replace("cluster: {cpus: 2}", f"cluster: {{cpus: 3}}\nrun: {{steps: 3, executor: ray, ray_address: '{ray_nodes.address}'}}"
        ).replace("fn: builtin:reverse_digits", "fn: flowrl_operators.tasks.digits:position_rewards")
        (tmp_path / f"p{replicas}.yaml").write_text(spec)
        out = tmp_path / f"run{replicas}"
        assert run(compile_file(str(tmp_path / f"p{replicas}.yaml")).plan, out, progress=False).status == "done"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(r["train"]["grad_norm"] > 0 for r in rows)  # it did train
        if replicas > 1:
            ranks = json.loads((out / "placement.json").read_text())["nodes"]["learner"]
            assert len({r["ray_node"] for r in ranks}) == replicas
        return load_file(next((out / "export" / "learner").glob("*.safetensors")))

    one, two = policy(1, "pack"), policy(2, "strict_spread")
    # Split into micro-batches and packed differently from the ranks' shards: equal up to summation
    # order, which Adam amplifies where a gradient is near its eps (adam_tolerance.py).
    assert_adam_close(two, one, lr=1e-3, steps=3)


@pytest.mark.slow
def test_a_lost_machine_moves_the_generate_stage_to_another_node(ray_nodes, tmp_path):
    # Generate may run on either worker; everything else on the head. Worker nodes a and b
    # carry flowrl_pool=workers, the head does not.
    others = {n: {"labels": {"flowrl_pool": "!workers"}} for n in ("score", "learner", "publish")}
    plan = placed(ops.grpo("sync", steps=30, batch_size=2, gen={"delay": 0.2}),
                  rollout={"labels": {"flowrl_pool": "workers"}}, **others)
    plan.run["ray_address"] = ray_nodes.address
    killed: list[str] = []
    finished = threading.Event()

    def lose_the_rollout_machine() -> None:
        trained = tmp_path / "train-learner.jsonl"  # the toy trainer appends a line per step
        while not finished.is_set():
            if trained.exists() and len(trained.read_text().splitlines()) >= 3:
                where = json.loads((tmp_path / "placement.json").read_text())["nodes"]["rollout"][0]
                killed.append(where["labels"]["flowrl_node"])
                ray_nodes.kill(killed[0])
                return
            time.sleep(0.1)

    thread = threading.Thread(target=lose_the_rollout_machine)
    thread.start()
    try:
        result = run(plan, tmp_path, executor="ray", progress=False)
    finally:
        finished.set()
        thread.join()
        if killed:
            ray_nodes.revive(killed[0])  # the cluster as the module's other tests expect it
    assert killed, "the run ended before the machine could be lost"
    assert result.status == "done" and result.steps == 30
    moved = json.loads((tmp_path / "placement.json").read_text())["nodes"]["rollout"][0]
    assert moved["labels"]["flowrl_node"] not in killed  # Ray re-placed it; flowrl restarted it there
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
    trained = [i for line in (tmp_path / "train-learner.jsonl").read_text().splitlines() for i in json.loads(line)["ids"]]
    assert sorted(trained) == sorted(f"{s}:{i}" for s in range(30) for i in range(2))  # none lost, none twice


def test_placement_check_refuses_what_the_alive_nodes_cannot_hold():
    from flowrl.operator import Resources
    from flowrl.runtime.executors.ray_placement import check

    # Shaped as ray.nodes() answers; a dead node offers nothing.
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 1.0, "box_a": 1.0},
              "Labels": {"zone": "a"}},
             {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 1.0}, "Labels": {"zone": "b"}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8.0, "box_c": 1.0}}]
    check({"rollout": Resources(cpus=0.5, custom={"box_a": 0.5}), "learner": Resources(labels={"zone": "b"}),
           "ranks": Resources(cpus=0.25, replicas=2, placement="strict_spread")}, nodes)
    refused = {
        "no node has it": ({"x": Resources(custom={"box_c": 1})}, r"node 'x': no Ray node can host it.*box_c"),
        "too big for any node": ({"x": Resources(cpus=1.5)}, r"node 'x'.*'CPU': 1.5.*10\.0\.0\.2: \{\"CPU\": 1\.0\}"),
        "label nobody carries": ({"x": Resources(labels={"zone": "c"})}, r"node 'x'.*labelled \{'zone': 'c'\}"),
        "more distinct nodes": ({"x": Resources(replicas=3, placement="strict_spread")}, r"on 3 distinct nodes"),
        "together too much": ({"x": Resources(custom={"box_a": 0.75}), "y": Resources(custom={"box_a": 0.5})},
                              r"together ask for more.*box_a 1\.25 of 1"),
    }
    for resources, message in refused.values():
        with pytest.raises(PlacementError, match=message):
            check(resources, nodes)


QUICKSTART_ON_THREE_NODES = [
    # A few steps of each phase of the shipped file, overridden at run time (the file is unchanged).
    "phases.0.steps=2", "phases.1.steps=3", "phases.1.seconds=null", "data.batch_size=4",
    "nodes.rollout.group_size=4", "data.eval.every=3", "data.eval.samples=4", "cluster.cpus=3",
    # Generate on the head; the two FSDP2 ranks one on each worker (labelled flowrl_pool=workers).
    "nodes.rollout.resources={cpus: 0.5, labels: {flowrl_pool: '!workers'}}",
    "nodes.learner.resources={cpus: 0.5, replicas: 2, labels: {flowrl_pool: workers}, placement: strict_spread}",
    "nodes.learner.own_process=null",  # each rank is a Ray actor process already
]


@pytest.mark.slow
def test_quickstart_async_on_three_nodes_generate_apart_from_two_train_ranks(ray_nodes, tmp_path):
    out = tmp_path / "run"
    assert main(["run", str(ROOT / "pipelines/quickstart_async.yaml"), *QUICKSTART_ON_THREE_NODES,
                 f"run.ray_address={ray_nodes.address}", "--executor", "ray", "--run-dir", str(out), "--quiet"]) == 0
    for phase, steps in (("0-warmup", 2), ("1-grpo", 3)):
        where = out / "phases" / phase
        report = ledger.check(where)
        assert report.ended and report.clean and report.produced > 0, report.problems  # none lost or twice
        record = json.loads((where / "placement.json").read_text())
        assert record["attached"] is True and record["ray_nodes"] == 3
        rollout, ranks = record["nodes"]["rollout"], record["nodes"]["learner"]
        assert len(rollout) == 1 and "flowrl_node" not in rollout[0]["labels"]  # the head
        assert sorted(r["labels"]["flowrl_node"] for r in ranks) == ["a", "b"]  # one rank per worker
        assert rollout[0]["ray_node"] not in {r["ray_node"] for r in ranks}
        rows = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(steps))
        assert all(r["coordinator_weight_bytes"] == 0 and r["train"]["grad_norm"] > 0 for r in rows)
    assert ray_nodes.alive_nodes() == 3


@pytest.mark.slow
def test_a_killed_train_rank_restarts_the_run_from_its_checkpoint_losing_nothing(ray_nodes, tmp_path):
    # The real pipeline with a two-rank FSDP2 train node, one rank per worker; rank 1's actor
    # process is killed with SIGKILL after the first checkpoint (version 2).
    import os
    import signal

    spec = (ROOT / "tests/specs/good/base.yaml").read_text().replace(
        "    op: train\n", "    op: train\n    resources: {cpus: 0.5, replicas: 2, placement: strict_spread}\n"
    ).replace("cluster: {cpus: 2}", f"cluster: {{cpus: 3}}\nrun: {{steps: 12, checkpoint_every: 2, "
              f"executor: ray, ray_address: '{ray_nodes.address}'}}")
    (tmp_path / "p.yaml").write_text(spec)
    out, killed, finished = tmp_path / "run", [], threading.Event()

    def kill_rank_1() -> None:
        while not finished.is_set():
            if (out / "checkpoints" / "latest").exists():
                pid = json.loads((out / "placement.json").read_text())["nodes"]["learner"][1]["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill_rank_1)
    thread.start()
    try:
        result = run(compile_file(str(tmp_path / "p.yaml")).plan, out, progress=False)
    finally:
        finished.set()
        thread.join()
    assert killed, "the run ended before a checkpoint was written"
    assert result.status == "done" and result.steps == 12 and result.restarts == 1
    report = ledger.check(out)
    assert report.ended and report.clean, report.problems  # every sample consumed once, none lost
    events = ledger.read(out)
    assert sum(e["event"] == "resume" for e in events) == 1
    issued = [e["id"] for e in events if e["event"] == "consume" and e["edge"] == "data -> rollout"]
    assert len(issued) == len(set(issued)) == 12 * 4  # each of 12 steps' 4 samples generated once
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))  # each step's row once, cut back to the checkpoint
    ranks = json.loads((out / "placement.json").read_text())["nodes"]["learner"]
    assert killed[0] not in {r["pid"] for r in ranks} and len({r["ray_node"] for r in ranks}) == 2
    assert ray_nodes.alive_nodes() == 3


@pytest.mark.slow
def test_out_of_restarts_a_killed_trainer_fails_cleanly_and_resume_completes(ray_nodes, tmp_path):
    # run.max_restarts: 0: the run stops with a message naming the dead stage, its checkpoint
    # intact; a resume finishes it with every sample trained once.
    import os
    import signal

    plan = ops.grpo("sync", steps=12, batch_size=2, train={"delay": 0.2})
    plan.run.update(executor="ray", ray_address=ray_nodes.address, checkpoint_every=2, max_restarts=0)
    killed, finished = [], threading.Event()

    def kill_trainer() -> None:
        while not finished.is_set():
            if (tmp_path / "checkpoints" / "latest").exists():
                killed.append(json.loads((tmp_path / "placement.json").read_text())["nodes"]["learner"][0]["pid"])
                os.kill(killed[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill_trainer)
    thread.start()
    try:
        with pytest.raises(StageFailed, match=r"node 'learner' \(replica 0\): its train actor's process died; "
                                              r"restarted 0 times \(run.max_restarts\).*intact.*--resume"):
            run(plan, tmp_path, progress=False)
    finally:
        finished.set()
        thread.join()
    assert killed and checkpoints.latest(tmp_path) is not None
    assert not ledger.check(tmp_path).ended  # not closed: the run is to be resumed
    result = run(plan, tmp_path, resume=True, progress=False)
    assert result.status == "done" and result.steps == 12 and result.restarts == 0
    report = ledger.check(tmp_path)
    assert report.ended and report.clean, report.problems
    last = {}  # step -> the ids its surviving (last) training took; steps redone after the kill count once
    for line in (tmp_path / "train-learner.jsonl").read_text().splitlines():
        row = json.loads(line)
        last[row["step"]] = row["ids"]
    assert sorted(i for ids in last.values() for i in ids) == sorted(f"{s}:{i}" for s in range(12) for i in range(2))


@pytest.mark.slow
def test_two_engines_of_one_generate_node_on_two_nodes_share_the_work_and_every_version(ray_nodes, tmp_path):
    # The real pipeline; the generate node has two replicas (two embedded engines), one per
    # worker; everything else on the head.
    head = "resources: {cpus: 0.25, labels: {flowrl_pool: '!workers'}}"
    spec = (ROOT / "tests/specs/good/base.yaml").read_text().replace(
        "    op: generate\n", "    op: generate\n    resources: {cpus: 0.5, replicas: 2, labels: {flowrl_pool: workers}, "
        "placement: strict_spread}\n").replace("    op: train\n", f"    op: train\n    {head}\n").replace(
        "    op: reward\n", f"    op: reward\n    {head}\n").replace("    op: sync\n", f"    op: sync\n    {head}\n"
    ).replace("cluster: {cpus: 2}", f"cluster: {{cpus: 3}}\nrun: {{steps: 3, executor: ray, ray_address: '{ray_nodes.address}'}}"
              ).replace("batch_size: 4", "batch_size: 6")
    (tmp_path / "p.yaml").write_text(spec)
    out = tmp_path / "run"
    assert run(compile_file(str(tmp_path / "p.yaml")).plan, out, progress=False).status == "done"
    engines = json.loads((out / "placement.json").read_text())["nodes"]["rollout"]
    assert sorted(e["labels"]["flowrl_node"] for e in engines) == ["a", "b"]
    report = ledger.check(out)
    assert report.ended and report.clean, report.problems
    events = ledger.read(out)
    issued = [e for e in events if e["event"] == "issue"]
    assert sorted(e["id"] for e in issued) == sorted(f"{s}:{i}" for s in range(3) for i in range(6))  # each once
    for step in range(3):  # balanced by load: both engines take part in every step
        assert {e["replica"] for e in issued if e["step"] == step} == {0, 1}
    assert 6 <= sum(e["replica"] for e in issued) <= 12  # engine 1's share of 18 groups: a third to two thirds
    loaded = {e["id"] for e in events if e["event"] == "consume" and e.get("weights")}
    assert {f"v{v}@{r}" for v in (1, 2) for r in (0, 1)} <= loaded  # every version reached both engines
