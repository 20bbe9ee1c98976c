"""The SGLang adapter's own pieces: SGLang's answer shapes, prefix-safe request ids, several servers
with a weight sync by disk, and partial rollout by abort + resubmit through a workflow — against
flowrl's SGLang-compatible server, since SGLang itself does not run here (launching and broadcast
weight sync: test_sglang_launch.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flowrl_operators.config import EngineConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.engine.factory import make_engine
from flowrl_operators.engine.server.server import start_server
from flowrl_operators.engine.sglang.adapter import SGLangEngine, parse_answer, sampling_params, token_versions
from flowrl_operators.engine.sglang.weights import ServerError
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_hf_model, resolve_model

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    folder = resolve_model("builtin:tiny-qwen2")
    hf = load_hf_model(folder)
    generator = torch.Generator().manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=generator)) for n, p in hf.named_parameters()]
    return folder, new


async def reference_greedy(folder, weights, prompt) -> list[int]:
    engine = EmbeddedEngine(folder, max_slots=2)
    try:
        if weights is not None:
            await engine.update_weights([weights], 1)
        result = await engine.generate(GenerateRequest(request_id="ref", input_ids=prompt, sampling=GREEDY))
        return result.output_ids
    finally:
        await engine.close()


def test_sglang_answer_shapes():
    meta = {"finish_reason": {"type": "length", "length": 3}, "weight_version": "4",
            "output_token_logprobs": [[-0.5, 7, "a"], [-1.0, 8, "b"], [-0.25, 9, None]]}
    spans = dict(meta, weight_versions=[{"version": "3", "start": 0, "end": 1},
                                        {"version": "4", "start": 1, "end": 3}])
    result = parse_answer("q", {"output_ids": [7, 8, 9], "meta_info": spans})
    assert (result.output_ids, result.logprobs, result.versions) == ([7, 8, 9], [-0.5, -1.0, -0.25], [3, 4, 4])
    assert result.finish_reason == "length" and result.error is None
    # Before 0.5.20 there are no spans: every token gets the version at the end.
    assert parse_answer("q", {"output_ids": [7, 8, 9], "meta_info": meta}).versions == [4, 4, 4]
    assert token_versions({"weight_versions": ["1", "2"]}, 2) == [1, 2]
    with pytest.raises(ServerError, match="covers 1 tokens"):
        token_versions({"weight_versions": [{"version": "1", "start": 0, "end": 1}]}, 3)
    with pytest.raises(ServerError, match="return_logprob"):
        parse_answer("q", {"output_ids": [7], "meta_info": {}})
    aborted = parse_answer("q", {"output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "Abort before prefill"}, "output_token_logprobs": []}})
    assert aborted.finish_reason == "abort" and aborted.error is None
    failed = parse_answer("q", {"output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "prompt too long"}, "output_token_logprobs": []}})
    assert failed.error == "prompt too long"
    assert sampling_params(SamplingParams(temperature=0.5, seed=3, stop_token_ids=[2])) == {
        "temperature": 0.5, "top_p": 1.0, "top_k": -1, "max_new_tokens": 128, "ignore_eos": False,
        "stop_token_ids": [2], "sampling_seed": 3}


def test_prefix_colliding_request_ids_abort_only_their_own(model):
    """SGLang aborts rids by prefix; the adapter's fixed-length rids keep "a#1" from aborting "a#10"."""
    folder, _ = model
    long = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)

    async def body():
        engine = EmbeddedEngine(folder, max_slots=4)
        runner, port = await start_server(engine)
        adapter = SGLangEngine(f"http://127.0.0.1:{port}")
        try:
            short = asyncio.create_task(adapter.generate(GenerateRequest(request_id="a#1", input_ids=[5], sampling=long)))
            longer = asyncio.create_task(adapter.generate(GenerateRequest(request_id="a#10", input_ids=[6],
                                                                          sampling=long)))
            await asyncio.sleep(0.1)
            await adapter.abort("a#1")
            return await short, await longer
        finally:
            await adapter.close()
            await runner.cleanup()
            await engine.close()

    aborted, kept = asyncio.run(body())
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 300
    assert kept.finish_reason == "length" and len(kept.output_ids) == 300


def test_two_servers_balanced_and_updated_from_disk(model):
    folder, new = model
    prompts = [[5 + i, 9] for i in range(8)]

    async def body():
        engines = [EmbeddedEngine(folder, max_slots=4) for _ in range(2)]
        served = [await start_server(e) for e in engines]
        adapter = make_engine(EngineConfig(kind="sglang", url=",".join(f"http://127.0.0.1:{p}" for _, p in served)),
                              str(folder))
        adapter.weight_sync = "disk"
        try:
            await adapter.start()
            tasks = [asyncio.create_task(adapter.generate(GenerateRequest(request_id=f"p{i}", input_ids=p,
                                                                          sampling=GREEDY)))
                     for i, p in enumerate(prompts)]
            await asyncio.sleep(0.01)
            spread = [s.in_flight for s in adapter.servers]
            before = await asyncio.gather(*tasks)
            await adapter.update_weights([new], 3)
            after = await adapter.generate(GenerateRequest(request_id="x", input_ids=[5, 17], sampling=GREEDY))
            return spread, before, after, [e.version for e in engines]
        finally:
            await adapter.close()
            for (runner, _), e in zip(served, engines, strict=True):
                await runner.cleanup()
                await e.close()

    spread, before, after, versions = asyncio.run(body())
    assert spread == [4, 4]
    alone = [asyncio.run(reference_greedy(folder, None, p)) for p in prompts[:2]]
    assert [r.output_ids for r in before[:2]] == alone
    assert versions == [3, 3] and after.versions == [3] * 12
    assert after.output_ids == asyncio.run(reference_greedy(folder, new, [5, 17]))


def test_partial_rollout_by_abort_and_resubmit_through_a_workflow(model):
    """Pause mode "abort" on SGLang: the server returns partial outputs, the workflow resubmits prompt +
    partial output (held by the adapter until resume), and the episode's tokens carry both versions."""
    from flowrl_operators.workflows.base import WorkflowContext

    folder, new = model
    long = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)

    async def body():
        engine = EmbeddedEngine(folder, max_slots=4)
        runner, port = await start_server(engine)
        adapter = SGLangEngine(f"http://127.0.0.1:{port}")
        try:
            ctx = WorkflowContext(engine=adapter, tokenizer=None, sampling=long, sample_id="s")
            episode = asyncio.create_task(ctx.generate([5, 17]))
            await asyncio.sleep(0.1)
            await adapter.pause("abort")
            await adapter.update_weights([new], 1)
            await asyncio.sleep(0.2)
            held = not episode.done()
            await adapter.resume()
            return held, await episode
        finally:
            await adapter.close()
            await runner.cleanup()
            await engine.close()

    held, result = asyncio.run(body())
    assert held, "the resubmitted request ran while the server was paused"
    assert len(result.output_ids) == 300 and result.finish_reason == "length"
    switch = result.versions.index(1)
    assert 0 < switch < 300 and result.versions == [0] * switch + [1] * (300 - switch)
