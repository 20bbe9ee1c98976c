"""The SGLang adapter's own pieces: SGLang's answer shapes, request ids, several servers, weight sync
by disk and by broadcast (into a server process), and the launcher (command line, health wait, Ray
actor) — all against flowrl's SGLang-compatible server, since SGLang itself does not run here."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

from flowrl_operators.config import EngineConfig
from flowrl_operators.engine.base import GenerateRequest, SamplingParams
from flowrl_operators.engine.embedded import EmbeddedEngine
from flowrl_operators.engine.server import start_server
from flowrl_operators.engine.sglang import SGLangEngine, parse_answer, sampling_params, token_versions
from flowrl_operators.engine.sglang_launch import (
    ServerProcess,
    launch_servers,
    make_engine,
    server_command,
    wait_healthy,
)
from flowrl_operators.engine.sglang_weights import PushedRecord, ServerError, SGLangSender, free_port
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


def flowrl_command(folder, port, server_args):
    return [sys.executable, "-m", "flowrl_operators.engine.server", "--model", str(folder), "--port", str(port)]


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


def test_server_command_forwards_server_args():
    command = server_command("/m", 31000, {"tp_size": 2, "mem_fraction_static": 0.7, "enable_metrics": True,
                                           "disable_radix_cache": False, "json_model_override_args": {"a": 1},
                                           "cuda_graph_bs": [1, 2]}, python="py")
    assert command == ["py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                       "--port", "31000", "--tp-size", "2", "--mem-fraction-static", "0.7", "--enable-metrics",
                       "--json-model-override-args", '{"a": 1}', "--cuda-graph-bs", "1", "2"]
    with pytest.raises(ValueError, match="server_args.port"):
        server_command("/m", 1, {"port": 5})


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


def test_server_process_and_broadcast_weight_sync(model, tmp_path):
    """A server process started and health-checked by the launcher; weights broadcast into it over gloo
    (init_weights_update_group + update_weights_from_distributed inside a begin/end session)."""
    folder, new = model
    port = free_port()
    server = ServerProcess(flowrl_command(folder, port, {}), port, tmp_path / "server.log",
                           env={"HF_HUB_OFFLINE": "1"})

    async def body(url):
        adapter = SGLangEngine(url, weight_sync="distributed")
        try:
            await adapter.update_weights([new[:5], new[5:]], 7)
            result = await adapter.generate(GenerateRequest(request_id="b", input_ids=[5, 17], sampling=GREEDY))
            await adapter.update_weights([new], 8)  # the group is reused for the next version
            return result, adapter.version
        finally:
            await adapter.close()

    async def adopted(url, record):
        adapter = SGLangEngine(url)
        try:
            await adapter.adopt(record)
            stale = PushedRecord(record.version + 1, record.urls)
            with pytest.raises(ServerError, match="expected 10"):
                await adapter.adopt(stale)
            return adapter.version, await adapter.generate(GenerateRequest(request_id="c", input_ids=[5, 17],
                                                                           sampling=GREEDY))
        finally:
            await adapter.close()

    try:
        url = server.start(timeout_s=120)
        result, version = asyncio.run(body(url))
        # Trainer side: this process is rank 0 of a fresh group and pushes the old weights back.
        sender = SGLangSender(url, weight_sync="distributed")
        try:
            record = sender.send([load_hf_model(folder).named_parameters()], 9)
        finally:
            sender.close()
        adopted_version, back = asyncio.run(adopted(url, record))
    finally:
        server.stop()
    assert result.versions == [7] * 12 and version == 8
    assert result.output_ids == asyncio.run(reference_greedy(folder, new, [5, 17]))
    assert adopted_version == 9 and back.versions == [9] * 12
    assert back.output_ids == asyncio.run(reference_greedy(folder, None, [5, 17]))


def test_health_wait_fails_early_with_the_log(tmp_path):
    port = free_port()
    dead = ServerProcess([sys.executable, "-c", "print('bad flag --tp-size'); raise SystemExit(3)"], port,
                         tmp_path / "dead.log")
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*bad flag --tp-size"):
        dead.start(timeout_s=60)
    with pytest.raises(ServerError, match="did not answer 200"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)


def test_launch_servers_as_ray_actors(model, tmp_path):
    """`engine: sglang` launches each server in a Ray actor on its own bundle (here flowrl's server
    and no GPUs; the actor code is the same)."""
    ray = pytest.importorskip("ray")
    folder, _ = model
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}})
    try:
        launched = launch_servers(str(folder), 1, {}, gpus=0, command=flowrl_command, log_dir=str(tmp_path),
                                  timeout_s=120)
        adapter = SGLangEngine([u for u, _ in launched], owned=[h for _, h in launched])

        async def body():
            try:
                return await adapter.generate(GenerateRequest(request_id="r", input_ids=[5, 17], sampling=GREEDY))
            finally:
                await adapter.close()

        result = asyncio.run(body())
        assert result.output_ids == asyncio.run(reference_greedy(folder, None, [5, 17]))
        with pytest.raises(Exception):  # noqa: B017 - stopped: the port no longer answers
            wait_healthy(launched[0][0], timeout_s=1.0)
    finally:
        if started:
            ray.shutdown()
