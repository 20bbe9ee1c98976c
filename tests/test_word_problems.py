"""The smollm2_math and smollm2_sums pipelines' pieces: their shipped data and rewards (no model
needed), and one step of smollm2_sums on the real checkpoint where tools/get_smollm2.py built it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.word_problems import final_answer, last_integer, number_anywhere

ROOT = Path(__file__).resolve().parents[1]


def scored(text: str, answer: str, reward=final_answer) -> float:
    t = Trajectory(id="s/0", group_id="s", sample_id="s", prompt_ids=[1], response_ids=[2], loss_mask=[1],
                   behaviour_logprobs=[0.0], versions=[0], metadata={"text": text, "sample": {"answer": answer}})
    return reward(t)


@pytest.mark.parametrize(("text", "expected"), [
    ("So Sam has 12 - 5 = 7 marbles left.", 1.0),
    ("The answer is \\boxed{7}.", 1.0),
    ("7", 1.0),
    ("He has 12 and gives 5, so 8.", 0.0),  # the last number counts, not any number
    ("seven", 0.0),
    ("", 0.0),
])
def test_the_reward_checks_the_final_number(text: str, expected: float) -> None:
    assert scored(text, "7") == expected


def test_the_reward_runs_in_a_thread() -> None:
    # The reward node calls rewards from threads; math-verify's default timeout needs the main thread.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(scored, "so 45", "45").result() == 1.0


def test_the_shipped_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    subprocess.run([sys.executable, str(ROOT / "tools/make_word_problems.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for split in ("train", "eval"):
        name = f"word_problems_{split}.parquet"
        assert pq.read_table(tmp_path / name).to_pylist() == pq.read_table(ROOT / "pipelines/data" / name).to_pylist()
    train = {r["messages"][0]["content"] for r in pq.read_table(tmp_path / "word_problems_train.parquet").to_pylist()}
    held = {r["messages"][0]["content"] for r in pq.read_table(tmp_path / "word_problems_eval.parquet").to_pylist()}
    assert len(train) == 2000 and len(held) == 64 and not train & held


@pytest.mark.parametrize(("text", "expected"), [
    ("47 + 38 = 85", 1.0),
    ("85", 1.0),
    ("The sum is 85.", 1.0),
    ("To find 47 + 38, we", 0.0),  # restating the sum is not answering it (math-verify says 1.0)
    ("47 + 38 = 84", 0.0),
    ("85 + 1 = 86", 0.0),  # the last integer counts
    ("", 0.0),
])
def test_the_sums_reward_checks_the_last_integer_written(text: str, expected: float) -> None:
    assert scored(text, "85", last_integer) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("47 + 38 = 85", 1.0),
    ("85 + 1 = 86", 1.0),  # where the sum stands does not matter (last_integer: 0.0)
    ("The answer is 85, I think so", 1.0),
    ("It is 85.", 1.0),  # a full stop ends the number
    ("1,085", 0.0),  # part of a longer number, thousands separator or not
    ("185", 0.0),
    ("850", 0.0),
    ("8.85", 0.0),
    ("85.5", 0.0),
    ("-85", 0.0),  # a different number
    ("47 + 38", 0.0),  # restating the question writes no sum
    ("eighty-five", 0.0),
    ("", 0.0),
])
def test_number_anywhere_finds_the_sum_as_a_whole_number(text: str, expected: float) -> None:
    assert scored(text, "85", number_anywhere) == expected


def test_math_verify_would_score_a_restated_sum() -> None:
    """Why smollm2_sums does not use final_answer: GRPO learned to restate the question under it."""
    assert scored("To find 47 + 38, we", "85") == 1.0


def test_the_shipped_sums_are_what_the_generator_writes(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    subprocess.run([sys.executable, str(ROOT / "tools/make_word_problems.py"), "--task", "sums", "--train", "4000",
                    "--eval", "256", "--out", str(tmp_path)], check=True, capture_output=True)
    tables = {}
    for split in ("train", "eval"):
        name = f"sums_{split}.parquet"
        tables[split] = pq.read_table(tmp_path / name).to_pylist()
        assert tables[split] == pq.read_table(ROOT / "pipelines/data" / name).to_pylist()
    train = {r["messages"][0]["content"] for r in tables["train"]}
    held = {r["messages"][0]["content"] for r in tables["eval"]}
    assert len(train) == 4000 and len(held) == 256 and not train & held
    assert all(int(r["answer"]) == sum(map(int, r["messages"][0]["content"][8:].split("?")[0].split(" + ")))
               for r in tables["eval"])


MODEL = ROOT / "models/smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="models/smollm2-135m-instruct not built "
                    "(python tools/get_smollm2.py)")
def test_smollm2_sums_runs_a_step_on_the_real_model(tmp_path: Path) -> None:
    """The shipped pipeline as shipped, cut to one small step: it loads, samples, scores, trains, evaluates."""
    import json

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", "pipelines/smollm2_sums.yaml", "run.steps=1",
                           "data.batch_size=2", "nodes.rollout.group_size=2", "data.eval.samples=4",
                           "--run-dir", str(run_dir), "--quiet"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0.0 <= rows[0]["reward"] <= 1.0
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 1] and all(e["samples"] == 4 for e in evals)
    # The pipeline's second reading of the same answers (data.eval.options.also): the sum anywhere.
    assert all(set(e["scores"]) == {"anywhere"} and 0.0 <= e["scores"]["anywhere"] <= 1.0 for e in evals)
