"""Semantic checks (flowrl/spec/semantics.py, flowrl_operators/semantics.py) and `flowrl validate
--probe` (flowrl_operators/probe.py), through the real command line: each misconfiguration exits 1
with a located message and no traceback; every shipped pipeline passes the probe. More cases, one
file each, are under tests/specs/bad (schedule_ends_early, stale_loss_async,
dynamic_sampling_group_of_one), checked by tests/test_spec.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_spec import BUILT_MODELS  # pipelines probed with a tiny stand-in model

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = (ROOT / "tests/specs/good/base.yaml").read_text()
PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))


def constant_reward(trajectory) -> float:
    """A reward that ignores the answer: what the probe must catch."""
    return 0.5


def prefers_empty(trajectory) -> float:
    """A reward that scores an empty answer above the right one."""
    return 1.0 if not trajectory.metadata["text"] else 0.5 if trajectory.metadata["text"].isdigit() else 0.0


def validate(capsys: pytest.CaptureFixture[str], file: Path, *args: str) -> tuple[int, str]:
    flags = [a for a in args if a.startswith("--")]  # flags before the file: overrides follow it
    code = main(["validate", *flags, str(file), *(a for a in args if a not in flags)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def located(err: str, file: Path, key: str, *words: str) -> str:
    """The line of `err` at `key` of `file` (file:line:col key: ...) holding every word."""
    lines = [line for line in err.splitlines() if line.startswith(f"{file}:") and f" {key}: " in line]
    assert lines, err
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def spec(tmp_path: Path, text: str) -> Path:
    file = tmp_path / "pipeline.yaml"
    file.write_text(text)
    return file


def test_lr_zero_is_refused_at_the_key_and_in_a_phase(tmp_path: Path, capsys) -> None:
    file = spec(tmp_path, BASE.replace("optim: {lr: 1.0e-3}", "optim: {lr: 0}"))
    code, err = validate(capsys, file)
    assert code == 1
    located(err, file, "nodes.learner.optim.lr", "expected `float` > 0")
    phased = BASE + "phases:\n  - {name: a, steps: 2}\n  - {name: b, steps: 2, set: {nodes.learner.optim.lr: 0.0}}\n"
    file = spec(tmp_path, phased)
    code, err = validate(capsys, file)
    assert code == 1
    line = located(err, file, "nodes.learner.optim.lr", "> 0")
    assert line.startswith(f"{file}:{len(BASE.splitlines()) + 3}:"), line  # at the phase's own set


def test_a_decay_that_ends_early_is_named_per_phase(tmp_path: Path, capsys) -> None:
    text = BASE.replace("optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-3, schedule: cosine, total_steps: 10}")
    file = spec(tmp_path, text + "phases:\n  - {name: short, steps: 10}\n  - {name: long, steps: 30}\n")
    code, err = validate(capsys, file)
    assert code == 1
    located(err, file, "nodes.learner.optim.total_steps", "phase 'long'", "last 20 steps would train with lr 0")
    assert "phase 'short'" not in err


def test_a_decay_in_a_phase_of_seconds_needs_total_steps(tmp_path: Path, capsys) -> None:
    text = BASE.replace("optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-3, schedule: linear}")
    file = spec(tmp_path, text + "phases:\n  - {name: timed, seconds: 30}\n")
    code, err = validate(capsys, file)
    assert code == 1
    located(err, file, "nodes.learner.optim.schedule", "bounded only by seconds", "set optim.total_steps")


def test_a_warmup_the_run_never_finishes(tmp_path: Path, capsys) -> None:
    text = BASE.replace("optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-3, warmup_steps: 40}\n    epochs: 2")
    file = spec(tmp_path, text + "run: {steps: 20}\n")
    code, err = validate(capsys, file)
    assert code == 1
    located(err, file, "nodes.learner.optim.warmup_steps", "never ends", "40 optimizer steps: 20 train steps x 2")
    assert validate(capsys, file, "nodes.learner.optim.warmup_steps=39")[0] == 0


def test_a_stale_edge_is_fine_once_the_loss_corrects_it(tmp_path: Path, capsys) -> None:
    file = ROOT / "tests/specs/bad/stale_loss_async.yaml"
    assert validate(capsys, file)[0] == 1
    assert validate(capsys, file, "nodes.learner.loss.correction={kind: tis}")[0] == 0
    assert validate(capsys, file, "nodes.learner.loss.kind=ppo_clip")[0] == 0
    # partial rollout on a sync edge mixes versions too
    text = BASE.replace("    op: train\n", "    op: train\n    loss: {kind: gpg}\n    advantage: {estimator: gpg}\n")
    file = spec(tmp_path, text.replace("group_size: 4\n", "group_size: 4\n    partial_rollout: true\n"))
    code, err = validate(capsys, file)
    assert code == 1
    located(err, file, "nodes.learner.loss.kind", "partial_rollout: true")


def _files(tmp_path: Path, train: list[str], held: list[str]) -> Path:
    for name, prompts in (("train", train), ("eval", held)):
        rows = [{"prompt": p, "answer": str(len(p))} for p in prompts]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = BASE.replace("  source: builtin:reverse_digits\n",
                        f"  source: {{file: {tmp_path / 'train.jsonl'}, eval_file: {tmp_path / 'eval.jsonl'}}}\n"
                        "  eval: {every: 5, samples: 1, options: {reward: 'test_semantics:length_reward'}}\n")
    return spec(tmp_path, text.replace("fn: builtin:reverse_digits", "fn: test_semantics:length_reward"))


def length_reward(trajectory) -> float:
    """1 when the answer is the row's answer (the prompt's length), else 0."""
    return float(trajectory.metadata["text"].strip() == trajectory.metadata["sample"]["answer"])


def test_held_out_rows_that_occur_in_the_training_rows(tmp_path: Path, capsys) -> None:
    train = [f"What is {i} plus {i}?" for i in range(10)]
    held = ["what is 3  plus 3?", "What is 100 plus 1?", "WHAT IS 7 PLUS 7?", "What is 200 plus 2?"]
    file = _files(tmp_path, train, held)
    code, err = validate(capsys, file)
    assert code == 1
    line = located(err, file, "data.source.eval_file", "2 of 4 held-out rows also occur in the training rows")
    assert "held-out row 0 = training row 3" in line and "held-out row 2 = training row 7" in line
    clean = _files(tmp_path, train, held[1::2])
    assert validate(capsys, clean)[0] == 0
    assert validate(capsys, clean, "--probe")[0] == 0  # the answer column is the reference


def test_max_new_tokens_that_cuts_the_reference_answers(tmp_path: Path, capsys) -> None:
    file = spec(tmp_path, BASE.replace("max_new_tokens: 8", "max_new_tokens: 2"))
    code, err = validate(capsys, file)
    assert code == 1
    located(err, file, "nodes.rollout.sampling.max_new_tokens", "max_new_tokens 2 cuts", "raise it to at least 6")


def test_probe_fails_a_reward_that_ignores_the_answer(tmp_path: Path, capsys) -> None:
    file = spec(tmp_path, BASE.replace("fn: builtin:reverse_digits", "fn: test_semantics:constant_reward"))
    assert validate(capsys, file)[0] == 0  # without --probe nothing calls the reward
    code, err = validate(capsys, file, "--probe")
    assert code == 1
    located(err, file, "nodes.score.fn", "test_semantics:constant_reward", "the same on 8 of 8 probed rows",
            "does not read the answer")


def test_probe_fails_a_reward_whose_best_is_not_the_reference(tmp_path: Path, capsys) -> None:
    file = spec(tmp_path, BASE.replace("fn: builtin:reverse_digits", "fn: test_semantics:prefers_empty"))
    code, err = validate(capsys, file, "--probe")
    assert code == 1
    located(err, file, "nodes.score.fn", "less than '' gets (1)", "the best answer should score best")


def test_probe_fails_a_reward_that_raises(tmp_path: Path, capsys) -> None:
    file = spec(tmp_path, BASE.replace("fn: builtin:reverse_digits", "fn: test_semantics:length_reward"))
    code, err = validate(capsys, file, "--probe")  # reverse_digits rows have no 'answer' key
    assert code == 1
    located(err, file, "nodes.score.fn", "failed on the reference answer", "KeyError")


def test_probe_process_exits_1_without_traceback(tmp_path: Path) -> None:
    held = ["What is 1 plus 1?"]
    file = _files(tmp_path, [f"What is {i} plus {i}?" for i in range(4)], held)
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", "--probe", str(file)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})  # the rewards of this file
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert f"{file}:" in proc.stderr and "data.source.eval_file: 1 of 1 held-out rows" in proc.stderr




@pytest.mark.parametrize("file", PIPELINES, ids=lambda f: f.stem)
def test_shipped_pipelines_pass_the_probe(file: Path, capsys, tmp_path: Path, monkeypatch) -> None:
    overrides = []
    if file.stem in BUILT_MODELS:  # a tiny local model in place of the folder the user builds
        from test_engine import make_checkpoint

        make_checkpoint("tiny-qwen2", tmp_path / BUILT_MODELS[file.stem], seed=0)
        overrides = [f"model.path={tmp_path / BUILT_MODELS[file.stem]}"]
    monkeypatch.chdir(ROOT)
    code, err = validate(capsys, file.relative_to(ROOT), "--probe", *overrides)
    assert code == 0 and err == "", err
