"""`/init_weights_update_group` on the real engine server over loopback: a rendezvous address where
no trainer listens is a 400 within a bounded, configurable time (it was a 500 after ~50 s), and every
wrong field is a 400 naming it, before anything connects."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
import torch

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.engine.server.server import start_server

torch.set_num_threads(1)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(test, **server):
    async def run():
        engine = EmbeddedEngine("builtin:tiny-qwen2", max_slots=2, threads=1, seed=0)
        runner, port = await start_server(engine, **server)
        try:
            async with aiohttp.ClientSession() as session:
                return await test(session, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
            await engine.close()

    return asyncio.run(run())


async def init(session, url: str, **fields) -> tuple[int, str, float]:
    body = {"master_address": "127.0.0.1", "master_port": closed_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo", **fields}
    started = time.monotonic()
    async with session.post(f"{url}/init_weights_update_group", json=body) as response:
        answer = await response.json()
    return response.status, answer["error"]["message"] if "error" in answer else str(answer), time.monotonic() - started


@pytest.mark.parametrize(("server", "fields", "bound"), [
    ({}, {}, 5.0),  # the server's default
    ({"rendezvous_timeout_s": 1.0}, {}, 1.0),  # --rendezvous-timeout
    ({}, {"rendezvous_timeout_s": 1}, 1.0),  # the request's own
])
def test_a_rendezvous_where_no_trainer_listens_is_a_400_within_its_bound(server, fields, bound):
    status, message, seconds = serve(lambda session, url: init(session, url, **fields), **server)
    assert status == 400, message
    assert "did not answer within" in message and "is the trainer running" in message, message
    assert f"rendezvous_timeout_s {bound:g}" in message and "Traceback" not in message
    assert seconds < 2 * bound + 5, seconds  # bounded (it was ~50 s), with slack for a loaded machine


@pytest.mark.parametrize(("fields", "said"), [
    ({"master_port": 70000}, "master_port must be an integer from 1 to 65535, got 70000"),
    ({"master_port": "http"}, "master_port must be an integer"),
    ({"world_size": 1}, "world_size must be an integer from 2"),
    ({"rank_offset": 2}, "rank_offset must be an integer from 1 to 1, got 2"),
    ({"backend": "mpi"}, "backend must be one of gloo, nccl, got 'mpi'"),
    ({"master_address": ""}, "master_address must be a host name or IP address"),
    ({"rendezvous_timeout_s": 0}, "rendezvous_timeout_s must be a number of seconds in (0, 600]"),
    ({"rendezvous_timeout_s": 1e9}, "rendezvous_timeout_s must be a number of seconds in (0, 600]"),
])
def test_each_wrong_field_is_a_400_naming_it_before_anything_connects(fields, said):
    async def test(session, url):
        return [await init(session, url, **fields)]

    [(status, message, seconds)] = serve(test)
    assert status == 400 and said in message, (status, message)
    assert seconds < 3.0  # no rendezvous was tried (its bound is 5 s); slack for a busy 2-core machine
