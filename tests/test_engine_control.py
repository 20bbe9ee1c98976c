"""Pause / weight update / resume, abort, and the atomicity of weight updates."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_engine import GREEDY, make_checkpoint, request, teacher_forced_logprobs

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import SamplingParams
from flowrl_operators.models import load_hf_model

torch.set_num_threads(1)
LONG = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_checkpoint("tiny-qwen2", root / "old", seed=0), make_checkpoint("tiny-qwen2", root / "new", seed=1)


def buckets_of(folder, size: int = 5):
    params = list(load_hf_model(folder).state_dict().items())  # includes the tied lm_head.weight
    return [params[i:i + size] for i in range(0, len(params), size)]


async def wait_for_tokens(engine: EmbeddedEngine, rid: str, count: int) -> None:
    while (snap := engine.snapshot(rid)) is None or len(snap.output_ids) < count:
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_update_resume_continues_under_new_weights(old_and_new, mode):
    old, new = old_and_new
    prompt = [5, 9, 13, 17]

    async def run():
        engine = EmbeddedEngine(old, max_slots=4)
        try:
            task = asyncio.create_task(engine.generate(request("r", prompt, LONG)))
            await wait_for_tokens(engine, "r", 5)
            await engine.pause(mode)
            prefix = len(engine.snapshot("r").output_ids)
            await asyncio.sleep(0.02)
            assert len(engine.snapshot("r").output_ids) == prefix, "paused engine kept decoding"
            await engine.update_weights(buckets_of(new), version=1)
            assert engine.version == 1
            await engine.resume()
            return prefix, await task
        finally:
            await engine.close()

    prefix, result = asyncio.run(run())
    assert 5 <= prefix < 60 and result.finish_reason == "length"
    assert result.versions == [0] * prefix + [1] * (60 - prefix)
    old_lp = teacher_forced_logprobs(load_hf_model(old), prompt, result.output_ids)
    new_lp = teacher_forced_logprobs(load_hf_model(new), prompt, result.output_ids)
    got = torch.tensor(result.logprobs)
    assert (got[:prefix] - old_lp[:prefix]).abs().max() < 1e-4
    if mode == "retract":
        # The KV cache was recomputed: the continuation is exactly the new policy's greedy choice.
        assert (got[prefix:] - new_lp[prefix:]).abs().mean() < 1e-5
        with torch.no_grad():
            logits = load_hf_model(new)(torch.tensor([prompt + result.output_ids])).logits[0]
        greedy = logits[len(prompt) - 1 + prefix: -1].argmax(-1).tolist()
        assert result.output_ids[prefix:] == greedy
    else:
        # in_place keeps KV from the old weights: the continuation mixes both (documented).
        assert (got[prefix:] - new_lp[prefix:]).abs().max() > 1e-4


def test_abort_mode_returns_partial_outputs_and_stays_paused(old_and_new):
    old, _ = old_and_new

    async def run():
        engine = EmbeddedEngine(old, max_slots=2)
        try:
            tasks = [asyncio.create_task(engine.generate(request(f"r{i}", [5 + i, 6], LONG))) for i in range(3)]
            await wait_for_tokens(engine, "r0", 3)
            await engine.pause("abort")
            results = await asyncio.gather(*tasks)
            later = asyncio.create_task(engine.generate(request("later", [5], GREEDY)))
            await asyncio.sleep(0.05)
            assert not later.done(), "a paused engine must not serve new requests"
            await engine.resume()
            return results, await later
        finally:
            await engine.close()

    results, later = asyncio.run(run())
    assert all(r.finish_reason == "abort" and r.error is None for r in results)
    assert len(results[0].output_ids) >= 3 and len(results[0].logprobs) == len(results[0].output_ids)
    assert results[2].output_ids == []  # third request was still queued (two slots)
    assert later.finish_reason == "length" and len(later.output_ids) == 24


def test_abort_one_request(old_and_new):
    old, _ = old_and_new

    async def run():
        engine = EmbeddedEngine(old, max_slots=4)
        try:
            victim = asyncio.create_task(engine.generate(request("victim", [5, 6], LONG)))
            other = asyncio.create_task(engine.generate(request("other", [7, 8], LONG)))
            await wait_for_tokens(engine, "victim", 4)
            returned = await engine.abort("victim")
            assert await engine.abort("no-such-request") is None
            return returned, await victim, await other
        finally:
            await engine.close()

    returned, victim, other = asyncio.run(run())
    assert returned == victim and victim.finish_reason == "abort" and 4 <= len(victim.output_ids) < 60
    assert other.finish_reason == "length" and len(other.output_ids) == 60


def test_cancelled_caller_frees_its_slot(old_and_new):
    old, _ = old_and_new

    async def run():
        engine = EmbeddedEngine(old, max_slots=1)
        try:
            first = asyncio.create_task(engine.generate(request("first", [5], LONG)))
            await wait_for_tokens(engine, "first", 2)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            return await asyncio.wait_for(engine.generate(request("second", [6], GREEDY)), 10)
        finally:
            await engine.close()

    assert len(asyncio.run(run()).output_ids) == 24


def snapshot(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.named_parameters()}


def test_update_weights_is_atomic(old_and_new):
    old, new = old_and_new
    good = buckets_of(new)

    def raising_midway():
        yield good[0]
        yield good[1]
        raise ConnectionError("trainer went away")

    async def async_buckets():
        for bucket in good:
            await asyncio.sleep(0)
            yield bucket

    async def run():
        engine = EmbeddedEngine(old, max_slots=4)
        try:
            before = snapshot(engine)
            serving = asyncio.create_task(engine.generate(request("s", [5, 6], LONG)))
            name, tensor = good[1][0]
            failures = [
                (raising_midway(), ConnectionError),
                ([good[0], [("model.layers.0.no_such.weight", tensor)]], KeyError),
                ([good[0], [(name, tensor[..., :-1])]], ValueError),
            ]
            for buckets, error in failures:
                with pytest.raises(error):
                    await engine.update_weights(buckets, version=7)
                assert engine.version == 0
                after = snapshot(engine)
                assert all(torch.equal(before[n], after[n]) for n in before), "old weights were touched"
            result = await serving
            assert result.versions == [0] * 60 and result.error is None
            await engine.update_weights(async_buckets(), version=3)
            return engine.version, snapshot(engine)
        finally:
            await engine.close()

    version, weights = asyncio.run(run())
    reference = dict(load_hf_model(new).named_parameters())
    assert version == 3 and set(weights) == set(reference)
    assert all(torch.equal(weights[n], reference[n]) for n in weights)


def test_update_from_disk_and_requests_in_flight(old_and_new):
    old, new = old_and_new

    async def run():
        engine = EmbeddedEngine(old, max_slots=4)
        try:
            task = asyncio.create_task(engine.generate(request("r", [5, 6, 7], LONG)))
            await wait_for_tokens(engine, "r", 3)
            await engine.load_weights_from_disk(new, version=2)  # no pause: applied between steps
            return await task, snapshot(engine)
        finally:
            await engine.close()

    result, weights = asyncio.run(run())
    reference = dict(load_hf_model(new).named_parameters())
    assert all(torch.equal(weights[n], reference[n]) for n in reference)
    switch = result.versions.index(2)
    assert switch >= 3 and set(result.versions[:switch]) == {0} and set(result.versions[switch:]) == {2}
