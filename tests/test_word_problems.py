"""The smollm2_math pipeline's pieces that run without the model: its shipped data and its reward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.word_problems import final_answer

ROOT = Path(__file__).resolve().parents[1]


def scored(text: str, answer: str) -> float:
    t = Trajectory(id="s/0", group_id="s", sample_id="s", prompt_ids=[1], response_ids=[2], loss_mask=[1],
                   behaviour_logprobs=[0.0], versions=[0], metadata={"text": text, "sample": {"answer": answer}})
    return final_answer(t)


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
