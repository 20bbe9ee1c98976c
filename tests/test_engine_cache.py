"""The embedded engine's KV cache is sized by the requests it admits, not by the model's
max_position_embeddings; growing it while requests decode leaves their outputs unchanged, and
max_context is a validated limit (engine, generate node, spec)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from flowrl.operator import ConfigError, GraphFacts, OperatorContext
from flowrl_operators.config import GenerateConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.generate import Generate
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_config

MODEL = "builtin:tiny-qwen2"
torch.set_num_threads(1)


def greedy(rid: str, prompt: list[int], new: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, input_ids=prompt,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))


def dense_bytes(engine: EmbeddedEngine, positions: int) -> int:
    """What a cache of every slot x `positions` would hold."""
    per = engine.cache.keys[0][0, :, 0].numel() * engine.cache.keys[0].element_size()
    return 2 * len(engine.cache.keys) * engine.max_slots * positions * per


def test_cache_holds_what_admitted_requests_need():
    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=32)
        try:
            empty = engine.stats()
            await asyncio.gather(*(engine.generate(greedy(f"r{i}", [5, 6, 7, 8, 9], 24)) for i in range(4)))
            return empty, engine.stats(), dense_bytes(engine, engine.max_context)
        finally:
            await engine.close()

    empty, after, dense = asyncio.run(run())
    assert after["max_context"] == load_config(MODEL).max_position_embeddings
    assert (empty["cache_slots"], empty["cache_positions"]) == (1, 64)
    # 4 requests of 5 + 24 tokens: 4 slots of one 64-position block, not 32 x max_position_embeddings.
    assert (after["cache_slots"], after["cache_positions"]) == (4, 64)
    assert after["cache_bytes"] * 50 < dense


def test_growing_the_cache_mid_flight_keeps_outputs():
    """A long request admitted while a short one decodes grows the cache (slots and positions); the
    short one's output is the one it gets alone, and so is the long one's."""
    short, long = [5, 6, 7], [(3 * i) % 40 + 5 for i in range(100)]

    async def alone(prompt, new):
        engine = EmbeddedEngine(MODEL, max_slots=4)
        try:
            return (await engine.generate(greedy("a", prompt, new))).output_ids
        finally:
            await engine.close()

    async def together():
        engine = EmbeddedEngine(MODEL, max_slots=4)
        try:
            first = asyncio.ensure_future(engine.generate(greedy("s", short, 40)))
            while engine.snapshot("s") is None or len(engine.snapshot("s").output_ids) < 5:
                await asyncio.sleep(0.001)
            before = engine.stats()
            second = await engine.generate(greedy("l", long, 40))
            return (await first).output_ids, second.output_ids, before, engine.stats()
        finally:
            await engine.close()

    s, lo, before, after = asyncio.run(together())
    assert (before["cache_slots"], before["cache_positions"]) == (1, 64)
    assert (after["cache_slots"], after["cache_positions"]) == (2, 192)
    assert s == asyncio.run(alone(short, 40)) and len(s) == 40
    assert lo == asyncio.run(alone(long, 40)) and len(lo) == 40


def test_max_context_limits_requests():
    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=2, max_context=32)
        try:
            long = await engine.generate(greedy("long", [5] * 32, 4))
            capped = await engine.generate(greedy("capped", [5] * 20, 100))
            return long, capped, engine.stats()
        finally:
            await engine.close()

    long, capped, stats = asyncio.run(run())
    assert long.finish_reason == "abort" and "no room in the context of 32 tokens" in long.error
    assert capped.finish_reason == "length" and len(capped.output_ids) == 12
    assert stats["cache_positions"] == 32  # capped at max_context, not rounded past it
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EmbeddedEngine(MODEL, max_context=load_config(MODEL).max_position_embeddings + 1)


def test_generate_node_reads_max_context():
    limit = load_config(MODEL).max_position_embeddings

    def node(max_context: int) -> Generate:
        config = msgspec.convert({"engine": {"max_context": max_context}, "sampling": {"max_new_tokens": 8}},
                                 GenerateConfig)
        return Generate(config, OperatorContext(node="rollout", model={"path": MODEL}, seed=0))

    op = node(48)
    asyncio.run(op.setup())
    try:
        assert op.engine.max_context == 48
    finally:
        asyncio.run(op.close())
    with pytest.raises(ConfigError, match=r"nodes\.rollout\.engine\.max_context: max_context .* between 2"):
        asyncio.run(node(limit + 1).setup())
    too_small = msgspec.convert({"engine": {"max_context": 8}, "sampling": {"max_new_tokens": 8}}, GenerateConfig)
    assert Generate.check_graph(too_small, GraphFacts())[0][0] == ("engine", "max_context")
