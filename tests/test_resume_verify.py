"""`flowrl run --resume` verifies a run directory before trusting it (flowrl/runtime/durability/resume.py).

One real run (tiny model, embedded engine, trainer) is killed with kill -9 at its third train step,
leaving checkpoints step-1 and step-2; each test damages a copy of it and resumes through the CLI.
Refusals come before any weights load (a few seconds); the resumes that go on are marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.runtime.durability import checkpoints, ledger

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"
SHORT = ["run.steps=4", "data.batch_size=2", "nodes.rollout.group_size=2", "run.checkpoint_every=1",
         "run.keep_checkpoints=3"]


def flowrl(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "FLOWRL_FAULT": fault, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args, "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300)


def refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "flowrl bug" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    proc = flowrl("run", str(BASE), *SHORT, "--run-dir", str(run_dir), fault="train:3")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-2"
    return run_dir


@pytest.fixture
def run_dir(killed, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    return copy


def test_every_checkpoint_file_has_a_checksum_taken_at_save(run_dir):
    step = run_dir / "checkpoints" / "step-2"
    manifest = json.loads((step / "manifest.json").read_text())
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest) == on_disk and "coordinator.pkl" in manifest
    assert any(name.startswith("learner/") for name in manifest)
    assert checkpoints.damage(step) is None


def test_a_ledger_shorter_than_the_checkpoint_is_refused_not_padded(run_dir):
    path = run_dir / "ledger.jsonl"
    recorded = json.loads((run_dir / "checkpoints/step-2/streams.json").read_text())["ledger.jsonl"]
    torn = path.read_bytes()[: recorded // 2]
    path.write_bytes(torn)
    refused(flowrl("run", "--resume", str(run_dir)), str(path), f"shorter than the {recorded} bytes",
            "Restore that file")
    assert path.read_bytes() == torn  # not padded with NUL bytes, not cut


def test_a_rollout_store_shorter_than_the_checkpoint_is_refused(run_dir):
    path = run_dir / "rollouts" / "learner.bin"
    recorded = json.loads((run_dir / "checkpoints/step-2/streams.json").read_text())["rollouts"]["learner.bin"]
    assert 0 < recorded <= path.stat().st_size
    path.write_bytes(path.read_bytes()[: recorded - 5])
    refused(flowrl("run", "--resume", str(run_dir)), str(path), f"shorter than the {recorded} bytes")


def test_damaged_learner_weights_are_refused_naming_the_file_and_the_intact_checkpoint(run_dir):
    weights = max((run_dir / "checkpoints/step-2/learner").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    weights.write_bytes(bytes(data))
    refused(flowrl("run", "--resume", str(run_dir)), str(weights), "does not match the checksum",
            "step-1 is intact", "write step-1 into")


@pytest.mark.parametrize(("edit", "words"), [
    (lambda s: s.replace("score:", "scorer:").replace("-> score", "-> scorer").replace("score ->", "scorer ->"),
     ["nodes: 'score' gone, 'scorer' new"]),
    (lambda s: s.replace("max_new_tokens: 8", "max_new_tokens: 12"),
     ["nodes.rollout.config.sampling.max_new_tokens was 8, is 12"]),
    (lambda s: (ROOT / "pipelines/grpo_sync.yaml").read_text(), ["name was \"bad\", is \"grpo-sync\""]),
])
def test_an_edited_spec_is_refused_naming_what_changed(run_dir, edit, words):
    spec = run_dir / "spec.yaml"
    spec.write_text(edit(spec.read_text()))
    refused(flowrl("run", "--resume", str(run_dir)), "is not the one its run started with", *words)


def test_the_batch_size_of_the_recorded_overrides_is_part_of_the_run(run_dir):
    launch = json.loads((run_dir / "launch.json").read_text())
    launch["overrides"] = [o if not o.startswith("data.batch_size=") else "data.batch_size=4"
                           for o in launch["overrides"]]
    (run_dir / "launch.json").write_text(json.dumps(launch))
    refused(flowrl("run", "--resume", str(run_dir)), "data.batch_size was 2, is 4")


def test_no_intact_checkpoint_is_refused_listing_each(run_dir):
    (run_dir / "checkpoints/latest").unlink()
    for step in ("step-1", "step-2"):
        (run_dir / "checkpoints" / step / "streams.json").write_text("{damaged")
    refused(flowrl("run", "--resume", str(run_dir)), "latest is missing", "no intact checkpoint remains",
            "step-2 is damaged", "step-1 is damaged", "start a new run")
    assert (run_dir / "checkpoints/step-2").is_dir() and (run_dir / "checkpoints/step-1").is_dir()


def test_damaged_run_records_are_located_errors(run_dir):
    (run_dir / "meta.json").write_text("{not json")
    refused(flowrl("run", "--resume", str(run_dir)), "cannot read", "meta.json")


def test_resume_with_overrides_says_how_to_change_a_setting(run_dir):
    refused(flowrl("run", "--resume", str(run_dir), "data.batch_size=8"), "--resume takes no key=value overrides",
            "data.batch_size=8", "spec.yaml key=value --run-dir NEW_DIR")


def test_rotation_never_removes_a_checkpoint_newer_than_the_one_written(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (1, 2, 4, 6):
        (root / f"step-{n}").mkdir(parents=True)
    checkpoints._rotate(root, keep=2, version=2)  # a resumed run wrote step-2 again: 4 and 6 are not superseded
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-4", "step-6"]
    checkpoints._rotate(root, keep=2, version=6)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]


@pytest.mark.slow
def test_a_missing_latest_resumes_from_the_newest_intact_checkpoint_and_says_so(run_dir):
    (run_dir / "checkpoints/latest").write_text("")
    (run_dir / "checkpoints/step-2/coordinator.pkl").write_bytes(b"junk")
    proc = flowrl("run", "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "latest is empty; resuming from step-1, the newest intact checkpoint" in proc.stderr
    assert "step-2 is damaged" in proc.stderr
    report = ledger.check(run_dir)
    assert report.ended and report.clean, report.problems
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # step 0 from before the kill, 1-3 after: none lost, none twice
    assert (run_dir / "checkpoints/latest").read_text() == "step-4"


@pytest.mark.slow
def test_resume_without_any_checkpoint_starts_again_and_keeps_the_earlier_records(run_dir):
    shutil.rmtree(run_dir / "checkpoints")
    earlier = (run_dir / "ledger.jsonl").read_bytes()
    proc = flowrl("run", "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "holds no checkpoint" in proc.stderr and "starting it again from step 0" in proc.stderr
    assert (run_dir / "earlier-1" / "ledger.jsonl").read_bytes() == earlier
    assert ledger.check(run_dir).clean


@pytest.mark.slow
def test_a_checkpoint_from_before_checksums_that_cannot_be_loaded_is_a_located_error(run_dir):
    # A run directory of an earlier flowrl (meta.json format 2) has no manifests: its damage shows
    # when the learner loads, and is said with the folder, not as a traceback.
    for manifest in (run_dir / "checkpoints").rglob("manifest.json"):
        manifest.unlink()
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps(meta | {"format": 2}))
    weights = max((run_dir / "checkpoints/step-2/learner").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    weights.write_bytes(weights.read_bytes()[:1000])
    refused(flowrl("run", "--resume", str(run_dir)), "cannot restore node 'learner' (replica 0)",
            str(run_dir / "checkpoints/step-2/learner/r0"), str(run_dir / "checkpoints/latest"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["deleted", "torn"])
def test_a_deleted_or_torn_trace_does_not_block_resume_it_starts_anew(run_dir, damage):
    """trace.json is an observation stream, not state: before, a deleted one refused the resume
    ("trace.json is 0 bytes, shorter than ..."). Now the resumed run writes a fresh, valid trace."""
    trace = run_dir / "trace.json"
    if damage == "deleted":
        trace.unlink()
    else:
        trace.write_bytes(trace.read_bytes()[:200])
    proc = flowrl("run", "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "train" for e in events)  # the resumed steps' spans
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # the other records as an uninterrupted run's
    assert ledger.check(run_dir).clean
