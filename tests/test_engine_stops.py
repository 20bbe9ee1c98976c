"""Stop tokens: the embedded engine stops at generation_config.json's eos_token_id as well as
config.json's, and the server's /v1/chat/completions honours `stop` (one-token strings and token
ids) and `logprobs: true`, or answers 400, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_engine import make_checkpoint
from test_engine_server import post, serve

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_tokenizer

torch.set_num_threads(1)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint("tiny-qwen2", tmp_path_factory.mktemp("ckpt") / "m", seed=0)


def greedy(folder, ids: list[int], count: int = 12, **sampling) -> list[int]:
    async def go():
        engine = EmbeddedEngine(folder, max_slots=2)
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=count, **sampling)
            return await engine.generate(GenerateRequest(request_id="r", input_ids=ids, sampling=params))
        finally:
            await engine.close()

    return asyncio.run(go())


def first_new(tokens: list[int], avoid: set[int], start: int = 2) -> int:
    """Index of the first token from `start` on that did not occur before it and is not in `avoid`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in avoid)


def test_generation_config_eos_ids_stop_the_engine(folder):
    config_eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    config_eos = {config_eos} if isinstance(config_eos, int) else set(config_eos)
    free = greedy(folder, [5, 6, 7], ignore_eos=True).output_ids
    cut = first_new(free, config_eos)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [free[cut]]}))
    try:
        stopped = greedy(folder, [5, 6, 7])
        assert stopped.output_ids == free[:cut + 1] and stopped.finish_reason == "stop"
        (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": free[cut]}))
        assert greedy(folder, [5, 6, 7]).output_ids == free[:cut + 1]  # an int as well as a list
    finally:
        (folder / "generation_config.json").write_text(json.dumps(generation))


def test_chat_route_honours_stop_and_logprobs_or_refuses_them(folder):
    tok = load_tokenizer(folder)
    prompt = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    free = greedy(folder, tok.encode(prompt), ignore_eos=True)
    cut = first_new(free.output_ids, eos)
    stop_text = tok.decode([free.output_ids[cut]])
    assert len(tok.encode(stop_text, add_special_tokens=False)) == 1 and not eos & set(free.output_ids[:cut])

    async def test(session, url, engine):
        base = {"model": "tiny", "messages": HI, "max_tokens": 12, "temperature": 0}
        by_text = await post(session, f"{url}/v1/chat/completions", {**base, "stop": stop_text, "logprobs": True})
        by_id = await post(session, f"{url}/v1/chat/completions", {**base, "stop": [free.output_ids[cut]]})
        plain = await post(session, f"{url}/v1/chat/completions", base)
        refused = [await post(session, f"{url}/v1/chat/completions", {**base, **extra}, status=400)
                   for extra in ({"stop": ["hi there"]}, {"logprobs": True, "top_logprobs": 2},
                                 {"logprobs": "yes"}, {"stop": [1.5]})]
        return by_text, by_id, plain, refused

    by_text, by_id, plain, refused = serve(folder, test)
    content = tok.decode(free.output_ids[:cut], skip_special_tokens=True)
    for answer in (by_text, by_id):
        assert answer["choices"][0]["message"]["content"] == content  # the stop token itself is not returned
        assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == cut + 1
    entries = by_text["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [tok.decode([t]) for t in free.output_ids[:cut]]
    assert [e["logprob"] for e in entries] == pytest.approx(free.logprobs[:cut], abs=1e-5)
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"] == [] for e in entries)
    assert plain["choices"][0]["logprobs"] is None and len(plain["choices"][0]["message"]["content"]) > len(content)
    messages = [r["error"]["message"] for r in refused]
    assert "stop string 'hi there' is 8 tokens" in messages[0]
    assert "top_logprobs is not supported" in messages[1]
    assert "logprobs must be true or false" in messages[2]
    assert "stop entries are strings or token ids" in messages[3]
