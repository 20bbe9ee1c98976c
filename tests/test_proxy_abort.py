"""Requests aborted by a weight update (`pause_mode: abort`, partial rollout) are resubmitted, by
`ctx.generate` and by the OpenAI proxy alike (one helper, `generate_complete`), and the resubmitted
request draws fresh noise, deterministically from its seed and position."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
from test_generate_node import perturbed  # noqa: E402
from test_proxy import tap  # noqa: E402

from flowrl.operator import OperatorContext  # noqa: E402
from flowrl_operators.config import GenerateConfig  # noqa: E402
from flowrl_operators.generate import Generate  # noqa: E402
from flowrl_operators.inference import GenerateRequest, SamplingParams  # noqa: E402
from flowrl_operators.workflows.base import generate_complete, resubmit_seed  # noqa: E402

MODEL = "builtin:tiny-qwen2"
TOKENS = 200
REPLIES: list = []
STARTED: list = []


async def long_reply_agent(base_url: str, sample: dict) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    STARTED.append(base_url)  # each episode its own prompt, so that the engine's requests tell them apart
    content = f"{sample['prompt']} {len(STARTED)}"
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": content}],
                                                 max_tokens=TOKENS)
    REPLIES.append(reply)
    await client.close()
    return 0.0


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(loop, **config) -> Generate:
    torch.set_num_threads(1)
    op = Generate(msgspec.convert(config, GenerateConfig), OperatorContext(node="rollout", model={"path": MODEL},
                                                                           seed=3))
    loop.run_until_complete(op.setup())
    return op


async def update_mid_request(op: Generate, task: asyncio.Future, running: int) -> None:
    """What a stage does on a weights record under partial rollout, while `running` requests decode."""
    while op.engine.stats()["running"] < running:
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.01)  # a few tokens each (the tiny model may stop at any token)
    assert not task.done()
    await op.pause()
    await op.update_weights(perturbed(op.engine, 0.05), 1)
    await op.resume()


def test_proxy_resubmits_aborted_requests_and_never_reports_a_truncation_as_stop(loop):
    op = make(loop, group_size=4, workflow="agent", workflow_args={"agent": "test_proxy_abort:long_reply_agent"},
              partial_rollout=True, pause_mode="abort", sampling={"temperature": 1.0, "max_new_tokens": TOKENS})
    produced = tap(op.engine)
    REPLIES.clear()

    async def main():
        task = asyncio.ensure_future(op.generate({"prompt": "7"}, step=0, sample_id="0:0"))
        await update_mid_request(op, task, running=4)
        return await task

    try:
        group = loop.run_until_complete(main())
        stops = op.engine.eos_ids | {op.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    finally:
        loop.run_until_complete(op.close())
    assert len(REPLIES) == 4 and len(group.trajectories) == 4
    spanning = 0
    def text(t):
        return op.tokenizer.decode(t.response_ids, skip_special_tokens=True)

    for reply, t in zip(sorted(REPLIES, key=lambda r: (r.usage.completion_tokens, r.choices[0].message.content)),
                        sorted(group.trajectories, key=lambda t: (len(t.response_ids), text(t))), strict=True):
        ids = t.response_ids
        # Complete: the full token budget, or a stop token; the reason says which.
        stopped = ids[-1] in stops
        assert len(ids) == TOKENS or stopped, (len(ids), ids[-1])
        reason = reply.choices[0].finish_reason
        assert reason == "stop" if len(ids) < TOKENS else reason in (("stop", "length") if stopped else ("length",))
        assert reply.usage.completion_tokens == len(ids)
        assert reply.choices[0].message.content == text(t)
        # The ids are the engine's: the attempts of this request, chained prompt + partial output.
        attempts = [(i, o, lp) for i, o, lp in produced if i == t.prompt_ids + ids[:len(i) - len(t.prompt_ids)]]
        assert sum((o for _, o, _ in attempts), []) == ids
        assert sum((lp for _, _, lp in attempts), []) == t.behaviour_logprobs
        if 0 in t.versions and 1 in t.versions:
            spanning += 1
            switch = t.versions.index(1)
            assert len(attempts) == 2 and switch == len(attempts[0][1])
            assert t.versions == [0] * switch + [1] * (len(ids) - switch)
    assert spanning, [t.versions for t in group.trajectories]


def test_resubmitted_request_draws_fresh_noise_deterministically(loop):
    op = make(loop, group_size=1, partial_rollout=True, pause_mode="abort")
    engine = op.engine
    prompt = [5, 9, 13]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=TOKENS, ignore_eos=True, seed=1234)

    async def direct(input_ids, seed, count):
        request = GenerateRequest(request_id=f"d{seed}-{len(input_ids)}", input_ids=input_ids,
                                  sampling=msgspec.structs.replace(sampling, seed=seed, max_new_tokens=count))
        return (await engine.generate(request)).output_ids

    produced = tap(engine)

    async def run():
        task = asyncio.ensure_future(generate_complete(engine, "r", prompt, sampling))
        while (snap := engine.snapshot("r#0")) is None or len(snap.output_ids) < 5:
            await asyncio.sleep(0.002)
        await engine.pause("abort")
        await engine.resume()  # same weights: only the noise can change the tokens
        result = await task
        k = len(produced[0][1])
        tail = result.output_ids[k:]
        fresh = await direct(prompt + result.output_ids[:k], resubmit_seed(1234, k), TOKENS - k)
        replayed = await direct(prompt + result.output_ids[:k], 1234, TOKENS - k)
        whole = await direct(prompt, 1234, TOKENS)
        return result, k, tail, fresh, replayed, whole

    try:
        result, k, tail, fresh, replayed, whole = loop.run_until_complete(run())
    finally:
        loop.run_until_complete(op.close())
    assert 5 <= k < TOKENS and len(result.output_ids) == TOKENS and result.finish_reason == "length"
    assert whole[:k] == result.output_ids[:k]  # the first attempt is the seed's own draw
    assert tail == fresh  # the resubmission's seed is a function of (seed, position): replayable
    assert tail != replayed  # the old behaviour: token k + i drew token i's noise again
    assert resubmit_seed(1234, 0) == 1234 and resubmit_seed(None, k) is None
    assert len({resubmit_seed(1234, n) for n in range(1, 50)}) == 49
