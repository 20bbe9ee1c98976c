"""Launching and feeding SGLang servers, proven on flowrl's own server (SGLang does not run here):
the command line from `server_args`, the health wait, a server process with weights broadcast into
it (by the adapter, and by the trainer-side sender as rank 0), and the Ray actor launch."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch
from test_sglang_adapter import GREEDY, reference_greedy

from flowrl_operators.engine.sglang.adapter import SGLangEngine
from flowrl_operators.engine.sglang.launch import ServerProcess, launch_servers, server_command, wait_healthy
from flowrl_operators.engine.sglang.sender import PushedRecord, SGLangSender
from flowrl_operators.engine.sglang.weights import ServerError, free_port
from flowrl_operators.inference import GenerateRequest
from flowrl_operators.models import load_hf_model, resolve_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    folder = resolve_model("builtin:tiny-qwen2")
    hf = load_hf_model(folder)
    generator = torch.Generator().manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=generator)) for n, p in hf.named_parameters()]
    return folder, new


def flowrl_command(folder, port, server_args):
    return [sys.executable, "-m", "flowrl_operators.engine.server", "--model", str(folder), "--port", str(port)]


def test_server_command_forwards_server_args():
    command = server_command("/m", 31000, {"tp_size": 2, "mem_fraction_static": 0.7, "enable_metrics": True,
                                           "disable_radix_cache": False, "json_model_override_args": {"a": 1},
                                           "cuda_graph_bs": [1, 2]}, python="py")
    assert command == ["py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                       "--port", "31000", "--tp-size", "2", "--mem-fraction-static", "0.7", "--enable-metrics",
                       "--json-model-override-args", '{"a": 1}', "--cuda-graph-bs", "1", "2"]
    with pytest.raises(ValueError, match="server_args.port"):
        server_command("/m", 1, {"port": 5})


def test_health_wait_fails_early_with_the_log(tmp_path):
    port = free_port()
    dead = ServerProcess([sys.executable, "-c", "print('bad flag --tp-size'); raise SystemExit(3)"], port,
                         tmp_path / "dead.log")
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*bad flag --tp-size"):
        dead.start(timeout_s=60)
    with pytest.raises(ServerError, match="did not answer 200"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)


def test_ray_launched_server_takes_broadcast_weights(model, tmp_path):
    """`engine: sglang` launches each server in a Ray actor on its own bundle (here flowrl's server and
    no GPUs; the actor code is the same). Weights then reach it by broadcast over gloo
    (init_weights_update_group + update_weights_from_distributed inside a begin/end session): from the
    adapter, then from a trainer-side sender as rank 0 of a fresh group, which the adapter adopts. Asking
    for GPUs the cluster lacks is an immediate error, not a wait."""
    ray = pytest.importorskip("ray")
    folder, new = model
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}})

    async def by_adapter(url):
        adapter = SGLangEngine(url, weight_sync="distributed")
        try:
            before = await adapter.generate(GenerateRequest(request_id="a", input_ids=[5, 17], sampling=GREEDY))
            await adapter.update_weights([new[:5], new[5:]], 7)
            after = await adapter.generate(GenerateRequest(request_id="b", input_ids=[5, 17], sampling=GREEDY))
            await adapter.update_weights([new], 8)  # the group is reused for the next version
            return before, after, adapter.version
        finally:
            await adapter.close()

    async def adopted(adapter, record):
        await adapter.adopt(record)
        with pytest.raises(ServerError, match="expected 10"):
            await adapter.adopt(PushedRecord(record.version + 1, record.urls))
        back = await adapter.generate(GenerateRequest(request_id="c", input_ids=[5, 17], sampling=GREEDY))
        await adapter.close()  # also stops the launched server (the adapter owns it)
        return adapter.version, back

    try:
        with pytest.raises(RuntimeError, match="has 0 GPUs; attach to running servers with engine.url"):
            launch_servers(str(folder), 1, {}, gpus=1, command=flowrl_command, log_dir=str(tmp_path))  # no wait
        launched = launch_servers(str(folder), 1, {}, gpus=0, command=flowrl_command, log_dir=str(tmp_path),
                                  timeout_s=120)
        url = launched[0][0]
        before, after, version = asyncio.run(by_adapter(url))
        sender = SGLangSender(url, weight_sync="distributed")
        try:
            record = sender.send([load_hf_model(folder).named_parameters()], 9)
        finally:
            sender.close()
        adopted_version, back = asyncio.run(adopted(SGLangEngine(url, owned=[h for _, h in launched]), record))
        with pytest.raises(ServerError):  # stopped: the port no longer answers
            wait_healthy(url, timeout_s=1.0)
    finally:
        if started:
            ray.shutdown()
    assert before.output_ids == asyncio.run(reference_greedy(folder, None, [5, 17]))
    assert after.versions == [7] * 12 and version == 8
    assert after.output_ids == asyncio.run(reference_greedy(folder, new, [5, 17]))
    assert adopted_version == 9 and back.versions == [9] * 12 and back.output_ids == before.output_ids
