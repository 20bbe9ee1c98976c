"""kill -9 of a real pipeline (embedded engine, FSDP2 trainer, tiny model) and `flowrl run --resume`:
the resumed run's final policy equals an uninterrupted run's, bit for bit (a sync pipeline on the
CPU is deterministic), so the resumed engine generated with exactly the restored policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl.runtime.durability import ledger

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["run.steps=5", "run.checkpoint_every=2", "data.batch_size=4", "nodes.rollout.group_size=4",
         "nodes.rollout.sampling.max_new_tokens=6"]


def flowrl(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "FLOWRL_FAULT": fault, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args, "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300)


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "export" / "learner" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    done = flowrl("run", str(ROOT / "pipelines/grpo_sync.yaml"), *SHORT, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return weights(run_dir)


@pytest.mark.parametrize("fault", ["train:4", "checkpoint:2"])
def test_killed_real_run_resumes_to_the_uninterrupted_policy(tmp_path, uninterrupted, fault):
    run_dir = tmp_path / "run"
    killed = flowrl("run", str(ROOT / "pipelines/grpo_sync.yaml"), *SHORT, "--run-dir", str(run_dir), fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-2"
    resumed = flowrl("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    report = ledger.check(run_dir)
    assert report.ended and report.clean, report.problems
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(5))
    # Every step, the resumed ones included: the engine's behaviour logprobs equal the trainer's
    # recomputation at that version (fp32), i.e. the engine held exactly the restored policy.
    assert max(r["train"]["mismatch_logprob_max"] for r in rows) < 1e-5
    final = weights(run_dir)
    assert final.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert final[name].equal(tensor), name


def test_a_failed_export_fails_the_run_and_the_next_phase_never_starts(tmp_path):
    run_dir = tmp_path / "run"
    blocked = run_dir / "phases" / "0-warmup" / "export"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a folder")  # the warm-up's final export cannot be written
    smoke = ["phases.0.steps=2", "phases.0.seconds=null", "phases.1.steps=2", "phases.1.seconds=null",
             "data.batch_size=4", "nodes.rollout.group_size=4", "data.eval=null"]
    failed = flowrl("run", str(ROOT / "pipelines/quickstart.yaml"), *smoke, "--run-dir", str(run_dir))
    assert failed.returncode == 1
    assert "learner" in failed.stderr and "while closing" in failed.stderr
    assert not (run_dir / "phases" / "1-grpo").exists()
    assert not (run_dir / "phases" / "0-warmup" / "phase.json").exists()
