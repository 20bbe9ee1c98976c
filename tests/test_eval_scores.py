"""`data.eval.options.also` and `data.eval.max_new_tokens` through a real short run of a built-in
task: every evaluation's row in eval.jsonl carries each extra score's mean over the same greedy
answers, and the answers keep to the evaluation's own token budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "tests/specs/good/base.yaml").read_text().replace(
    "  batch_size: 4\n",
    "  batch_size: 2\n"
    "  eval:\n"
    "    every: 1\n"
    "    samples: 4\n"
    "    max_new_tokens: 3\n"
    "    options:\n"
    "      also:\n"
    "        same: builtin:reverse_digits\n"
    "        exact: flowrl_operators.tasks.digits:exact_match\n"
    "        length: test_eval_scores:response_tokens\n"
    "run: {steps: 1, executor: inprocess}\n").replace("group_size: 4", "group_size: 2")


def response_tokens(trajectory) -> float:
    """A score that reads the answer's length: the evaluation's budget is what the engine kept to."""
    return float(len(trajectory.response_ids))


@pytest.fixture(scope="module")
def evals(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    folder = tmp_path_factory.mktemp("also")
    (folder / "pipeline.yaml").write_text(SPEC)
    assert main(["run", str(folder / "pipeline.yaml"), "--run-dir", str(folder / "run"), "--quiet"]) == 0
    return [json.loads(line) for line in (folder / "run/eval.jsonl").read_text().splitlines()]


def test_each_evaluation_row_carries_the_extra_scores(evals: list[dict]) -> None:
    assert [e["version"] for e in evals] == [0, 1]
    for e in evals:
        assert list(e)[:3] == ["version", "eval_reward", "scores"] and set(e["scores"]) == {"same", "exact", "length"}
        # The task's own reward under another name scores the same answers the same; a whole answer
        # right (exact) is also every position right.
        assert e["scores"]["same"] == e["eval_reward"]
        assert 0.0 <= e["scores"]["exact"] <= e["eval_reward"] <= 1.0


def test_the_greedy_answers_keep_to_the_evaluation_budget(evals: list[dict]) -> None:
    """sampling.max_new_tokens is 8 and the untrained model writes all 8 (tests/test_generate_node.py);
    data.eval.max_new_tokens 3 cuts its evaluation answers to 3."""
    assert all(0 < e["scores"]["length"] <= 3 for e in evals)
