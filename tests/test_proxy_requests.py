"""The agent proxy reads requests as the engine server's chat route does (chat/request.py),
over real loopback HTTP with a real tiny model and the `openai` client: what cannot be honoured is a
400 with the route's message and records nothing; `tool_choice` "none" answers text; a tool-call
answer sent back (content null) is spliced in as the model's own tokens, so the trajectory is exact;
a template that drops `tools` refuses them.

The model is the built-in tiny Qwen2 taught, in a few hundred CPU steps, to answer one prompt with a
tool call: a random model never writes one."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
from test_engine_server_tools import CALC, REFUSED, TOOLS_TEMPLATE  # noqa: E402

from flowrl_operators.chat.template import chat_ids
from flowrl_operators.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from flowrl_operators.inference import SamplingParams  # noqa: E402
from flowrl_operators.models import load_hf_model, load_tokenizer  # noqa: E402
from flowrl_operators.workflows.proxy import Proxy, assemble  # noqa: E402

torch.set_num_threads(1)
ASK = [{"role": "user", "content": "2*3?"}]
ANSWER = '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'  # what the model is taught
GREEDY = {"max_tokens": 80, "temperature": 0}  # the answer is 67 tokens with its end


def teach(folder, tok, prompt: list[int], answer: list[int]) -> None:
    """Fit the tiny model to answer `prompt` with `answer` greedily, with a margin, and save it."""
    torch.manual_seed(0)
    model = load_hf_model("builtin:tiny-qwen2").float().train()
    ids = torch.tensor([prompt + answer])
    targets = torch.tensor(answer)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(600):
        logits = model(ids).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, targets[:, None])[:, 0]
        rival = logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
        if (chosen - rival).min() > 4:  # every answer token wins by a margin the engine's numerics keep
            break
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the tiny model did not learn the tool-call answer")
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """A taught checkpoint with a tools template, an engine on it, and a loop to run proxies on."""
    folder = tmp_path_factory.mktemp("caller")
    tok = load_tokenizer("builtin:tiny-qwen2")
    tok.chat_template = TOOLS_TEMPLATE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    teach(folder, tok, chat_ids(tok, ASK, tools=[CALC]), tok.encode(ANSWER, add_special_tokens=False) + [end])
    loop = asyncio.new_event_loop()
    engine = EmbeddedEngine(folder, max_slots=4, threads=1, seed=0)
    yield loop, engine, load_tokenizer(folder)
    loop.run_until_complete(engine.close())
    loop.close()


def with_proxy(loop, engine, tok, test):
    """Run `test(proxy, client)` against a proxy on loopback with an open session "s"; returns
    (its result, the session's recorded calls)."""

    async def go():
        proxy = Proxy(engine, tok, SamplingParams(temperature=1.0, max_new_tokens=4))
        await proxy.start()
        client = openai.AsyncOpenAI(base_url=proxy.open_session("s"), api_key="unused", max_retries=0)
        try:
            return await test(proxy, client), proxy.close_session("s")
        finally:
            await client.close()
            await proxy.close()

    return loop.run_until_complete(go())


def test_what_the_engine_route_refuses_the_proxy_refuses_with_its_message_and_records_nothing(caller):
    loop, engine, tok = caller

    async def test(proxy, client):
        refused = {}
        for message, extra in REFUSED.items():  # extra_body: the keys as sent, over the typed ones
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="p", messages=ASK, **GREEDY, extra_body=extra)
            refused[message] = error.value.message
        return refused

    refused, calls = with_proxy(loop, engine, tok, test)
    for message, answer in refused.items():
        assert message in answer
    assert calls == []  # nothing refused was generated or recorded


def test_tool_choice_none_answers_text_and_auto_reads_the_calls(caller):
    loop, engine, tok = caller

    async def test(proxy, client):
        return [await client.chat.completions.create(model="p", messages=ASK, tools=[CALC], **GREEDY, **extra)
                for extra in ({"tool_choice": "none"}, {"tool_choice": "auto"})]

    (plain, called), calls = with_proxy(loop, engine, tok, test)
    assert calls[0].output_ids == calls[1].output_ids  # the same prompt: "none" renders the tools too
    assert plain.choices[0].message.content == ANSWER and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
    message = called.choices[0].message
    assert message.content is None and called.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("calc", '{"e": "2*3"}')]


def test_a_tool_call_sent_back_is_the_models_own_tokens_in_the_trajectory(caller):
    loop, engine, tok = caller
    end_of_turn = "<|im_end|>\n"

    async def test(proxy, client):
        first = await client.chat.completions.create(model="p", messages=ASK, tools=[CALC], **GREEDY)
        sent_back = first.choices[0].message.model_dump()  # content None, tool_calls, and the client's other keys
        history = [*ASK, sent_back, {"role": "tool", "tool_call_id": "call_0", "content": "6"}]
        await client.chat.completions.create(model="p", messages=history, tools=[CALC], max_tokens=3)
        return sent_back, history

    (sent_back, history), calls = with_proxy(loop, engine, tok, test)
    assert sent_back["content"] is None and sent_back["tool_calls"]
    first, second = calls
    assert tok.decode(first.output_ids) == ANSWER + "<|im_end|>"
    tool_turn = tok.encode(end_of_turn.removeprefix("<|im_end|>") + "<|im_start|>tool\n6<|im_end|>\n"
                           "<|im_start|>assistant\n", add_special_tokens=False)
    assert second.prompt_ids == first.prompt_ids + first.output_ids + tool_turn  # spliced, not re-rendered
    assert chat_ids(tok, history, tools=[CALC]) != second.prompt_ids  # the template writes the call otherwise
    (trajectory,) = assemble(calls, version=0)
    trajectory.validate()
    assert trajectory.prompt_ids == first.prompt_ids and len(trajectory.turns) == 2
    model_tokens = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    assert model_tokens == first.output_ids + second.output_ids  # exactly what the model generated
    assert trajectory.response_ids[len(first.output_ids):trajectory.turns[1].start] == tool_turn


def test_a_template_that_drops_tools_refuses_them(caller):
    loop, engine, _ = caller  # the built-in template renders no tools (the engine's weights do not matter)

    async def test(proxy, client):
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(model="p", messages=ASK, tools=[CALC], **GREEDY)
        plain = await client.chat.completions.create(model="p", messages=ASK, max_tokens=2)
        return error.value.message, plain

    (message, plain), calls = with_proxy(loop, engine, load_tokenizer("builtin:tiny-qwen2"), test)
    assert "tools: this model's chat template does not render tools" in message
    assert len(calls) == 1 and plain.choices[0].message.content is not None  # only the plain call was made


def test_sampling_keys_are_honoured_over_the_sessions_own(caller):
    loop, engine, tok = caller
    end, comma = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(",")

    async def test(proxy, client):
        return [await client.chat.completions.create(model="p", messages=ASK, tools=[CALC], **extra) for extra in (
            {"temperature": 0},  # the session's 4 new tokens
            {"temperature": 0, "max_tokens": 70, "extra_body": {"ignore_eos": True}},  # runs past its end
            {"temperature": 0, "max_tokens": 70, "stop": [","]},  # a one-token stop string
            {"temperature": 0.7, "max_tokens": 3, "seed": 11, "extra_body": {"top_k": 1}})]  # top_k 1: greedy

    (short, past, stopped, top_one), calls = with_proxy(loop, engine, tok, test)
    taught = tok.encode(ANSWER, add_special_tokens=False) + [end]
    assert calls[0].output_ids == taught[:4] and short.choices[0].finish_reason == "length"
    assert calls[1].sampling.ignore_eos and end not in calls[1].sampling.stop_token_ids
    assert calls[1].output_ids[:len(taught)] == taught and len(calls[1].output_ids) == 70
    assert past.choices[0].finish_reason == "length"
    assert calls[2].output_ids == taught[:taught.index(comma) + 1] and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == ANSWER[:ANSWER.index(",")]  # the stop token is not content
    assert calls[3].sampling.top_k == 1 and calls[3].sampling.seed == 11 and calls[3].output_ids == taught[:3]
    assert all(end in c.sampling.stop_token_ids for c in (calls[0], calls[2], calls[3]))
