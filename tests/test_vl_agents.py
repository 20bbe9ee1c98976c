"""Vision-language episodes on the real embedded engine (builtin:tiny-qwen2-vl): an environment with
image observations, an agent with image content through the official `openai` client and the proxy,
and the SGLang adapter sending `image_data` to flowrl's SGLang-compatible server. Every recorded id
is the engine's, every image in the trajectory in placeholder order."""

from __future__ import annotations

import base64
import io
import os

import pytest
from engines import embedded_engine, tap

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
from PIL import Image  # noqa: E402

from flowrl.data import images  # noqa: E402
from flowrl_operators.inference import GenerateRequest, SamplingParams  # noqa: E402
from flowrl_operators.tasks.grid_nav import GridNavEnv, grid_nav, render  # noqa: E402
from flowrl_operators.workflows.base import WorkflowContext  # noqa: E402
from flowrl_operators.workflows.environment import EnvironmentWorkflow  # noqa: E402

MODEL = "builtin:tiny-qwen2-vl"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    yield images.use_store(tmp_path_factory.mktemp("run") / "images")
    images.use_store(images.default_root())


@pytest.fixture(scope="module")
def engine(loop, store):
    yield from embedded_engine(loop, MODEL, 8)


@pytest.fixture(scope="module")
def facts():
    from flowrl_operators.vision import vision

    return vision(MODEL)


def untap(engine) -> None:
    del engine.generate


def check_placeholders(facts, trajectory) -> None:
    """Each image's placeholder run, in order, holds exactly its token count (vision.spans raises
    otherwise) and is never trained on."""
    ids = trajectory.prompt_ids + trajectory.response_ids
    spans = facts.spans(ids, trajectory.images)
    mask = [0] * len(trajectory.prompt_ids) + trajectory.loss_mask
    written = sum(1 for i, m in zip(ids, mask, strict=True) if i == facts.vision_start_id and m == 0)
    assert len(spans) == len(trajectory.images) == written  # a sampled vision-start token is text
    assert all(mask[i] == 0 for start, end in spans for i in range(start, end))


def test_environment_episode_records_each_observation_image(loop, engine, store, facts):
    from flowrl_operators.models import load_tokenizer

    tok = load_tokenizer(MODEL)
    ctx = WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
                          sample_id="0:0", seed=3)
    sample = {"size": 4, "agent": [0, 0], "target": [3, 3], "target_move": "down"}  # 6 cells: never reached in 4
    seen = tap(engine)
    try:
        t = loop.run_until_complete(EnvironmentWorkflow(GridNavEnv, max_turns=4)(ctx, sample))
    finally:
        untap(engine)
    assert len(t.turns) == 4 and len(t.images) == 4  # the first view, then one per answered turn but the last
    check_placeholders(facts, t)
    # What each call sent and got is in the trajectory: ids, images so far, the engine's tokens.
    for k, (request, result) in enumerate(seen):
        turn = t.turns[k]
        assert request.input_ids == t.prompt_ids + t.response_ids[:turn.start]
        assert request.images == t.images[:k + 1]
        assert t.response_ids[turn.start:turn.end] == result.output_ids
        assert t.behaviour_logprobs[turn.start:turn.end] == result.logprobs
    # The pixels: the first image is the rendered first view, read back from the run's store.
    first = render(4, (0, 0), (3, 3), 1, 19)
    assert store.get(t.images[0]).tobytes() == first.tobytes()


def test_text_only_environment_is_unchanged(loop, engine):
    from flowrl_operators.chat.template import chat_ids
    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.tasks import guess_number

    tok = load_tokenizer(MODEL)
    ctx = WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(max_new_tokens=3), sample_id="1:0")
    sample = guess_number(seed=0).sample(0, 0)
    t = loop.run_until_complete(guess_number.workflow(max_turns=2)(ctx, sample))
    assert t.images == [] and t.prompt_ids == chat_ids(tok, [{"role": "user", "content": sample["prompt"]}])


def test_supervised_first_view_warm_up(loop, engine, facts):
    from flowrl_operators.models import load_tokenizer

    tok = load_tokenizer(MODEL)
    ctx = WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(), sample_id="2:0")
    sample = grid_nav(seed=1).sample(0, 0)
    t = loop.run_until_complete(grid_nav.workflow(supervised=True)(ctx, sample))
    assert tok.decode(t.response_ids) == sample["target_move"] + "<|im_end|>" and t.loss_mask == [1] * len(t.response_ids)
    assert len(t.images) == 1
    check_placeholders(facts, t)


def data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def vl_agent(base_url: str, sample: dict) -> float:
    """Looks at two pictures over two turns with nothing but the openai client."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    view = render(4, tuple(sample["agent"]), tuple(sample["target"]), 1, 19)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(view)}},
                                             {"type": "text", "text": "where?"}]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4, logprobs=True)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": [{"type": "text", "text": "and now"}, {"type": "image_url", "image_url": {
                     "url": data_url(Image.new("RGB", (56, 84), (0, 0, 255)))}}]}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    await client.close()
    return 0.5


def test_openai_agent_with_images_is_recorded_with_the_engines_ids(loop, engine, store, facts):
    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.workflows.agent import AgentWorkflow
    from flowrl_operators.workflows.proxy import Proxy

    tok = load_tokenizer(MODEL)
    proxy = Proxy(engine, tok, SamplingParams(temperature=1.0, max_new_tokens=4))
    loop.run_until_complete(proxy.start())
    ctx = WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
                          sample_id="3:0", seed=1, services={"proxy": proxy})
    seen = tap(engine)
    try:
        (t,) = loop.run_until_complete(AgentWorkflow(vl_agent)(ctx, grid_nav(seed=2).sample(0, 0)))
    finally:
        untap(engine)
        loop.run_until_complete(proxy.close())
    assert len(seen) == 2 and len(t.turns) == 2 and t.reward == 0.5
    (r1, out1), (r2, out2) = seen
    assert t.prompt_ids == r1.input_ids and t.images == r2.images and r1.images == t.images[:1]
    assert r2.input_ids == t.prompt_ids + t.response_ids[:t.turns[1].start]  # the second call extends the first
    assert t.response_ids[t.turns[0].start:t.turns[0].end] == out1.output_ids
    assert t.behaviour_logprobs[t.turns[1].start:t.turns[1].end] == out2.logprobs
    assert [(i.width, i.height) for i in t.images] == [(57, 57), (56, 84)]
    assert store.get(t.images[1]).getpixel((5, 5)) == (0, 0, 255)
    check_placeholders(facts, t)


def test_sglang_adapter_sends_images_to_the_flowrl_server(loop, engine, store, facts):
    from flowrl_operators.chat.images import store_images
    from flowrl_operators.chat.template import chat_ids
    from flowrl_operators.engine.server.server import start_server
    from flowrl_operators.engine.sglang.adapter import SGLangEngine
    from flowrl_operators.models import load_tokenizer

    tok = load_tokenizer(MODEL)
    view = GridNavEnv().reset({"size": 4, "agent": [1, 1], "target": [3, 0]})
    messages, refs = store_images([view])
    ids = chat_ids(tok, messages, images=refs)
    request = GenerateRequest(request_id="vl", input_ids=ids, images=refs, sampling=SamplingParams(temperature=0.0, max_new_tokens=5))

    async def go():
        direct = await engine.generate(request)
        runner, port = await start_server(engine)
        adapter = SGLangEngine(f"http://127.0.0.1:{port}")
        try:
            served = await adapter.generate(msgspec_copy(request, "vl2"))
            blind = await adapter.generate(msgspec_copy(request, "vl3", images=[]))  # no image_data sent
        finally:
            await adapter.close()
            await runner.cleanup()
        return direct, served, blind

    direct, served, blind = loop.run_until_complete(go())
    assert served.output_ids == direct.output_ids and served.logprobs == pytest.approx(direct.logprobs, abs=1e-5)
    assert blind.error and "image" in blind.error  # placeholders without images: refused, not garbage


def msgspec_copy(request: GenerateRequest, request_id: str, **changes) -> GenerateRequest:
    import msgspec

    return msgspec.structs.replace(request, request_id=request_id, **changes)


def test_a_dataset_row_with_an_image_through_single_turn(loop, engine, store, facts, tmp_path):
    """Item: a dataset file's row (an image path relative to the file) -> a sample with an ImageRef
    -> the default workflow's prompt with the placeholders expanded -> the engine."""
    import json

    from flowrl.data.source import load_source
    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.workflows.single_turn import single_turn

    (tmp_path / "pics").mkdir()
    Image.new("RGB", (30, 60), (0, 200, 0)).save(tmp_path / "pics" / "a.png")
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "color?"}, {"type": "image"}]}],
           "images": ["pics/a.png"], "answer": "green"}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    sample = load_source({"source": {"file": str(tmp_path / "rows.jsonl")}, "batch_size": 1}).sample(0, 0)
    tok = load_tokenizer(MODEL)
    ctx = WorkflowContext(engine=engine, tokenizer=tok, sampling=SamplingParams(max_new_tokens=3), sample_id="4:0")
    t = loop.run_until_complete(single_turn(ctx, sample))
    assert t.images == sample["images"] and store.get(t.images[0]).getpixel((1, 1)) == (0, 200, 0)
    check_placeholders(facts, t)
    assert t.prompt_ids.count(facts.image_token_id) == facts.image_tokens(t.images[0])
