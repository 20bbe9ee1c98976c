"""The OpenAI-compatible proxy: an agent that only uses the `openai` client plays guess-the-number;
the recorded token ids are exactly the engine's; Ray processes: tests/test_workflows_ray.py."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import openai  # noqa: E402

from flowrl.operator import OperatorContext  # noqa: E402
from flowrl_operators.chat.template import chat_ids
from flowrl_operators.config import GenerateConfig  # noqa: E402
from flowrl_operators.generate import Generate  # noqa: E402
from flowrl_operators.tasks import guess_number  # noqa: E402
from flowrl_operators.workflows.proxy import Call, assemble  # noqa: E402

MODEL = "builtin:tiny-qwen2"
SEEN: list[str] = []  # what the in-process agent was told, to compare with the recorded ids


async def guess_agent(base_url: str, sample: dict, turns: int = 3, side_question: bool = False) -> float:
    """Plays guess-the-number with nothing but the openai client."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": sample["prompt"]}]
    reward = 0.0
    for _ in range(turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        text = reply.choices[0].message.content
        SEEN.append(text)
        messages.append({"role": "assistant", "content": text})
        digits = "".join(c for c in text if c.isdigit())
        if digits and int(digits) == sample["secret"]:
            reward = 1.0
            break
        hint = "higher" if not digits or int(digits) < sample["secret"] else "lower"
        messages.append({"role": "user", "content": hint})
    if side_question:  # a fresh conversation: a second trajectory
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "sum?"}],
                                             max_tokens=2)
    await client.close()
    return reward


def sync_agent(base_url: str, sample: dict) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    return None


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(loop, **args) -> Generate:
    import torch

    torch.set_num_threads(1)
    config = msgspec.convert({"group_size": 2, "workflow": "agent", "workflow_args": args,
                              "sampling": {"temperature": 1.0, "max_new_tokens": 4}}, GenerateConfig)
    op = Generate(config, OperatorContext(node="rollout", model={"path": MODEL}, seed=5))
    loop.run_until_complete(op.setup())
    return op


def tap(engine) -> list[tuple[list[int], list[int], list[float]]]:
    """Record what the engine returns for every request (input ids, output ids, logprobs)."""
    produced = []
    generate = engine.generate

    async def tapped(request):
        result = await generate(request)
        produced.append((list(request.input_ids), list(result.output_ids), list(result.logprobs)))
        return result

    engine.generate = tapped
    return produced


def test_openai_agent_episode_is_recorded_with_engine_ids(loop):
    op = make(loop, agent="test_proxy:guess_agent", side_question=True)
    proxy = op.services["proxy"]
    recorded: list[Call] = []
    end = proxy.end_session

    def keep(session_id):  # observe the calls the proxy hands to the workflow
        session = end(session_id)
        recorded.extend(session.calls)
        return session

    proxy.end_session = keep
    produced = tap(op.engine)
    try:
        SEEN.clear()
        sample = guess_number(seed=1).sample(0, 0)
        group = loop.run_until_complete(op.generate(sample, step=0, sample_id="0:0"))
        # What the proxy recorded is exactly what the engine produced, call for call.
        assert sorted((c.prompt_ids, c.output_ids, c.logprobs) for c in recorded) == sorted(produced)
        side = chat_ids(op.tokenizer, [{"role": "user", "content": "sum?"}])
        game_calls = [c for c in recorded if c.prompt_ids != side]
        assert len(recorded) - len(game_calls) == 2  # one side question per episode
        # The agent was told exactly the decoded engine output of each call.
        assert sorted(SEEN) == sorted(op.tokenizer.decode(c.output_ids, skip_special_tokens=True) for c in game_calls)
        assert len(group.trajectories) == 4  # 2 episodes x (the game + the side question)
        games = [t for t in group.trajectories if t.prompt_ids != side]
        assert len(games) == 2 and sum(len(t.turns) for t in games) == len(game_calls)
        im_end = op.tokenizer.convert_tokens_to_ids("<|im_end|>")
        for t in group.trajectories:
            t.validate()
            model_ids = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
            spans = [t.response_ids[turn.start:turn.end] for turn in t.turns]
            assert sum(spans, []) == model_ids
            assert all(span in [c.output_ids for c in recorded] for span in spans)
            for turn, nxt in zip(t.turns, t.turns[1:], strict=False):
                gap = t.response_ids[turn.end:nxt.start]
                assert gap and t.loss_mask[turn.end:nxt.start] == [0] * len(gap)
                closing = "\n" if t.response_ids[turn.end - 1] == im_end else "<|im_end|>\n"
                assert op.tokenizer.decode(gap).startswith(closing + "<|im_start|>user\n")
            assert t.reward in (0.0, 1.0) and t.metadata["sample"] == sample
        assert {t.id for t in group.trajectories} == {"0:0/0.0", "0:0/0.1", "0:0/1.0", "0:0/1.1"}
        assert not proxy.sessions  # every episode's session is closed
    finally:
        loop.run_until_complete(op.close())


def test_sync_agent_and_http_errors(loop):
    op = make(loop, agent="test_proxy:sync_agent")
    proxy = op.services["proxy"]
    try:
        group = loop.run_until_complete(op.generate({"prompt": "x"}, step=0, sample_id="0:0"))
        assert len(group.trajectories) == 2 and all(t.reward is None for t in group.trajectories)

        async def errors():
            base = proxy.open_session("s1")
            client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
            msgs = [{"role": "user", "content": "hi"}]
            with pytest.raises(openai.BadRequestError, match="n must be 1"):
                await client.chat.completions.create(model="m", messages=msgs, n=2)
            with pytest.raises(openai.BadRequestError, match="stop string 'hi there' is"):
                await client.chat.completions.create(model="m", messages=msgs, stop=["hi there"])
            reply = await client.chat.completions.create(model="m", messages=msgs, logprobs=True, max_tokens=3)
            calls = proxy.close_session("s1")
            assert len(calls) == 1  # the refused requests were not recorded
            kept = len(calls[0].output_ids) - (reply.choices[0].finish_reason == "stop")  # the stop token is not content
            assert [c.logprob for c in reply.choices[0].logprobs.content] == pytest.approx(calls[0].logprobs[:kept])
            with pytest.raises(openai.NotFoundError, match="no open session"):
                await client.chat.completions.create(model="m", messages=msgs)
            models = await client.models.list()
            await client.close()
            return models

        assert loop.run_until_complete(errors()).data[0].id == "flowrl-policy"
    finally:
        loop.run_until_complete(op.close())


def test_assemble_chains_calls_that_extend_each_other():
    def call(prompt, output):
        return Call(prompt, output, [-0.5] * len(output), [3] * len(output), "stop", None)

    calls = [call([1, 2], [3]), call([9], [8]), call([1, 2, 3, 4, 5], [6, 7]), call([9, 8, 0], [1])]
    first, second = assemble(calls, version=3)
    assert first.prompt_ids == [1, 2] and first.response_ids == [3, 4, 5, 6, 7]
    assert first.loss_mask == [1, 0, 0, 1, 1] and [(t.start, t.end) for t in first.turns] == [(0, 1), (3, 5)]
    assert first.behaviour_logprobs == [-0.5, 0.0, 0.0, -0.5, -0.5]
    assert second.prompt_ids == [9] and second.response_ids == [8, 0, 1] and second.loss_mask == [1, 0, 1]


def test_tool_calls_are_parsed_into_openai_shape():
    from flowrl_operators.chat.tool_calls import parse_tool_calls

    text = 'ok <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call> and ' \
           '<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>'
    calls = parse_tool_calls(text)
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "calc", "arguments": '{"expression": "2*3"}'}}]
    assert parse_tool_calls("plain answer") == []


def test_render_splices_the_engines_ids_for_replies_it_sent():
    """A reply whose ids do not survive decode + re-encode (special tokens inside, no end-of-turn
    token) is spliced back as the engine's ids, so the next prompt extends the last one exactly."""
    from flowrl_operators.inference import SamplingParams
    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.workflows.proxy import Proxy, Session

    tok = load_tokenizer(MODEL)
    proxy = Proxy(engine=None, tokenizer=tok)
    first = [{"role": "user", "content": "guess"}]
    prompt = proxy.render(first, None, None)
    eot, unk = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|unk|>")
    session = Session("s", SamplingParams(), 0)
    for output in ([tok.convert_tokens_to_ids("7"), unk, eot], [tok.convert_tokens_to_ids("9"), unk]):
        text = tok.decode(output, skip_special_tokens=True)
        session.remember({"role": "assistant", "content": text}, output)
        conversation = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "higher"}]
        follow = proxy.render(conversation, None, session)
        assert chat_ids(tok, conversation) != follow  # the text round trip would have lost the ids
        closing = "\n" if output[-1] == eot else "<|im_end|>\n"
        assert follow == prompt + output + tok.encode(
            f"{closing}<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
