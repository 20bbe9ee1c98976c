"""pipelines/vl_agent.yaml through `flowrl run`: a few steps of both phases (default suite), and a
run interrupted by SIGINT then resumed with `--resume`, which loses no image and no trajectory
(slow). Every trajectory the reward node scores is logged with its images; each must be in the
phase's image store (`<phase dir>/images`), with one placeholder run per image."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.data.images import ImageRef, ImageStore
from flowrl.runtime.durability import checkpoints, ledger

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = str(ROOT / "pipelines/vl_agent.yaml")
LOG = "FLOWRL_TEST_VL_LOG"
SMOKE = ["phases.0.steps=1", "data.batch_size=2", "nodes.rollout.group_size=2", "data.eval.every=1",
         "data.eval.samples=2", "nodes.score.fn=test_vl_pipeline:logged"]


def logged(trajectory) -> float:
    """The task's reward; also appends the trajectory's id, images, vision-start count and the image
    store it was recorded in (its phase's) to $FLOWRL_TEST_VL_LOG."""
    from flowrl.data import images
    from flowrl_operators.tasks.grid_nav import grid_nav
    from flowrl_operators.vision import vision

    facts = vision("builtin:tiny-qwen2-vl")
    ids = trajectory.prompt_ids + trajectory.response_ids
    facts.spans(ids, trajectory.images)  # raises unless each image has its placeholder run, in order
    # Image starts the prompt and the environment wrote (a sampled token may be one too: it is text).
    mask = [0] * len(trajectory.prompt_ids) + trajectory.loss_mask
    with open(os.environ[LOG], "a") as f:
        f.write(json.dumps({"id": trajectory.id, "store": str(images.store().root),
                            "starts": sum(1 for i, m in zip(ids, mask, strict=True) if i == facts.vision_start_id
                                          and m == 0),
                            "images": [[r.sha256, r.width, r.height] for r in trajectory.images]}) + "\n")
    return grid_nav.reward(trajectory)


def check_images(phase: Path, rows: list[dict]) -> int:
    """Every image of the rows scored in `phase` is in that phase's store; returns how many rows."""
    store = ImageStore(phase / "images")
    mine = [r for r in rows if Path(r["store"]) == store.root]
    for row in mine:
        assert row["starts"] == len(row["images"]) >= 1, row
        for sha, width, height in row["images"]:
            assert store.get(ImageRef(sha, width, height)).size == (width, height)
    return len(mine)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module) -> Path:
    out = tmp_path_factory.mktemp("vl") / "run"
    monkeypatch_module.setenv(LOG, str(out.parent / "scored.jsonl"))
    code = main(["run", PIPELINE, *SMOKE, "phases.1.steps=2", "phases.1.seconds=null", "--run-dir", str(out),
                 "--quiet"])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_both_phases_run_and_every_scored_image_is_in_the_store(smoke: Path) -> None:
    warmup, grpo = smoke / "phases/0-warmup", smoke / "phases/1-grpo"
    for phase in (warmup, grpo):
        assert json.loads((phase / "phase.json").read_text())["status"] == "done"
        report = ledger.check(phase)
        assert report.clean and report.ended and report.produced > 0, report
    rows = [json.loads(line) for line in (smoke.parent / "scored.jsonl").read_text().splitlines()]
    assert check_images(warmup, rows) == 32  # 1 step of the phase's own batch size, one view each
    assert check_images(grpo, rows) == 2 * 2 * 2  # 2 steps x 2 samples x 2 episodes
    assert all(len(r["images"]) == 1 for r in rows if Path(r["store"]) == warmup / "images")
    evals = [json.loads(line) for line in (grpo / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 1, 2] and all(-0.7 <= e["eval_reward"] <= 1.2 for e in evals)


def test_the_exported_policy_is_a_vision_language_checkpoint(smoke: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smoke / "phases/1-grpo/export/learner", local_files_only=True)
    assert config.model_type == "qwen2_vl"


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from flowrl.cli import main
sys.exit(main({argv!r}))
"""


def flowrl(argv: list[str], log: Path) -> subprocess.Popen:
    script = SCRIPT.format(tests=str(Path(__file__).parent), argv=argv)
    env = {**os.environ, LOG: str(log), "TERM": "dumb"}
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)


def referenced_images(checkpoint: Path) -> list[ImageRef]:
    """The images of every trajectory a checkpoint keeps in its channels (the records a resume
    hands on)."""
    state = pickle.loads((checkpoint / "coordinator.pkl").read_bytes())
    refs = []
    for records, _ in state["channels"].values():
        for record in records:
            for t in getattr(record.value, "trajectories", []) or []:
                refs += t.images
    return refs


@pytest.mark.slow
def test_sigint_then_resume_loses_no_image_and_no_trajectory(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "scored.jsonl"
    argv = ["run", PIPELINE, *SMOKE, "phases.1.steps=8", "phases.1.seconds=null", "data.eval.every=4",
            "run.checkpoint_every=1", "--run-dir", str(run_dir)]
    proc = flowrl(argv, log)
    grpo = run_dir / "phases/1-grpo"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        checkpoint = grpo / "checkpoints" / "latest"
        if checkpoint.exists() and (grpo / "metrics.jsonl").exists() and \
                len((grpo / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "1-grpo: interrupted after" in out, out  # flowrl run: 1 unless done
    assert (run_dir / "phases/0-warmup/phase.json").exists() and not (grpo / "phase.json").exists(), out
    # The records a resume hands on keep their images (often none wait at this batch size: then the
    # scored rows below, from before and after the interruption, are the check).
    held = referenced_images(checkpoints.latest(grpo))
    store = ImageStore(grpo / "images")
    assert all(store.path(ref).is_file() for ref in held)
    before = len(log.read_text().splitlines())

    resumed = flowrl(["run", "--resume", str(run_dir), "--quiet"], log)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert json.loads((grpo / "phase.json").read_text())["status"] == "done"
    report = ledger.check(grpo)
    assert report.ended and report.clean, report.problems  # every trajectory consumed exactly once
    steps = [json.loads(line)["step"] for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(8))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) > before > 32  # scored before the interruption (the warm-up's 32 too) and after
    assert check_images(grpo, rows) >= 8 * 2 * 2  # every scored episode, re-issued ones included
