"""Tools and the request keys of the engine server's /v1/chat/completions, over real loopback HTTP
with a real tiny model: `tools` and tool-call history reach the chat template as the agent proxy
renders them, answers' tool-call blocks become OpenAI `tool_calls`, and every key the engine cannot
honour (an unknown role, a forced tool choice, penalties, JSON mode, ...) is a 400 that names it."""

from __future__ import annotations

import msgspec
import pytest
import torch
from engines import tap
from test_engine import make_checkpoint
from test_engine_server import post, serve

from flowrl_operators.chat.request import choice
from flowrl_operators.chat.tool_calls import parse_tool_calls, split_tool_calls
from flowrl_operators.inference import GenerateResult
from flowrl_operators.models import load_tokenizer
from flowrl_operators.workflows.proxy import Proxy

torch.set_num_threads(1)
CHAT = "/v1/chat/completions"
# A Qwen-like template that renders tools and tool calls (the built-in tiny template renders neither).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools:' }}{% for tool in tools %}{{ '\n' }}"
    "{{ tool['function'] | tojson }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('a system message must come first') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}{{ '\n<tool_call>\n' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
CALL = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2*3"}'}}
HISTORY = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2*3?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_0", "content": "6"}]
GREEDY = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = make_checkpoint("tiny-qwen2", tmp_path_factory.mktemp("tools"), seed=0)
    tok = load_tokenizer(folder)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def test_tools_and_tool_history_are_rendered_as_the_proxy_renders_them(folder):
    tok = load_tokenizer(folder)
    expected = tok.encode(tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in HISTORY],
                                                  tools=[CALC], add_generation_prompt=True, tokenize=False))

    async def test(session, url, engine):
        proxied = Proxy(engine, tok).render(HISTORY, [CALC], None)
        seen = tap(engine)
        answers = [await post(session, url + CHAT, {**GREEDY, "messages": HISTORY, **extra})
                   for extra in ({"tools": [CALC]}, {"tools": [CALC], "tool_choice": "none"}, {})]
        return proxied, seen, answers

    proxied, seen, answers = serve(folder, test)
    with_tools, tools_none, without = [request.input_ids for request, _ in seen]
    assert with_tools == proxied == expected and tools_none == with_tools
    text = tok.decode(with_tools)
    assert '"name": "calc"' in text and '"description": "evaluate arithmetic"' in text  # the tool
    assert '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}\n</tool_call>' in text
    assert "<|im_start|>tool\n6<|im_end|>" in text
    assert "Tools:" not in tok.decode(without) and len(without) < len(with_tools)
    assert all(answer["usage"]["prompt_tokens"] == len(request.input_ids)
               for answer, (request, _) in zip(answers, seen, strict=True))


def test_a_tool_call_answer_becomes_tool_calls():
    tok = load_tokenizer("builtin:tiny-qwen2")
    block = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
    text = f"Computing. {block}"
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = tok.encode(text, add_special_tokens=False) + end
    result = GenerateResult(request_id="r", output_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids),
                            finish_reason="stop")
    read = choice(0, result, tok, logprobs=True, read_calls=True)
    assert read["message"] == {"role": "assistant", "content": "Computing.", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2*3"}'}}]}
    assert read["finish_reason"] == "tool_calls" and len(read["logprobs"]["content"]) == len(ids) - 1
    assert read["message"]["tool_calls"] == parse_tool_calls(text)  # the proxy's reading
    alone = tok.encode(block, add_special_tokens=False) + end
    only_call = choice(0, GenerateResult(request_id="r", output_ids=alone, logprobs=[0.0] * len(alone),
                                         finish_reason="stop"), tok, logprobs=False, read_calls=True)
    assert only_call["message"]["content"] is None and only_call["message"]["tool_calls"]
    cut = choice(0, msgspec.structs.replace(result, finish_reason="length"), tok, logprobs=False, read_calls=True)
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"]
    broken = 'a <tool_call>{"name": "calc", "arguments": {</tool_call> b'  # not JSON: left as text, not dropped
    assert split_tool_calls(broken) == (broken, [])
    unread = choice(0, result, tok, logprobs=False, read_calls=False)  # tool_choice none, or no tools
    assert unread["message"] == {"role": "assistant", "content": text} and unread["finish_reason"] == "stop"


REFUSED = {
    "messages[0].role must be one of system, user, assistant, tool, got None": {"messages": [{"content": "hi"}]},
    "messages[1].role must be one of system, user, assistant, tool, got 'developer'":
        {"messages": [{"role": "user", "content": "hi"}, {"role": "developer", "content": "be brief"}]},
    "messages[0].tool_calls: only an assistant message has tool_calls":
        {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]},
    "messages[2].tool_calls[0] must be {type: function, function: {name, arguments}}":
        {"messages": [*HISTORY[:2], {"role": "assistant", "tool_calls": [{"function": {"name": "calc"}}]}]},
    "the chat template cannot render these messages: a system message must come first":
        {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]},
    "tools[0] must be {type: function, function: {name, description, parameters}}": {"tools": [{"name": "calc"}]},
    "tool_choice 'required' is not supported: flowrl cannot force a tool call":
        {"tools": [CALC], "tool_choice": "required"},
    "tool_choice {'type': 'function', 'function': {'name': 'calc'}} is not supported":
        {"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "calc"}}},
    "parallel_tool_calls is not supported: flowrl cannot hold the model to one tool call":
        {"tools": [CALC], "parallel_tool_calls": False},
    "frequency_penalty is not supported: the engine applies no penalties": {"frequency_penalty": 0.5},
    "presence_penalty is not supported: the engine applies no penalties": {"presence_penalty": -1},
    "repetition_penalty is not supported": {"repetition_penalty": 1.2},
    "min_p is not supported": {"min_p": 0.1},
    "logit_bias is not supported: the engine has no logit bias": {"logit_bias": {"5": 10}},
    "response_format is not supported: the engine has no constrained decoding":
        {"response_format": {"type": "json_object"}},
    "stream_options is not supported": {"stream_options": {"include_usage": True}},
    "stream is not supported": {"stream": True},
    "modalities is not supported": {"modalities": ["text", "audio"]},
    "unsupported request keys ['function_call', 'functions']": {"functions": [CALC["function"]], "function_call": "auto"},
    "send tools instead of functions": {"functions": [CALC["function"]]},
    "unsupported request keys ['best_of', 'chat_template_kwargs']": {"best_of": 2, "chat_template_kwargs": {}},
    "n must be an integer in [1, 256], got 0": {"n": 0},
    "temperature must be a number >= 0, got 'hot'": {"temperature": "hot"},
    "top_p must be a number in [0, 1], got 1.5": {"top_p": 1.5},
    "top_k must be an integer in [-2147483647, 2147483647], got 2.5": {"top_k": 2.5},
    "max_tokens must be an integer in [1, 2147483647], got 0": {"max_tokens": 0},
    "ignore_eos must be true or false": {"ignore_eos": "yes"},
    "stop_token_ids must be a list of token ids": {"stop_token_ids": ["<|im_end|>"]},
}


def test_what_cannot_be_honoured_is_a_400_and_neutral_values_are_accepted(folder):
    hi = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {},
               "response_format": {"type": "text"}, "stream": False, "stream_options": None, "top_logprobs": 0,
               "parallel_tool_calls": True, "modalities": ["text"], "tool_choice": "auto", "user": "u",
               "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "model": None}

    async def test(session, url, engine):
        seen = tap(engine)
        refused = {message: await post(session, url + CHAT, {**hi, **extra}, status=400)
                   for message, extra in REFUSED.items()}
        assert not seen  # nothing refused reached the engine
        plain = await post(session, url + CHAT, hi)
        accepted = await post(session, url + CHAT, {**hi, **neutral})
        top_one = await post(session, url + CHAT, {**hi, "temperature": 1.0, "top_k": 1, "ignore_eos": True})
        return refused, plain, accepted, top_one, seen

    refused, plain, accepted, top_one, seen = serve(folder, test)
    for message, answer in refused.items():
        assert message in answer["error"]["message"]
    assert accepted["choices"] == plain["choices"] and accepted["model"] == "tiny"  # the values change nothing
    (_, greedy), _, (request, sampled) = seen
    assert request.sampling.top_k == 1 and request.sampling.ignore_eos  # honoured, not dropped
    assert sampled.output_ids[:len(greedy.output_ids)] == greedy.output_ids  # top_k 1 samples the greedy tokens
    assert top_one["usage"]["completion_tokens"] == GREEDY["max_tokens"] and top_one["choices"][0]["finish_reason"] == "length"


def test_a_template_that_drops_tools_or_tool_calls_refuses_them():
    async def test(session, url, engine):
        seen = tap(engine)
        tools = await post(session, url + CHAT, {**GREEDY, "messages": HISTORY[:2], "tools": [CALC]}, status=400)
        calls = await post(session, url + CHAT, {**GREEDY, "messages": HISTORY}, status=400)
        plain = await post(session, url + CHAT, {**GREEDY, "messages": HISTORY[:2]})
        return tools, calls, plain, seen

    tools, calls, plain, seen = serve("builtin:tiny-qwen2", test)
    assert "this model's chat template does not render tools" in tools["error"]["message"]
    assert "messages[2].tool_calls: this model's chat template does not render tool calls" in calls["error"]["message"]
    assert len(seen) == 1 and plain["choices"][0]["message"]["content"] is not None
