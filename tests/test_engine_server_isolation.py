"""One hostile request fails alone on the engine server, over real loopback HTTP with the tiny model:
sampling values that cannot run are refused before they join a shared batch (the others in that batch
finish as they would have alone), every malformed body is a 400 naming what is wrong, an oversized one
a 413, a client that goes away takes its work with it, and a huge prompt neither blocks the event
loop nor is tokenised at all."""

from __future__ import annotations

import asyncio
import struct
import time
import zlib

import aiohttp
import pytest
import torch

from flowrl.data import images
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.engine.server.server import start_server
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_tokenizer

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"
SAMPLED = {"temperature": 1.0, "top_k": 5, "max_new_tokens": 24, "ignore_eos": True}


def serve(test, max_slots: int = 8):
    """Run `test(session, url, engine)` against a server of the tiny model on a free loopback port."""

    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=max_slots, threads=1, seed=0)
        runner, port = await start_server(engine, tokenizer=load_tokenizer(MODEL), model_name="tiny")
        try:
            async with aiohttp.ClientSession() as session:
                return await test(session, f"http://127.0.0.1:{port}", engine)
        finally:
            await runner.cleanup()
            await engine.close()

    return asyncio.run(run())


async def send(session, url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=data, headers=headers) as response:
        try:
            return response.status, await response.json(content_type=None)
        except ValueError:
            return response.status, {"error": {"message": await response.text()}}


def message(answer: dict) -> str:
    return str(answer.get("error", {}).get("message", answer))


def bomb_png(width: int = 12000, height: int = 12000) -> bytes:
    """A valid 1-bit PNG of width x height black pixels: a few tens of KB that decode to 432 MB of RGB."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" + b"\x00" * ((width + 7) // 8)
    pixels = zlib.compress(row * height, 9)
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_a_request_whose_sampling_cannot_run_fails_alone_and_its_batch_finishes_as_alone():
    """top_k past int64 (as uint64 JSON) beside other top-k requests: before, the batched sampler's
    tensor overflowed and every request in the batch was aborted."""
    good = [{"input_ids": [5 + i, 6, 7], "sampling_params": {**SAMPLED, "seed": i}} for i in range(3)]
    hostile = [{"top_k": 2**63}, {"top_k": 10**6}, {"temperature": 1e-30}]

    async def test(session, url, engine):
        alone = [await send(session, f"{url}/generate", _json(body)) for body in good]
        await send(session, f"{url}/pause_generation", _json({"mode": "in_place"}))
        tasks = [asyncio.create_task(send(session, f"{url}/generate", _json(body))) for body in good]
        tasks += [asyncio.create_task(send(session, f"{url}/generate", _json(
            {"input_ids": [9, 9], "sampling_params": {**SAMPLED, **bad}}))) for bad in hostile]
        await asyncio.sleep(0.5)  # every request is queued behind the pause: one batch at resume
        await send(session, f"{url}/continue_generation", b"{}")
        return alone, await asyncio.gather(*tasks)

    alone, together = serve(test)
    for (status, answer), (_, reference) in zip(together[:3], alone, strict=True):
        assert status == 200, answer
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert answer["output_ids"] == reference["output_ids"]  # seeded: as alone
    words = ["top_k", "top_k", "temperature"]
    for (status, answer), word in zip(together[3:], words, strict=True):
        assert status == 400 and word in message(answer), answer


def test_nan_temperature_in_process_fails_alone_beside_sampled_requests():
    """NaN passes `temperature >= 0`'s negation (NaN < 0 is false): the engine's own check refuses it."""

    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=4, threads=1, seed=0)
        try:
            params = SamplingParams(temperature=1.0, top_k=5, max_new_tokens=16, ignore_eos=True, seed=1)
            await engine.pause("in_place")
            calls = [engine.generate(GenerateRequest(request_id=f"ok{i}", input_ids=[5, 6], sampling=params))
                     for i in range(2)]
            calls.append(engine.generate(GenerateRequest(
                request_id="nan", input_ids=[5, 6], sampling=SamplingParams(temperature=float("nan")))))
            tasks = [asyncio.ensure_future(c) for c in calls]
            await asyncio.sleep(0.1)
            await engine.resume()
            return await asyncio.gather(*tasks)
        finally:
            await engine.close()

    first, second, nan = asyncio.run(run())
    assert first.error is None and len(first.output_ids) == 16 and first.output_ids == second.output_ids
    assert nan.error and "temperature" in nan.error


def test_a_row_whose_sampling_fails_aborts_that_request_only():
    """The sampler's last line of defence, for values no check let through: a batch whose sampling
    raises is sampled row by row, and a row with no valid token fails alone."""
    engine = EmbeddedEngine(MODEL, max_slots=4, threads=1, seed=0)
    from flowrl_operators.engine.embedded.engine import Sequence

    def seq(rid: str, **params) -> Sequence:
        request = GenerateRequest(request_id=rid, input_ids=[5], sampling=SamplingParams(seed=3, **params))
        return Sequence(request=request, future=None, seed=3, stop_ids=frozenset(), tokens=[5])

    for bad in (seq("raises", temperature="hot"), seq("nan", temperature=float("nan"))):
        good = seq("good", top_k=5)
        engine._emit([good, bad], torch.randn(2, engine.vocab_size))
        assert good.error is None and len(good.output) == 1 and good.finish_reason is None
        assert bad.finish_reason == "abort" and "sampling failed" in bad.error and bad.output == []


def _json(body) -> bytes:
    import json

    return json.dumps(body).encode()


MALFORMED = {  # body -> words the 400's message holds
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}': "JSON",
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": ["bash"]}': "tools[0]",
    b"[" * 200_000 + b"]" * 200_000: "JSON",
    b'[{"role": "user"}]': "JSON object",
    b"null": "JSON object",
    b'"hello"': "JSON object",
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}': "UTF-8",
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}': "JSON",
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}': "JSON",
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 100000}': "n must be",
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}': "text must be a string",
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 100000000000000000000}': "seed must be",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000000000000}': "max_tokens must be",
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["' + b"x" * 100_000 + b'"]}': "longer than any one token",
    b'{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [' + b"1," * 999 + b'1]}': "at most 64",
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
    + b'{"name": "f", "parameters": ' + b'{"a": ' * 300 + b"1" + b"}" * 300 + b"}}]}": "nests",
}
GENERATE_MALFORMED = {
    b'{"input_ids": 5}': "input_ids",
    b'{"input_ids": [[1], 2]}': "input_ids",
    b'{"text": [1, 2]}': "text",
    b'{"input_ids": [1], "rid": 5}': "rid",
    b'{"input_ids": [[1]], "rid": ["a", "b"]}': "rid",
    b'{"input_ids": [1], "sampling_params": {"temperature": 1e400}}': "JSON",
    b'{"input_ids": ' + b"[[1]," * 300 + b"[1]" + b"]" * 300 + b"}": "nests",
}


def test_every_malformed_request_is_a_400_that_says_what_is_wrong():
    async def test(session, url, engine):
        chat = [(body, await send(session, f"{url}/v1/chat/completions", body)) for body in MALFORMED]
        generate = [(body, await send(session, f"{url}/generate", body)) for body in GENERATE_MALFORMED]
        async with session.get(f"{url}/health") as r:  # and the server serves on
            return chat, generate, r.status

    chat, generate, health = serve(test)
    for body, (status, answer) in chat:
        assert status == 400 and MALFORMED[body] in message(answer), (body[:80], status, answer)
    for body, (status, answer) in generate:
        assert status == 400 and GENERATE_MALFORMED[body] in message(answer), (body[:80], status, answer)
    assert health == 200


@pytest.mark.parametrize(("side", "said"), [(12000, "12000x12000 pixels"),
                                           # past PIL's own limit: it refuses at open, and was a 500
                                           (20000, "declares 400000000 pixels, over the limit")])
def test_a_decompression_bomb_is_refused_from_its_header(tmp_path, side, said):
    images.use_store(tmp_path / "images")
    png = bomb_png(side, side)
    assert len(png) < 400_000
    url = "data:image/png;base64," + __import__("base64").b64encode(png).decode()

    async def test(session, url_, engine):
        started = time.monotonic()
        answer = await send(session, f"{url_}/generate", _json({"input_ids": [5], "image_data": [url]}))
        return *answer, time.monotonic() - started

    status, answer, seconds = serve(test)
    assert status == 400 and said in message(answer), answer
    assert "Traceback" not in message(answer) and seconds < 5  # nothing decoded
    assert not list((tmp_path / "images").rglob("*.png"))


def test_a_body_over_the_limit_is_a_413_before_it_is_read():
    async def test(session, url, engine):
        big = b'{"text": "' + b"a" * (65 * 1024**2) + b'"}'
        return await send(session, f"{url}/generate", big)

    status, answer = serve(test)
    assert status == 413 and "limit" in message(answer), (status, answer)


def test_a_huge_prompt_is_refused_untokenised_and_the_loop_serves_meanwhile():
    """Before: 8 MB of text was tokenised on the event loop (~27 s), every other request waiting."""

    async def test(session, url, engine):
        text = "word " * (2 * 1024**2 // 5)
        big = asyncio.create_task(send(session, f"{url}/generate", _json({"text": text})))
        chat = asyncio.create_task(send(session, f"{url}/v1/chat/completions", _json(
            {"messages": [{"role": "user", "content": text}]})))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        async with session.get(f"{url}/health") as r:
            health = r.status, time.perf_counter() - started
        return await big, await chat, health, time.perf_counter() - started

    big, chat, (health, health_s), total_s = serve(test)
    assert big[0] == 400 and "characters" in message(big[1]), big
    assert chat[0] == 400 and "characters" in message(chat[1]), chat
    assert health == 200 and health_s < 1.0
    assert total_s < 5.0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate"])
def test_a_client_that_goes_away_takes_its_work_with_it(route):
    """Before: `n` choices of a client that had hung up were generated to the end for nobody, and
    every later request queued behind them."""
    if route == "/generate":
        body = {"input_ids": [[5, 6]] * 64, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 64, "max_tokens": 900, "ignore_eos": True}

    async def test(session, url, engine):
        busy = []

        async def watch():
            while True:
                busy.append(engine.stats()["running"] + engine.stats()["waiting"])
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            async with session.post(f"{url}{route}", json=body, timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        except asyncio.TimeoutError:
            pass
        watcher.cancel()
        busy = max(busy)
        deadline = time.perf_counter() + 3.0
        while engine.stats()["running"] + engine.stats()["waiting"] and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        left = engine.stats()["running"] + engine.stats()["waiting"]
        started = time.perf_counter()
        status, answer = await send(session, f"{url}/generate", _json(
            {"input_ids": [5], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
        return busy, left, status, time.perf_counter() - started

    busy, left, status, later_s = serve(test)
    assert busy > 0  # the work had started
    assert left == 0
    assert status == 200 and later_s < 2.0
