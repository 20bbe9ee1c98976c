"""The rollout store and `flowrl replay`: a run's trained batches, recorded and trained on again.

Fast tests use the toy pipeline (tests/runtime_ops.py) or no run at all; the replays of the tiny
model through the real CLI set up the model and trainer (~5 s each on 2 cores), hence `slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import runtime_ops as ops

from flowrl.cli import main
from flowrl.data.trajectory import Group, Trajectory
from flowrl.runtime.durability import rollouts
from flowrl.runtime.run import run

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"
TINY = ["data.batch_size=4", "nodes.rollout.group_size=2", "nodes.rollout.sampling.max_new_tokens=4", "run.steps=3"]


def group(gid: str, step: int) -> Group:
    trajectory = Trajectory(id=f"{gid}/0", group_id=gid, sample_id=gid, prompt_ids=[1, 2], response_ids=[3],
                            loss_mask=[1], behaviour_logprobs=[-0.5], versions=[step], reward=1.0)
    return Group(id=gid, step=step, trajectories=[trajectory])


def test_the_store_reads_back_what_was_appended(tmp_path):
    sizes = [rollouts.append(tmp_path, "learner", s, s, [group(f"{s}:{i}", s) for i in range(2)]) for s in range(3)]
    file = rollouts.path(tmp_path, "learner")
    assert file.stat().st_size == sum(sizes)
    steps = list(rollouts.read(file))
    assert [s.step for s in steps] == [0, 1, 2]
    assert rollouts.sample_ids(steps) == [[f"{s}:0/0", f"{s}:1/0"] for s in range(3)]
    assert steps[1].groups[0] == group("1:0", 1)


@pytest.mark.parametrize(("damage", "words"), [
    (lambda b: b[:-3], "record 1 at byte"),
    (lambda b: b[:-3] + b"xyz", "checksum mismatch"),
    (lambda b: b + b"FR", "record 2 at byte"),
    (lambda b: b"XXXX" + b[4:], "record 0 at byte 0: no record starts here"),
])
def test_a_damaged_store_is_located(tmp_path, damage, words):
    for s in range(2):
        rollouts.append(tmp_path, "learner", s, s, [group(f"{s}:0", s)])
    file = rollouts.path(tmp_path, "learner")
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(rollouts.StoreError, match=words) as e:
        list(rollouts.read(file))
    assert str(file) in str(e.value)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("toy") / "run"
    assert run(ops.grpo("sync", steps=4, batch_size=2), run_dir, progress=False).status == "done"
    return run_dir


def test_the_run_records_every_trained_batch_in_order(toy_run):
    steps = list(rollouts.read(rollouts.path(toy_run, "learner")))
    assert [s.step for s in steps] == [0, 1, 2, 3]
    consumed = [json.loads(line) for line in (toy_run / "ledger.jsonl").read_text().splitlines()]
    consumed = [e for e in consumed if e["event"] == "consume" and e.get("consumer") == "learner"]
    for s in steps:  # the ledger's consumed records of each step are the stored groups, in order
        assert [g.id for g in s.groups] == [e["id"] for e in consumed if e["consumer_version"] == s.step]


@pytest.mark.parametrize(("mode", "k"), [("sync", 0), ("async", 2)])
def test_replay_feeds_the_train_operator_the_recorded_batches_in_order(tmp_path, mode, k, capsys):
    """The toy train node folds every batch it gets into a checksum (tests/runtime_ops.py)."""
    run_dir = tmp_path / "run"
    assert run(ops.grpo(mode, k, steps=5, batch_size=3), run_dir, progress=False).status == "done"
    assert main(["replay", str(run_dir), "--run-dir", str(tmp_path / "again")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 5 and summary["samples"] == 15 and summary["max_abs_diff_vs_recorded"] is None
    then, now = ((d / "train-learner.jsonl").read_text().splitlines() for d in (run_dir, tmp_path / "again"))
    assert [json.loads(r)["checksum"] for r in now] == [json.loads(r)["checksum"] for r in then]
    rows = [json.loads(r) for r in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(5)) and all(r["replay"] for r in rows)


def test_a_phased_run_replays_its_last_phase(tmp_path):
    from flowrl.replay import phase_directory

    for name in ("0-warmup", "1-grpo", "10-late"):
        (tmp_path / "phases" / name).mkdir(parents=True)
        (tmp_path / "phases" / name / "plan.json").write_text("{}")
    assert phase_directory(tmp_path) == tmp_path / "phases" / "10-late"
    assert phase_directory(tmp_path / "phases" / "1-grpo") == tmp_path / "phases" / "1-grpo"


def test_record_rollouts_false_writes_no_store_and_replay_says_so(tmp_path, capsys):
    plan = ops.grpo("sync", steps=2, batch_size=2)
    plan.run["record_rollouts"] = False
    assert run(plan, tmp_path / "run", progress=False).status == "done"
    assert not (tmp_path / "run" / "rollouts").exists()
    assert main(["replay", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "learner.bin is missing: the run recorded no rollouts (run.record_rollouts: false" in err


@pytest.mark.parametrize(("damage", "words"), [
    (lambda b: b[:-10], "truncated"),
    (lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:], "record 0 at byte 0: checksum mismatch"),
])
def test_replay_of_a_damaged_store_fails_located(tmp_path, toy_run, damage, words, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(toy_run, copy)
    file = rollouts.path(copy, "learner")
    file.write_bytes(damage(file.read_bytes()))
    assert main(["replay", str(copy)]) == 1
    err = capsys.readouterr().err
    assert str(file) in err and words in err and "Traceback" not in err, err
    assert not list(copy.glob("replay-*")), "nothing is written before the store is read whole"


def test_a_store_cut_at_a_record_boundary_is_caught_against_the_metrics(tmp_path, toy_run, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(toy_run, copy)
    file = rollouts.path(copy, "learner")
    data, last = file.read_bytes(), list(rollouts.read(file))[-1]
    file.write_bytes(data[:len(data) - len(rollouts.encode(last))])
    assert main(["replay", str(copy)]) == 1
    assert "holds 3 steps but" in capsys.readouterr().err


def test_inspect_compares_runs_by_their_samples(tmp_path, toy_run, capsys):
    other = tmp_path / "other"
    assert run(ops.grpo("sync", steps=4, batch_size=3), other, progress=False).status == "done"
    assert main(["inspect", str(toy_run), str(toy_run)]) == 0
    assert "same samples: yes (equal ids checksums)" in capsys.readouterr().out
    assert main(["inspect", str(toy_run), str(other)]) == 0
    out = capsys.readouterr().out
    assert "same samples: no" in out and "4 steps" in out


def test_overrides_change_the_train_node_only(toy_run, capsys):
    assert main(["replay", str(toy_run), "nodes.rollout.group_size=3"]) == 1
    assert "replay changes the train node's config only: give nodes.learner.<key>=<value>" in capsys.readouterr().err


# ---- the tiny model through the real CLI ---------------------------------------------------------

def flowrl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def recorded(tmp_path: Path, spec: Path, *extra: str) -> Path:
    run_dir = tmp_path / "run"
    proc = flowrl("run", str(spec), *TINY, *extra, "--run-dir", str(run_dir), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def async_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "async.yaml"
    spec.write_text(BASE.read_text().replace("  - score -> learner\n",
                                             "  - score -> learner: {mode: async, max_staleness: 1}\n"))
    return spec


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "two threads"])
def test_replay_without_overrides_reproduces_the_policy_bit_for_bit(tmp_path, mode):
    """"two threads": the engine sets 2 torch threads for the process (as the quickstart's does),
    the environment says 1: replay must train with the 2 the run's trainer had."""
    extra = ["nodes.rollout.engine.threads=2"] if mode == "two threads" else []
    run_dir = recorded(tmp_path, async_spec(tmp_path) if mode == "async" else BASE, *extra)
    proc = flowrl("replay", str(run_dir))
    result = summary(proc)
    assert result["steps"] == 3 and result["samples"] == 12 and result["trajectories"] == 24
    assert result["max_abs_diff_vs_recorded"] == 0.0
    assert "replay step 2: 4 groups" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "replay-1" / "metrics.jsonl").read_text().splitlines()]
    then = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["train"]["loss"] for r in rows] == [r["train"]["loss"] for r in then if "train" in r]
    assert {r["train"]["torch_threads"] for r in rows} == {2.0 if extra else 1.0}


@pytest.mark.slow
def test_replay_with_another_loss_trains_on_the_same_samples(tmp_path):
    run_dir = recorded(tmp_path, BASE)
    same = summary(flowrl("replay", str(run_dir), "--quiet"))
    other = summary(flowrl("replay", str(run_dir), "nodes.learner.loss={kind: sft}", "--run-dir",
                           str(tmp_path / "sft"), "--quiet"))
    assert other["ids_sha256"] == same["ids_sha256"] and other["samples"] == same["samples"]
    assert other["max_abs_diff_vs_recorded"] is None and other["ab_max_abs_diff"] > 1e-4
    assert json.loads((tmp_path / "sft" / "replay.json").read_text())["overrides"] == ["nodes.learner.loss={kind: sft}"]
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) == 3
    shown = flowrl("inspect", str(run_dir), str(run_dir / "replay-1"), str(tmp_path / "sft"))
    assert shown.returncode == 0, shown.stderr
    assert "same samples: yes" in shown.stdout and "with nodes.learner.loss={kind: sft}" in shown.stdout
    assert "loss[2]" in shown.stdout and len(shown.stdout.splitlines()) == 3 + 1 + 1 + 3, shown.stdout  # sides, same, header, steps
    bad = flowrl("replay", str(run_dir), "nodes.learner.loss.kind=nope", "--run-dir", str(tmp_path / "bad"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "nope" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_replay_of_the_quickstarts_grpo_phase_is_bit_for_bit(tmp_path):
    """The last phase starts from the warm-up's export, trains with the engine's 2 threads."""
    run_dir = tmp_path / "run"
    proc = flowrl("run", str(ROOT / "pipelines/quickstart.yaml"), "phases.0.steps=2", "phases.1.steps=2",
                  "data.eval=null", "--run-dir", str(run_dir), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = summary(flowrl("replay", str(run_dir), "--quiet"))
    assert result["source"] == str(run_dir / "phases" / "1-grpo") and result["steps"] == 2
    assert result["max_abs_diff_vs_recorded"] == 0.0
