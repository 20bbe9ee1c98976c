"""The long-tail agentic task (operators/tasks/longtail.py): the tail knob, the tool's waits, an
episode on the real embedded engine, its rewards, and the shipped pipelines."""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

import pytest
from engines import embedded_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.spec.load import load  # noqa: E402
from flowrl_operators.inference import SamplingParams  # noqa: E402
from flowrl_operators.tasks import TASKS  # noqa: E402
from flowrl_operators.tasks.digits import position_rewards  # noqa: E402
from flowrl_operators.tasks.longtail import chunk_count, longtail_digits, rollout_seconds, tool_waits  # noqa: E402
from flowrl_operators.workflows import WorkflowContext, load_workflow  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin:tiny-qwen2"


@pytest.fixture(scope="module")
def engine(loop):
    yield from embedded_engine(loop, MODEL, 64)


@pytest.fixture(scope="module")
def tok():
    from flowrl_operators.models import load_tokenizer

    return load_tokenizer(MODEL)


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_tail_knob_from_uniform_to_heavy():
    """tail 0: every problem has two chunks and every wait is latency_s; tail 1: a heavy tail of
    chunks, lognormal waits and cold starts, whose rollout p99 stays within 20x its median."""
    rng = random.Random(0)
    assert {chunk_count(1.0 - rng.random(), 0.0, 12) for _ in range(1000)} == {2}
    assert tool_waits(rng, 5, 0.0, 0.1) == [0.1] * 5
    heavy = [chunk_count(1.0 - rng.random(), 1.0, 12) for _ in range(5000)]
    assert statistics.median(heavy) == 3 and max(heavy) == 12 and 0.02 < heavy.count(12) / len(heavy) < 0.05
    ratios = {}
    for tail in (0.0, 0.5, 1.0):
        times = [rollout_seconds(rng, tail, 0.1, 0.04) for _ in range(20000)]
        ratios[tail] = quantile(times, 0.99) / statistics.median(times)
    assert ratios[0.0] == pytest.approx(1.0) and 1.5 < ratios[0.5] < ratios[1.0] <= 20.0


def test_cold_starts_hit_first_calls_only():
    rng = random.Random(1)
    firsts, rests = zip(*[(w[0], w[1]) for w in (tool_waits(rng, 2, 1.0, 0.1) for _ in range(20000))], strict=True)
    assert sum(w > 1.5 for w in firsts) / len(firsts) == pytest.approx(0.02, abs=0.006)
    assert max(rests) < 1.5  # a lognormal wait alone (sigma 0.6) stays far below a cold start


def test_samples_are_pure_held_out_and_eval_has_no_waits():
    source, other = longtail_digits(seed=3, tail=0.5), longtail_digits(seed=4, tail=0.5)
    assert source.sample(2, 5) == source.sample(2, 5) != other.sample(2, 5)
    sample = source.sample(2, 5)
    assert sample["prompt"] == f"<{sample['chunks'][0]}>" and sample["tail"] == 0.5
    train = {"|".join(source.sample(0, i)["chunks"]) for i in range(300)}
    held = [source.eval_sample(i) for i in range(50)]
    assert not train & {"|".join(s["chunks"]) for s in held}
    assert all(s["latency_s"] == 0.0 for s in held) and source.sample(0, 0)["latency_s"] == 0.05
    assert TASKS["longtail_digits"] is longtail_digits
    with pytest.raises(ValueError, match="tail"):
        longtail_digits(tail=1.5)
    with pytest.raises(ValueError, match="latency_s"):
        longtail_digits(latency_s=-1.0)


def test_episode_is_one_trajectory_per_turn_after_the_tool_waits(loop, engine, tok):
    """On the real engine: one trajectory per chunk, each prompted by its chunk alone, credited by
    digits.position_rewards against its own target; the episode lasts at least its tool's waits."""
    sample = {"prompt": "<123>", "chunks": ["123", "4567", "89"], "tail": 0.0, "latency_s": 0.05}
    ctx = WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
                          sample_id="0:0", episode=0, seed=7)
    started = time.monotonic()
    trajectories = loop.run_until_complete(load_workflow("builtin:longtail_digits")(ctx, sample))
    assert time.monotonic() - started >= 0.15  # three tool calls of 0.05 s
    assert [tok.decode(t.prompt_ids) for t in trajectories] == ["<123>", "<4567>", "<89>"]
    assert [t.metadata["sample"]["target"] for t in trajectories] == ["321", "7654", "98"]
    episode = trajectories[0].metadata["episode_reward"]
    assert all(t.metadata["episode_reward"] == episode and t.metadata["turns"] == 3 for t in trajectories)
    for t in trajectories:
        t.metadata["text"] = tok.decode(t.response_ids, skip_special_tokens=True)
        assert len(position_rewards(t)["token_rewards"]) == len(t.response_ids) > 0
    assert longtail_digits.reward(trajectories[1]) == episode == pytest.approx(
        statistics.mean(position_rewards(t)["reward"] for t in trajectories))


@pytest.mark.parametrize("name", ["longtail_sync", "longtail_async"])
def test_pipelines_validate(name):
    loaded = load(ROOT / f"pipelines/{name}.yaml", ["data.options.tail=0.5"])
    [warmup, grpo] = loaded.spec.phases
    assert (warmup.name, grpo.name) == ("warmup", "grpo")
    assert loaded.spec.data.options == {"tail": 0.5, "latency_s": 0.2}
