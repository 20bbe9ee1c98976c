"""One agent's hostile request fails alone at the agent proxy, over real loopback HTTP with the tiny
model: it never reaches the batch the other agents' calls share (before, one `temperature: NaN` ended
every episode of the step), malformed bodies are 400s naming the fault (not aiohttp's bare "Server got
itself in trouble"), an agent that hangs up takes its generation with it, and a huge prompt neither
blocks the proxy's loop nor is tokenised."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import torch
from test_engine_server_isolation import MALFORMED, _json, message, send

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import SamplingParams
from flowrl_operators.models import load_tokenizer
from flowrl_operators.workflows.proxy import Proxy

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"
ASK = [{"role": "user", "content": "2*3?"}]


def with_proxy(test, sessions: int = 4):
    """Run `test(session, urls, proxy, engine)` with `sessions` open agent sessions; returns its result
    and each session's recorded calls."""

    async def go():
        engine = EmbeddedEngine(MODEL, max_slots=8, threads=1, seed=0)
        proxy = Proxy(engine, load_tokenizer(MODEL), SamplingParams(temperature=1.0, top_k=5, max_new_tokens=12,
                                                                    ignore_eos=True))
        await proxy.start()
        urls = [proxy.open_session(f"s{i}", seed=i) for i in range(sessions)]
        try:
            async with aiohttp.ClientSession() as session:
                result = await test(session, urls, proxy, engine)
            return result, [proxy.close_session(f"s{i}") for i in range(sessions)]
        finally:
            await proxy.close()
            await engine.close()

    return asyncio.run(go())


def test_one_agents_hostile_sampling_ends_its_own_call_only():
    hostile = [b'{"messages": [{"role": "user", "content": "2*3?"}], "temperature": NaN}',
               _json({"messages": ASK, "top_k": 2**63})]

    async def test(session, urls, proxy, engine):
        await engine.pause("in_place")  # every call queues: they meet in one batch at resume
        good = [asyncio.create_task(send(session, f"{url}/chat/completions", _json({"messages": ASK})))
                for url in urls[:2]]
        bad = [asyncio.create_task(send(session, f"{url}/chat/completions", body))
               for url, body in zip(urls[2:], hostile, strict=True)]
        await asyncio.sleep(0.5)
        await engine.resume()
        return await asyncio.gather(*good), await asyncio.gather(*bad)

    (good, bad), calls = with_proxy(test)
    for status, answer in good:
        assert status == 200 and answer["usage"]["completion_tokens"] == 12, answer
    assert [len(c) for c in calls] == [1, 1, 0, 0]  # the refused calls recorded nothing
    assert bad[0][0] == 400 and "JSON" in message(bad[0][1]), bad[0]
    assert bad[1][0] == 400 and "top_k" in message(bad[1][1]), bad[1]


def test_every_malformed_request_is_a_400_that_says_what_is_wrong():
    async def test(session, urls, proxy, engine):
        answers = [(body, await send(session, f"{urls[0]}/chat/completions", body)) for body in MALFORMED]
        too_big = await send(session, f"{urls[0]}/chat/completions", b'{"x": "' + b"a" * (65 * 1024**2) + b'"}')
        return answers, too_big

    (answers, too_big), _ = with_proxy(test, sessions=1)
    for body, (status, answer) in answers:
        assert status == 400 and MALFORMED[body] in message(answer), (body[:80], status, answer)
    assert too_big[0] == 413 and "limit" in message(too_big[1]), too_big


def test_an_agent_that_hangs_up_takes_its_generation_with_it():
    async def test(session, urls, proxy, engine):
        busy = []

        async def watch():
            while True:
                busy.append(engine.stats()["running"] + engine.stats()["waiting"])
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        body = {"messages": ASK, "max_tokens": 1000}
        try:
            async with session.post(f"{urls[0]}/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        except asyncio.TimeoutError:
            pass
        deadline = time.perf_counter() + 3.0
        while engine.stats()["running"] + engine.stats()["waiting"] and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        watcher.cancel()
        return max(busy), engine.stats()["running"] + engine.stats()["waiting"]

    (busy, left), calls = with_proxy(test, sessions=1)
    assert busy == 1 and left == 0
    assert calls == [[]]  # the call never finished, so nothing was recorded


def test_a_huge_prompt_is_refused_untokenised_and_the_proxy_serves_meanwhile():
    async def test(session, urls, proxy, engine):
        text = "word " * (2 * 1024**2 // 5)
        big = asyncio.create_task(send(session, f"{urls[0]}/chat/completions", _json(
            {"messages": [{"role": "user", "content": text}]})))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        async with session.get(f"{urls[1]}/models") as r:
            models = r.status, time.perf_counter() - started
        return await big, models

    (big, (status, models_s)), _ = with_proxy(test, sessions=2)
    assert big[0] == 400 and "characters" in message(big[1]), big
    assert status == 200 and models_s < 1.0
