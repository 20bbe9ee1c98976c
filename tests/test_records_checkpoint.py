"""A checkpoint's streams.json and manifest.json, and a run's trackers.json, have one reader and
writer (flowrl/records/checkpoint.py, RunDir.trackers): what the runtime writes reads back typed,
files written by the writers before them still read, and damage is located."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import runtime_ops as ops

from flowrl.records import Checkpoint, RecordError, RunDir, StreamSizes, TrackerEntry
from flowrl.runtime.durability import checkpoints
from flowrl.runtime.run import run


def test_a_checkpoint_the_runtime_writes_reads_back_typed(tmp_path: Path) -> None:
    plan = ops.grpo("sync", 0, steps=4, batch_size=2)
    plan.run["checkpoint_every"] = 2
    assert run(plan, tmp_path, progress=False).status == "done"
    step = Checkpoint(tmp_path / "checkpoints/step-4")
    sizes = step.streams()
    assert isinstance(sizes, StreamSizes) and sizes.ledger > 0 and sizes.metrics > 0 and sizes.trace > 0
    assert sizes.of("metrics.jsonl") == sizes.metrics and sizes.of("no-such.jsonl") == 0
    manifest = step.manifest()
    on_disk = {p.relative_to(step.path).as_posix() for p in step.path.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {"manifest.json"}
    assert manifest["streams.json"][0] == (step.path / "streams.json").stat().st_size
    assert checkpoints.damage(step.path) is None


def test_the_previous_writers_files_still_read(tmp_path: Path) -> None:
    """Byte for byte what the json-module writers of 0fd40f7 wrote."""
    (tmp_path / "streams.json").write_text(json.dumps(
        {"ledger.jsonl": 120, "metrics.jsonl": 80, "samples.jsonl": 0, "errors.jsonl": 0, "trace.json": 400,
         "tensorboard": {"events.out.1": 96}, "rollouts": {"learner.bin": 512}}))
    (tmp_path / "manifest.json").write_text('{\n"streams.json": [167, "ab12"],\n"learner/r0/state.pt": [9, "cd34"]\n}\n')
    sizes = Checkpoint(tmp_path).streams()
    assert (sizes.ledger, sizes.trace, sizes.folder("rollouts"), sizes.folder("tensorboard")) == \
        (120, 400, {"learner.bin": 512}, {"events.out.1": 96})
    assert Checkpoint(tmp_path).manifest() == {"streams.json": (167, "ab12"), "learner/r0/state.pt": (9, "cd34")}
    (tmp_path / "trackers.json").write_text(json.dumps(
        {"wandb": {"state": {"id": "r1"}, "steps": {"learner": 7}}}, indent=1))
    assert RunDir(tmp_path).trackers() == {"wandb": TrackerEntry(state={"id": "r1"}, steps={"learner": 7})}


def test_written_and_read_back_equal(tmp_path: Path) -> None:
    sizes = StreamSizes(ledger=3, metrics=5, trace=60, rollouts={"learner.bin": 8})
    Checkpoint(tmp_path).write_streams(sizes)
    Checkpoint(tmp_path).write_manifest({"a": (1, "ff"), "b/c": (2, "ee")})
    assert Checkpoint(tmp_path).streams() == sizes
    assert Checkpoint(tmp_path).manifest() == {"a": (1, "ff"), "b/c": (2, "ee")}
    assert (tmp_path / "manifest.json").read_text().count("\n") == 4  # one file a line


def test_damage_is_located(tmp_path: Path) -> None:
    (tmp_path / "streams.json").write_text('{"ledger.jsonl": "many"}')
    with pytest.raises(RecordError, match=r"streams\.json: StreamSizes: .*ledger\.jsonl"):
        Checkpoint(tmp_path).streams()
    (tmp_path / "manifest.json").write_text('{\n"a": [1, "ff"],\n"b": [2, 3]\n}\n')
    assert "manifest.json" in (checkpoints.damage(tmp_path) or "")
    (tmp_path / "trackers.json").write_text('{\n"wandb": {"steps": {"learner": "seven"}}\n}')
    with pytest.raises(RecordError, match=r"trackers\.json: .*steps"):
        RunDir(tmp_path).trackers()
    assert RunDir(tmp_path / "elsewhere").trackers() == {}
