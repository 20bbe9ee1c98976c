"""Shared prefill in the embedded engine: a GRPO group's equal prompts are computed once and forked,
a prefix cached by a decoding request is copied instead of recomputed, and neither changes any
request's tokens or logprobs (vs the same request run alone), nor survives a weight update."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from test_engine import make_checkpoint, wait_for_tokens

from flowrl.operator import OperatorContext
from flowrl_operators.config import GenerateConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.engine.embedded.prefill import Leader, batches
from flowrl_operators.generate import Generate
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.tasks import reverse_digits

torch.set_num_threads(1)
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny-qwen2", tmp_path_factory.mktemp("ckpt") / "tiny-qwen2", seed=5)


def group(prompt: list[int], size: int, tag: str) -> list[GenerateRequest]:
    """A GRPO group: equal prompts, each with its own seed (and one greedy member)."""
    return [GenerateRequest(request_id=f"{tag}{i}", input_ids=list(prompt), sampling=SamplingParams(
        temperature=0.0 if i == 0 else 1.0, max_new_tokens=6 + 3 * i, ignore_eos=True, seed=100 + i))
        for i in range(size)]


def assert_same(a, b) -> None:
    assert a.error is None and b.error is None and a.output_ids, (a.error, b.error)
    assert a.output_ids == b.output_ids, a.request_id
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5, a.request_id


def alone_then_together(checkpoint, requests: list[GenerateRequest], slots: int):
    """Each request run alone, then all at once on the same engine: (alone, together, the prefill
    stats after the alone runs, and what the together run added to them)."""

    async def run():
        engine = EmbeddedEngine(checkpoint, max_slots=slots)
        try:
            alone = [await engine.generate(r) for r in requests]
            before = engine.stats()
            together = await asyncio.gather(*[engine.generate(r) for r in requests])
            added = {k: v - before[k] for k, v in engine.stats().items() if k.startswith("prefill")}
            return alone, together, before, added
        finally:
            await engine.close()

    alone, together, before, added = asyncio.run(run())
    for a, b in zip(alone, together, strict=True):
        assert_same(a, b)
    return together, before, added


def test_group_is_prefilled_once_and_equals_requests_alone(checkpoint):
    requests = group(SYSTEM + [40, 41, 42], 8, "g") + group(SYSTEM + [50, 51], 4, "h")
    together, before, added = alone_then_together(checkpoint, requests, slots=16)
    assert len({tuple(r.output_ids[:5]) for r in together}) > 2  # the seeds do differ
    # One at a time: 12 prefills, nothing shared. Together: 2 computed, 10 forked.
    assert (before["prefills"], before["prefill_forks"], before["prefill_shared_tokens"]) == (12, 0, 0)
    assert added["prefills"] == 2
    assert added["prefill_forks"] == 10
    assert added["prefill_tokens"] == 15 + 14


def test_prefix_of_a_decoding_request_is_copied(checkpoint):
    long = GenerateRequest(request_id="long", input_ids=SYSTEM + [60, 61], sampling=SamplingParams(
        temperature=1.0, max_new_tokens=60, ignore_eos=True, seed=1))
    late = group(SYSTEM + [70, 71, 72], 3, "late")

    async def run():
        engine = EmbeddedEngine(checkpoint, max_slots=8)
        try:
            alone = [await engine.generate(r) for r in late]
            running = asyncio.ensure_future(engine.generate(long))
            await wait_for_tokens(engine, "long", 3)
            before = engine.stats()
            crowded = await asyncio.gather(*[engine.generate(r) for r in late])
            after = engine.stats()
            await running
            return alone, crowded, after["prefill_shared_tokens"] - before["prefill_shared_tokens"]
        finally:
            await engine.close()

    alone, crowded, shared = asyncio.run(run())
    for a, b in zip(alone, crowded, strict=True):
        assert_same(a, b)
    assert shared == len(SYSTEM) + 2 * (len(SYSTEM) + 3)  # the system prompt copied, then two forks


def test_kv_of_old_weights_is_not_shared_after_an_update(checkpoint):
    """After an in-place update a decoding request's cache holds old-weight KV: a new request with the
    same prefix must compute it under the new weights."""
    long = GenerateRequest(request_id="long", input_ids=SYSTEM + [60], sampling=SamplingParams(
        temperature=0.0, max_new_tokens=60, ignore_eos=True))
    new = GenerateRequest(request_id="new", input_ids=SYSTEM + [80, 81], sampling=SamplingParams(
        temperature=0.0, max_new_tokens=8, ignore_eos=True))

    async def run():
        engine = EmbeddedEngine(checkpoint, max_slots=4)
        try:
            changed = [(name, p.detach() * 1.3) for name, p in engine.named_parameters()]
            running = asyncio.ensure_future(engine.generate(long))
            await wait_for_tokens(engine, "long", 2)
            await engine.pause("in_place")
            await engine.update_weights([changed], version=1)
            await engine.resume()
            before = engine.stats()["prefill_shared_tokens"]
            crowded = await engine.generate(new)
            shared = engine.stats()["prefill_shared_tokens"] - before
            await running
            fresh = EmbeddedEngine(checkpoint, max_slots=4)
            try:
                await fresh.update_weights([changed], version=1)
                return crowded, await fresh.generate(new), shared
            finally:
                await fresh.close()
        finally:
            await engine.close()

    crowded, reference, shared = asyncio.run(run())
    assert shared == 0
    assert_same(crowded, reference)


def test_batches_bound_padding():
    rows = [Leader(type("S", (), {"tokens": [0] * n, "slot": i})()) for i, n in enumerate([30, 3, 28, 4, 29])]
    cut = batches(rows)
    assert sorted(len(r.seq.tokens) for b in cut for r in b) == [3, 4, 28, 29, 30]
    for b in cut:
        sizes = [len(r.seq.tokens) for r in b]
        assert max(sizes) * len(sizes) <= 1.25 * sum(sizes)
    assert len(cut) == 2  # the short pair together, the long three together


def test_decoding_requests_move_down_into_freed_slots(checkpoint):
    """Short requests in slots 0 and 1 finish; the long one in slot 2 moves to slot 0 (its KV copied),
    so later decodes compute one row, not three, and its output is what it is alone."""
    long = GenerateRequest(request_id="long", input_ids=[30, 31, 32], sampling=SamplingParams(
        temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=4))
    shorts = [GenerateRequest(request_id=f"s{i}", input_ids=[40 + i, 41], sampling=SamplingParams(
        temperature=0.0, max_new_tokens=3, ignore_eos=True)) for i in range(2)]

    async def run():
        engine = EmbeddedEngine(checkpoint, max_slots=4)
        try:
            alone = await engine.generate(long)
            tasks = [asyncio.ensure_future(engine.generate(r)) for r in [*shorts, long]]
            await asyncio.gather(*tasks[:2])
            await wait_for_tokens(engine, "long", 8)
            slot = engine._by_id["long"].slot
            return alone, await tasks[2], slot
        finally:
            await engine.close()

    alone, moved, slot = asyncio.run(run())
    assert slot == 0
    assert_same(alone, moved)


def test_generate_node_submits_a_group_together(checkpoint):
    """The generate node gathers a sample's episodes at once: the engine computes the prompt once."""

    async def run():
        op = Generate(msgspec.convert({"group_size": 8, "sampling": {"max_new_tokens": 4}}, GenerateConfig),
                      OperatorContext(node="rollout", model={"path": str(checkpoint)}, seed=3))
        await op.setup()
        try:
            group = await op.generate(reverse_digits(seed=0).sample(0, 1), step=0, sample_id="0:1")
            return group, op.engine.stats(), op.metrics()
        finally:
            await op.close()

    group, stats, metrics = asyncio.run(run())
    assert len(group.trajectories) == 8
    assert (stats["prefills"], stats["prefill_forks"]) == (1, 7)
    # The node reports its engine's step counters (flowrl plan fits a prefill's cost on them).
    assert (metrics["engine/admitted"], metrics["engine/prefill_steps"]) == (8, 1)
    assert metrics["engine/steps"] == stats["steps"] >= 4 and metrics["engine/step_seconds"] > 0


def test_the_engine_counts_its_steps_those_that_prefill_and_their_seconds(checkpoint):
    """Three requests of four tokens in two slots: a step admits two and prefills them (their first
    token), three decode; the third is admitted when they finish, prefilled, and decoded three more."""
    requests = [GenerateRequest(request_id=f"r{i}", input_ids=[30 + i, 31, 32], sampling=SamplingParams(
        temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=i)) for i in range(3)]

    async def run():
        engine = EmbeddedEngine(checkpoint, max_slots=2)
        try:
            await asyncio.gather(*[engine.generate(r) for r in requests])
            return engine.stats()
        finally:
            await engine.close()

    stats = asyncio.run(run())
    assert (stats["steps"], stats["prefill_steps"], stats["admitted"]) == (8, 2, 3)
    assert 0 < stats["prefill_step_seconds"] < stats["step_seconds"]


def test_new_prompts_with_a_long_common_prefix_compute_it_once(checkpoint):
    """Two groups arriving together whose prompts open with the same 20 tokens: the second group's
    leader waits for the first's forward and copies those 20 positions."""
    system = list(range(60, 80))
    requests = group(system + [40, 41, 42], 3, "a") + group(system + [50, 51], 3, "b")
    _, _, delta = alone_then_together(checkpoint, requests, slots=8)
    assert delta["prefills"] == 2 and delta["prefill_forks"] == 4 and delta["prefill_forwards"] == 2
    assert delta["prefill_tokens"] == 23 + 2
    assert delta["prefill_shared_tokens"] == 20 + 2 * 23 + 2 * 22
