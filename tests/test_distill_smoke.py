"""A few steps of every phase of pipelines/distill.yaml through `flowrl run`: the teacher phases
train and export builtin:tiny-qwen2-large, the warm-up starts a fresh builtin:tiny-qwen2, and the
distill phase trains that student on the teacher node's token rewards, the teacher read from the
`teacher` phase's export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flowrl.cli import main
from flowrl.runtime import check

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["phases.0.steps=2", "phases.2.steps=2", "phases.3.steps=3", "phases.3.seconds=null",
         "data.batch_size=4", "nodes.rollout.group_size=4", "data.eval.every=1", "data.eval.samples=4"]


def test_distill_pipeline_runs_every_phase(tmp_path: Path) -> None:
    from transformers import AutoConfig

    out = tmp_path / "run"
    assert main(["run", str(ROOT / "pipelines/distill.yaml"), *SMOKE, "--run-dir", str(out), "--quiet"]) == 0
    phases = {p.name.split("-", 1)[1]: p for p in (out / "phases").iterdir()}
    assert sorted(phases) == ["distill", "teacher", "teacher_eval", "warmup"]
    plans = {name: json.loads((p / "plan.json").read_text()) for name, p in phases.items()}
    teacher_export = str(phases["teacher"] / "export/learner")
    assert plans["teacher_eval"]["model"]["path"] == teacher_export
    assert plans["warmup"]["model"]["path"] == "builtin:tiny-qwen2"  # a fresh student
    assert plans["distill"]["model"]["path"] == str(phases["warmup"] / "export/learner")
    assert plans["distill"]["nodes"]["teach"]["config"]["model"]["path"] == teacher_export
    widths = {name: AutoConfig.from_pretrained(phases[name] / "export/learner").hidden_size
              for name in ("teacher", "distill")}
    assert widths == {"teacher": 256, "distill": 128}
    # The teacher is evaluated once, the student before each distill step (eval.every=1).
    evals = {name: [json.loads(line)["version"] for line in (phases[name] / "eval.jsonl").read_text().splitlines()]
             for name in ("teacher_eval", "distill")}
    assert evals == {"teacher_eval": [0], "distill": [0, 1, 2, 3]}  # teacher_eval sets data.eval.final: false
    rows = [json.loads(line) for line in (phases["distill"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train"]["tokens"] > 0 for r in rows)
    for phase in phases.values():
        report = check(phase)
        assert report.clean and report.ended, report
    # Resumed after the earlier phases finished: the teacher path comes from their markers.
    shutil.rmtree(phases["distill"])
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    plan = json.loads((phases["distill"] / "plan.json").read_text())
    assert plan["nodes"]["teach"]["config"]["model"]["path"] == teacher_export
    assert (phases["distill"] / "export/learner/config.json").is_file()
